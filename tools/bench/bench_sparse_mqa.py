#!/usr/bin/env python3
"""Time the sparse MQA-latent attention kernels on one GPU, in one process.

    python tools/bench/bench_sparse_mqa.py --out DIR            # full run (H200: ~1 min warm)
    python tools/bench/bench_sparse_mqa.py --quick --shapes ref,tp8 --out DIR
    python tools/bench/bench_sparse_mqa.py --dry-run            # the plan, floors; no torch
    python tools/bench/bench_sparse_mqa.py --cpu-standin --quick --out /tmp/b
        # every code path on CPU (tiny shape), the reference standing in for the kernels

What is timed, per shape (``--shapes``; see ``harness.SHAPES``), with CUDA events around
each call, after a warm-up, over ``--sets`` (>= 3) input sets rotated call by call so that L2
never holds the previous call's inputs:

    fwd         mqa_latent_sparse_fwd                      (ours; bf16 in, out bf16 + lse fp32)
    bwd_atomic  mqa_latent_sparse_bwd(deterministic=False)  (ours; fp32 atomic dKV)
    bwd_det     mqa_latent_sparse_bwd(deterministic=True)   (ours; bitwise repeatable)
    ref_fwd     sparse_mqa_fwd_ref (fp32)   only where its estimated memory is under
    ref_bwd     mqa_latent_sparse_bwd_ref (fp32)  --ref-mem-gb, with --ref-reps repetitions
and once per run a dense bf16 ``N x N x N`` matmul (``--matmul-n``, 8192) whose TFLOP/s is the
peak that ``frac_peak`` divides by.

FLOPs (every top-k slot counted; see harness.py):
    fwd = 2*B*S*H*topk*(Dk+Dv)        bwd = 2*B*S*H*topk*(2*Dv+3*Dk)   matmul = 2*N^3

Each row has ms (median, p20, p80, min), TFLOP/s, fraction of the measured matmul peak, peak
memory (``torch.cuda.max_memory_allocated`` reset before the variant, so it includes the
resident input sets; ``extra_mem_mb`` is the part the variant itself added), the det/atomic
ratio on ``bwd_det`` rows, and whether two calls on the same inputs gave bitwise equal outputs.
Output in ``--out`` (default ``$OUT`` if set, else ``tools/bench/results/``): results.json,
results.csv, time_per_shape.png, table.txt; the table is also printed last.  JSON and CSV are
rewritten after every shape so a run killed by a time limit keeps what it measured.

A variant whose function cannot be imported is skipped with a line saying why; an exception in
one variant is recorded in its row and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
sys.path.insert(0, _HERE)
if os.path.join(_REPO, "src") not in sys.path:
    # so that `python tools/bench/bench_sparse_mqa.py` works without PYTHONPATH=src
    sys.path.append(os.path.join(_REPO, "src"))

# the same kernel cache as tools/precompile.py and tools/run_gpu_suite.sh, so a run after them
# finds every kernel compiled
os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(_REPO, ".tilelang-cache"))

import harness  # noqa: E402

VARIANTS = ("fwd", "bwd_atomic", "bwd_det", "ref_fwd", "ref_bwd")
OURS = ("fwd", "bwd_atomic", "bwd_det")
REFS = ("ref_fwd", "ref_bwd")

#: DeepSeek-V3.2's softmax scale, (qk_nope_head_dim + qk_rope_head_dim) ** -0.5; it does not
#: change the work, only keeps the scores in a realistic range.
DEFAULT_SM_SCALE = (128 + 64) ** -0.5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=None,
                   help="output folder (default: $OUT if set, else tools/bench/results/)")
    p.add_argument("--shapes", default=None,
                   help="comma-separated names, 'default' or 'all' (default: "
                        f"{','.join(harness.DEFAULT_SHAPES)}; with --cpu-standin: tiny); known: "
                        + ", ".join(f"{k} ({v.dims()})" for k, v in harness.SHAPES.items()))
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--quick", action="store_true",
                   help="fewer repetitions (20 timed, 2 warm-up; reference 2)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per variant (default 50)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 5)")
    p.add_argument("--sets", type=int, default=3, help="input sets rotated per shape (>= 3)")
    p.add_argument("--ref-reps", type=int, default=None, help="reference timed calls (default 3)")
    p.add_argument("--ref-shapes", default=None,
                   help="shapes on which the (slow, fp32) reference is timed: names or 'all' "
                        "(default: tiny,tp8,ref; --quick: tiny,tp8)")
    p.add_argument("--ref-mem-gb", type=float, default=40.0,
                   help="skip the reference where its estimated memory exceeds this (GB)")
    p.add_argument("--no-ref", action="store_true", help="do not time the reference")
    p.add_argument("--matmul-n", type=int, default=8192, help="dense matmul size (0: skip)")
    p.add_argument("--copy-mb", type=int, default=1024,
                   help="device-to-device copy size in MiB for the bandwidth ceiling (0: skip)")
    p.add_argument("--no-sink", action="store_true", help="benchmark without an attention sink")
    p.add_argument("--sm-scale", type=float, default=DEFAULT_SM_SCALE)
    p.add_argument("--indices", choices=("torch", "numpy"), default="torch",
                   help="causal top-k indices drawn on the device with torch (fast) or by "
                        "attn.indices.causal_topk_indices (numpy)")
    p.add_argument("--no-check-indices", action="store_true",
                   help="pass check_indices=False to our kernels (skips the index range check "
                        "and its device->host read; default: the library default, checked)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="start no new shape after this many seconds (keeps under a 10-min limit)")
    p.add_argument("--cpu-standin", action="store_true",
                   help="run on CPU with the reference in place of the CUDA kernels (shapes "
                        "default to tiny: the GPU shapes take minutes each on CPU)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (shapes, FLOPs, floors, memory) and exit; needs no torch")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    a = p.parse_args(argv)
    if a.shapes is None and a.cpu_standin:
        a.shapes = "tiny"  # the H200 shapes would grind on CPU for minutes each
    try:
        a.shape_list = harness.select_shapes(a.shapes)
    except ValueError as e:  # unknown name: a usage error, not a traceback
        p.error(str(e))
    a.variant_list = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variant_list if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; known: {', '.join(VARIANTS)}")
    if a.no_ref:
        a.variant_list = [v for v in a.variant_list if v not in REFS]
    a.reps = a.reps if a.reps is not None else (20 if a.quick else 50)
    a.warmup = a.warmup if a.warmup is not None else (2 if a.quick else 5)
    a.ref_reps = a.ref_reps if a.ref_reps is not None else (2 if a.quick else 3)
    if a.ref_shapes is None:
        a.ref_shapes = "tiny,tp8" if a.quick else "tiny,tp8,ref"
    try:
        a.ref_shape_names = {x.name for x in harness.select_shapes(a.ref_shapes, "--ref-shapes")}
    except ValueError as e:
        p.error(str(e))
    if a.sets < 3:
        p.error("--sets must be >= 3 (rotating fewer input sets lets L2 flatter the numbers)")
    if a.reps < 1 or a.warmup < 0 or a.ref_reps < 1:
        p.error("--reps and --ref-reps must be >= 1, --warmup >= 0")
    if a.out is None:
        a.out = os.environ.get("OUT") or os.path.join(_HERE, "results")
    return a


# --------------------------------------------------------------------------------------------
# Plan (no torch needed)
# --------------------------------------------------------------------------------------------


def input_bytes_per_set(s: harness.Shape) -> int:
    """q, kv, indices (int32), sink, dO, out (bf16) and lse (fp32) of one input set."""
    return (s.B * s.S * s.H * (s.Dk + 2 * s.Dv) * 2 + s.B * s.S_kv * s.Dk * 2
            + s.B * s.S * s.topk * 4 + s.B * s.S * s.H * 4 + s.H * 4)


def plan_text(a: argparse.Namespace) -> str:
    lines = [f"variants: {', '.join(a.variant_list)}; reps {a.reps} (+{a.warmup} warm-up), "
             f"reference reps {a.ref_reps}; {a.sets} input sets per shape; "
             f"sink {'off' if a.no_sink else 'on'}; matmul {a.matmul_n or 'skipped'}",
             "FLOPs: fwd 2*B*S*H*topk*(Dk+Dv); bwd 2*B*S*H*topk*(2*Dv+3*Dk); "
             f"floors at {harness.H200_MATMUL_TFLOPS:g} TFLOP/s and {harness.H200_COPY_TBS:g} TB/s"]
    for s in a.shape_list:
        ff = harness.floor(harness.fwd_flops(s), harness.fwd_min_bytes(s))
        fb = harness.floor(harness.bwd_flops(s), harness.bwd_min_bytes(s))
        ref = harness.reference_mem_bytes(s)
        runs_ref = (any(v in REFS for v in a.variant_list) and s.name in a.ref_shape_names
                    and ref <= a.ref_mem_gb * 1e9)
        lines.append(
            f"{s.name:6s} {s.dims():40s} fwd {harness.fwd_flops(s) / 1e12:6.3f} TFLOP floor "
            f"{ff['floor_ms']:6.2f} ms | bwd {harness.bwd_flops(s) / 1e12:6.3f} TFLOP floor "
            f"{fb['floor_ms']:6.2f} ms | inputs {a.sets} x {input_bytes_per_set(s) / 1e9:.2f} GB"
            f" | reference ~{ref / 1e9:.1f} GB: {'timed' if runs_ref else 'not timed'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Functions under test
# --------------------------------------------------------------------------------------------


def _local_ref_fwd(torch, q, kv, idx, sm_scale, sink=None, d_v=512):
    """fp32 forward for the CPU stand-in when attn/reference.py is not importable; follows
    docs/conventions.md (natural, sink-exclusive lse)."""
    q32, kv32 = q.float(), kv.float()
    valid = idx >= 0
    safe = idx.clamp(min=0).long()
    g = torch.stack([kv32[b][safe[b]] for b in range(q.shape[0])])  # [B, S, L, Dk]
    s = torch.einsum("bshd,bsld->bshl", q32, g) * sm_scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    z = lse if sink is None else torch.logaddexp(lse, sink.float()[None, None, :])
    z = torch.where(torch.isinf(z), torch.zeros_like(z), z)  # empty row: P = 0, not NaN
    p = torch.exp(s - z[..., None])
    return torch.einsum("bshl,bsld->bshd", p, g[..., :d_v]), lse


def _local_ref_bwd(torch, q, kv, grad_out, idx, sm_scale, sink=None, d_v=512):
    with torch.enable_grad():
        q_ = q.float().requires_grad_()
        kv_ = kv.float().requires_grad_()
        sink_ = sink.float().requires_grad_() if sink is not None else None
        out, _ = _local_ref_fwd(torch, q_, kv_, idx, sm_scale, sink_, d_v)
        wrt = [q_, kv_] + ([sink_] if sink_ is not None else [])
        grads = torch.autograd.grad(out, wrt, grad_out.float())
    d_sink = grads[2] if sink is not None else torch.zeros(q.shape[2], dtype=torch.float32)
    return grads[0], grads[1], d_sink


def _accepts(fn, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def load_functions(torch, variants, cpu_standin: bool, say,
                   check_indices: bool = True) -> tuple[dict, dict]:
    """Import what each variant calls.  Returns ({variant: fn(inp) -> outputs},
    {variant: reason it is skipped}); never raises on a missing module."""
    fns, skipped = {}, {}
    ref_fwd = ref_bwd = None
    # the backward needs out/lse, which our forward makes, even when fwd itself is not timed
    variants = list(variants) + (["fwd"] if "fwd" not in variants and any(
        v in variants for v in ("bwd_det", "bwd_atomic")) else [])
    try:
        from paddlefleet.tilelang_ops.attn import reference as ref_mod

        ref_fwd, ref_bwd = ref_mod.sparse_mqa_fwd_ref, ref_mod.mqa_latent_sparse_bwd_ref
        ref_src = "attn.reference"
    except Exception as e:  # noqa: BLE001 - any import failure means "skip", never crash
        ref_src = None
        ref_err = f"{type(e).__name__}: {e}"

    def call_ref_fwd(i):
        return ref_fwd(i["q"], i["kv"], i["idx"], i["sm_scale"], i["sink"], d_v=i["Dv"])

    def call_ref_bwd(i):
        return ref_bwd(i["q"], i["kv"], i.get("out"), i["dO"], i.get("lse"), i["sink"], i["idx"],
                       i["sm_scale"])

    for v in REFS:
        if v not in variants:
            continue
        if ref_src is None:
            skipped[v] = f"paddlefleet.tilelang_ops.attn.reference not importable ({ref_err})"
        else:
            fns[v] = call_ref_fwd if v == "ref_fwd" else call_ref_bwd

    if cpu_standin:
        if ref_src is None:
            say("cpu-standin: attn.reference not importable; using the benchmark's own fp32 "
                "stand-in (" + ref_err + ")")

            def s_fwd(i):
                out, lse = _local_ref_fwd(torch, i["q"], i["kv"], i["idx"], i["sm_scale"],
                                          i["sink"], i["Dv"])
                return out.to(torch.bfloat16), lse

            def s_bwd(i):
                return _local_ref_bwd(torch, i["q"], i["kv"], i["dO"], i["idx"], i["sm_scale"],
                                      i["sink"], i["Dv"])
        else:
            say("cpu-standin: attn.reference stands in for the CUDA kernels")

            def s_fwd(i):
                out, lse = call_ref_fwd(i)
                return out.to(torch.bfloat16), lse

            s_bwd = call_ref_bwd
        for v in OURS:
            if v in variants:
                fns[v] = s_fwd if v == "fwd" else s_bwd
        return fns, skipped

    try:
        from paddlefleet.tilelang_ops.attn import interface
    except Exception as e:  # noqa: BLE001
        interface = None
        why = f"paddlefleet.tilelang_ops.attn.interface not importable ({type(e).__name__}: {e})"
    fwd = getattr(interface, "mqa_latent_sparse_fwd", None) if interface else None
    bwd = getattr(interface, "mqa_latent_sparse_bwd", None) if interface else None
    if interface is not None:
        why = "interface has no mqa_latent_sparse_fwd/bwd"
    # only passed when asked for, and only if the wrapper has the keyword
    kw_fwd = {} if check_indices or not _accepts(fwd, "check_indices") else {
        "check_indices": False}
    kw_bwd = {} if check_indices or not _accepts(bwd, "check_indices") else {
        "check_indices": False}
    if not check_indices and not (kw_fwd and kw_bwd):
        say("--no-check-indices: the interface has no check_indices keyword; ignored")

    def call_fwd(i):
        return fwd(i["q"], i["kv"], i["idx"], i["sm_scale"], i["sink"], d_v=i["Dv"], **kw_fwd)

    def make_bwd(deterministic):
        def call_bwd(i):
            return bwd(i["q"], i["kv"], i["out"], i["dO"], i["lse"], i["sink"], i["idx"],
                       i["sm_scale"], deterministic=deterministic, lse_format="natural",
                       **kw_bwd)

        return call_bwd

    for v in OURS:
        if v not in variants:
            continue
        if v == "fwd":
            if fwd is None:
                skipped[v] = why
            else:
                fns[v] = call_fwd
        elif bwd is None:
            skipped[v] = why
        else:
            fns[v] = make_bwd(v == "bwd_det")
    return fns, skipped


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def causal_topk_indices_torch(torch, s: harness.Shape, generator, device, row_chunk=1024):
    """``[B, S, topk]`` int32 on ``device`` with the semantics of
    ``attn.indices.causal_topk_indices``: row ``s`` (absolute position ``S_kv - S + s``) holds
    distinct keys drawn uniformly from ``0 .. S_kv - S + s`` in random order, ``-1``-padded at
    the end when fewer than ``topk`` exist.  The top ``topk`` of uniform random scores over the
    allowed keys is a uniform random subset in random order; one ``topk`` call per row chunk
    keeps it fast on the GPU at S = S_kv = 8192."""
    out = torch.full((s.B, s.S, s.topk), -1, dtype=torch.int32, device=device)
    k = min(s.topk, s.S_kv)
    keys = torch.arange(s.S_kv, device=device)
    for b in range(s.B):
        for r0 in range(0, s.S, row_chunk):
            r1 = min(s.S, r0 + row_chunk)
            pos = torch.arange(r0, r1, device=device) + (s.S_kv - s.S)
            score = torch.rand((r1 - r0, s.S_kv), generator=generator, device=device)
            score.masked_fill_(keys[None, :] > pos[:, None], -1.0)  # future keys: never chosen
            val, idx = torch.topk(score, k, dim=1, largest=True, sorted=True)
            out[b, r0:r1, :k] = torch.where(val >= 0, idx, torch.full_like(idx, -1)).to(torch.int32)
    return out


def make_input_sets(torch, s: harness.Shape, a, device) -> list[dict]:
    """``a.sets`` independent random input sets (bf16 q, kv, dO; fp32 sink; int32 indices)."""
    sets = []
    for k in range(a.sets):
        g = torch.Generator(device=device)
        g.manual_seed(a.seed * 1000 + k)
        bf16 = torch.bfloat16
        inp = {
            "q": torch.randn((s.B, s.S, s.H, s.Dk), generator=g, device=device, dtype=bf16),
            "kv": torch.randn((s.B, s.S_kv, s.Dk), generator=g, device=device, dtype=bf16),
            "dO": torch.randn((s.B, s.S, s.H, s.Dv), generator=g, device=device, dtype=bf16),
            "sink": None if a.no_sink else torch.randn((s.H,), generator=g, device=device,
                                                       dtype=torch.float32),
            "sm_scale": a.sm_scale,
            "Dv": s.Dv,
        }
        if a.indices == "numpy":
            from paddlefleet.tilelang_ops.attn.indices import causal_topk_indices

            idx = causal_topk_indices(s.B, s.S, s.S_kv, s.topk, seed=a.seed * 1000 + k)
            inp["idx"] = torch.from_numpy(idx).to(device=device, dtype=torch.int32)
        else:
            inp["idx"] = causal_topk_indices_torch(torch, s, g, device)
        sets.append(inp)
    return sets


def add_out_lse(torch, sets: list[dict], fwd_fn) -> None:
    """Give every input set the ``out`` (bf16) and natural ``lse`` (fp32) the backward reads."""
    for inp in sets:
        out, lse = fwd_fn(inp)
        inp["out"] = out.to(torch.bfloat16).contiguous()
        inp["lse"] = lse.to(torch.float32).contiguous()


def ref_fwd_any(torch):
    """The reference forward as an out/lse source even when ref_fwd is not being timed."""
    try:
        from paddlefleet.tilelang_ops.attn.reference import sparse_mqa_fwd_ref
    except Exception:  # noqa: BLE001
        return None
    return lambda i: sparse_mqa_fwd_ref(i["q"], i["kv"], i["idx"], i["sm_scale"], i["sink"],
                                        d_v=i["Dv"])


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


class Backend:
    """Device, timer and memory counters (CUDA, or CPU for the stand-in)."""

    def __init__(self, torch, cpu: bool):
        self.torch = torch
        self.cpu = cpu
        self.device = "cpu" if cpu else "cuda"
        self.timer = harness.HostTimer() if cpu else harness.CudaTimer()

    def sync(self):
        if not self.cpu:
            self.torch.cuda.synchronize()

    def allocated(self):
        return None if self.cpu else self.torch.cuda.memory_allocated()

    def reset_peak(self):
        if not self.cpu:
            self.torch.cuda.reset_peak_memory_stats()

    def max_allocated(self):
        return None if self.cpu else self.torch.cuda.max_memory_allocated()

    def free(self):
        if not self.cpu:
            self.torch.cuda.empty_cache()

    def healthy(self) -> bool:
        """False once the CUDA context is broken (e.g. an illegal address): every later call
        would fail too, so the run stops launching work."""
        if self.cpu:
            return True
        try:
            self.torch.cuda.synchronize()
            x = self.torch.ones(1, device="cuda")
            return float((x + x).item()) == 2.0
        except Exception:  # noqa: BLE001
            return False

    def name(self) -> str:
        if self.cpu:
            import platform

            return f"CPU stand-in ({platform.processor() or platform.machine()})"
        return self.torch.cuda.get_device_name()


def _outputs(x) -> list:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _same(torch, xs, ys) -> bool:
    return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(xs, ys))


def _finite(torch, xs) -> bool:
    return all(x is None or not x.is_floating_point() or bool(torch.isfinite(x).all()) for x in xs)


def time_variant(be: Backend, fn, arg_sets, warmup: int, reps: int, check_repeat: bool) -> dict:
    """First call (compile + run, wall s), warm-up, timed calls; memory; repeatability."""
    torch = be.torch
    be.sync()
    base = be.allocated()
    be.reset_peak()
    t0 = time.perf_counter()
    fn(*arg_sets[0])
    be.sync()
    first = time.perf_counter() - t0
    samples = be.timer.measure(fn, arg_sets, warmup, reps)
    peak = be.max_allocated()
    res = harness.summarize(samples)
    res["first_call_s"] = first
    if peak is not None:
        res["peak_mem_mb"] = peak / 1e6
        res["extra_mem_mb"] = (peak - base) / 1e6
    notes = []
    if check_repeat:
        a = _outputs(fn(*arg_sets[0]))
        b = _outputs(fn(*arg_sets[0]))
        be.sync()
        res["repeatable"] = _same(torch, a, b)
        if not _finite(torch, a):
            notes.append("non-finite output")
        del a, b
    res["note"] = "; ".join(notes) or None
    return res


def _error_status(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"error: {type(e).__name__}: {msg[:160]}"


def run(a: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    try:
        import torch
    except ImportError:
        print("bench_sparse_mqa: PyTorch is not installed; the benchmark drives the kernels "
              "through PyTorch tensors (see README.md, 'GPU validation environment'). --dry-run needs no torch.",
              file=sys.stderr)
        return 2
    if not a.cpu_standin and not torch.cuda.is_available():
        print("bench_sparse_mqa: no CUDA device; use --cpu-standin to exercise the tool on CPU",
              file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    be = Backend(torch, a.cpu_standin)

    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    say = (tqdm.write if tqdm else print)

    meta = harness.run_meta(_REPO, be.name(), torch.__version__)
    meta["timer"] = be.timer.name
    meta["cpu_standin"] = a.cpu_standin
    if not a.cpu_standin:
        meta["gpu_state_before"] = harness.gpu_state()
        meta["device_capability"] = list(torch.cuda.get_device_capability())
        meta["device_memory_gb"] = torch.cuda.get_device_properties(0).total_memory / 1e9

    fns, skipped = load_functions(torch, a.variant_list, a.cpu_standin, say,
                                  check_indices=not a.no_check_indices)
    meta["check_indices"] = not a.no_check_indices
    try:
        from paddlefleet.tilelang_ops.attn import reference as _ref_mod

        ref_chunk_bytes = int(getattr(_ref_mod, "_CHUNK_BYTES", 256 << 20))
    except Exception:  # noqa: BLE001
        ref_chunk_bytes = 256 << 20
    if any(v in fns for v in OURS) or any(v in fns for v in REFS):
        # TileLang is imported by the interface; record the version that ran.
        meta["tilelang"] = harness.package_version("tilelang") or meta["tilelang"]
    for v, why in skipped.items():
        say(f"skip {v}: {why}")

    rows: list[dict] = []
    setup_s: dict = {}
    payload = {
        "meta": meta,
        "config": {k: v for k, v in vars(a).items()
                   if k not in ("shape_list", "variant_list", "ref_shape_names")},
        "shapes": [dataclasses.asdict(s) for s in a.shape_list],
        "variants": a.variant_list,
        "flop_formulas": {
            "fwd": "2*B*S*H*topk*(Dk+Dv)",
            "bwd": "2*B*S*H*topk*(2*Dv+3*Dk)  (five GEMMs)",
            "matmul": "2*N^3",
        },
        "floors": {
            s.name: {
                "fwd": harness.floor(harness.fwd_flops(s), harness.fwd_min_bytes(s)),
                "bwd": harness.floor(harness.bwd_flops(s), harness.bwd_min_bytes(s)),
                "fwd_min_bytes": harness.fwd_min_bytes(s),
                "bwd_min_bytes": harness.bwd_min_bytes(s),
            } for s in a.shape_list
        },
        "skipped_variants": skipped,
        "setup_s": setup_s,
        "rows": rows,
    }

    def save():
        harness.fill_det_ratio(rows)
        payload["bars"] = harness.check_bars(rows)
        payload["elapsed_s"] = time.perf_counter() - t_start
        harness.write_json(payload, os.path.join(a.out, "results.json"))
        harness.write_csv(rows, os.path.join(a.out, "results.csv"))

    def variants_for(shp):
        return [v for v in a.variant_list if v not in REFS or shp.name in a.ref_shape_names]

    tasks = (1 if a.matmul_n else 0) + (1 if a.copy_mb else 0) + sum(len(variants_for(x)) for x in a.shape_list)
    bar = None
    if tqdm is not None and not a.no_progress:
        bar = tqdm(total=tasks, desc="bench", unit="run", file=sys.stderr, mininterval=1.0,
                   ncols=90)

    def advance(label):
        if bar is not None:
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

    # ---- the card's peak, measured in this run ------------------------------------------
    peak_tflops = None
    if a.matmul_n:
        n = min(a.matmul_n, 256) if a.cpu_standin else a.matmul_n
        dt = torch.float32 if a.cpu_standin else torch.bfloat16  # CPU bf16 GEMM is slow
        row = harness.make_row(None, f"matmul_{'fp32' if a.cpu_standin else 'bf16'}", meta,
                               shape=f"{n}^3")
        try:
            g = torch.Generator(device=be.device)
            g.manual_seed(a.seed)
            mats = [(torch.randn((n, n), generator=g, device=be.device, dtype=dt),
                     torch.randn((n, n), generator=g, device=be.device, dtype=dt))
                    for _ in range(a.sets)]
            row.update(time_variant(be, torch.matmul, mats, a.warmup, a.reps, False))
            harness.fill_rates(row, 2 * n ** 3, None)
            peak_tflops = row["tflops"]
            row["frac_peak"] = 1.0
            del mats
        except Exception as e:  # noqa: BLE001
            row["status"] = _error_status(e)
        rows.append(row)
        say(f"matmul {n}^3: {row['status']}"
            + (f" {row['ms']:.3f} ms = {row['tflops']:.0f} TFLOP/s" if row.get("ms") else ""))
        advance("matmul")
        be.free()
    # ---- the card's copy bandwidth (bytes read + written), for the memory floor ----------
    copy_tbs = None
    if a.copy_mb:
        nbytes = int(min(a.copy_mb, 8) if a.cpu_standin else a.copy_mb) * 2 ** 20
        row = harness.make_row(None, "copy", meta, shape=f"{nbytes >> 20}MiB")
        try:
            bufs = [torch.empty(nbytes, dtype=torch.uint8, device=be.device).fill_(k + 1)
                    for k in range(a.sets)]
            dst = torch.empty(nbytes, dtype=torch.uint8, device=be.device)
            row.update(time_variant(be, dst.copy_, [(b,) for b in bufs], a.warmup, a.reps,
                                    False))
            harness.fill_rates(row, None, None, nbytes=2 * nbytes)
            copy_tbs = row["tbs"]
            del bufs, dst
        except Exception as e:  # noqa: BLE001
            row["status"] = _error_status(e)
        rows.append(row)
        say(f"copy {nbytes >> 20} MiB: {row['status']}"
            + (f" {row['ms']:.3f} ms = {row['tbs']:.2f} TB/s" if row.get("ms") else ""))
        advance("copy")
        be.free()
    meta["copy_tbs"] = copy_tbs or harness.H200_COPY_TBS
    meta["peak_tflops"] = peak_tflops or harness.H200_MATMUL_TFLOPS
    meta["copy_source"] = ("measured" if copy_tbs else
                           f"planning value {harness.H200_COPY_TBS:g} (copy not measured)")
    meta["peak_source"] = (f"measured {rows[0]['variant']}" if peak_tflops else
                           f"planning value {harness.H200_MATMUL_TFLOPS:g} (matmul not measured)")
    payload["floors_measured"] = {
        s.name: {p: harness.floor(fl, by, meta["peak_tflops"], meta["copy_tbs"])
                 for p, fl, by in (("fwd", harness.fwd_flops(s), harness.fwd_min_bytes(s)),
                                   ("bwd", harness.bwd_flops(s), harness.bwd_min_bytes(s)))}
        for s in a.shape_list}
    save()

    # ---- shapes ---------------------------------------------------------------------------
    context_lost = None
    for s in a.shape_list:
        if time.perf_counter() - t_start > a.budget_s:
            for v in variants_for(s):
                rows.append(harness.make_row(s, v, meta, status=f"not run: past --budget-s "
                                                                f"{a.budget_s:g}"))
                advance(f"{s.name}/{v}")
            continue
        if context_lost:
            for v in variants_for(s):
                rows.append(harness.make_row(s, v, meta, status=f"not run: {context_lost}"))
                advance(f"{s.name}/{v}")
            continue
        t0 = time.perf_counter()
        needs_out = any(v in fns for v in ("bwd_det", "bwd_atomic"))
        if not variants_for(s):
            continue
        ref_est = harness.reference_mem_bytes(s, ref_chunk_bytes)
        ref_fits = ref_est <= a.ref_mem_gb * 1e9
        try:
            sets = make_input_sets(torch, s, a, be.device)
            be.sync()
        except Exception as e:  # noqa: BLE001
            status = "not run: input setup failed: " + _error_status(e)
            say(f"{s.name}: {status}")
            if not be.healthy():
                context_lost = f"CUDA error in {s.name} setup"
            for v in variants_for(s):
                rows.append(harness.make_row(s, v, meta, status=status))
                advance(f"{s.name}/{v}")
            be.free()
            save()
            continue
        # out/lse for the backward: from our forward, else from the reference
        out_src = None
        if needs_out:
            candidates = [("fwd", fns.get("fwd"))]
            if ref_fits:
                candidates.append(("ref_fwd", fns.get("ref_fwd") or ref_fwd_any(torch)))
            for src, fn in candidates:
                if fn is None:
                    continue
                try:
                    add_out_lse(torch, sets, fn)
                    be.sync()
                    out_src = src
                    break
                except Exception as e:  # noqa: BLE001
                    say(f"{s.name}: out/lse from {src} failed: {_error_status(e)}")
                    if not be.healthy():
                        context_lost = f"CUDA error in {s.name}/{src} (setup)"
                        break
        setup_s[s.name] = time.perf_counter() - t0
        arg_sets = [(inp,) for inp in sets]

        for v in variants_for(s):
            advance_label = f"{s.name}/{v}"
            row = harness.make_row(s, v, meta)
            if v in skipped:
                row["status"] = "skipped: not importable"
            elif context_lost:
                row["status"] = f"not run: {context_lost}"
            elif v in ("bwd_det", "bwd_atomic") and out_src is None:
                row["status"] = "skipped: no forward available to produce out/lse"
            elif v in REFS and not ref_fits:
                row["status"] = (f"skipped: reference needs ~{ref_est / 1e9:.0f} GB "
                                 f"> --ref-mem-gb {a.ref_mem_gb:g}")
            else:
                is_ref = v in REFS
                try:
                    row.update(time_variant(
                        be, fns[v], arg_sets,
                        warmup=0 if is_ref else a.warmup,  # its first call is the warm-up
                        reps=a.ref_reps if is_ref else a.reps,
                        check_repeat=not is_ref))
                    fwd_pass = v.endswith("fwd")
                    flops = harness.fwd_flops(s) if fwd_pass else harness.bwd_flops(s)
                    nbytes = harness.fwd_min_bytes(s) if fwd_pass else harness.bwd_min_bytes(s)
                    harness.fill_rates(row, flops, meta["peak_tflops"], nbytes, meta["copy_tbs"])
                    if a.cpu_standin and v in OURS:
                        row["note"] = "; ".join(x for x in (row.get("note"),
                                                            "cpu-standin: reference") if x)
                    if v in ("bwd_det", "bwd_atomic") and out_src != "fwd":
                        row["note"] = "; ".join(x for x in (row.get("note"),
                                                            f"out/lse from {out_src}") if x)
                except Exception as e:  # noqa: BLE001
                    row["status"] = _error_status(e)
                    oom = "out of memory" in str(e).lower()
                    if not oom and not be.healthy():
                        context_lost = f"CUDA error in {s.name}/{v}"
                    say(f"{s.name}/{v}: {row['status']}")
                    if not oom:
                        say(traceback.format_exc(limit=3).rstrip())
            if row["status"] == "ok":
                say(f"{s.name:6s} {v:10s} {row['ms']:9.3f} ms (p20 {row['ms_p20']:.3f}, "
                    f"p80 {row['ms_p80']:.3f}) {row.get('tflops') or 0:7.1f} TFLOP/s"
                    + (f" first call {row['first_call_s']:.1f} s" if row["first_call_s"] > 2
                       else ""))
            elif not row["status"].startswith("error"):
                say(f"{s.name}/{v}: {row['status']}")
            rows.append(row)
            advance(advance_label)
        del sets, arg_sets
        be.free()
        save()

    if bar is not None:
        bar.close()
    if not a.cpu_standin:
        meta["gpu_state_after"] = harness.gpu_state()
    save()

    if not a.no_plot:
        try:
            import plot

            png = plot.plot_results(rows, meta, os.path.join(a.out, "time_per_shape.png"))
            say(f"plot: {png}")
        except ImportError as e:
            say(f"plot skipped: {e}")
        except Exception as e:  # noqa: BLE001 - a plotting problem must not lose the numbers
            say(f"plot failed: {_error_status(e)}")

    table = harness.format_table(rows, meta, payload["bars"])
    with open(os.path.join(a.out, "table.txt"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    sys.stderr.flush()
    print(f"\nresults in {a.out} ({time.perf_counter() - t_start:.0f} s; FLOPs fwd "
          "2*B*S*H*topk*(Dk+Dv), bwd 2*B*S*H*topk*(2*Dv+3*Dk); %peak = of the bf16 matmul)")
    print(table, flush=True)
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.dry_run:
        print(plan_text(a))
        return 0
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
