"""Tile choices of the sparse MQA-latent attention kernels, as pure functions.

Why the head tile matters: every backward CTA scatters ``topk x Dk`` values into ``dKV``
whatever its number of heads, and that scatter (not the GEMMs) dominates the backward
(measured on an H200 with the upstream TileLang example: the backward at H=8 costs about as much as
at H=64, 14.5 vs 15.6 ms at S=4096, S_kv=8192, topk=2048).  So one CTA
takes as many heads as it can hold (up to 64) instead of ``block_h``: a head group of 64 heads
scatters once where four groups of 16 would scatter four times.  ``block_h`` (16 or 32) is the
granularity of the head padding: the CTA tile is the padded head count rounded up to a power
of two (16, 32 or 64: a 48-head tile cannot be split over 8 warps in 16-row slices), or 64 when
more than 64 heads need several groups.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

__all__ = [
    "HeadPlan",
    "head_plan",
    "resolve_block_h",
    "FWD_KEY_BLOCK",
    "BWD_KEY_BLOCK",
    "INDEX_PAD",
    "padded_topk",
    "MAX_HEADS_PER_CTA",
    "SUPPORTED_DIMS",
    "check_head_dims",
    "bwd_key_block",
    "dkv_columns_permuted",
    "dkv_column",
    "dkv_source_column",
]

#: Largest head tile of one CTA: fp32 dQ ``[64, 576]`` plus dKV ``[32, 576]`` fragments already
#: fill the 255-register budget of 256 threads.
MAX_HEADS_PER_CTA = 64
#: Key block of the forward (slots per online-softmax step) and of the backward.
FWD_KEY_BLOCK = 64
BWD_KEY_BLOCK = 32
#: (the backward uses 64 for a 16-head tile: see :func:`bwd_key_block`; the 64-head first pass,
#: ``bwd_two_warpgroups``, walks 64-key blocks of its own)
#: ``L`` is padded with ``-1`` to a multiple of this (every key block divides it; the 64-key
#: kernels would drop a remainder).
INDEX_PAD = 64
#: (Dk, Dv) pairs of the package's host side (checks, reference, op, layers): absorbed MLA
#: (DeepSeek-V3.2, GLM-5: 512 latent + 64 rope, the value is the first 512 columns) and
#: DeepSeek-V4 (512, RoPE on its last 64 columns, the value is the whole kv row).  The pairs
#: the TileLang kernels are built for are :func:`kernel_dims`.
SUPPORTED_DIMS = ((576, 512), (512, 512))


@dataclass(frozen=True)
class HeadPlan:
    """How ``H`` query heads map onto CTAs.

    block_h: padding granularity (16 or 32).
    heads_per_cta: the head tile ``M`` one CTA (and one kernel specialisation) handles.
    padded_heads: ``H_pad``, a multiple of ``heads_per_cta``; heads ``H..H_pad-1`` are zero pads.
    num_groups: ``H_pad // heads_per_cta`` head groups per query row.
    """

    block_h: int
    heads_per_cta: int
    padded_heads: int
    num_groups: int


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def resolve_block_h(num_heads: int, block_h=None) -> int:
    """``block_h`` given, or the default: 32 when it divides ``num_heads``, else 16.

    Raises:
        TypeError: ``block_h`` neither None nor an int (``16.0``, ``"32"`` and ``True`` are
            refused rather than read as a number).
        ValueError: ``block_h`` an int other than 16 or 32.
    """
    if block_h is None:
        return 32 if num_heads % 32 == 0 else 16
    if isinstance(block_h, bool) or not isinstance(block_h, numbers.Integral):
        raise TypeError(f"block_h: expected 16, 32 or None, got {type(block_h).__name__} "
                        f"{block_h!r}")
    if block_h not in (16, 32):
        raise ValueError(
            f"block_h: expected 16, 32 or None, got {block_h!r}; the kernel's head tile must "
            f"equal the head group it is handed (heads are zero-padded to a multiple of block_h), "
            f"and only 16- and 32-head multiples are built"
        )
    return int(block_h)


def head_plan(num_heads: int, block_h=None) -> HeadPlan:
    """The head plan for ``num_heads`` (1..any) query heads.

    Rule: ``H_blk = roundup(H, block_h)``; if ``H_blk <= 64`` one CTA takes all heads, the tile
    being ``H_blk`` rounded up to a power of two (``heads_per_cta = H_pad`` in 16, 32, 64; the
    GEMMs give each of the 8 warps 16-row slices, which 48 rows do not allow), else
    ``heads_per_cta = 64`` and ``H_pad = roundup(H, 64)`` (several head groups per row).

    Examples: H=1..16 -> tile 16 (block_h 16) or 32 (block_h 32); H=24 (block_h 16) -> 32;
    H=40, 48 -> 64; H=64 -> 64; H=128 -> 2 groups of 64; H=100 -> H_pad 128, 2 groups.

    Raises:
        ValueError: ``num_heads < 1`` or ``block_h`` an int other than 16 or 32.
        TypeError: ``block_h`` neither None nor an int.
    """
    if isinstance(num_heads, bool) or int(num_heads) != num_heads or num_heads < 1:
        raise ValueError(f"num_heads: expected a positive int, got {num_heads!r}")
    num_heads = int(num_heads)
    bh = resolve_block_h(num_heads, block_h)
    h_blk = _round_up(num_heads, bh)
    if h_blk <= MAX_HEADS_PER_CTA:
        tile = 16
        while tile < h_blk:
            tile *= 2
        h_pad = tile
    else:
        tile, h_pad = MAX_HEADS_PER_CTA, _round_up(num_heads, MAX_HEADS_PER_CTA)
    return HeadPlan(block_h=bh, heads_per_cta=tile, padded_heads=h_pad, num_groups=h_pad // tile)


def bwd_key_block(heads_per_cta: int) -> int:
    """Key block of the backward for a head tile: 64 for 16 heads, else 32.

    The score GEMM ``[M, BK]`` must give each of the 8 warps a multiple of 16 rows and 8 columns:
    ``M = 16`` leaves one warp row, so ``BK`` must be 64 (8 column slices of 8); for ``M >= 32``,
    ``BK = 32`` keeps the fp32 dKV fragment ``[BK, 576]`` small enough to avoid spills.
    """
    return 64 if heads_per_cta == 16 else BWD_KEY_BLOCK


def padded_topk(topk: int) -> int:
    """``L`` rounded up to :data:`INDEX_PAD` (the host pads the indices with ``-1``)."""
    return _round_up(int(topk), INDEX_PAD)


def kernel_dims() -> tuple:
    """The ``(Dk, Dv)`` pairs the TileLang kernels are built for: ``kernels.D_PAIRS`` (the
    kernel registry's one list), ``((576, 512),)`` where the registry has no such name."""
    from . import kernels  # the package's __init__ imports no framework and no TileLang

    return tuple(tuple(int(d) for d in pair)
                 for pair in getattr(kernels, "D_PAIRS", ((576, 512),)))


def check_head_dims(d_qk: int, d_v: int) -> None:
    """Raise ``ValueError`` unless the kernels are built for ``(Dk, Dv)`` (:func:`kernel_dims`);
    a pair of :data:`SUPPORTED_DIMS` whose kernels are not built yet is named as such."""
    pair = (int(d_qk), int(d_v))
    built = kernel_dims()
    if pair in built:
        return
    if pair in SUPPORTED_DIMS:
        raise ValueError(
            f"query/kv: the TileLang kernels for (Dk, Dv) = {pair} are not built yet (built: "
            f"{list(built)}); the reference and the op on CPU tensors take this pair"
        )
    raise ValueError(
        f"query/kv: the TileLang kernels take (Dk, Dv) in {list(built)}, got Dk={d_qk}, "
        f"Dv={d_v}"
    )


def dkv_columns_permuted(heads_per_cta: int) -> bool:
    """Whether the dKV accumulator of this head tile holds its columns in the order of
    :func:`dkv_column`: the 64-head tiles' (the two-warpgroup first pass adds each thread's
    wgmma accumulator fragment as it is, and the one-role kernel, their re-run, follows it)."""
    return heads_per_cta == 64


def dkv_column(c):
    """Where real column ``c`` of a key's dKV sits in a permuted accumulator row (int or TIR
    expression).  Within every 16 columns, the wgmma accumulator gives a thread columns
    ``2 q + {0, 1, 8, 9}`` (``q`` = lane % 4) of a row; they go to ``4 q + {0, 1, 2, 3}``, so
    that each lane adds one float4 and the four lanes of a row 64 contiguous bytes."""
    return (c // 16) * 16 + ((c % 8) // 2) * 4 + ((c % 16) // 8) * 2 + c % 2


def dkv_source_column(p):
    """The inverse of :func:`dkv_column`: the real column held at position ``p``."""
    return (p // 16) * 16 + ((p % 16) // 4) * 2 + ((p % 4) // 2) * 8 + p % 2
