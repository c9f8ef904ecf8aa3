"""Compile (or only lower) every TileLang kernel specialisation in parallel.

A fresh GPU host pays 9-16 s of JIT compile per kernel; compiling them one after another inside
pytest would take minutes.  This tool builds them in a process pool that shares
``TILELANG_CACHE_DIR``, so the tests and the benchmark afterwards find every kernel cached.

    python tools/precompile.py                  # compile all (GPU host), 16 workers
    python tools/precompile.py --lower-only     # lower for sm_90a only (any CPU machine)
    python tools/precompile.py --heads 64 --jobs 4
    python tools/precompile.py --dims 512x512     # one (Dk, Dv) pair only

Specialisations: ``paddlefleet.tilelang_ops.attn.kernels.specs``, the ones the wrappers
launch: the forward, the backward preprocess per lse format, and the main backward in its three
flavours (deterministic with dQ, deterministic re-run without dQ, atomic; the 64-head atomic
one only with the preprocess fused, per lse format) for every head tile in ``--heads`` (default
16 32 64, all the tiles ``tiling.head_plan`` can give), the dKV finish, and the exact dKV's
five bookkeeping kernels (``exact_grid.py``: grid_rows, the deterministic backward's
preprocess, per lse format; grid_scatter, grid_keys, rerun_plan, rerun_slots, one
specialisation each; whatever the head tile), for every (Dk, Dv) pair in ``--dims``
(default: all of ``kernels.D_PAIRS``, (576, 512) and (512, 512)).  Prints one line per
kernel and a summary; exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("TILELANG_CACHE_DIR", str(ROOT / ".tilelang-cache"))



def kernel_specs(heads=(16, 32, 64), pairs=None):
    """``(name, args)`` of every specialisation (``attn.kernels.specs``) for the head tiles and
    (Dk, Dv) pairs given (``None``: every pair of ``kernels.D_PAIRS``)."""
    from paddlefleet.tilelang_ops.attn import kernels

    return kernels.specs(tuple(heads), kernels.D_PAIRS if pairs is None else tuple(pairs))


def parse_dims(dims):
    """``["576x512", "512x512"]`` -> ``((576, 512), (512, 512))``; ``None`` stays ``None``."""
    if dims is None:
        return None
    try:
        pairs = tuple(tuple(int(x) for x in d.lower().split("x")) for d in dims)
    except ValueError:
        pairs = ()
    if not pairs or any(len(p) != 2 for p in pairs):
        raise SystemExit(f"--dims: pairs as DKxDV (e.g. 576x512), got {dims}")
    return pairs


def lower(name, args, pass_configs=None):
    """Lower one specialisation for ``settings.TARGET`` (no GPU needed)."""
    from paddlefleet.tilelang_ops.attn import kernels

    return kernels.lower(name, args, pass_configs)


def _build_one(name, args, lower_only):
    t0 = time.time()
    try:
        if lower_only:
            lower(name, args)
        else:
            from paddlefleet.tilelang_ops.attn import kernels

            kernels.build(name, args)  # compiles and stores in TILELANG_CACHE_DIR
        return name, args, time.time() - t0, None
    except Exception as exc:  # report every failure, keep building the others
        return name, args, time.time() - t0, f"{type(exc).__name__}: {exc}"[-2000:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lower-only", action="store_true")
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--dims", nargs="+", metavar="DKxDV",
                    help="(Dk, Dv) pairs, e.g. 576x512 512x512 (default: kernels.D_PAIRS)")
    ns = ap.parse_args(argv)
    specs = kernel_specs(tuple(ns.heads), parse_dims(ns.dims))
    t0 = time.time()
    failed = 0
    with ProcessPoolExecutor(max_workers=ns.jobs) as pool:
        futs = [pool.submit(_build_one, n, a, ns.lower_only) for n, a in specs]
        for fut in as_completed(futs):
            name, args, dt, err = fut.result()
            status = "ok" if err is None else "FAILED"
            print(f"[precompile] {status:6s} {name}{args} {dt:.1f}s", flush=True)
            if err is not None:
                failed += 1
                print(err, flush=True)
    print(f"[precompile] {len(specs) - failed}/{len(specs)} kernels in {time.time() - t0:.1f}s "
          f"(cache {os.environ['TILELANG_CACHE_DIR']})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
