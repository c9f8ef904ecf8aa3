"""Where a CTA of the 64-head atomic backward spends its time: the fused first pass built with
``timeline=True`` (``sparse_bwd.main``'s last knob) writes SM-cycle stamps (since the CTA began)
into its ``DSink`` row buffer instead of the rows' ``d_sink`` terms; this prints their spread
over the CTAs at ``ref`` and ``fleet`` (random full rows), the steady time per key block, and the
call's time with and without the stamps.  (``d_sink`` of the stamped calls is meaningless.)

    source tools/gpu_env.sh
    python3 tools/experiments/bwd_timeline.py

Cycles are printed as microseconds at 1.98 GHz (the boost clock; the stamps count cycles).
Needs a CUDA GPU; run from the repository root.  The backward's counterpart of
``fwd_timeline.py`` (docs/performance.md, "Next", item 2).
"""
import sys

import numpy as np
import torch

sys.path.insert(0, "src")
sys.path.insert(0, "tools/bench")
sys.path.insert(0, "tools/experiments")
from kernel_trial import Variant  # noqa: E402
from paddlefleet.tilelang_ops.attn import interface  # noqa: E402

#: the shipped schedule's knobs (row_extent on), then tma_tiles (default) and timeline
KNOBS = (None,) * 8 + (True, None, None, None)
NAMES = {0: "tiles issued (TMA)", 1: "fused loads + row scan done", 2: "q_ready passed",
         3: "fused rows done", 4: "W0: block 0 left half", 5: "W0: block 0 P/dS handed",
         8: "W1: block 0 P/dS taken", 6: "W0: loop end", 9: "W1: loop end",
         7: "W0: end (dQ stored)", 10: "W1: end (dQ stored)", 16: "W0: block 8 top",
         17: "W0: block 24 top"}


class Stamps(Variant):
    """The shipped kernels, the 64-head first pass with or without the stamps; keeps the
    fused pass's row buffer (where the stamps are)."""

    def __init__(self, timeline):
        super().__init__(bwd_extra=KNOBS + (bool(timeline),))
        self.rows = None

    def bwd_main(self, *args, pre=None):
        super().bwd_main(*args, pre=pre)
        if pre is not None:
            self.rows = pre.d_sink_rows


def timed(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(reps):
        fn()
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / reps


def main():
    plain, stamped = Stamps(False), Stamps(True)
    for name, S, SKV, L in (("ref", 4096, 8192, 2048), ("fleet", 8192, 8192, 640)):
        g = torch.Generator(device="cuda").manual_seed(0)
        B, H, scale = 1, 64, 576 ** -0.5
        q = torch.randn(B, S, H, 576, device="cuda", generator=g).bfloat16()
        kv = torch.randn(B, SKV, 576, device="cuda", generator=g).bfloat16()
        do = torch.randn(B, S, H, 512, device="cuda", generator=g).bfloat16()
        idx = torch.argsort(torch.rand(S, SKV, device="cuda", generator=g), dim=1)[:, :L]
        idx = idx.to(torch.int32).reshape(B, S, L).contiguous()
        sink = torch.randn(H, device="cuda", generator=g).float()
        out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, scale, sink)

        def call(prov):
            return lambda: interface.mqa_latent_sparse_bwd(
                q, kv, out, do, lse, sink, idx, scale, deterministic=False, provider=prov)

        ms = {"plain": timed(call(plain)), "timeline": timed(call(stamped))}
        call(stamped)()
        torch.cuda.synchronize()
        st = stamped.rows[0, :, :18].double().cpu().numpy()
        waves = S / 132
        print(f"== {name}: atomic backward plain {ms['plain']:.3f} ms, timeline "
              f"{ms['timeline']:.3f} ms; per wave {ms['timeline'] / waves * 1e3:.2f} us")
        for e, n in NAMES.items():
            if e == 17 and name != "ref":  # fleet's rows have 10 blocks: no block 24
                continue
            p = np.percentile(st[:, e], [10, 50, 90]) / 1980
            print(f"  {e:2d} {n:30s} p10 {p[0]:7.2f}  p50 {p[1]:7.2f}  p90 {p[2]:7.2f} us")
        end = np.max(st[:, [7, 10]], axis=1) / 1980
        print(f"  CTA duration p50 {np.median(end):.2f} us")
        if name == "ref":
            blk = (st[:, 17] - st[:, 16]) / 16 / 1980
            print(f"  steady block p50 {np.median(blk):.3f} us; the CTA besides its 32 blocks "
                  f"~{np.median(end) - 32 * np.median(blk):.2f} us")


if __name__ == "__main__":
    main()
