"""Tensor-parallel DeepSeek-V4 sparse attention: sliding window + compressed keys, D = 512.

:class:`DeepSeekV4Attention` is one attention block of DeepSeek-V4 as its public training code
has it (radixark/miles ``miles_plugins/models/deepseek_v4/``: ``deepseek_v4.py``,
``ops/compressor.py``, ``ARCHITECTURE.md``).  Data flow for ``x: [B, S, hidden]`` with
``h = heads / TP`` heads and ``g = o_groups / TP`` head groups on this rank, ``D = head_dim``,
``r = qk_rope_head_dim``, RoPE on the last ``r`` columns of a ``D``-wide row::

    c_q   = RMSNorm(x @ wq_a)                         [B, S, q_lora]     replicated
    q     = copy_to_tp(c_q) @ wq_b                    [B, S, h, D]       column-parallel
    q     = rope(q / rms(q))                          per-head RMSNorm without weight
    kv    = rope(RMSNorm(x @ wkv))                    [B, S, D]          one kv head, replicated
    kv_c  = compressor(x)                             [B, S // ratio, D] replicated (ratio set)
    kv    = copy_to_tp(concat(kv, kv_c))              [B, S + S // ratio, D]  keys = values
    o     = mqa_latent_sparse_attention(q, kv, indices, sink[h], d_v=D)   [B, S, h, D]
    o     = rope^-1(o)                                inverse RoPE on the last r columns
    o     = einsum(o as [B, S, g, (H/G) D], wo_a[g])  [B, S, g, o_lora]  grouped low rank
    y     = reduce_from_tp(o as [B, S, g o_lora] @ wo_b[g rows])   [B, S, hidden]  row-parallel

The compressor (``ratio`` tokens per group, complete groups only): ``kv = x @ wkv_c`` and
``score = x @ wgate_c + ape`` per token of a group, a softmax of the scores over the group's
tokens (per column), the weighted sum, an RMSNorm and RoPE at the group's first position
``j * ratio``.  Ratio 4 overlaps groups: ``wkv_c``, ``wgate_c`` and ``ape`` are ``2 D`` wide, and
group ``j`` pools its own 4 tokens through the second ``D`` columns and the 4 tokens of group
``j - 1`` through the first ``D`` (group 0: no predecessor, weight 0).  Every compressor
product is computed in the parameters' dtype (fp32).

Key sets (``indices.window_compressed_indices`` states the rule): every row attends to its
causal window of ``window_size`` tokens; a ratio-128 layer adds every complete past group (key
``S + j`` for ``(j + 1) * ratio <= s + 1``); a ratio-4 layer adds the groups its indexer picked,
passed to :meth:`DeepSeekV4Attention.forward` as ``compressed_indices`` (group numbers; the
indexer itself is out of scope, :func:`random_compressed_picks` stands in for it in tests and
demos).  As in miles, a pick the row may not see yet becomes an empty slot.

Tensor parallelism and the two attention partitions are those of the V3.2 layer
(:class:`~.layer.MQALatentAttention`, whose sequence-partitioned core this layer runs as it
is): ``"heads"`` runs this rank's ``h`` heads on every row; ``"sequence"`` runs all heads on
``ceil(S / TP)`` rows per rank between two all-to-alls.  ``copy_to_tp`` on the replicated
activations makes the replicated weights' gradients (``wq_a``, ``q_norm_weight``, ``wkv``,
``kv_norm_weight`` and the compressor's) full on every rank.

Packed documents (``cu_seqlens``, ``B = 1``): the block allows them whole, as miles' THD path
does: RoPE positions restart in each document, the window stays in its document, each document
is compressed on its own (its trailing ``len % ratio`` tokens in no group, ratio 4's overlap
never crossing a boundary), the compressed rows of all documents follow the ``S`` tokens in
document order, and a row sees only its own document's groups (``compressed_indices`` count a
document's groups from 0).  A packed forward and backward equal each document run alone.

Simplifications (documented, not hidden): rotate-half RoPE (DeepSeek uses interleaved pairs:
the same rotation after a fixed permutation of the rope columns of ``wq_b``, ``wkv`` and the
compressor's ``wkv_c``, undone by the inverse RoPE before ``wo_a``), no YaRN scaling, no FP8
quantisation-aware steps, and no indexer.

Parameters are created in Paddle's default dtype (fp32); ``attn_sink`` is always fp32.  The
dtype rules are the V3.2 layer's (they share ``layer._TensorParallelAttention``): on CPU the
layer runs in float32 or float64 only (``layer.CPU_DTYPES``; a float16/bfloat16 layer raises a
``TypeError`` saying so at its first forward), and an fp64 layer computes its RoPE tables in
float64.
"""

from __future__ import annotations


import numpy as np
import paddle
import paddle.nn.functional as F

from .adapter import type_name
from .indices import window_compressed_indices
from . import layer
from .layer import _rms_norm, _rope
from .tp import copy_to_tensor_parallel, reduce_from_tensor_parallel
from .v4_config import DeepSeekV4AttentionConfig

__all__ = ["DeepSeekV4Attention", "init_full_weights", "shard_of", "random_compressed_picks",
           "SHARD_AXIS", "SHARD_UNIT"]

#: Per-rank parameters and the axis along which they are split.
SHARD_AXIS = {"wq_b": 1, "attn_sink": 0, "wo_a": 0, "wo_b": 0}
#: What a shard holds whole: heads (``wq_b`` columns, sink) or head groups (``wo_a``, ``wo_b``).
SHARD_UNIT = {"wq_b": "heads", "attn_sink": "heads", "wo_a": "groups", "wo_b": "groups"}
_NORMS = ("q_norm_weight", "kv_norm_weight", "norm_c")


def _full_shapes(cfg: DeepSeekV4AttentionConfig) -> dict:
    H, G, D = cfg.num_attention_heads, cfg.o_groups, cfg.head_dim
    shapes = {
        "wq_a": (cfg.hidden_size, cfg.q_lora_rank),
        "q_norm_weight": (cfg.q_lora_rank,),
        "wq_b": (cfg.q_lora_rank, H * D),
        "wkv": (cfg.hidden_size, D),
        "kv_norm_weight": (D,),
        "wo_a": (G, cfg.o_lora_rank, cfg.heads_per_group * D),
        "wo_b": (G * cfg.o_lora_rank, cfg.hidden_size),
    }
    if cfg.use_attn_sink:
        shapes["attn_sink"] = (H,)
    if cfg.compress_ratio is not None:
        width = (2 if cfg.compress_ratio == 4 else 1) * D  # ratio 4: overlapping groups
        shapes.update(wkv_c=(cfg.hidden_size, width), wgate_c=(cfg.hidden_size, width),
                      ape=(cfg.compress_ratio, width), norm_c=(D,))
    return shapes


def _init_weights(cfg: DeepSeekV4AttentionConfig, seed: int, rank: int, tp: int) -> dict:
    """This rank's weights (``tp`` ranks; ``layer._draw_weights``): a sharded parameter drawn
    unit by unit (head or head group, :data:`SHARD_UNIT`), so every TP degree holds slices of
    the same full weights; the norms' weights start at 1."""
    units = {name: cfg.num_attention_heads if unit == "heads" else cfg.o_groups
             for name, unit in SHARD_UNIT.items()}
    return layer._draw_weights(cfg, _full_shapes(cfg), seed, rank, tp, norms=_NORMS,
                               shard_axis=SHARD_AXIS, units=units)


def init_full_weights(config: DeepSeekV4AttentionConfig, seed: int = 0) -> dict:
    """The unsharded weights (numpy fp32 by name) a layer built with ``seed`` holds.  Shapes:
    ``wq_a [hidden, q_lora]``, ``q_norm_weight [q_lora]``, ``wq_b [q_lora, H*D]`` (head-major
    columns), ``wkv [hidden, D]``, ``kv_norm_weight [D]``, ``wo_a [G, o_lora, (H/G)*D]``,
    ``wo_b [G*o_lora, hidden]`` (group-major rows), ``attn_sink [H]`` (with a sink), and with
    compression ``wkv_c``/``wgate_c [hidden, c*D]``, ``ape [ratio, c*D]`` (``c`` = 2 for ratio 4,
    else 1), ``norm_c [D]``."""
    return _init_weights(config, seed, 0, 1)


def shard_of(name: str, full: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's slice of a full parameter (or of its gradient); replicated ones whole."""
    return layer.shard_of(name, full, rank, world_size, SHARD_AXIS)


def _documents(S: int, cu) -> list:
    return [(0, S)] if cu is None else [(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]


def random_compressed_picks(config: DeepSeekV4AttentionConfig, seq_len: int, *, batch: int = 1,
                            cu_seqlens=None, seed: int = 0):
    """A stand-in for a ratio-4 layer's indexer: ``[B, S, compressed_topk]`` int32 group
    numbers (``-1`` = empty), a seeded uniform choice of each row's visible groups (of its own
    document with ``cu_seqlens``, counted from 0 there), from
    :func:`~.indices.window_compressed_indices`.  ``None`` for the other layer types (their
    keys need no picks)."""
    c = config
    if c.compressed_topk is None:
        return None
    out = np.full((batch, seq_len, c.compressed_topk), -1, np.int32)
    for d, (a, b) in enumerate(_documents(seq_len, cu_seqlens)):
        if b > a:
            idx = window_compressed_indices(b - a, window=1, ratio=c.compress_ratio,
                                            compressed_topk=c.compressed_topk, batch=batch,
                                            seed=int(np.random.SeedSequence([seed, d])
                                                     .generate_state(1)[0]))
            out[:, a:b] = np.where(idx[..., 1:] >= 0, idx[..., 1:] - (b - a), -1)
    return out


def _picks_on_host(picks, B: int, S: int) -> np.ndarray:
    if isinstance(picks, paddle.Tensor):
        picks = picks.numpy()
    if not isinstance(picks, np.ndarray):
        raise TypeError(f"compressed_indices: expected a paddle.Tensor or numpy.ndarray, got "
                        f"{type_name(picks)}")
    if picks.dtype not in (np.int32, np.int64):
        raise TypeError(f"compressed_indices: expected dtype int32 or int64, got {picks.dtype}")
    if picks.ndim != 3 or picks.shape[:2] != (B, S) or picks.shape[2] < 1:
        raise ValueError(f"compressed_indices: expected [B, S, K] with B={B}, S={S} (from "
                         f"hidden_states) and K >= 1, got shape {list(picks.shape)}")
    return picks


def _key_indices(cfg: DeepSeekV4AttentionConfig, B: int, S: int, cu, picks) -> np.ndarray:
    """``[B, S, L]`` int32 rows of ``kv = concat(S tokens, compressed rows)`` per query row:
    each document's window, then its compressed keys (every visible group, or the visible
    ones among the picks), ``-1`` padded."""
    W, ratio = cfg.window_size, cfg.compress_ratio
    docs = _documents(S, cu)
    groups = [0 if ratio is None else (b - a) // ratio for a, b in docs]
    slots = 0 if ratio is None else (picks.shape[2] if picks is not None else max(groups))
    out = np.full((B, S, W + slots), -1, np.int32)
    offset = S  # first compressed row of the document
    for (a, b), n_groups in zip(docs, groups):
        n = b - a
        if n == 0:
            continue
        static = picks is None and ratio is not None
        idx = window_compressed_indices(n, window=W, ratio=ratio if static else None)[0]
        out[:, a:b, :W] = np.where(idx[:, :W] >= 0, idx[:, :W] + a, -1)
        if static:
            comp = idx[:, W:]
            out[:, a:b, W:W + comp.shape[1]] = np.where(comp >= 0, comp - n + offset, -1)
        elif picks is not None:
            p = picks[:, a:b].astype(np.int64)
            bad = (p < -1) | (p >= n_groups)
            if bad.any():
                bb, s, k = (int(v) for v in np.argwhere(bad)[0])
                raise ValueError(
                    f"compressed_indices: expected -1 or a group number in [0, {n_groups}) "
                    f"(the complete groups of {'the row' if cu is None else 'its document'}, "
                    f"{n} tokens // ratio {ratio}), got {int(p[bb, s, k])} at [{bb}, {a + s}, {k}]")
            # a group the row may not see yet (not complete at the row) is an empty slot
            visible = p < ((np.arange(n) + 1) // ratio)[None, :, None]
            out[:, a:b, W:] = np.where(visible & (p >= 0), p + offset, -1)
        offset += n_groups
    return out


def _rope_tail(x, positions, theta: float, r: int):
    """RoPE (``layer._rope``) on the last ``r`` columns of ``x``; negative positions undo it."""
    return paddle.concat([x[..., :-r], _rope(x[..., -r:], positions, theta)], axis=-1)


def _overlap(t, D: int, fill: float):
    """Ratio 4's overlapping groups: ``[B, n, ratio, 2D]`` -> ``[B, n, 2 ratio, D]``, group ``j``
    = group ``j - 1``'s first ``D`` columns then its own last ``D`` (``fill`` before group 0)."""
    B, n, ratio, _ = t.shape
    first = paddle.full([B, 1, ratio, D], fill, dtype=t.dtype)
    prev = first if n == 1 else paddle.concat([first, t[:, :-1, :, :D]], axis=1)
    return paddle.concat([prev, t[..., D:]], axis=2)


class DeepSeekV4Attention(layer._TensorParallelAttention):
    """DeepSeek-V4 sparse attention (module docstring), heads split over a tensor-parallel
    group.

    Args:
        config: :class:`~.v4_config.DeepSeekV4AttentionConfig`;
            ``config.tensor_parallel_degree`` must equal the group's size.
        group: the tensor-parallel group; ``None``: fleet's model-parallel group when hybrid
            parallel is initialised, else the world group.
        seed: seeds the weights (:func:`init_full_weights`); every TP degree gets the same model.

    Forward:
        hidden_states: ``[B, S, hidden_size]`` in the parameters' dtype, the same on every rank.
        compressed_indices: ratio-4 layers only (required there): ``[B, S, K]`` int32/int64
            group numbers the indexer picked per row (``-1`` = empty; with ``cu_seqlens``
            counted from 0 in the row's document), a ``paddle.Tensor`` or ``numpy.ndarray``,
            read to the host; values in ``[-1, groups)``; a group the row may not see yet
            becomes an empty slot.  ``None`` for the other layer types.
        cu_seqlens: ``None`` or the ``[num_docs + 1]`` int32 boundaries of documents packed
            into one ``B = 1`` row (module docstring).
        Returns ``[B, S, hidden_size]`` in ``hidden_states``' dtype, identical on every rank.

    Raises:
        TypeError: ``config`` not a V4 config; (forward) ``hidden_states`` not a paddle.Tensor
            in the parameters' dtype; a float16/bfloat16 layer on CPU (named, with
            ``layer.CPU_DTYPES``); ``compressed_indices`` not an int tensor/array.
        ValueError: the group size differs from ``config.tensor_parallel_degree``;
            ``config.initializer_range`` so large that fp32 weights overflow; (forward)
            bad shapes, ``compressed_indices`` given to a layer without picks or missing from a
            ratio-4 layer, a pick out of ``[-1, groups)``, or bad ``cu_seqlens`` / ``B != 1``
            with it.  With ``"sequence"`` every rank raises alike (the V3.2 layer's agreement).
    """

    config_class = DeepSeekV4AttentionConfig
    shard_axis = SHARD_AXIS
    _init_weights = staticmethod(_init_weights)

    def __init__(self, config: DeepSeekV4AttentionConfig, group=None, seed: int = 0):
        super().__init__(config, group, seed)
        self.num_local_groups = config.groups_per_rank

    def extra_repr(self) -> str:
        c = self.config
        return (f"heads={c.num_attention_heads}, local_heads={self.num_local_heads}, "
                f"local_groups={self.num_local_groups}, tp_rank={self.tp_rank}/{self.tp_size}, "
                f"D={c.head_dim}, window={c.window_size}, compress_ratio={c.compress_ratio}, "
                f"compressed_topk={c.compressed_topk}, sink={c.use_attn_sink}")

    def _check_forward_inputs(self, hidden_states, compressed_indices):
        c = self.config
        B, S = self._check_hidden_states(hidden_states)
        if c.compressed_topk is None and compressed_indices is not None:
            kind = "window-only" if c.compress_ratio is None else "ratio-128"
            raise ValueError(f"compressed_indices: expected None for a {kind} layer (its keys "
                             f"are fixed; only ratio-4 layers take an indexer's picks)")
        if c.compressed_topk is not None and compressed_indices is None:
            raise ValueError("compressed_indices: a ratio-4 layer needs the indexer's picks, "
                             "[B, S, K] group numbers (random_compressed_picks stands in)")
        return B, S

    def _compress(self, x, docs):
        """The compressed kv rows of every document, in order: ``[B, sum groups, D]``, or
        ``None`` when no document has a complete group."""
        c = self.config
        ratio, D = c.compress_ratio, c.head_dim
        parts = []
        for a, b in docs:
            n = (b - a) // ratio
            if n == 0:
                continue
            xs = x[:, a:a + n * ratio]
            B = xs.shape[0]
            kv = paddle.matmul(xs, self.wkv_c).reshape([B, n, ratio, -1])
            score = paddle.matmul(xs, self.wgate_c).reshape([B, n, ratio, -1]) + self.ape
            if ratio == 4:
                kv, score = _overlap(kv, D, 0.0), _overlap(score, D, float("-inf"))
            pooled = (kv * F.softmax(score, axis=2)).sum(axis=2)  # [B, n, D]
            pooled = _rms_norm(pooled, self.norm_c, c.rms_norm_eps)
            parts.append(_rope_tail(pooled, np.arange(n) * ratio, c.layer_rope_theta,
                                    c.qk_rope_head_dim))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=1)

    def forward(self, hidden_states, compressed_indices=None, cu_seqlens=None):
        c = self.config
        with self._inputs_checked_on_every_rank():
            B, S = self._check_forward_inputs(hidden_states, compressed_indices)
            if cu_seqlens is None:
                cu, positions = None, np.arange(S)
            else:
                cu, positions = self._packed_positions(hidden_states, cu_seqlens)
            picks = (None if compressed_indices is None
                     else _picks_on_host(compressed_indices, B, S))
            indices = paddle.to_tensor(_key_indices(c, B, S, cu, picks))
        D, r, h, eps = c.head_dim, c.qk_rope_head_dim, self.num_local_heads, c.rms_norm_eps
        theta = c.layer_rope_theta

        c_q = _rms_norm(paddle.matmul(hidden_states, self.wq_a), self.q_norm_weight, eps)
        q = paddle.matmul(copy_to_tensor_parallel(c_q, self.group), self.wq_b)
        q = _rms_norm(q.reshape([B, S, h, D]), 1.0, eps)  # per head, no weight
        query = _rope_tail(q, positions, theta, r)

        kv = _rms_norm(paddle.matmul(hidden_states, self.wkv), self.kv_norm_weight, eps)
        kv = _rope_tail(kv, positions, theta, r)
        if c.compress_ratio is not None:
            kv_c = self._compress(hidden_states, _documents(S, cu))
            if kv_c is not None:
                kv = paddle.concat([kv, kv_c], axis=1)
        kv = copy_to_tensor_parallel(kv, self.group)

        # the key sets are per document already: the op needs no cu_seqlens
        o = self._sparse_core(query, kv, indices)
        o = _rope_tail(o, -positions, theta, r)  # inverse RoPE

        g = self.num_local_groups
        o = paddle.einsum("bsgd,grd->bsgr", o.reshape([B, S, g, -1]), self.wo_a)
        y = paddle.matmul(o.reshape([B, S, g * c.o_lora_rank]), self.wo_b)
        return reduce_from_tensor_parallel(y, self.group)
