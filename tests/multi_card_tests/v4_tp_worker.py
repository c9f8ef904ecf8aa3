"""Rank process of the DeepSeek-V4 tensor-parallel tests (launched by paddle.distributed.launch).

Usage: v4_tp_worker.py OUT_DIR SPEC [SPEC ...]

A SPEC is ``CASE@PARTITION`` (a case of :data:`CASES` run with that attention partition) or
``errors`` (bad compressed picks on some ranks, :func:`errors`).  Writes
OUT_DIR/<spec>_rank<r>.npz (output, input gradient, this rank's parameter gradients); the
pytest process (test_v4_tp.py) compares them with one process.  The pytest process imports
:func:`run_case` from here for that single-process run.

Every process builds the same full weights and inputs from fixed seeds and loads its slice
(``DeepSeekV4Attention.load_full_weights``), as tp_case.py does for the V3.2 layer.
"""

import os
import sys

import numpy as np

from paddlefleet.tilelang_ops.attn.indices import cu_seqlens_from_lengths
from paddlefleet.tilelang_ops.attn.v4_config import DeepSeekV4AttentionConfig
from paddlefleet.tilelang_ops.attn.v4_layer import init_full_weights, random_compressed_picks

#: Tiny V4 blocks: 64 heads in 8 groups (8 heads and one group per rank at TP 8, as V4-Flash),
#: D = 32 with 8 rope columns.  initializer_range 0.1 keeps the softmax far from uniform.
BASE = dict(hidden_size=32, num_attention_heads=64, q_lora_rank=16, o_lora_rank=8, o_groups=8,
            head_dim=32, qk_rope_head_dim=8, window_size=4, initializer_range=0.1,
            backward_backend="reference")
#: name -> (config overrides, batch, S or document lengths).  S = 21 is divisible by none of
#: 2, 4, 8 (pad rows in the sequence partition; its last token in no group); 260 tokens give
#: the ratio-128 layer two groups; the packed case has an empty document and one too short
#: for a group.
CASES = {
    "c4": (dict(compress_ratio=4, compressed_topk=3), 2, 24),
    "c4_s21": (dict(compress_ratio=4, compressed_topk=3), 2, 21),
    "c128": (dict(compress_ratio=128), 1, 260),
    "win_nosink": (dict(use_attn_sink=False), 2, 24),
    "c4_packed": (dict(compress_ratio=4, compressed_topk=2), 1, [5, 0, 11, 3, 6]),
}


def case_config(name: str, tp: int, partition: str = "heads") -> DeepSeekV4AttentionConfig:
    return DeepSeekV4AttentionConfig(**BASE, **CASES[name][0], tensor_parallel_degree=tp,
                                     attention_partition=partition)


def case_inputs(name: str):
    """(full weights, x [B,S,hidden], compressed picks or None, grad_y, cu_seqlens or None)."""
    cfg = case_config(name, 1)
    _, batch, size = CASES[name]
    full = init_full_weights(cfg, seed=11)
    rng = np.random.default_rng(123)
    for key in ("q_norm_weight", "kv_norm_weight", "norm_c"):  # a generic point, not ones
        if key in full:
            full[key] = (1.0 + 0.1 * rng.standard_normal(full[key].shape)).astype(np.float32)
    cu = cu_seqlens_from_lengths(size) if isinstance(size, list) else None
    seq = int(cu[-1]) if cu is not None else size
    x = rng.standard_normal((batch, seq, cfg.hidden_size)).astype(np.float32)
    picks = random_compressed_picks(cfg, seq, batch=batch, cu_seqlens=cu, seed=5)
    grad_y = rng.standard_normal((batch, seq, cfg.hidden_size)).astype(np.float32)
    return full, x, picks, grad_y, cu


def run_case(name: str, tp: int, group=None, partition: str = "heads") -> dict:
    """Forward + backward of ``sum(y * grad_y)`` on this process's shard: numpy ``y``, ``dx``
    and ``grad.<param>`` of every local parameter."""
    import paddle

    from paddlefleet.tilelang_ops.attn.v4_layer import DeepSeekV4Attention

    full, x_np, picks, gy_np, cu = case_inputs(name)
    layer = DeepSeekV4Attention(case_config(name, tp, partition), group=group)
    layer.load_full_weights(full)
    x = paddle.to_tensor(x_np, stop_gradient=False)
    y = layer(x, None if picks is None else paddle.to_tensor(picks),
              cu_seqlens=None if cu is None else paddle.to_tensor(cu))
    (y * paddle.to_tensor(gy_np)).sum().backward()
    out = {"y": y.numpy(), "dx": x.grad.numpy()}
    for pname, p in layer.named_parameters():
        out["grad." + pname] = p.grad.numpy()
    return out


def errors(rank: int) -> dict:
    """The "sequence" layer with a compressed pick out of range on rank 1 only, then on every
    rank, then a good call: what each rank raised (``type: message``) and the good output.  A
    check failing on some ranks only must not leave the others waiting in the exchange."""
    import paddle

    from paddlefleet.tilelang_ops.attn.v4_layer import DeepSeekV4Attention

    full, x, picks, _, _ = case_inputs("c4")
    layer = DeepSeekV4Attention(case_config("c4", paddle.distributed.get_world_size(),
                                            "sequence"))
    layer.load_full_weights(full)
    out = {}
    for case in ("pick_on_rank1", "pick_on_every_rank"):
        bad = picks.copy()
        if case == "pick_on_every_rank" or rank == 1:
            bad[0, 20, 0] = 6  # S = 24: groups 0 .. 5
        try:
            layer(paddle.to_tensor(x), paddle.to_tensor(bad))
            out[case] = np.array("no error")
        except Exception as e:  # noqa: BLE001 (recorded for the pytest process)
            out[case] = np.array(f"{type(e).__name__}: {e}")
    out["y"] = layer(paddle.to_tensor(x), paddle.to_tensor(picks)).numpy()
    return out


def main(out_dir: str, specs) -> None:
    import paddle.distributed as dist

    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    for spec in specs:
        if spec == "errors":
            result = errors(rank)
        else:
            case, partition = spec.split("@")
            # group=None: the world group, the tensor-parallel group here (gloo sub-groups are
            # broken on the CPU wheel, Paddle 3.3.1)
            result = run_case(case, world, partition=partition)
        np.savez(os.path.join(out_dir, f"{spec}_rank{rank}.npz"), **result)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
