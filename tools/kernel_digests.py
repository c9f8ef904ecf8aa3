"""Print the sha256 of the lowered CUDA of every kernel specialisation (the refactor check).

A refactor of the kernels that should change nothing proves it by comparing these digests
before and after: kernel names, argument order, buffer names and every instruction show in the
CUDA source, so an identical digest means an identical kernel.

    python tools/kernel_digests.py --out before.txt            # every spec of kernels.specs()
    python tools/kernel_digests.py --only bwd_main --out x.txt  # one kernel name
    python tools/kernel_digests.py --compare before.txt after.txt
    python tools/kernel_digests.py --dims 512x512 --src-dir cu/ --ptxas regs.txt  # one pair,
                                                              # and ptxas' registers and spills

Each line is ``name args -> sha256`` (args as ``repr``).  Lowering runs for ``settings.TARGET``
(sm_90a) and needs no GPU; it takes seconds to a minute per specialisation, so ``--out`` is
written line by line and lines already in it are skipped when the run is resumed.  Each
specialisation is lowered in a fresh interpreter with ``PYTHONHASHSEED=0`` (``--jobs`` at once):
TileLang 0.1.13's lowering is not a function of the kernel alone (see ``_WORKSPACE`` and
``_digest_in_child``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


#: TileLang's reduction workspaces in shared memory (``workspace``, ``workspace_1``, ...) are
#: named in an order that follows Python's string hashing (``PYTHONHASHSEED``): the same kernel
#: lowered twice may use ``workspace_1`` where it used ``workspace_2`` before, both at the same
#: offset.  The digest is taken with each such name replaced by its offset in shared memory.
#: Not covered: two such workspaces of one size may also trade offsets between runs of the same
#: tree (the one-role forward's row-max and block-sum reductions, seen on an untouched tree): a
#: "CHANGED" whose ``--src-dir`` diff is only that swap is no change.
_WORKSPACE = re.compile(r"void\* (workspace(?:_\d+)?) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem "
                        r"\+ (\d+)\)\);")


def canonical(src: str) -> str:
    """``src`` with every shared-memory workspace named by its offset (see ``_WORKSPACE``)."""
    names = dict(_WORKSPACE.findall(src))
    if not names:
        return src
    pat = re.compile(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b")
    return pat.sub(lambda m: f"workspace_at_{names[m.group(1)]}", src)


def digest(name: str, args: tuple, src_dir=None) -> str:
    """sha256 (hex) of the CUDA source ``kernels.lower(name, args)`` produces, workspaces named
    by offset (:func:`canonical`); that source also into ``src_dir/<sha256>.cu`` when given (to
    diff two runs' kernels), and TileLang's own into ``<sha256>.raw.cu`` (the one to compile:
    two workspaces may share an offset, and then a name, in the canonical one)."""
    from paddlefleet.tilelang_ops.attn import kernels

    raw = kernels.lower(name, args).kernel_source
    src = canonical(raw)
    sha = hashlib.sha256(src.encode()).hexdigest()
    if src_dir:
        Path(src_dir).mkdir(parents=True, exist_ok=True)
        (Path(src_dir) / f"{sha}.cu").write_text(src)
        (Path(src_dir) / f"{sha}.raw.cu").write_text(raw)
    return sha


def nvcc_cubin(cu, cubin, timeout=600):
    """Compile the lowered CUDA source ``cu`` to ``cubin`` for sm_90a with nvcc (``-Xptxas -v``,
    TileLang's and CUTLASS's headers) and return ``subprocess.CompletedProcess`` (ptxas' report
    in ``.stderr``).  The compile test and ``--ptxas`` use this one command line."""
    import tilelang

    tl_dir = Path(tilelang.__file__).resolve().parent
    cmd = ["nvcc", "--cubin", "-O3", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v",
           f"-I{tl_dir / 'src'}", f"-I{tl_dir / '3rdparty/cutlass/include'}",
           "-o", str(cubin), str(cu)]
    if os.path.exists("/usr/bin/g++"):
        cmd.insert(1, "-ccbin=/usr/bin/g++")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_stats(stderr: str) -> dict:
    """``{"regs", "spill_st", "spill_ld", "c7514"}`` from ``nvcc -Xptxas -v``'s report of one
    kernel (``c7514``: ptxas serialised the kernel's wgmmas)."""
    regs, spills = _REGS.findall(stderr), _SPILL.findall(stderr)
    if not regs or not spills:
        raise ValueError(f"no ptxas register report in: {stderr[-2000:]}")
    return {"regs": int(regs[-1]), "spill_st": int(spills[-1][0]),
            "spill_ld": int(spills[-1][1]), "c7514": "C7514" in stderr}


def _ptxas_line(key, sha, src_dir) -> str:
    import tempfile

    cu = Path(src_dir) / f"{sha}.raw.cu"
    with tempfile.TemporaryDirectory() as tmp:
        res = nvcc_cubin(cu, Path(tmp) / "k.cubin")
    if res.returncode != 0:
        return f"{key} | nvcc failed: {res.stderr.strip().splitlines()[-1:]}"
    st = ptxas_stats(res.stderr)
    return (f"{key} | regs {st['regs']}, spill {st['spill_st']}/{st['spill_ld']} B"
            f"{', C7514' if st['c7514'] else ''}")


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


def _digest_in_child(index, src_dir):
    """``(key, sha256, seconds)`` of ``kernels.specs()[index]``, lowered in a fresh interpreter
    with ``PYTHONHASHSEED=0``: TileLang's choices that follow Python's hashing (workspace
    names and offsets, where it puts some barriers) depend on the seed and on what the process
    lowered before, so a digest is a function of the tree and the specialisation only this way."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(index)]
    if src_dir:
        cmd += ["--src-dir", src_dir]
    t0 = time.time()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"specialisation {index}: {res.stderr[-3000:]}")
    key, sha = res.stdout.strip().splitlines()[-1].rsplit(" -> ", 1)
    return key, sha, time.time() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="digest file to write (resumed if it exists)")
    ap.add_argument("--only", nargs="+", help="kernel names to digest (default: all)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--src-dir", help="also write each kernel's CUDA source here")
    ap.add_argument("--jobs", type=int, default=2, help="specialisations lowered at once")
    ap.add_argument("--dims", nargs="+", metavar="DKxDV",
                    help="(Dk, Dv) pairs to digest, e.g. 576x512 512x512 (default: every pair "
                         "of kernels.D_PAIRS)")
    ap.add_argument("--ptxas", metavar="FILE",
                    help="also compile each digested source (needs --src-dir) with nvcc and "
                         "write its registers, spill stores/loads and C7514 to FILE")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.compare:
        return compare(*ns.compare)
    from paddlefleet.tilelang_ops.attn import kernels

    specs = kernels.specs()
    if ns.child is not None:
        name, args = specs[ns.child]
        print(f"{name} {args!r} -> {digest(name, args, ns.src_dir)}")
        return 0
    if ns.ptxas and not ns.src_dir:
        ap.error("--ptxas needs --src-dir")
    wanted = specs
    if ns.dims:
        from precompile import parse_dims

        wanted = kernels.specs(pairs=parse_dims(ns.dims))
    done = read(ns.out) if ns.out and Path(ns.out).exists() else {}
    todo = [i for i, (name, args) in enumerate(specs)
            if (name, args) in wanted and not (ns.only and name not in ns.only)
            and f"{name} {args!r}" not in done]
    sink = open(ns.out, "a") if ns.out else None
    regs = open(ns.ptxas, "a") if ns.ptxas else None
    failed = 0

    def one(i):
        try:
            return _digest_in_child(i, ns.src_dir)
        except RuntimeError as e:  # reported, and the other specialisations go on
            return f"{specs[i][0]} {specs[i][1]!r}", None, str(e)

    with ThreadPoolExecutor(max_workers=ns.jobs) as pool:
        for key, sha, dt in pool.map(one, todo):
            if sha is None:
                failed += 1
                print(f"FAILED {key}: {dt[-1500:]}", flush=True)
                continue
            print(f"{key} -> {sha}  ({dt:.0f}s)", flush=True)
            if sink:
                sink.write(f"{key} -> {sha}\n")
                sink.flush()
            if regs:
                line = _ptxas_line(key, sha, ns.src_dir)
                print(line, flush=True)
                regs.write(line + "\n")
                regs.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
