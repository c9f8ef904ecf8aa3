"""attn/tiling.py: the head plan (block_h, head tile, padding) and the key blocks, as the host
wrappers and kernels use them."""

from __future__ import annotations

import numpy as np
import pytest

from paddlefleet.tilelang_ops.attn import tiling


@pytest.mark.parametrize(
    "H, block_h, tile, h_pad",
    [(1, None, 16, 16), (8, 32, 32, 32), (16, None, 16, 16), (24, None, 32, 32),
     (32, None, 32, 32), (40, None, 64, 64), (48, 16, 64, 64), (64, None, 64, 64),
     (100, None, 64, 128), (128, 16, 64, 128)],
)
def test_head_plan(H, block_h, tile, h_pad):
    plan = tiling.head_plan(H, block_h)
    assert (plan.heads_per_cta, plan.padded_heads) == (tile, h_pad)
    assert plan.num_groups * plan.heads_per_cta == plan.padded_heads >= H
    assert plan.block_h == (block_h or (32 if H % 32 == 0 else 16))


@pytest.mark.parametrize("bad", [8, 64, 0, -16])
def test_block_h_must_be_16_or_32(bad):
    with pytest.raises(ValueError, match="block_h.*head tile"):
        tiling.head_plan(64, bad)


@pytest.mark.parametrize("bad", [16.0, 32.0, True, "32", np.float64(16.0)])
def test_block_h_must_be_an_int(bad):
    """16.0 compares equal to 16; it must still be refused, not silently taken as 16."""
    with pytest.raises(TypeError, match=r"^block_h: expected 16, 32 or None, got "):
        tiling.head_plan(64, bad)


def test_block_h_accepts_numpy_ints():
    assert tiling.head_plan(64, np.int64(16)).block_h == 16


def test_key_blocks_divide_index_pad():
    for m in (16, 32, 64):
        assert tiling.INDEX_PAD % tiling.bwd_key_block(m) == 0
    assert tiling.INDEX_PAD % tiling.FWD_KEY_BLOCK == 0
    assert tiling.INDEX_PAD % 64 == 0  # the 64-head first pass's blocks (NB = L // 64)
    assert [tiling.padded_topk(L) for L in (1, 64, 65, 100, 2048)] == [64, 64, 128, 128, 2048]


@pytest.mark.parametrize("d_qk", [576, 512])
def test_dkv_column_order_is_the_wgmma_fragment_in_float4s(d_qk):
    """The 64-head tiles' dKV accumulator order: a bijection on each key row (Dk columns, 576 or
    512), its inverse is dkv_source_column, and the columns a thread of the wgmma accumulator
    holds, 2 q + {0, 1, 8, 9} of every 16 (q = lane % 4), land in 4 contiguous floats at 16 c +
    4 q: each lane adds one 16-byte float4 and the four lanes of a row 64 contiguous bytes."""
    cols = [tiling.dkv_column(c) for c in range(d_qk)]
    assert sorted(cols) == list(range(d_qk))
    assert [tiling.dkv_source_column(p) for p in cols] == list(range(d_qk))
    for c16 in range(0, d_qk, 16):
        for q in range(4):
            got = [tiling.dkv_column(c16 + 2 * q + k) for k in (0, 1, 8, 9)]
            assert got == [c16 + 4 * q + k for k in range(4)]
    assert tiling.dkv_columns_permuted(64)
    assert not tiling.dkv_columns_permuted(16) and not tiling.dkv_columns_permuted(32)
