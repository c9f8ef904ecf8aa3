"""One compile baseline for every TileLang kernel in this package.

Every ``@tilelang.jit`` in ``paddlefleet.tilelang_ops`` takes its ``pass_configs`` from
:data:`PASS_CONFIGS` and nothing else; no kernel file carries its own copy (tests enforce this).

Why each setting:
    TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE = False
        In TileLang 0.1.9-0.1.10 the aggressive merge shortened the lifetime of the Q tile
        loaded before the key loop and placed another live buffer on top of it, producing NaN
        dQ/dKV on the first backward (reported by PaddleFleet users;
        fixed upstream in 0.1.11, but the pass stays off here).  Turning it
        off costs ~2 % (15.6 -> 15.9 ms on the upstream example, H200).

The lowering target is Hopper: :data:`TARGET` names ``sm_90a`` explicitly because a plain
``"cuda"`` target silently means sm_50 when no GPU is visible (CI), and the wgmma / setmaxnreg
instructions need the ``a`` variant.
"""

from __future__ import annotations

import importlib.metadata

#: Hopper (H100/H200) with the architecture-specific feature set.
TARGET = {"kind": "cuda", "arch": "sm_90a"}

_MERGE_KEY = "tl.enable_aggressive_shared_memory_merge"


def _pass_configs() -> dict:
    return {_MERGE_KEY: False}


#: The pass configs every kernel compiles with.  Keys are TileLang's string names so that this
#: module can be imported without TileLang installed.
PASS_CONFIGS: dict = _pass_configs()


def pass_configs(**overrides) -> dict:
    """A copy of :data:`PASS_CONFIGS`, optionally with overrides (tests use this to prove the
    merge setting changes what is compiled; kernels never pass overrides)."""
    cfg = dict(PASS_CONFIGS)
    cfg.update(overrides)
    return cfg


def tilelang_flavour() -> str | None:
    """Which TileLang build is installed: ``"paddle"`` (tilelang-paddle), ``"mainline"``
    (tilelang, PyTorch), or ``None``."""
    for dist, name in (("tilelang-paddle", "paddle"), ("tilelang", "mainline")):
        try:
            importlib.metadata.version(dist)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


_tilelang = None


def import_tilelang():
    """Import TileLang the way the installed build needs.

    tilelang-paddle still does ``import torch`` internally and reaches Paddle tensors through
    Paddle's torch proxy, which must be enabled (scoped to ``tilelang``) before the import.
    ``TILELANG_CACHE_DIR`` is honoured by TileLang itself; set it in CI and tests.

    Raises:
        ImportError: when no TileLang build is installed.
    """
    global _tilelang
    if _tilelang is not None:
        return _tilelang
    flavour = tilelang_flavour()
    if flavour is None:
        raise ImportError(
            "TileLang is not installed: install tilelang-paddle (Paddle) or tilelang (PyTorch); "
            "see README.md"
        )
    if flavour == "paddle":
        import paddle

        paddle.compat.enable_torch_proxy(scope={"tilelang"})
    import tilelang

    _tilelang = tilelang
    return tilelang

