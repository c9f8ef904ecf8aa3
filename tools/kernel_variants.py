"""Time each backward stage and kernel variants at the reference shape (GPU, PyTorch).

    python tools/kernel_variants.py [--heads 64] [--variants "dict(scatter_early=True)" ...]

Breaks the wrapper times of tools/kernel_timing.py into their parts (forward kernel alone,
backward preprocess, fixed-point scale, main kernel deterministic / atomic, postprocess) and
times extra static variants of the main kernel (keyword arguments of
``kernels.sparse_bwd.main``), compiled in parallel first.  Used to pick the kernels' defaults;
the numbers go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tools"))

DK, DV = 576, 512


def _compile(args_kw):
    args, kw = args_kw
    from paddlefleet.tilelang_ops.attn.kernels import sparse_bwd

    t0 = time.time()
    try:
        sparse_bwd.main(*args, **kw)
        return args, kw, time.time() - t0, None
    except Exception as exc:
        return args, kw, time.time() - t0, f"{type(exc).__name__}: {exc}"[-600:]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--seq-kv", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--variants", nargs="*", default=[])
    ns = ap.parse_args(argv)

    from paddlefleet.tilelang_ops.attn import tiling

    plan = tiling.head_plan(ns.heads)
    m = plan.heads_per_cta
    bk = tiling.bwd_key_block(m)
    variants = [dict()] + [eval(v, {}) for v in ns.variants]  # noqa: S307 (trusted CLI)
    jobs = [((m, DK, DV, det, bk), kw) for kw in variants for det in (True, False)]
    jobs.append(((m, DK, DV, True, bk), dict(slot_partials=True)))
    with ProcessPoolExecutor(max_workers=16) as pool:
        for args, kw, dt, err in pool.map(_compile, jobs):
            print(f"[compile] {args} {kw} {dt:.1f}s {err or 'ok'}", flush=True)

    import torch
    from kernel_timing import _time

    from paddlefleet.tilelang_ops.attn import interface
    from paddlefleet.tilelang_ops.attn.indices import causal_topk_indices
    from paddlefleet.tilelang_ops.attn.kernels import sparse_bwd
    from paddlefleet.tilelang_ops.attn.kernels.sparse_fwd import sparse_fwd

    B, S, S_kv, H, L = 1, ns.seq, ns.seq_kv, ns.heads, ns.topk
    sm = DK ** -0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((B, S, H, DK), generator=g, device="cuda").bfloat16()
    kv = torch.randn((B, S_kv, DK), generator=g, device="cuda").bfloat16()
    do = torch.randn((B, S, H, DV), generator=g, device="cuda").bfloat16()
    idx = torch.from_numpy(causal_topk_indices(B, S, S_kv, L, seed=0)).cuda()
    assert plan.padded_heads == H, "breakdown assumes no head padding"
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, sm, check_indices=False)
    ops = interface.ops_for(q)
    bflop = 2.0 * B * S * H * L * (2 * DV + 3 * DK)
    fflop = 2.0 * B * S * H * L * (DK + DV)

    sink = torch.full((H,), float("-inf"), device="cuda")
    scale1 = torch.full((1,), sm, device="cuda")
    o2, l2 = torch.empty_like(out), torch.empty_like(lse)
    fk = sparse_fwd(m, DK, DV)
    rows = []
    rows.append(("fwd kernel", _time(lambda: fk(q, kv, idx, sink, scale1, o2, l2)), fflop))
    rows.append(("fwd wrapper", _time(lambda: interface.mqa_latent_sparse_fwd(
        q, kv, idx, sm, check_indices=False)), fflop))

    n = B * S * H
    delta = torch.empty((n,), device="cuda")
    pre = sparse_bwd.preprocess(DV)
    rows.append(("bwd preprocess", _time(lambda: pre(out.view(n, DV), do.view(n, DV), delta)),
                 None))
    delta3 = delta.view(B, S, H)
    rows.append(("fixed_point_scale", _time(lambda: interface.fixed_point_scale(
        ops, q, kv, do, delta3, sm, n)), None))
    fx = interface.fixed_point_scale(ops, q, kv, do, delta3, sm, n)
    scale2 = torch.cat([scale1, fx])
    lse2 = (lse * 1.4426950408889634).contiguous()
    dq = torch.empty_like(q)
    for kw in variants:
        for det in (True, False):
            k = sparse_bwd.main(m, DK, DV, det, bk, **kw)
            acc = torch.zeros((B, S_kv, DK), dtype=torch.int64 if det else torch.float32,
                              device="cuda")
            rows.append((f"bwd main det={det} {kw}",
                         _time(lambda: k(q, kv, do, idx, lse2, delta3, scale2, dq, acc)), bflop))
    # ordered deterministic mode: slot partials, stable sort, fixed-order reduction
    g_n = plan.num_groups
    parts = torch.empty((B, S, g_n, L, DK), dtype=torch.float32, device="cuda")
    ks = sparse_bwd.main(m, DK, DV, True, bk, slot_partials=True)
    rows.append(("bwd main slot partials",
                 _time(lambda: ks(q, kv, do, idx, lse2, delta3, scale2, dq, parts)), bflop))
    rows.append(("bwd sort slots", _time(lambda: interface._sort_slots_by_key(ops, idx, g_n, S_kv)),
                 None))
    perm, off = interface._sort_slots_by_key(ops, idx, g_n, S_kv)
    red = sparse_bwd.slot_reduce(DK)
    dkv_o = torch.zeros((B, S_kv, DK), dtype=torch.float32, device="cuda")
    parts2 = parts.view(B, -1, DK)
    rows.append(("bwd slot reduce", _time(lambda: red(parts2, perm, off, dkv_o)), None))
    del parts, parts2
    for name, method in (("ordered", "ordered"), ("fixed point", "fixed_point")):
        rows.append((f"bwd wrapper det {name}", _time(lambda: interface.mqa_latent_sparse_bwd(
            q, kv, out, do, lse, None, idx, sm, det_method=method, check_indices=False)), bflop))
    acc = torch.zeros((B, S_kv, DK), dtype=torch.int64, device="cuda")
    post = sparse_bwd.postprocess(DK)
    dkv = torch.empty((B, S_kv, DK), dtype=torch.bfloat16, device="cuda")
    rows.append(("bwd postprocess", _time(lambda: post(acc, scale2, dkv)), None))
    rows.append(("bwd wrapper atomic", _time(lambda: interface.mqa_latent_sparse_bwd(
        q, kv, out, do, lse, None, idx, sm, deterministic=False, check_indices=False)), bflop))
    print(f"\nGPU {torch.cuda.get_device_name()} B={B} S={S} S_kv={S_kv} H={H} topk={L}")
    for name, (med, lo, hi), flop in rows:
        tf = f"{flop / med / 1e9:7.1f} TFLOP/s" if flop else ""
        print(f"{name:55s} {med:8.3f} ms (min {lo:.3f} max {hi:.3f}) {tf}", flush=True)


if __name__ == "__main__":
    main()
