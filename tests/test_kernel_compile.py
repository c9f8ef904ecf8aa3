"""CPU tests of the TileLang kernels' compilation (no GPU): every kernel lowers for
``settings.TARGET`` (sm_90a) with the shared settings, what is compiled has the aggressive
shared-memory merge off, and, where ``nvcc`` exists, the lowered CUDA compiles to a cubin.

Lowering costs 3-6 s per kernel on 2 cores, so only a handful of specialisations are built:
the 64-head forward (the reference shape), the 64-head backward main kernel in the default
ordered deterministic mode (``slot_partials=True``) and in the fixed-point mode, the 16-head
atomic backward (the other key block), the preprocess, the postprocess and the slot reduction.
Runs under tilelang-paddle 0.1.13 (CI) and mainline TileLang 0.1.15; skipped when TileLang is
not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from paddlefleet.tilelang_ops import settings

pytestmark = pytest.mark.skipif(
    settings.tilelang_flavour() is None or importlib.util.find_spec("tilelang") is None,
    reason="TileLang is not installed",
)

MERGE = "tl.enable_aggressive_shared_memory_merge"
SMEM_LIMIT = 232448  # bytes of dynamic shared memory per block on H100/H200
KERNEL_DIR = Path(__file__).resolve().parent.parent / "src/paddlefleet/tilelang_ops/attn/kernels"


def _kernels():
    from paddlefleet.tilelang_ops.attn.kernels import sparse_bwd, sparse_fwd

    return sparse_fwd, sparse_bwd


_CACHE = {}


def _lower(name, args, pass_configs=None):
    key = (name, args, None if pass_configs is None else tuple(sorted(pass_configs.items())))
    if key not in _CACHE:
        from paddlefleet.tilelang_ops.attn.kernels import lower

        fwd, bwd = _kernels()
        jit = {"fwd": fwd.sparse_fwd, "pre": bwd.preprocess, "main": bwd.main,
               "main_slots": bwd.main, "post": bwd.postprocess, "reduce": bwd.slot_reduce}[name]
        # "main_slots": the ordered deterministic mode (interface.TileLangKernels' default)
        kwargs = {"slot_partials": True} if name == "main_slots" else None
        _CACHE[key] = lower(jit, args, pass_configs, kwargs)
    return _CACHE[key]


def _smem(art):
    (f,) = [f for _, f in art.device_mod.functions.items()]
    attrs = f.attrs
    return int(attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in attrs else 0


def _layout(art):
    """``{shared buffer: byte offset}`` in the generated kernel."""
    pat = r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)"
    return dict((n, int(o)) for n, o in re.findall(pat, art.kernel_source))


SPECS = [
    ("fwd", (64, 576, 512)),
    ("main", (64, 576, 512, True, 32)),
    ("main_slots", (64, 576, 512, True, 32)),
    ("main", (16, 576, 512, False, 64)),
    ("pre", (512,)),
    ("post", (576,)),
    ("reduce", (576,)),
]


def test_settings_keep_the_merge_off():
    assert settings.PASS_CONFIGS == {MERGE: False}
    assert settings.TARGET == {"kind": "cuda", "arch": "sm_90a"}


def test_every_kernel_takes_the_shared_pass_configs():
    fwd, bwd = _kernels()
    jits = (fwd.sparse_fwd, bwd.preprocess, bwd.main, bwd.postprocess, bwd.slot_reduce)
    for jit in jits:
        assert jit.pass_configs is settings.PASS_CONFIGS
    # no kernel file carries its own copy of a pass config
    decorators = []
    for path in KERNEL_DIR.glob("*.py"):
        text = path.read_text()
        assert "PassConfigKey" not in text and "aggressive" not in text.lower(), path.name
        decorators += re.findall(r"@tilelang\.jit\(([^)]*)\)", text)
    assert len(decorators) == len(jits)
    assert all(d == "pass_configs=settings.PASS_CONFIGS" for d in decorators), decorators


@pytest.mark.parametrize("name, args", SPECS, ids=[f"{n}{a[:1]}" for n, a in SPECS])
def test_kernel_lowers_for_sm90a(name, args):
    art = _lower(name, args)
    src = art.kernel_source
    assert "__global__" in src
    assert _smem(art) <= SMEM_LIMIT
    if name in ("fwd", "main", "main_slots") and args[0] == 64:
        assert "wgmma" in src, "the 64-head kernels should use Hopper wgmma"
    if name == "main_slots":
        # plain stores of per-slot rows: no atomics at all (that is the point of the mode)
        assert "atomic" not in src.lower(), "slot_partials=True should not scatter atomically"
    elif name == "main":
        assert "atomic" in src.lower(), "the fixed-point/atomic dKV scatter is missing"


def test_compiled_kernel_has_the_merge_off():
    """The build with the shared settings differs from one with the merge forced on, and is the
    build TileLang makes from the kernel's own pass configs: flipping the setting in
    settings.py changes (and fails) this test."""
    args = (64, 576, 512, True, 32)
    default = _lower("main", args)
    explicit_off = _lower("main", args, settings.pass_configs(**{MERGE: False}))
    forced_on = _lower("main", args, settings.pass_configs(**{MERGE: True}))
    assert _layout(default) == _layout(explicit_off)
    assert _layout(default) != _layout(forced_on), (
        "the shared-memory layout does not depend on the merge setting: is it still applied?"
    )
    # With the merge off the Q tile, loaded before the key loop, has bytes nobody else uses
    # (the aliasing behind the NaN dQ/dKV of TileLang 0.1.9-0.1.10).
    lay = _layout(default)
    q0 = lay["Q_shared"]
    q1 = min([o for n, o in lay.items() if o > q0] + [_smem(default)])
    assert not [n for n, o in lay.items() if n != "Q_shared" and q0 <= o < q1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("name, args", SPECS[:3], ids=["fwd64", "main64_det", "main64_slots"])
def test_lowered_source_compiles_to_cubin(name, args, tmp_path):
    import tilelang

    tl_dir = Path(tilelang.__file__).resolve().parent
    cu = tmp_path / f"{name}.cu"
    cu.write_text(_lower(name, args).kernel_source)
    cmd = ["nvcc", "--cubin", "-O3", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v",
           f"-I{tl_dir / 'src'}", f"-I{tl_dir / '3rdparty/cutlass/include'}",
           "-o", str(tmp_path / f"{name}.cubin"), str(cu)]
    if os.path.exists("/usr/bin/g++"):
        cmd.insert(1, "-ccbin=/usr/bin/g++")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / f"{name}.cubin").stat().st_size > 0
    print(" ".join(l.strip() for l in res.stderr.splitlines() if "registers" in l or "spill" in l))
