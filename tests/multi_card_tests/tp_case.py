"""Shared inputs for the tensor-parallel tests: one definition of each case, used both by the
rank processes (tp_worker.py) and by the pytest process for the single-process run.

Every process builds the same full weights and inputs from fixed seeds; a rank loads only its
slice (``MQALatentAttention.load_full_weights``), so rank results must equal the matching slice
of the single-process results.
"""

from __future__ import annotations

import numpy as np

from paddlefleet.tilelang_ops.attn.config import get_preset
from paddlefleet.tilelang_ops.attn.indices import (
    causal_topk_indices,
    cu_seqlens_from_lengths,
    varlen_causal_topk_indices,
)
from paddlefleet.tilelang_ops.attn.layer import REPLICATED, init_full_weights

#: name -> config overrides of the small preset.  64 heads give 8 per rank at TP=8; 48 heads
#: give 6 per rank (not a power of two).  initializer_range 0.1 keeps the softmax far from
#: uniform so the comparison is sensitive.
CASES = {
    "h64": dict(num_attention_heads=64, use_attn_sink=True),
    "h64_nosink": dict(num_attention_heads=64, use_attn_sink=False),
    "h48": dict(num_attention_heads=48, use_attn_sink=True),
    "h64_packed": dict(num_attention_heads=64, use_attn_sink=True),
    "h48_packed": dict(num_attention_heads=48, use_attn_sink=False),
    "h64_s45": dict(num_attention_heads=64, use_attn_sink=True),
    "h48_s45": dict(num_attention_heads=48, use_attn_sink=True),
    "h48_packed_s45": dict(num_attention_heads=48, use_attn_sink=True),
    "h48_s3": dict(num_attention_heads=48, use_attn_sink=True),
}
BATCH, SEQ, TOPK = 2, 48, 32
#: Cases whose sequence length is not SEQ.  45 is divisible by none of 2, 4, 8: the sequence
#: partition pads it to 46, 48 and 48 rows (at TP 8 the last rank holds 3 rows and 3 pad rows).
#: 3 at TP 8: one row per rank, ranks 3..7 hold only pad rows.
SEQ_OF = {"h64_s45": 45, "h48_s45": 45, "h48_packed_s45": 45, "h48_s3": 3}
#: Packed cases: B = 1, documents of these lengths (sum: the case's S) back to back, cu_seqlens.
DOC_LENS = {"h64_packed": [3, 1, 25, 0, 19], "h48_packed": [30, 2, 16],
            "h48_packed_s45": [7, 0, 31, 7]}
#: The attention partitions a case runs with (config.attention_partition).
PARTITIONS = ("heads", "sequence")


def case_config(name: str, tp: int, partition: str = "heads"):
    return get_preset(
        "deepseek_v32_small",
        **CASES[name],
        index_topk=TOPK,
        initializer_range=0.1,
        backward_backend="reference",
        tensor_parallel_degree=tp,
        attention_partition=partition,
    )


def case_inputs(name: str):
    """(full weights, x [B,S,hidden], token_indices [B,S,L], grad_y [B,S,hidden], cu_seqlens)
    as numpy; ``cu_seqlens`` is ``None`` except for the packed cases (B = 1 there)."""
    cfg = case_config(name, 1)
    full = init_full_weights(cfg, seed=11)
    rng = np.random.default_rng(123)
    # Non-trivial norm weights so their gradients are checked at a generic point.
    for key in REPLICATED:
        if key.endswith("norm_weight"):
            full[key] = (1.0 + 0.1 * rng.standard_normal(full[key].shape)).astype(np.float32)
    cu = None
    batch, seq = BATCH, SEQ_OF.get(name, SEQ)
    if name in DOC_LENS:
        cu = cu_seqlens_from_lengths(DOC_LENS[name])
        assert int(cu[-1]) == seq
        batch = 1
    x = rng.standard_normal((batch, seq, cfg.hidden_size)).astype(np.float32)
    if cu is None:
        idx = causal_topk_indices(BATCH, seq, seq, TOPK, seed=5)  # early rows are -1 padded
    else:
        idx = varlen_causal_topk_indices(cu, TOPK, seed=5)  # causal inside each document
    grad_y = rng.standard_normal((batch, seq, cfg.hidden_size)).astype(np.float32)
    return full, x, idx, grad_y, cu


def run_case(name: str, tp: int, group=None, partition: str = "heads") -> dict:
    """Forward + backward of ``sum(y * grad_y)`` on this process's shard with the given
    attention partition; numpy results: ``y``, ``dx`` and ``grad.<param>`` for every local
    parameter."""
    import paddle

    from paddlefleet.tilelang_ops.attn.layer import MQALatentAttention

    full, x_np, idx_np, gy_np, cu = case_inputs(name)
    layer = MQALatentAttention(case_config(name, tp, partition), group=group)
    layer.load_full_weights(full)
    x = paddle.to_tensor(x_np, stop_gradient=False)
    y = layer(x, paddle.to_tensor(idx_np), cu_seqlens=None if cu is None else paddle.to_tensor(cu))
    (y * paddle.to_tensor(gy_np)).sum().backward()
    out = {"y": y.numpy(), "dx": x.grad.numpy()}
    for pname, p in layer.named_parameters():
        out["grad." + pname] = p.grad.numpy()
    return out
