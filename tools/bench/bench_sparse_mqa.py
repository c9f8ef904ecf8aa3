#!/usr/bin/env python3
"""Time the sparse MQA-latent attention kernels on one GPU, in one process.

    python tools/bench/bench_sparse_mqa.py --out DIR [--quick] [--shapes ref,tp8]
    python tools/bench/bench_sparse_mqa.py --stages --shapes ref --no-ref --no-check-indices
        # also each wrapper's stages and the exact dKV's re-runs and head-room
    python tools/bench/bench_sparse_mqa.py --partition --out DIR   # issue 10, TP 1-8
    python tools/bench/bench_sparse_mqa.py --dry-run               # plan and floors, no torch
    python tools/bench/bench_sparse_mqa.py --cpu-standin --quick --out /tmp/b
        # every code path on CPU (tiny shape), the package's reference in place of the kernels
    python tools/bench/bench_sparse_mqa.py --shapes default,v4 --out DIR
        # and DeepSeek-V4's (Dk, Dv) = (512, 512) shapes (model.V4_SHAPES; --cpu-standin:
        # v4tiny), skipped on the GPU while kernels.D_PAIRS lacks the pair

Per shape: fwd, bwd_atomic, bwd_det (our wrappers, as training calls them: input value checks
on unless --no-check-indices; outputs checked finite and, over two calls, bitwise equal) and,
on --ref-shapes, the package's fp32 reference (ref_fwd, ref_bwd; its row's note has our fwd's
and bwd_det's relative L2 error against it on the same inputs); first a dense bf16 matmul and
a device copy, the measured ceilings.  CUDA events around each call, --sets input sets rotated
call by call; each variant's timed calls start after --settle-s of idle (the same GPU state for
every row, whatever ran before), and --hot-s adds its sustained time at the power limit
(ms_hot).  Work model: model.py.  Output in --out: results.json, results.csv (rewritten
after every shape), table.txt (printed last), time_per_shape.png (with matplotlib).  A shape
out of device memory is recorded as skipped; any other error stops the run, after saving.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
sys.path.insert(0, _HERE)
if os.path.join(_REPO, "src") not in sys.path:  # runs without PYTHONPATH=src
    sys.path.append(os.path.join(_REPO, "src"))
# the kernel cache tools/precompile.py fills in the GPU suite: a run after it compiles nothing
os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(_REPO, ".tilelang-cache"))

import harness  # noqa: E402
import model  # noqa: E402

VARIANTS = ("fwd", "bwd_atomic", "bwd_det", "ref_fwd", "ref_bwd")
OURS = VARIANTS[:3]
#: DeepSeek-V3.2's softmax scale, (128 + 64) ** -0.5: keeps the scores in a realistic range.
DEFAULT_SM_SCALE = (128 + 64) ** -0.5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--out", help="output folder (default: $OUT if set, else tools/bench/results/)")
    add("--shapes", help="comma-separated shape names and groups (default: the default "
        "group; --cpu-standin: tiny; --partition: the one base shape, ref); groups: "
        + ", ".join(f"{k} ({','.join(v)})" for k, v in model.SHAPE_GROUPS.items() if k != "all")
        + ", all (every shape); shapes: "
        + "; ".join(f"{k} ({v.dims()})" for k, v in model.SHAPES.items()))
    add("--variants", help=f"comma-separated subset of {','.join(VARIANTS)} (default: all)")
    add("--quick", action="store_true", help="20 timed calls after 2 warm-up (reference: 2)")
    add("--reps", type=int, help="timed calls per variant (default 50)")
    add("--warmup", type=int, help="warm-up calls (default 5)")
    add("--sets", type=int, default=3, help="input sets rotated call by call (>= 3; default 3)")
    add("--ref-reps", type=int, help="timed calls of the reference (default 3)")
    add("--ref-shapes", help="shapes the slow fp32 reference is timed on (default: tiny,tp8,"
        "ref; --quick: tiny,tp8)")
    add("--no-ref", action="store_true", help="do not time the reference")
    add("--matmul-n", type=int, default=8192, help="dense bf16 matmul size, the peak (0: skip)")
    add("--copy-mb", type=int, default=1024, help="device copy MiB, the bandwidth (0: skip)")
    add("--no-sink", action="store_true", help="no attention sink")
    add("--sm-scale", type=float, default=DEFAULT_SM_SCALE,
        help=f"softmax scale (default Dk^-0.5 = {DEFAULT_SM_SCALE:.6g}; finite, > 0)")
    add("--no-check-indices", action="store_true",
        help="call our wrappers with check_indices=False (as the op's backward calls them)")
    add("--settle-s", type=float, help="idle seconds before each variant's timed calls (ours "
        "and the reference's, not the ceilings'), so that every row starts from the same GPU "
        f"state (default {harness.SETTLE_S:g}; --cpu-standin: 0)")
    add("--hot-s", type=float, help="also time each of our variants sustained: the mean per "
        f"call over this many s after {harness.HOT_WARM_S:g} s of back-to-back calls, as in a "
        f"training loop (column `ms hot`, field ms_hot; default {harness.HOT_S:g}; "
        "--cpu-standin: 0; 0: not timed)")
    add("--seed", type=int, default=0)
    add("--budget-s", type=float, default=540.0,
        help="start no new shape after this many s (>= 0)")
    add("--stages", action="store_true",
        help="also time each of our wrappers' kernel launches and the rest of the call, and "
             "print the exact dKV's re-run keys and head-room")
    add("--partition", action="store_true",
        help="forward + deterministic backward of one rank (rows core_heads_tpN, core_seq_tpN) "
             "for TP 1, 2, 4, 8 with the heads or the query rows split, and the sequence "
             "split's all-to-all bytes (issue 10; docs/performance.md)")
    add("--cpu-standin", action="store_true",
        help="run on CPU with the reference in place of the kernels (tests the tool)")
    add("--dry-run", action="store_true", help="print the plan and floors; needs no torch")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--no-plot", action="store_true", help="no PNG")
    a = p.parse_args(argv)
    for flag, value in (("--shapes", a.shapes), ("--variants", a.variants),
                        ("--ref-shapes", a.ref_shapes)):
        if value is not None and not value.strip(" ,"):
            p.error(f"{flag}: empty; leave the flag out for its default")
    if a.shapes is None and (a.cpu_standin or a.partition):
        a.shapes = "tiny" if a.cpu_standin else "ref"  # GPU shapes take minutes each on CPU
    a.parts = None
    try:
        a.shape_list = model.select_shapes(a.shapes)
        a.ref_shape_names = {s.name for s in model.select_shapes(
            a.ref_shapes or ("tiny,tp8" if a.quick else "tiny,tp8,ref"), "--ref-shapes")}
        if a.partition:
            if len(a.shape_list) != 1 or a.variants:
                raise ValueError("--partition: times fwd and bwd_det at the rank shapes of one "
                                 "--shapes base; no --variants")
            a.parts = model.partition_shapes(a.shape_list[0])
            a.shape_list = list(dict.fromkeys(s for _, _, s in a.parts))
            a.variants = "fwd,bwd_det"
    except ValueError as e:  # a usage error, not a traceback
        p.error(str(e))
    a.variant_list = [v.strip() for v in (a.variants or ",".join(VARIANTS)).split(",")
                      if v.strip() and not (a.no_ref and v.strip().startswith("ref"))]
    if set(a.variant_list) - set(VARIANTS):
        p.error(f"--variants: unknown {sorted(set(a.variant_list) - set(VARIANTS))}; known: "
                + ", ".join(VARIANTS))
    if a.settle_s is None:
        a.settle_s = 0.0 if a.cpu_standin else harness.SETTLE_S
    if a.hot_s is None:
        a.hot_s = 0.0 if a.cpu_standin else harness.HOT_S
    for flag, value in (("--settle-s", a.settle_s), ("--hot-s", a.hot_s),
                        ("--budget-s", a.budget_s)):
        if not (math.isfinite(value) and value >= 0):
            p.error(f"{flag}: expected a finite number of seconds >= 0, got {value}")
    for flag, value in (("--matmul-n", a.matmul_n), ("--copy-mb", a.copy_mb)):
        if value < 0:
            p.error(f"{flag}: expected >= 0 (0: skip), got {value}")
    if not (math.isfinite(a.sm_scale) and a.sm_scale > 0):
        p.error(f"--sm-scale: expected a finite number > 0, got {a.sm_scale}")
    a.reps = a.reps if a.reps is not None else (20 if a.quick else 50)
    a.warmup = a.warmup if a.warmup is not None else (2 if a.quick else 5)
    a.ref_reps = a.ref_reps if a.ref_reps is not None else (2 if a.quick else 3)
    if a.sets < 3:
        p.error("--sets must be >= 3 (fewer input sets let the L2 flatter the numbers)")
    for flag, value, least in (("--reps", a.reps, 1), ("--ref-reps", a.ref_reps, 1),
                               ("--warmup", a.warmup, 0)):
        if value < least:
            p.error(f"{flag}: expected >= {least}, got {value}")
    if a.stages and a.cpu_standin:
        p.error("--stages times the kernels' launches; --cpu-standin has no kernels")
    a.out = a.out or os.environ.get("OUT") or os.path.join(_HERE, "results")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        p.error(f"--out: {a.out} is a file, not a folder")
    if not a.variant_list:
        p.error("--variants: nothing left to time (--no-ref drops the ref_* variants)")
    return a


def kernel_dims() -> tuple:
    """The ``(Dk, Dv)`` pairs our kernels are built for: ``attn.tiling.kernel_dims()``, which
    reads ``kernels.D_PAIRS`` (imports neither a framework nor TileLang).  A GPU run skips the
    shapes of any other pair (:func:`model.unbuilt_dims`)."""
    from paddlefleet.tilelang_ops.attn import tiling

    return tiling.kernel_dims()


def plan_text(a: argparse.Namespace) -> str:
    lines = [f"variants {','.join(a.variant_list)}; {a.reps} timed calls after {a.warmup} "
             f"warm-up; {a.sets} input sets; sink {'off' if a.no_sink else 'on'}; "
             f"check_indices {not a.no_check_indices}; reference timed on "
             f"{','.join(sorted(a.ref_shape_names))}", "", harness.floors_table(a.shape_list)]
    built = kernel_dims()
    unbuilt = {}
    for s in a.shape_list:
        why = model.unbuilt_dims(s, built)
        if why is not None:
            unbuilt.setdefault(why, []).append(s.name)
    lines += [f"on the GPU, skipped: {', '.join(names)}: {why}" for why, names in unbuilt.items()]
    if a.parts:
        base = a.parts[0][2]
        lines += ["", f"sequence split of {base.name}, all-to-all per layer and rank: " + ", ".join(
            f"TP={tp} {model.seq_a2a_bytes(base, tp) / 1e6:,.1f} MB" for tp in model.PARTITION_TPS)]
    return "\n".join(lines)


# --- inputs and the functions under test -----------------------------------------------------


def causal_topk_indices_torch(torch, s: model.Shape, generator, device, row_chunk=1024):
    """``[B, S, topk]`` int32 with the semantics of ``attn.indices.causal_topk_indices`` (row
    ``s`` holds distinct random keys of ``0 .. S_kv - S + s`` in random order, ``-1`` after
    them), drawn on the device: the numpy helper takes seconds per set at the GPU shapes.  The
    top ``topk`` of uniform scores over the allowed keys is a uniform random subset."""
    out = torch.full((s.B, s.S, s.topk), -1, dtype=torch.int32, device=device)
    k = min(s.topk, s.S_kv)
    keys = torch.arange(s.S_kv, device=device)
    for b in range(s.B):
        for r0 in range(0, s.S, row_chunk):
            r1 = min(s.S, r0 + row_chunk)
            pos = torch.arange(r0, r1, device=device) + (s.S_kv - s.S)
            score = torch.rand((r1 - r0, s.S_kv), generator=generator, device=device)
            score.masked_fill_(keys[None, :] > pos[:, None], -1.0)  # future keys: never chosen
            val, idx = torch.topk(score, k, dim=1)
            out[b, r0:r1, :k] = torch.where(val >= 0, idx, -1).to(torch.int32)
    return out


def window_compressed_indices_torch(torch, s: model.Shape, seed: int, device):
    """``[B, S, topk]`` int32 of a V4 layout (``s.ratio`` set): the rows of the last ``S`` of
    the ``T = s.tokens()`` tokens of ``attn.indices.window_compressed_indices`` (the window,
    then ``s.compressed_topk`` seeded compressed picks), made with numpy (~0.2 s per set at
    T = 4096) and copied to ``device``."""
    from paddlefleet.tilelang_ops.attn.indices import window_compressed_indices

    t = s.tokens()
    idx = window_compressed_indices(t, window=s.window, ratio=s.ratio,
                                    compressed_topk=s.compressed_topk, batch=s.B, seed=seed)
    return torch.from_numpy(idx[:, t - s.S:]).to(device)


def make_input_sets(torch, s: model.Shape, device, sets=3, seed=0, sink=True,
                    sm_scale=DEFAULT_SM_SCALE) -> list[dict]:
    """Independent random inputs: bf16 q, kv, dO (never zeros), fp32 sink, int32 indices
    (random causal top-k, or the V4 window + compressed layout of a shape with ``ratio``)."""
    out = []
    for k in range(sets):
        g = torch.Generator(device=device).manual_seed(seed * 1000 + k)

        def randn(*shape, dtype=torch.bfloat16):
            return torch.randn(shape, generator=g, device=device, dtype=dtype)

        idx = (causal_topk_indices_torch(torch, s, g, device) if s.ratio is None else
               window_compressed_indices_torch(torch, s, seed * 1000 + k, device))
        out.append({"q": randn(s.B, s.S, s.H, s.Dk), "kv": randn(s.B, s.S_kv, s.Dk),
                    "dO": randn(s.B, s.S, s.H, s.Dv),
                    "sink": randn(s.H, dtype=torch.float32) if sink else None,
                    "idx": idx, "sm_scale": sm_scale, "Dv": s.Dv})
    return out


def load_functions(torch, cpu_standin: bool, check_indices: bool = True) -> dict:
    """``{variant: fn(inputs, provider=None)}``.  With ``cpu_standin`` the package's reference
    stands in for our kernels; ``provider`` goes to our wrappers (the stage timing's)."""
    from paddlefleet.tilelang_ops.attn import reference

    def ref_fwd(i, provider=None):
        return reference.mqa_latent_sparse_fwd_ref(i["q"], i["kv"], i["idx"], i["sm_scale"],
                                                   i["sink"], d_v=i["Dv"])

    def ref_bwd(i, provider=None):
        return reference.mqa_latent_sparse_bwd_ref(i["q"], i["kv"], i["out"], i["dO"], i["lse"],
                                                   i["sink"], i["idx"], i["sm_scale"])

    if cpu_standin:
        def fwd(i, provider=None):
            out, lse = ref_fwd(i)
            return out.to(torch.bfloat16), lse.float()  # the kernel's dtypes

        return {"fwd": fwd, "bwd_atomic": ref_bwd, "bwd_det": ref_bwd, "ref_fwd": ref_fwd,
                "ref_bwd": ref_bwd}
    from paddlefleet.tilelang_ops.attn import interface

    def fwd(i, provider=None):
        return interface.mqa_latent_sparse_fwd(i["q"], i["kv"], i["idx"], i["sm_scale"],
                                               i["sink"], d_v=i["Dv"], provider=provider,
                                               check_indices=check_indices)

    def bwd(deterministic):
        return lambda i, provider=None: interface.mqa_latent_sparse_bwd(
            i["q"], i["kv"], i["out"], i["dO"], i["lse"], i["sink"], i["idx"], i["sm_scale"],
            deterministic=deterministic, check_indices=check_indices, provider=provider)

    return {"fwd": fwd, "bwd_atomic": bwd(False), "bwd_det": bwd(True), "ref_fwd": ref_fwd,
            "ref_bwd": ref_bwd}


def nvml_reader(torch):
    """:func:`harness.nvml_reader` of the current CUDA device, found by its PCI bus id where
    torch gives it: NVML numbers every GPU of the host, CUDA only the visible ones."""
    dev = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(dev)
    if getattr(p, "pci_bus_id", None) is None:  # older torch: NVML's index, right on one GPU
        return harness.nvml_reader(index=dev)
    return harness.nvml_reader(
        pci_bus_id=f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")


def sampled_calls(torch, clock, fn, inputs, warmup, reps) -> tuple[list, dict]:
    """:func:`harness.time_calls` and the GPU's median SM clock and board power while they ran
    and the fraction of NVML's samples with a power/thermal clock-event reason
    (``{"sm_mhz": MHz, "power_w": W, "capped": 0..1}``, None where NVML cannot be read): the
    clock falls from 1980 to ~1750 MHz at the H200's power limit under sustained load, and the
    times with it; ``capped`` says whether the power cap was on (run 95: the forward's
    sustained slow state)."""
    with _sampler(torch, clock) as gpu:
        times = harness.time_calls(clock, fn, inputs, warmup, reps)
    return times, gpu.fields()


def sustained_calls(torch, clock, fn, inputs, hot_s) -> tuple[float, float | None]:
    """:func:`harness.sustained_ms` over ``hot_s`` (after ``harness.HOT_WARM_S`` of calls) and
    the GPU's median SM clock over the measured seconds (MHz; None where NVML cannot be read)."""
    gpu = _sampler(torch, clock)
    return harness.sustained_ms(clock, fn, inputs, harness.HOT_WARM_S, hot_s, gpu), gpu.sm_mhz


def _sampler(torch, clock):
    return harness.GpuSampler(nvml_reader(torch) if clock.cuda else None)


def time_variant(torch, clock, fn, inputs, warmup, reps, check, settle_s=0.0,
                 hot_s=0.0) -> dict:
    """First call (compile + run, wall s), then, after ``settle_s`` of idle
    (:func:`harness.settle`), the timed calls with the GPU's median SM clock (``sm_mhz``, MHz),
    board power (``power_w``, W) and the fraction of samples power- or heat-capped (``capped``,
    0..1, :data:`harness.CAP_REASONS`) while they ran; peak memory on the GPU; with ``check``,
    whether the outputs are finite and two calls on the same inputs bitwise equal; with
    ``hot_s``, last, the sustained time (``ms_hot``, :func:`sustained_calls`) and its clock
    (``sm_mhz_hot``)."""
    clock.sync()
    if clock.cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    fn(inputs[0])
    clock.sync()
    res = {"first_call_s": time.perf_counter() - t0}
    harness.settle(clock, settle_s)
    times, gpu = sampled_calls(torch, clock, fn, inputs, warmup, reps)
    res.update(harness.summarize(times), **gpu)
    if clock.cuda:
        peak = torch.cuda.max_memory_allocated()
        res.update(peak_mem_mb=peak / 1e6, extra_mem_mb=(peak - base) / 1e6)
    if check:
        x, y = fn(inputs[0]), fn(inputs[0])
        res["repeatable"] = all(torch.equal(u, v) for u, v in zip(x, y))
        if not all(bool(torch.isfinite(u).all()) for u in x):
            res["note"] = "non-finite output"
    if hot_s > 0:
        res["ms_hot"], res["sm_mhz_hot"] = sustained_calls(torch, clock, fn, inputs, hot_s)
    return res


#: Which of our variants each reference variant checks, and the names of their outputs.
CHECKED_BY_REF = {"ref_fwd": ("fwd", ("out", "lse")), "ref_bwd": ("bwd_det", ("dq", "dkv", "d_sink"))}


def rel_errors(ours, ref, names) -> str:
    """Relative L2 error of each of our outputs against the reference's (all-zero ones, e.g.
    d_sink without a sink, left out)."""
    return ", ".join(f"{n} {float((o.float() - r.float()).norm() / r.float().norm()):.1e}"
                     for n, o, r in zip(names, ours, ref) if bool(r.float().norm() > 0))


# --- stage timing ------------------------------------------------------------------------------


class StageClock:
    """A kernel provider (``kernel_provider.KernelProvider``: fwd, bwd_preprocess, bwd_main,
    bwd_finish and the exact dKV's ``exact_*`` launchers) that launches through ``inner`` with a
    clock mark on each side of every launch; the deterministic backward's ``grid_rows`` (its preprocess,
    with the rows' grid weights) counts as "preprocess", its other two grid kernels as one
    stage ("grid"), its re-run plan and slot compaction as another ("re-run plan"); where
    ``inner`` fuses the
    preprocess into the atomic main kernel (``interface.FUSED_PREPROCESS``), "main" includes it
    and there is no "preprocess" stage.  It keeps what the deterministic backward hands its
    exact dKV passes: the first pass's per-key bound and the re-run pass's slots (the first
    ``counts[b, s]`` of each row of its indices; the rest of a row is ``-1`` or, in a batch
    with no re-run key, unwritten)."""

    def __init__(self, clock, inner):
        self.clock, self.inner, self.device = clock, inner, inner.device
        self.marks, self.bound, self.rerun_idx = [], None, None
        # the tiles whose main kernel does the preprocess's work (kernel_provider.FusedPreprocess):
        # those of inner, whose launch then counts in "main" (no "preprocess" stage)
        self.fused_preprocess_tiles = getattr(inner, "fused_preprocess_tiles", ())

    def _launch(self, stage, launch, *args):
        start = self.clock.mark()
        launch(*args)
        self.marks.append((stage, start, self.clock.mark()))

    def fwd(self, *args):
        self._launch("fwd kernel", self.inner.fwd, *args)

    def bwd_preprocess(self, *args):
        self._launch("preprocess", self.inner.bwd_preprocess, *args)

    def bwd_main(self, heads_per_cta, deterministic, with_dq, q, kv, grad_out, indices, lse2,
                 delta, scale, inv_grid, counts, dq, dkv_acc, bound, bound_exp, pre=None):
        args = (heads_per_cta, deterministic, with_dq, q, kv, grad_out, indices, lse2, delta,
                scale, inv_grid, counts, dq, dkv_acc, bound, bound_exp)
        args += () if pre is None else (pre,)
        self._launch("main" if with_dq else "main re-run", self.inner.bwd_main, *args)
        if deterministic and with_dq:
            self.bound = bound.clone()  # the re-run adds to it
        elif deterministic:
            # its slots: the first counts[b, s] of each row (the rest may be unwritten)
            self.rerun_idx = (indices, counts)

    def exact_grid_rows(self, *args):
        # the deterministic backward's preprocess (with the rows' grid weights)
        self._launch("preprocess", self.inner.exact_grid_rows, *args)

    def exact_grid_scatter(self, *args):
        self._launch("grid", self.inner.exact_grid_scatter, *args)

    def exact_grid_keys(self, *args):
        self._launch("grid", self.inner.exact_grid_keys, *args)

    def exact_rerun_plan(self, *args):
        self._launch("re-run plan", self.inner.exact_rerun_plan, *args)

    def exact_rerun_slots(self, *args):
        self._launch("re-run plan", self.inner.exact_rerun_slots, *args)

    def bwd_finish(self, *args):
        self._launch("finish", self.inner.bwd_finish, *args)


def stage_report(torch, clock, fn, inputs, reps, inner) -> dict:
    """Median ms per stage over ``reps`` calls of ``fn`` through a :class:`StageClock` on
    ``inner`` ("rest of the call": framework ops and host time between the kernels) and, for the
    deterministic backward, how many keys the exact dKV re-ran and the head-room
    ``log2(2^EXACT_BITS / bound)`` its first pass left (quantiles over keys)."""
    from paddlefleet.tilelang_ops.attn.exact_dkv import EXACT_BITS

    samples = []
    for i in range(reps + 1):  # call 0 loads the provider's kernels
        rec = StageClock(clock, inner)
        start = clock.mark()
        fn(inputs[i % len(inputs)], provider=rec)
        end = clock.mark()
        clock.sync()
        t = {}
        for stage, a, b in rec.marks:
            t[stage] = t.get(stage, 0.0) + clock.ms(a, b)
        t["rest of the call"] = clock.ms(start, end) - sum(t.values())
        t["call"] = clock.ms(start, end)
        samples.append(t)
    rep = {k: float(np.median([t[k] for t in samples[1:]])) for k in samples[-1]}
    if rec.bound is not None:
        used = rec.bound[rec.bound > 0].double()
        room = torch.log2(2.0 ** EXACT_BITS / used).cpu().numpy()
        idx2, counts = rec.rerun_idx
        rerun = idx2[torch.arange(idx2.shape[-1], device=idx2.device) < counts[..., None]]
        rep["exact"] = {"keys": used.numel(), "keys_rerun": torch.unique(rerun).numel(),
                        "slots_rerun": rerun.numel(),
                        "headroom_bits": np.quantile(room, [0, 0.01, 0.5, 0.99, 1]).tolist()}
    return rep


def stage_lines(name: str, rep: dict) -> list[str]:
    lines = [f"{name} stages, ms (median): " + " | ".join(
        f"{k} {v:.3f}" for k, v in rep.items() if k != "exact")]
    if "exact" in rep:
        e = rep["exact"]
        lines.append(f"{name} exact dKV: {e['keys_rerun']} of {e['keys']} keys re-run "
                     f"({e['slots_rerun']} slots); head-room bits min/p1/p50/p99/max "
                     + "/".join(f"{x:.1f}" for x in e["headroom_bits"]))
    return lines


# --- the partition mode ------------------------------------------------------------------------


def partition_rows(parts, rows: list[dict], meta: dict) -> list[dict]:
    """``core_{heads,seq}_tpN``: a rank's forward + deterministic backward at its shape (the
    sum of the two medians; peak memory of the backward, which holds more)."""
    base = parts[0][2]
    by = {(r["shape"], r["variant"]): r for r in rows}
    out = []
    for tp, part, s in parts:
        f, d = (by.get((s.name, v), {"status": "not run"}) for v in ("fwd", "bwd_det"))
        row = harness.make_row(s, f"core_{part}_tp{tp}", meta, shape=base.name, a2a_mb=(
            model.seq_a2a_bytes(base, tp) / 1e6 if part == "seq" else None))
        if f["status"] != "ok" or d["status"] != "ok":
            row["status"] = f"not run: fwd {f['status']}; bwd_det {d['status']}"
        else:
            row.update(ms=f["ms"] + d["ms"], peak_mem_mb=d["peak_mem_mb"],
                       extra_mem_mb=d["extra_mem_mb"],
                       note=f"{s.name}: fwd {f['ms']:.3f} + bwd_det {d['ms']:.3f} ms")
            flops, nbytes = (x + y for x, y in zip(model.work(s, "fwd"), model.work(s, "bwd")))
            harness.fill_rates(row, flops, nbytes, meta["peak_tflops"], meta["copy_tbs"])
        out.append(row)
    return out


def partition_table(core: list[dict]) -> str:
    tp1 = {r["variant"].split("_")[1]: r["ms"] for r in core if r["variant"].endswith("_tp1")}

    def ratio(r):
        part = r["variant"].split("_")[1]
        return r["ms"] / tp1[part] if r["status"] == "ok" and tp1.get(part) else None

    return harness.table((("variant", "variant", ""), ("S", "S", "d"), ("H", "H", "d"),
                          ("fwd + bwd_det ms", harness.ms_or_status, ".3f"),
                          ("x TP=1", ratio, ".3f"), ("all-to-all MB/layer", "a2a_mb", ",.1f"),
                          ("TFLOP/s", "tflops", ".1f"), ("note", "note", "")), core)


# --- the run -----------------------------------------------------------------------------------


def ceilings(torch, clock, a, device, meta, add) -> None:
    """This card's dense matmul rate (the peak of ``frac_peak``) and copy rate (bytes read +
    written), measured in the run; the planning values where one is skipped (size 0)."""
    peak = copy = None
    if a.matmul_n:  # fp32 and at most 256 on the CPU stand-in: bf16 GEMMs crawl there
        gen = torch.Generator(device=device).manual_seed(a.seed)
        n, dt = (min(a.matmul_n, 256), "fp32") if a.cpu_standin else (a.matmul_n, "bf16")
        mats = [torch.randn((2, n, n), generator=gen, device=device,
                            dtype=torch.float32 if dt == "fp32" else torch.bfloat16)
                for _ in range(a.sets)]
        row = harness.make_row(None, f"matmul_{dt}", meta, shape=f"{n}^3", frac_peak=1.0,
                               **time_variant(torch, clock, lambda m: m[0] @ m[1], mats,
                                              a.warmup, a.reps, False))
        peak = add(harness.fill_rates(row, 2 * n ** 3, None, None, None))["tflops"]
    if a.copy_mb:
        n = (min(a.copy_mb, 8) if a.cpu_standin else a.copy_mb) << 20
        bufs = [torch.full((n,), k + 1, dtype=torch.uint8, device=device) for k in range(a.sets)]
        dst = torch.empty_like(bufs[0])
        row = harness.make_row(None, "copy", meta, shape=f"{n >> 20}MiB", **time_variant(
            torch, clock, dst.copy_, bufs, a.warmup, a.reps, False))
        copy = add(harness.fill_rates(row, None, 2 * n, None, None))["tbs"]
    meta.update(peak_tflops=peak or model.H200_MATMUL_TFLOPS, copy_tbs=copy or model.H200_COPY_TBS,
                peak_source=f"measured matmul_{dt}" if peak else
                f"planning value {model.H200_MATMUL_TFLOPS:g} (matmul not measured)",
                copy_source="measured" if copy else
                f"planning value {model.H200_COPY_TBS:g} (copy not measured)")


def run(a: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    try:
        import torch
    except ImportError:
        print("bench_sparse_mqa: needs PyTorch (docs/developing.md, 'GPU validation environment'); "
              "--dry-run needs none", file=sys.stderr)
        return 2
    if not a.cpu_standin and not torch.cuda.is_available():
        print("bench_sparse_mqa: no CUDA device; --cpu-standin runs the tool on CPU",
              file=sys.stderr)
        return 2
    try:
        from tqdm import tqdm
    except ImportError:  # the GPU host may lack it: no bar then
        tqdm = None
    os.makedirs(a.out, exist_ok=True)
    cpu = a.cpu_standin
    device, clock = ("cpu", harness.Clock()) if cpu else ("cuda", harness.Clock(torch))
    meta = dict(harness.run_meta(_REPO, "CPU stand-in" if cpu else torch.cuda.get_device_name(),
                                 torch.__version__), cpu_standin=cpu,
                timer="host" if cpu else "cuda-events", check_indices=not a.no_check_indices)
    if not cpu:
        meta.update(gpu_state_before=harness.gpu_state(),
                    device_capability=list(torch.cuda.get_device_capability()),
                    device_memory_gb=torch.cuda.get_device_properties(0).total_memory / 1e9)
    fns = load_functions(torch, cpu, check_indices=not a.no_check_indices)
    if a.stages:
        from paddlefleet.tilelang_ops.attn.kernel_provider import TileLangKernels

        inner = TileLangKernels()  # one for the run: it keeps its loaded kernels
    rows: list[dict] = []
    payload = {"meta": meta, "config": {k: v for k, v in vars(a).items()
                                        if k not in ("shape_list", "parts")},
               "shapes": [dataclasses.asdict(s) for s in a.shape_list], "rows": rows,
               "stages": {}, "partition": [(tp, p, s.name) for tp, p, s in a.parts or ()]}

    def todo(s):
        return [v for v in a.variant_list if not v.startswith("ref") or s.name in a.ref_shape_names]

    bar = tqdm(total=(a.matmul_n > 0) + (a.copy_mb > 0) + sum(len(todo(s)) for s in a.shape_list),
               file=sys.stderr, ncols=90, disable=a.no_progress) if tqdm else None
    say = tqdm.write if tqdm else print

    def add(row):
        rows.append(row)
        if bar is not None:
            bar.update(1)
        say(f"{row['shape']} {row['variant']}: {row['status']}" if row["status"] != "ok" else
            f"{row['shape']:14s} {row['variant']:11s} {row['ms']:9.3f} ms (p20 {row['ms_p20']:.3f},"
            f" p80 {row['ms_p80']:.3f}, min {row['ms_min']:.3f}, max {row['ms_max']:.3f}) "
            + (f"{row['tflops']:7.1f} TFLOP/s" if row["tflops"] else f"{row['tbs']:.2f} TB/s")
            + (f", first call {row['first_call_s']:.1f} s" if row["first_call_s"] > 2 else "")
            + (f", SM {row['sm_mhz']:.0f} MHz" if row["sm_mhz"] is not None else "")
            + (f", {row['power_w']:.0f} W" if row["power_w"] is not None else "")
            + (f", power/heat-capped {row['capped']:.0%} of samples" if row["capped"] is not None
               else "")
            + (f"; sustained {row['ms_hot']:.3f} ms{harness.clock_note(row['sm_mhz_hot'])}"
               if row["ms_hot"] is not None else ""))
        return row

    def save():
        harness.fill_det_ratio(rows)
        payload["elapsed_s"] = time.perf_counter() - t_start
        harness.write_json(payload, os.path.join(a.out, "results.json"))
        harness.write_csv(rows, os.path.join(a.out, "results.csv"))

    core = []
    try:
        ceilings(torch, clock, a, device, meta, add)
        payload["floors"] = {s.name: {p: model.floor(*model.work(s, p), meta["peak_tflops"],
                                                     meta["copy_tbs"]) for p in ("fwd", "bwd")}
                             for s in a.shape_list}
        for s in a.shape_list:
            if time.perf_counter() - t_start > a.budget_s:
                for v in todo(s):
                    add(harness.make_row(s, v, meta, status=f"not run: past --budget-s "
                                                            f"{a.budget_s:g}"))
                continue
            why = None if cpu else model.unbuilt_dims(s, kernel_dims())
            if why is not None:  # the kernels for this (Dk, Dv) have not landed yet
                for v in todo(s):
                    add(harness.make_row(s, v, meta, status=f"skipped: {why}"))
                continue
            try:
                sets = make_input_sets(torch, s, device, a.sets, a.seed, not a.no_sink, a.sm_scale)
                if any("bwd" in v for v in todo(s)):  # out and lse from our forward
                    for inp in sets:
                        inp["out"], inp["lse"] = fns["fwd"](inp)
                for v in todo(s):
                    ref = v.startswith("ref")  # slow: its first call is the warm-up
                    row = harness.make_row(s, v, meta, **time_variant(
                        torch, clock, fns[v], sets, 0 if ref else a.warmup,
                        a.ref_reps if ref else a.reps, not ref, a.settle_s,
                        0.0 if ref else a.hot_s))
                    harness.fill_rates(row, *model.work(s, "fwd" if "fwd" in v else "bwd"),
                                       meta["peak_tflops"], meta["copy_tbs"])
                    if cpu and not ref:
                        row["note"] = "; ".join(filter(None, (row["note"], "cpu-standin: "
                                                                           "reference")))
                    if ref:  # our values against the package's reference, same inputs
                        mine, names = CHECKED_BY_REF[v]
                        row["note"] = f"{mine} vs reference, rel. L2: " + rel_errors(
                            fns[mine](sets[0]), fns[v](sets[0]), names)
                    add(row)
                    if a.stages and not ref:
                        harness.settle(clock, a.settle_s)  # not right after the sustained calls
                        rep = payload["stages"][f"{s.name}/{v}"] = stage_report(
                            torch, clock, fns[v], sets, a.reps, inner)
                        for line in stage_lines(f"{s.name} {v}", rep):
                            say(line)
            except torch.cuda.OutOfMemoryError as e:
                done = {r["variant"] for r in rows if r["shape"] == s.name}
                why = f"skipped: out of memory ({str(e).splitlines()[0][:120]})"
                for v in todo(s):
                    if v not in done:
                        add(harness.make_row(s, v, meta, status=why))
            sets = None
            if not cpu:
                torch.cuda.empty_cache()
            save()
        core = partition_rows(a.parts, rows, meta) if a.parts else []
        rows += core
    finally:
        if bar is not None:
            bar.close()
        if not cpu:
            meta["gpu_state_after"] = harness.gpu_state()
        save()

    if not a.no_plot:
        try:
            import plot

            say(f"plot: {plot.plot_results(rows, meta, os.path.join(a.out, 'time_per_shape.png'))}")
        except ImportError as e:  # matplotlib is optional
            say(f"plot skipped: {e}")
    text = "\n\n".join(filter(None, (harness.run_line(meta), harness.table(
        harness.result_cols(rows), rows[:len(rows) - len(core)]), core and partition_table(core))))
    with open(os.path.join(a.out, "table.txt"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    sys.stderr.flush()
    print(f"\nresults in {a.out} ({time.perf_counter() - t_start:.0f} s)\n{text}", flush=True)
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.dry_run:
        print(plan_text(a))
        return 0
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
