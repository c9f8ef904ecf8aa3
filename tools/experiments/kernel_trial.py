"""GPU trial of kernel variants against the shipped ones, through the public wrappers.

Each variant is a provider whose kernels get another schedule; outputs are compared with
the shipped kernels' (relative L2, bitwise repeat of the deterministic backward) and timed with
CUDA events (median).  Not a test and not the benchmark: a scratch tool for A/B decisions, whose
printed lines go into docs/performance.md.

    source tools/gpu_env.sh
    python3 tools/experiments/kernel_trial.py --fwd "regs216=consumer_regs=216" \
        --bwd "lanes4=row_lanes=4,pred_red=False" --shapes ref,fleet --reps 10

``--fwd NAME=FIELDS``: the 64-head forward built with ``schedule.fwd_schedule()`` and the fields
given changed (``FwdSchedule``: block_k, threads, num_stages, consumer_regs); ``--bwd
NAME=FIELDS``: the 32- and 64-head main backward (``kernels.main_args``) with those fields of its
schedule record changed where the record has them (``BwdSchedule``: block_k, threads,
num_stages, dkv_chunk, dkv_transposed, for the one-role kernel of 32-head tiles and the 64-head
re-run; ``TwoWarpgroupSchedule``: wg0_chunks, overlap, row_lanes, pred_red, for the 64-head
first pass).  FIELDS is ``name=value,...`` (ints, ``True``, ``False``).

``--state`` sets the GPU's state for each timing: ``queued`` (default) as the previous calls
left it; ``cool`` starts each timing (1 warm-up and ``--reps`` calls, median) after 1.5 s of idle (the boost clock); ``hot``
takes the mean per call over 1 s after 1.5 s of back-to-back calls (the clock at the power
limit; ``--reps`` does not apply).  Each timing prints `` at N MHz``, the median SM clock
(NVML) while its calls ran, where NVML can be read.  Compare variants in both states,
with the shapes repeated: every repeat of a shape runs the providers in the reverse order of
its previous one (``provider_orders``).  Run from the repository root (``src`` and
``tools/bench`` are put on ``sys.path`` relative to it); needs a CUDA GPU.
``--no-shipped --atomic-only``
leave one launch per call for Nsight Compute (``--det-only``: the deterministic backward
only); ``--check-indices`` times the calls with the value
checks on (off by default: kernels and host only).  ``--unfused`` times the atomic backward
twice per provider, with the preprocess fused into the 64-head main kernel
(``interface.FUSED_PREPROCESS``, the default) and as a launch of its own, and prints the
relative error between the two and whether the fused one repeats dq and d_sink bit for bit.
"""
import argparse
import sys
import time
from dataclasses import fields, replace

sys.path.insert(0, "src")
sys.path.insert(0, "tools/bench")
import harness  # noqa: E402
from bench_sparse_mqa import sampled_calls, sustained_calls  # noqa: E402
import model  # noqa: E402
from paddlefleet.tilelang_ops.attn import interface, kernel_provider, kernels  # noqa: E402
from paddlefleet.tilelang_ops.attn.indices import causal_topk_indices  # noqa: E402
from paddlefleet.tilelang_ops.attn.kernels.schedule import fwd_schedule  # noqa: E402

DK, DV = 576, 512
#: the benchmark's shapes, and three only the trials use
SHAPES = dict(model.SHAPES, **{s.name: s for s in (
    model.Shape("wave_ref", 1, 132, 8192, 64, 2048),  # one CTA per SM: the per-CTA time
    model.Shape("wave_fleet", 1, 132, 8192, 64, 640),
    model.Shape("h32", 1, 4096, 8192, 32, 2048),
    # 4092 = 31 x 132 rows: ref without its last wave of 4 CTAs (what that wave costs)
    model.Shape("ref31w", 1, 4092, 8192, 64, 2048),
    # causal training rows (S = S_kv): the first topk rows see fewer keys
    model.Shape("causal8k", 1, 8192, 8192, 64, 2048),
    # ref with a quarter and a half of its key blocks per row (every row full): with ref, a
    # CTA's fixed time and its time per key block
    model.Shape("t512", 1, 4096, 8192, 64, 512),
    model.Shape("t1024", 1, 4096, 8192, 64, 1024),
)})


def parse_fields(text):
    """``{field: value}`` of ``"name=value,..."`` (ints, ``True``, ``False``)."""
    words = {"True": True, "False": False}
    out = {}
    for item in text.split(","):
        key, value = item.split("=")
        out[key.strip()] = words[value] if value in words else int(value)
    return out


def with_fields(args, changes):
    """``args`` (a specialisation's static arguments) with ``changes`` made to its schedule
    record, those of its fields the record has (``dataclasses.replace``)."""
    return tuple(replace(a, **{k: v for k, v in changes.items()
                               if k in {f.name for f in fields(a)}})
                 if hasattr(a, "__dataclass_fields__") else a for a in args)


class Variant(kernel_provider.TileLangKernels):
    """Shipped kernels, except that the 64-head forward / 32- and 64-head main backward take
    other schedule fields (``fwd_fields`` / ``bwd_fields``, as :func:`parse_fields` gives)."""

    def __init__(self, fwd_fields=None, bwd_fields=None):
        super().__init__()
        self.fwd_fields, self.bwd_fields = fwd_fields, bwd_fields

    def _kernel(self, key):
        # the shipped provider's, announcing each build (trials compile variants mid-run)
        if key in self._kernels:
            return self._kernels[key]
        t = time.time()
        kernel = super()._kernel(key)
        print(f"[build] {key}: {time.time() - t:.1f}s", flush=True)
        return kernel

    def fwd_key(self, heads_per_cta, d_qk, d_v):
        key = super().fwd_key(heads_per_cta, d_qk, d_v)
        if self.fwd_fields is None or heads_per_cta != 64:
            return key
        return key + (replace(fwd_schedule(), **self.fwd_fields),)

    def bwd_main_key(self, heads_per_cta, deterministic, with_dq, d_qk, d_v, pre=None):
        key = super().bwd_main_key(heads_per_cta, deterministic, with_dq, d_qk, d_v, pre)
        if self.bwd_fields is None or heads_per_cta not in (32, 64):
            return key
        return with_fields(key, self.bwd_fields)

#: check_indices of every timed call (--check-indices)
CHECK = False
#: time the atomic backward with and without the fused preprocess (--unfused)
UNFUSED = False

#: the GPU's state for each timing (--state): "queued" as left by the previous calls; "cool":
#: after harness.SETTLE_S of idle (the boost clock); "hot": the mean per call over
#: harness.HOT_S after harness.HOT_WARM_S of back-to-back calls (the clock at the 700 W power
#: limit, as in training); the benchmark's settled and sustained timings (docs/performance.md,
#: "How it is measured")
STATE = "queued"


def median_ms(fn, reps):
    """``(ms, SM MHz)``: the median of ``reps`` calls after one warm-up (CUDA events, the
    benchmark's clock), after the benchmark's idle pause in the ``--state cool``; in the
    ``--state hot`` the mean per call of sustained calls (``reps`` unused).  The clock (NVML,
    None where it cannot be read) is the median while the timed calls ran, as the benchmark's
    rows record it: cool rounds of one shape ranged 4.05-4.54 ms at h128 (runs 79-80) with no
    clock beside."""
    import torch  # here, not at the top: the module's pure helpers import without torch

    clock = harness.Clock(torch)
    if STATE == "hot":
        return sustained_calls(torch, clock, lambda _: fn(), [None], harness.HOT_S)
    if STATE == "cool":
        harness.settle(clock, harness.SETTLE_S)
    times, gpu = sampled_calls(torch, clock, lambda _: fn(), [None], 1, reps)
    return harness.summarize(times)["ms"], gpu["sm_mhz"]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def run_shape(name, providers, do_fwd, do_bwd, reps, dets):
    import torch

    sh = SHAPES[name]
    B, S, SKV, H, K = sh.B, sh.S, sh.S_kv, sh.H, sh.topk
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn((B, S, H, DK), generator=g, device="cuda").bfloat16()
    kv = torch.randn((B, SKV, DK), generator=g, device="cuda").bfloat16()
    do = torch.randn((B, S, H, DV), generator=g, device="cuda").bfloat16()
    idx = torch.from_numpy(causal_topk_indices(B, S, SKV, K, seed=0)).cuda()
    sink = torch.randn((H,), generator=g, device="cuda")
    sm = DK ** -0.5
    # the shipped kernels' forward: what every forward is compared with and the backward's input
    base_out = interface.mqa_latent_sparse_fwd(q, kv, idx, sm, sink, check_indices=False)
    for pname, prov in providers.items():
        if not do_fwd.get(pname, True):
            continue
        f = lambda: interface.mqa_latent_sparse_fwd(q, kv, idx, sm, sink, check_indices=CHECK,
                                                    provider=prov)
        out, lse = f()
        ms, mhz = median_ms(f, reps)
        print(f"[{name}] fwd {pname}: {ms:.3f} ms{harness.clock_note(mhz)}, out rel {rel(out.float(), base_out[0].float()):.2e},"
              f" lse max|d| {(lse - base_out[1]).abs().max().item():.2e}", flush=True)
    out, lse = base_out
    base = {}
    shipped_fused = interface.FUSED_PREPROCESS
    for pname, prov in providers.items():
        if not do_bwd.get(pname, True):
            continue
        for det in dets:
            both = UNFUSED and not det
            fused_r = None
            for fused in ((True, False) if both else (shipped_fused,)):
                interface.FUSED_PREPROCESS = fused
                f = lambda: interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, sm,
                                                            deterministic=det,
                                                            check_indices=CHECK, provider=prov)
                r1, r2 = f(), f()
                same = all(torch.equal(x, y) for x, y in zip(r1, r2))
                # dq and d_sink: written once per (row, head) / a fixed-order sum, in both modes
                same_qs = torch.equal(r1[0], r2[0]) and torch.equal(r1[2], r2[2])
                base.setdefault(det, r1)
                o = base[det]
                ms, mhz = median_ms(f, reps)
                tag = f" fused={fused}" if both else ""
                print(f"[{name}] bwd {pname} det={det}{tag}: {ms:.3f} ms{harness.clock_note(mhz)}, "
                      f"repeat-bitwise={same}"
                      f" (dq, dsink: {same_qs}), vs first: dq {rel(r1[0], o[0]):.2e} dkv "
                      f"{rel(r1[1].float(), o[1].float()):.2e} dsink {rel(r1[2], o[2]):.2e} "
                      f"dkv-equal={torch.equal(r1[1], o[1])}", flush=True)
                if both and fused:
                    fused_r = r1
                elif both:
                    print(f"[{name}] bwd {pname} fused vs unfused: dq {rel(fused_r[0], r1[0]):.2e}"
                          f" dkv {rel(fused_r[1].float(), r1[1].float()):.2e} dsink "
                          f"{rel(fused_r[2], r1[2]):.2e}", flush=True)
            interface.FUSED_PREPROCESS = shipped_fused


def precompile(providers, jobs=16):
    """Build every kernel the trial launches for 32- and 64-head tiles, in parallel (TileLang's
    disk cache); other tiles compile on first use."""
    from concurrent.futures import ProcessPoolExecutor

    sys.path.insert(0, "tools")
    from precompile import _build_one, kernel_specs

    keys = set(kernel_specs((32, 64)))
    for prov in providers.values():
        if getattr(prov, "fwd_fields", None):
            keys.add(("fwd", (64, DK, DV, replace(fwd_schedule(), **prov.fwd_fields))))
        if getattr(prov, "bwd_fields", None):
            for name, args in kernels.specs((32, 64)):
                if name == "bwd_main":
                    keys.add((name, with_fields(args, prov.bwd_fields)))
    t = time.time()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for name, a, dt, err in pool.map(_build_one, *zip(*[(n, a, False) for n, a in keys])):
            print(f"[precompile] {name}{a} {dt:.1f}s {err or 'ok'}", flush=True)
    print(f"[precompile] {len(keys)} kernels in {time.time() - t:.1f}s", flush=True)


def provider_orders(shapes, names):
    """``(shape, provider names)`` per entry of ``shapes``: a shape's every repeat takes the
    providers in the reverse order of its previous one, so that repeats are rounds the other
    way (a provider timed right after another inherits the GPU's state from it)."""
    seen = {}
    out = []
    for shape in shapes:
        k = seen.get(shape, 0)
        seen[shape] = k + 1
        out.append((shape, list(names)[::-1] if k % 2 else list(names)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--fwd", action="append", default=[],
                    help="name=field=value,... (FwdSchedule)")
    ap.add_argument("--bwd", action="append", default=[],
                    help="name=field=value,... (BwdSchedule / TwoWarpgroupSchedule)")
    ap.add_argument("--shapes", default="ref,fleet",
                    help="comma-separated, repeats allowed; one of " + ", ".join(SHAPES))
    ap.add_argument("--reps", type=int, default=10, help="timed calls per timing (not hot)")
    ap.add_argument("--state", choices=("queued", "cool", "hot"), default="queued",
                    help="GPU state of each timing: as queued, after idle, or sustained")
    ap.add_argument("--no-shipped", action="store_true", help="variants only (for ncu)")
    ap.add_argument("--atomic-only", action="store_true", help="skip deterministic=True")
    ap.add_argument("--det-only", action="store_true", help="skip deterministic=False")
    ap.add_argument("--check-indices", action="store_true",
                    help="calls with the value checks on (default off: kernels and host only)")
    ap.add_argument("--unfused", action="store_true",
                    help="atomic backward also with the separate preprocess (A/B of the fused one)")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    unknown = [n for n in shapes if n not in SHAPES]
    if unknown:  # before the minute of precompiling
        ap.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    global CHECK, UNFUSED, STATE
    CHECK = args.check_indices
    STATE = args.state
    UNFUSED = args.unfused
    providers = {"shipped": kernel_provider.TileLangKernels()}
    do_fwd, do_bwd = {}, {}
    for spec in args.fwd:
        n, a = spec.split("=", 1)
        providers[n] = Variant(fwd_fields=parse_fields(a))
        do_bwd[n] = False
    for spec in args.bwd:
        n, a = spec.split("=", 1)
        providers[n] = Variant(bwd_fields=parse_fields(a))
        do_fwd[n] = False
    if not args.bwd and not args.unfused:
        do_bwd["shipped"] = False
    if args.no_shipped:
        providers.pop("shipped")
    if args.atomic_only and args.det_only:
        ap.error("--atomic-only and --det-only leave nothing to time")
    dets = (False,) if args.atomic_only else (True,) if args.det_only else (True, False)
    precompile(providers)
    for name, order in provider_orders(shapes, providers):
        run_shape(name, {n: providers[n] for n in order}, do_fwd, do_bwd, args.reps, dets)


if __name__ == "__main__":
    main()
