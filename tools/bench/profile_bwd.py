"""Where the backward's time goes: per-kernel CUDA time of one call, and ptxas resource usage.

    python3 tools/bench/profile_bwd.py [--heads 64] [--seq 4096] [--seq-kv 8192] [--topk 2048]
                                       [--no-ptxas] [--timeline]

1. ``nvcc -Xptxas -v`` on the lowered CUDA of the main backward kernel (exact with dQ, exact
   re-run, atomic; the 64-head atomic one with the preprocess fused, as launched) for the head
   tile of ``--heads``: registers, spills, stack (spills inside the
   key loop are the usual reason a variant is slow).
2. ``torch.profiler`` around one deterministic and one atomic backward (after warm-up): the
   CUDA time of every kernel the wrapper launches, host-side framework ops included, largest
   first.  Needs PyTorch with CUDA and TileLang (GPU host; see README.md).
3. ``--timeline``: the GPU timeline of one call of each wrapper (forward, atomic and
   deterministic backward; value checks on and off, sink on): every kernel in launch order with
   its start after the call began, its duration and the idle gap before it, and the call's host
   time; shows where the GPU waits for the host (a gap) rather than for a kernel.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import bench_sparse_mqa as bench  # puts src/ on sys.path, sets the kernel cache
import model


def ptxas_report(heads_per_cta: int) -> list[str]:
    """One line per main-kernel flavour: registers, spill bytes, stack frame."""
    import tilelang

    from paddlefleet.tilelang_ops.attn import kernels

    tl_dir = Path(tilelang.__file__).resolve().parent
    lines = []
    for deterministic, with_dq in ((True, True), (True, False), (False, True)):
        # as the wrappers launch it: the atomic first pass with the preprocess fused where it can
        fused = not deterministic and heads_per_cta in kernels.FUSED_TILES
        args = kernels.main_args(heads_per_cta, deterministic, with_dq, fused=fused)
        src = kernels.lower("bwd_main", args).kernel_source
        with tempfile.TemporaryDirectory() as tmp:
            cu = Path(tmp) / "k.cu"
            cu.write_text(src)
            cmd = ["nvcc", "--cubin", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                   "-std=c++17", "-Xptxas", "-v", f"-I{tl_dir / 'src'}",
                   f"-I{tl_dir / '3rdparty/cutlass/include'}", "-o", str(Path(tmp) / "k.cubin"),
                   str(cu)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        info = " ".join(ln.strip() for ln in res.stderr.splitlines()
                        if re.search(r"registers|spill|stack frame", ln))
        lines.append(f"[ptxas] main{args} rc={res.returncode}: {info or res.stderr[-300:]}")
    return lines


def profile(s: model.Shape):
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    inp = bench.make_input_sets(torch, s, "cuda", sets=1, sink=False, sm_scale=s.Dk ** -0.5)[0]
    fns = bench.load_functions(torch, cpu_standin=False, check_indices=False)
    inp["out"], inp["lse"] = fns["fwd"](inp)
    for det in (True, False):
        call = fns["bwd_det" if det else "bwd_atomic"]
        for _ in range(3):
            call(inp)
        torch.cuda.synchronize()
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            call(inp)
            torch.cuda.synchronize()
        events = sorted((e for e in prof.key_averages() if e.device_time_total > 0),
                        key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events) / 1e3
        print(f"[profile] deterministic={det} {s.dims()}: {total:.3f} ms of kernels", flush=True)
        for e in events[:14]:
            print(f"[profile]   {e.device_time_total / 1e3:8.3f} ms  x{e.count:<3d} "
                  f"{e.key[:100]}", flush=True)


def timeline(s: model.Shape, calls: int = 3):
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    inp = bench.make_input_sets(torch, s, "cuda", sets=1, sink=True, sm_scale=s.Dk ** -0.5)[0]
    for check in (True, False):
        fns = bench.load_functions(torch, cpu_standin=False, check_indices=check)
        inp["out"], inp["lse"] = fns["fwd"](inp)
        for name in ("fwd", "bwd_atomic", "bwd_det"):
            for _ in range(3):
                fns[name](inp)
            torch.cuda.synchronize()
            host = []
            with tprofile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(calls):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    with torch.profiler.record_function("call"):
                        fns[name](inp)
                    host.append((time.perf_counter() - t0) * 1e3)
                    torch.cuda.synchronize()
            evs = prof.events()
            marks = sorted(e.time_range.start for e in evs if e.name == "call")
            gpu = sorted((e for e in evs if e.device_type == torch.autograd.DeviceType.CUDA
                          and e.device_time_total > 0), key=lambda e: e.time_range.start)
            # the last call: its kernels are those launched after its mark
            last = [e for e in gpu if e.time_range.start >= marks[-1]]
            t0 = marks[-1]
            print(f"[timeline] {name} check_indices={check} {s.dims()}: host ms per call "
                  f"{', '.join(f'{h:.3f}' for h in host)}; last call's GPU span "
                  f"{(last[-1].time_range.end - t0) / 1e3:.3f} ms from the call's start, "
                  f"kernels {sum(e.time_range.elapsed_us() for e in last) / 1e3:.3f} ms",
                  flush=True)
            prev = t0
            for e in last:
                st, du = e.time_range.start, e.time_range.elapsed_us()
                print(f"[timeline]   +{(st - t0) / 1e3:7.3f} gap {(st - prev) / 1e3:6.3f} "
                      f"dur {du / 1e3:6.3f}  {e.name[:90]}", flush=True)
                prev = e.time_range.end


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--seq-kv", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--no-ptxas", action="store_true")
    ap.add_argument("--timeline", action="store_true", help="per-call GPU timelines only")
    ns = ap.parse_args(argv)
    if ns.timeline:
        timeline(model.Shape("profile", 1, ns.seq, ns.seq_kv, ns.heads, ns.topk))
        return
    if not ns.no_ptxas and shutil.which("nvcc"):
        from paddlefleet.tilelang_ops.attn import tiling

        for line in ptxas_report(tiling.head_plan(ns.heads).heads_per_cta):
            print(line, flush=True)
    profile(model.Shape("profile", 1, ns.seq, ns.seq_kv, ns.heads, ns.topk))


if __name__ == "__main__":
    main()
