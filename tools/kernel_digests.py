"""Print the sha256 of the lowered CUDA of every kernel specialisation (the refactor check).

A refactor of the kernels that should change nothing proves it by comparing these digests
before and after: kernel names, argument order, buffer names and every instruction show in the
CUDA source, so an identical digest means an identical kernel.

    python tools/kernel_digests.py --out before.txt            # every spec of kernels.specs()
    python tools/kernel_digests.py --only bwd_main --out x.txt  # one kernel name
    python tools/kernel_digests.py --compare before.txt after.txt

Each line is ``name args -> sha256`` (args as ``repr``).  Lowering runs for ``settings.TARGET``
(sm_90a) and needs no GPU; it takes seconds to a minute per specialisation, so ``--out`` is
written line by line and lines already in it are skipped when the run is resumed.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def digest(name: str, args: tuple, src_dir=None) -> str:
    """sha256 (hex) of the CUDA source ``kernels.lower(name, args)`` produces; the source also
    into ``src_dir/<sha256>.cu`` when given (to diff two runs' kernels)."""
    from paddlefleet.tilelang_ops.attn import kernels

    src = kernels.lower(name, args).kernel_source
    sha = hashlib.sha256(src.encode()).hexdigest()
    if src_dir:
        Path(src_dir).mkdir(parents=True, exist_ok=True)
        (Path(src_dir) / f"{sha}.cu").write_text(src)
    return sha


def read(path) -> dict:
    """``{"name args": sha256}`` of a digest file."""
    out = {}
    for line in Path(path).read_text().splitlines():
        if " -> " in line:
            key, sha = line.rsplit(" -> ", 1)
            out[key] = sha.strip()
    return out


def compare(before, after) -> int:
    """Print, per specialisation, identical / changed / only before / only after; 1 if any
    specialisation present in both differs."""
    b, a = read(before), read(after)
    changed = 0
    for key in sorted(set(b) | set(a)):
        if key in b and key in a:
            state = "identical" if b[key] == a[key] else "CHANGED"
            changed += state == "CHANGED"
        else:
            state = "only before" if key in b else "only after"
        print(f"{state:11s} {key}")
    same = sum(1 for k in b if k in a and b[k] == a[k])
    print(f"{same} identical, {changed} changed, {len(set(b) - set(a))} only before, "
          f"{len(set(a) - set(b))} only after")
    return 1 if changed else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="digest file to write (resumed if it exists)")
    ap.add_argument("--only", nargs="+", help="kernel names to digest (default: all)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--src-dir", help="also write each kernel's CUDA source here")
    ap.add_argument("--shard", default="0/1", metavar="K/N",
                    help="digest only every N-th specialisation from the K-th (parallel runs)")
    ns = ap.parse_args(argv)
    if ns.compare:
        return compare(*ns.compare)
    from paddlefleet.tilelang_ops.attn import kernels

    done = read(ns.out) if ns.out and Path(ns.out).exists() else {}
    sink = open(ns.out, "a") if ns.out else None
    k, n = map(int, ns.shard.split("/"))
    for i, (name, args) in enumerate(kernels.specs()):
        key = f"{name} {args!r}"
        if i % n != k or (ns.only and name not in ns.only) or key in done:
            continue
        t0 = time.time()
        line = f"{key} -> {digest(name, args, ns.src_dir)}"
        print(f"{line}  ({time.time() - t0:.0f}s)", flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
