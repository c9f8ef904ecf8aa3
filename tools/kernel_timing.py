"""Time the TileLang kernels at one shape (default: the reference shape of docs/performance.md).

    python tools/kernel_timing.py                     # B=1 S=4096 S_kv=8192 H=64 topk=2048
    python tools/kernel_timing.py --heads 8 128 --topk 640

Prints, per head count, the median time (CUDA events, several repeats) of the forward, the
deterministic backward and the atomic backward, each through its host wrapper (padding and
preprocess included), with TFLOP/s from the usual FLOP counts
(fwd ``2*B*S*H*topk*(Dk+Dv)``, bwd ``2*B*S*H*topk*(2*Dv+3*Dk)``), then the deterministic
backward's exact-dKV statistics: how many keys the re-run took, and the head-room
``log2(2^24 / Bound_j)`` the first pass left (quantiles over keys).  Needs PyTorch with CUDA.
The benchmark suite proper (CSV, plots, baselines) lives in tools/bench/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

DK, DV = 576, 512


def _time(fn, warmup=3, reps=10):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), min(times), max(times)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def _parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=_positive_int, default=1, help="default: %(default)s")
    ap.add_argument("--seq", type=_positive_int, default=4096, help="default: %(default)s")
    ap.add_argument("--seq-kv", type=_positive_int, default=8192, help="default: %(default)s")
    ap.add_argument("--heads", type=_positive_int, nargs="+", default=[64],
                    help="one or more head counts (default: 64)")
    ap.add_argument("--topk", type=_positive_int, default=2048, help="default: %(default)s")
    ap.add_argument("--sink", action="store_true")
    ap.add_argument("--reps", type=_positive_int, default=10, help="default: %(default)s")
    ns = ap.parse_args(argv)
    # The kernels run on a CUDA device through PyTorch: without one, a usage error (exit 2)
    # instead of a traceback from the first .cuda() call.
    try:
        import torch
    except ImportError:
        ap.error("needs PyTorch with CUDA (torch is not installed; see README.md, "
                 "'GPU validation environment')")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device through PyTorch (torch.cuda.is_available() is False)")
    return ns


def main(argv=None):
    ns = _parse(argv)
    import torch

    from paddlefleet.tilelang_ops.attn import interface
    from paddlefleet.tilelang_ops.attn.indices import causal_topk_indices

    B, S, S_kv, L = ns.batch, ns.seq, ns.seq_kv, ns.topk
    idx = torch.from_numpy(causal_topk_indices(B, S, S_kv, L, seed=0)).cuda()
    sm = DK ** -0.5
    print(f"GPU {torch.cuda.get_device_name()}  B={B} S={S} S_kv={S_kv} topk={L} "
          f"sink={ns.sink}", flush=True)
    for H in ns.heads:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn((B, S, H, DK), generator=g, device="cuda").bfloat16()
        kv = torch.randn((B, S_kv, DK), generator=g, device="cuda").bfloat16()
        do = torch.randn((B, S, H, DV), generator=g, device="cuda").bfloat16()
        sink = torch.randn((H,), generator=g, device="cuda") if ns.sink else None
        out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, sm, sink, check_indices=False)
        fwd = lambda: interface.mqa_latent_sparse_fwd(q, kv, idx, sm, sink,  # noqa: E731
                                                      check_indices=False)

        def bwd(det):
            return lambda: interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, sm,
                                                           deterministic=det,
                                                           check_indices=False)

        f_flop = 2.0 * B * S * H * L * (DK + DV)
        b_flop = 2.0 * B * S * H * L * (2 * DV + 3 * DK)
        for name, fn, flop in (("fwd", fwd, f_flop), ("bwd_det", bwd(True), b_flop),
                               ("bwd_atomic", bwd(False), b_flop)):
            med, lo, hi = _time(fn, reps=ns.reps)
            print(f"H={H:4d} {name:13s} {med:8.3f} ms (min {lo:.3f}, max {hi:.3f})  "
                  f"{flop / med / 1e9:7.1f} TFLOP/s", flush=True)
        _exact_stats(interface, q, kv, out, do, lse, sink, idx, sm, H)


def _exact_stats(interface, q, kv, out, do, lse, sink, idx, sm, H):
    """Re-run count and first-pass head-room of the deterministic backward's exact dKV."""
    import torch

    seen = []

    class Recorder(interface.TileLangKernels):
        def bwd_main(self, m, mode, with_dq, *args):
            super().bwd_main(m, mode, with_dq, *args)
            bound, counts = args[-2], args[-5]
            seen.append((with_dq, bound.clone(), counts.clone()))

    interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, sm, check_indices=False,
                                    provider=Recorder())
    (_, bound, _), (_, _, counts) = seen
    used = bound[bound > 0].double()
    room = (2.0**24 / used).log2()
    qs = torch.quantile(room.float(), torch.tensor([0.0, 0.01, 0.5, 0.99, 1.0],
                                                   device=room.device)).tolist()
    print(f"H={H:4d} exact dKV: {int((used > 2**24).sum())} of {used.numel()} keys re-run "
          f"({int(counts.sum())} slots); head-room bits min/p1/p50/p99/max "
          + "/".join(f"{v:.1f}" for v in qs), flush=True)


if __name__ == "__main__":
    main()
