"""Where a CTA of the 64-head forward spends its time: the kernel built with ``timeline=True``
writes SM-cycle stamps (since the CTA began, after its barriers' set-up) into
``Lse[b, s, h0 + slot]`` instead of the lse, and the SM's id and clock at its start and end into
slots 18-24; this prints their spread over the CTAs at ``ref`` and ``fleet`` (random full rows),
the steady time per pair of key blocks, and the gap on each SM between one CTA's end and the
next one's start.  Also the call's time with and without the stamps (they cost a few percent).

    source tools/gpu_env.sh
    python3 tools/experiments/fwd_timeline.py            # the shipped kernel (query by TMA)
    python3 tools/experiments/fwd_timeline.py cp_async   # the query tile by cp.async

Cycles are printed as microseconds at 1.98 GHz (the boost clock; the stamps count cycles).
Needs a CUDA GPU; run from the repository root.  Run 110 in docs/validation.md.
"""
import sys
import numpy as np
import torch
sys.path.insert(0, "src")
from paddlefleet.tilelang_ops.attn import kernels

NAMES = {0: "Q issued", 1: "scan done", 2: "q_ready passed", 4: "P: block0 left issued",
         5: "W0: ready_l0 (blk0)", 6: "W0: blk0 scores done", 7: "W0: m0 arrive (blk0)",
         8: "W1: ready_rt1 (blk1)", 9: "W1: m1 arrive (blk1)", 10: "W0: loop end",
         11: "W1: loop end", 12: "W0: fold done", 13: "W0: end (O, lse issued)",
         14: "W1: end (O issued)", 15: "P: end", 16: "W0: pair 8 top", 17: "W0: pair 12 top"}
TMA = sys.argv[1:] != ["cp_async"]
kt = kernels.build("fwd", (64, 576, 512, 64, 256, 1, None, True, 224, True, TMA))
kp = kernels.build("fwd", (64, 576, 512, 64, 256, 1, None, True, 224, False, TMA))
print("tma_q", TMA)
for name, S, SKV, L in (("ref", 4096, 8192, 2048), ("fleet", 8192, 8192, 640)):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H = 1, 64
    q = torch.randn(B, S, H, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, SKV, 576, device="cuda", generator=g).bfloat16()
    idx = torch.argsort(torch.rand(S, SKV, device="cuda", generator=g), dim=1)[:, :L]
    idx = idx.to(torch.int32).reshape(B, S, L).contiguous()
    sink = torch.randn(H, device="cuda", generator=g).float()
    scale = torch.tensor([576 ** -0.5], device="cuda")
    o = torch.empty(B, S, H, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(B, S, H, device="cuda")
    ms = {}
    for kn, k in (("plain", kp), ("timeline", kt), ("plain", kp), ("timeline", kt)):
        for _ in range(3):
            k(q, kv, idx, sink, scale, o, lse)
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(10):
            k(q, kv, idx, sink, scale, o, lse)
        ev[1].record(); torch.cuda.synchronize()
        ms[kn] = ev[0].elapsed_time(ev[1]) / 10
    lse.fill_(float("nan"))
    kt(q, kv, idx, sink, scale, o, lse)
    torch.cuda.synchronize()
    st = lse[0, :, :25].double().cpu().numpy()
    waves = S / 132
    print(f"== {name}: plain {ms['plain']:.3f} ms, timeline {ms['timeline']:.3f} ms; "
          f"per wave {ms['timeline'] / waves * 1e3:.2f} us; cycles->us at 1.98 GHz")
    for e, n in NAMES.items():
        v = st[:, e]
        v = v[np.isfinite(v)]
        if len(v):
            p = np.percentile(v, [10, 50, 90]) / 1980
            print(f"  {e:2d} {n:26s} p10 {p[0]:7.2f}  p50 {p[1]:7.2f}  p90 {p[2]:7.2f} us")
    end = np.nanmax(st[:, [13, 14, 15]], axis=1) / 1980
    print(f"  CTA duration p50 {np.median(end):.2f} us; wave {ms['timeline'] / waves * 1e3:.2f} us"
          f" -> gap between CTAs ~{ms['timeline'] / waves * 1e3 - np.median(end):.2f} us")
    sm = st[:, 18].astype(int)
    start = st[:, 19] * 2**24 + st[:, 20]
    end = np.maximum(st[:, 21] * 2**24 + st[:, 22], st[:, 23] * 2**24 + st[:, 24])
    gaps, n_per = [], []
    for k in np.unique(sm):
        o = np.argsort(start[sm == k])
        a, z = start[sm == k][o], end[sm == k][o]
        gaps += list(a[1:] - z[:-1])
        n_per.append(len(a))
    g = np.array(gaps) / 1980
    print(f"  SMs {len(n_per)}, CTAs per SM {min(n_per)}-{max(n_per)}; gap end->next start "
          f"p10 {np.percentile(g, 10):.2f} p50 {np.median(g):.2f} p90 {np.percentile(g, 90):.2f}"
          f" us; min {g.min():.2f}")
    if name == "ref":
        pair = (st[:, 17] - st[:, 16]) / 4 / 1980
        print(f"  steady pair p50 {np.median(pair):.3f} us (per block {np.median(pair) / 2:.3f})")
