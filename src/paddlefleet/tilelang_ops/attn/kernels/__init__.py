"""TileLang kernels of sparse MQA-latent attention (no framework import), and their registry.

Every kernel is built for each (Dk, Dv) of :data:`D_PAIRS` from one source: the rope tail
(``Dk - Dv`` columns of the query and key only) is a static choice, and at ``Dk = Dv`` no tail
buffer, copy, GEMM or dKV chunk is built (the value is the whole gathered row).

One kernel per file, in launch order:

* ``value_stats.value_stats``: the wrappers' value checks (index range, NaN/+inf sinks, NaN
  lse) in one launch;
* ``sparse_fwd.sparse_fwd``: the forward (online softmax over top-k key blocks, sink folded in;
  the 64-head tile warp-specialised);
* the backward: ``bwd_preprocess.preprocess`` (Delta, the base-2 lse and the rows' ``d_sink``
  terms; the atomic backward of 64-head tiles has it fused into its main kernel's prologue,
  ``main_args(..., fused=True)``, and the deterministic backward has it in
  ``exact_grid.grid_rows``) -> the main kernel, dQ and dKV, which the registry picks per head
  tile: ``bwd_two_warpgroups.main`` for the 64-head first pass, ``bwd_main.main`` for the 16-
  and 32-head tiles and every re-run without dQ (``deterministic=True``: then once more with
  ``with_dq=False`` for the keys whose exactness bound failed) -> ``bwd_finish.finish`` (the
  fp32 dKV accumulator to bf16: the 64-head tiles' column order undone, the deterministic
  mode's grids applied);
* around the exact dKV passes (``deterministic=True``), ``exact_grid``: the preprocess with the
  first pass's per-key grids (``grid_rows`` -> ``grid_scatter`` -> ``grid_keys``) and, after
  it, which keys re-run (``rerun_plan``, with a flag per batch that has any) and their slots
  (``rerun_slots``, which skips the unflagged batches).

Shared pieces: ``schedule`` (each kernel's schedule record and why), ``exact_bounds`` (the
deterministic mode's rounding and bound), ``async_copy`` (TMA and ``cp.async`` copies),
``row_blocks`` (how many key blocks a row walks), ``ptx`` (inline PTX).

:func:`build` maps a kernel name and its static arguments to the compiled kernel and
:func:`specs` lists every specialisation the host wrappers launch: the provider in
``attn/kernel_provider.py`` (which keys each kernel by its tensors' last dimensions, so the
(Dk, Dv) pair of the inputs picks the specialisation), ``tools/precompile.py`` and the compile
tests all use these two, with the
static arguments from :func:`main_args`, :func:`pre_args`, :func:`grid_rows_args` and
:func:`finish_args`.  Every kernel compiles with ``settings.PASS_CONFIGS``.  :func:`lower`
lowers one specialisation for ``settings.TARGET`` without a GPU (tests, tools), and
:func:`named` gives a specialisation's arguments by name.
"""

from .schedule import TwoWarpgroupSchedule, bwd_schedule, two_warpgroup_schedule

#: Head tiles ``tiling.head_plan`` can give.
HEAD_TILES = (16, 32, 64)
#: The (Dk, Dv) pairs the kernels are built for (the one definition; ``tiling.kernel_dims``
#: reads it): DeepSeek-V3.2's latent row with its 64-column rope tail, and DeepSeek-V4's, whose
#: value is the whole row (no tail: every kernel builds the tail's buffers and steps only where
#: ``Dk > Dv``, a static choice).  ``D_QK, D_V``: the first pair, the ``*_args`` defaults.
D_PAIRS = ((576, 512), (512, 512))
D_QK, D_V = D_PAIRS[0]

#: Head tiles whose first backward pass (with dQ) is the two-warpgroup kernel
#: (``bwd_two_warpgroups``); it can also do the preprocess's work in its prologue (``fused``),
#: which the atomic backward uses: the providers' ``fused_preprocess_tiles``.
TWO_WARPGROUP_TILES = (64,)
FUSED_TILES = TWO_WARPGROUP_TILES


def builders() -> dict:
    """``{name: TileLang jit function}`` of every kernel.  ``bwd_main`` names the one-role main
    backward; :func:`build` and :func:`lower` send the two-warpgroup specialisations that
    :func:`main_args` gives under that name to ``bwd_main_two_wg``."""
    from . import (bwd_finish, bwd_main, bwd_preprocess, bwd_two_warpgroups, exact_grid,
                   sparse_fwd, value_stats)

    return {"value_stats": value_stats.value_stats, "fwd": sparse_fwd.sparse_fwd,
            "bwd_pre": bwd_preprocess.preprocess, "bwd_main": bwd_main.main,
            "bwd_main_two_wg": bwd_two_warpgroups.main, "bwd_finish": bwd_finish.finish,
            "grid_rows": exact_grid.grid_rows, "grid_scatter": exact_grid.grid_scatter,
            "grid_keys": exact_grid.grid_keys, "rerun_plan": exact_grid.rerun_plan,
            "rerun_slots": exact_grid.rerun_slots}


def main_args(heads_per_cta: int, deterministic: bool, with_dq: bool, d_qk: int = D_QK,
              d_v: int = D_V, fused: bool = False, natural: bool = True) -> tuple:
    """Static arguments of the main backward (``bwd_main``) for one head tile:
    ``(heads_per_cta, d_qk, d_v, deterministic, with_dq, schedule)``, the schedule record
    choosing the kernel (``schedule.bwd_schedule`` / ``schedule.two_warpgroup_schedule``), then
    for the two-warpgroup kernel ``(fused, natural)``: ``fused`` (the preprocess in its
    prologue; ``natural``: the lse format it reads) only for :data:`FUSED_TILES`."""
    head = (heads_per_cta, d_qk, d_v, bool(deterministic), bool(with_dq))
    if heads_per_cta in TWO_WARPGROUP_TILES and with_dq:
        # natural matters only where fused: one key per kernel
        return head + (two_warpgroup_schedule(deterministic), bool(fused),
                       bool(natural) or not fused)
    if fused:
        raise ValueError(f"fused: the preprocess is fused only into the first pass of the "
                         f"{TWO_WARPGROUP_TILES}-head tiles, got heads_per_cta={heads_per_cta}, "
                         f"with_dq={with_dq}")
    return head + (bwd_schedule(heads_per_cta),)


def pre_args(natural: bool, d_v: int = D_V) -> tuple:
    """Static arguments of ``bwd_preprocess.preprocess`` (the atomic backward's, where not
    fused)."""
    return (d_v, bool(natural))


def grid_rows_args(natural: bool, d_qk: int = D_QK, d_v: int = D_V) -> tuple:
    """Static arguments of ``exact_grid.grid_rows`` (the deterministic backward's preprocess)."""
    return (d_qk, d_v, bool(natural))


def finish_args(heads_per_cta: int, deterministic: bool, d_qk: int = D_QK) -> tuple:
    """Static arguments of ``bwd_finish.finish`` for the accumulator of one head tile."""
    from ..tiling import dkv_columns_permuted

    return (d_qk, dkv_columns_permuted(heads_per_cta), bool(deterministic))


def specs(heads=HEAD_TILES, pairs=D_PAIRS) -> list:
    """``(name, args)`` of every specialisation the wrappers launch, for the head tiles and
    (Dk, Dv) pairs given, pair by pair in the order given (a specialisation two pairs share,
    such as the value checks or the preprocess at one Dv, listed once, with the first).  The
    exact dKV's bookkeeping kernels do not depend on the head tile: always listed.  The atomic
    first pass of :data:`FUSED_TILES` is listed fused only (per lse format): that is the one
    the wrappers launch."""
    out = []
    for d_qk, d_v in pairs:
        for spec in _pair_specs(heads, d_qk, d_v):
            if spec not in out:
                out.append(spec)
    return out


def _pair_specs(heads, d_qk: int, d_v: int) -> list:
    """:func:`specs` for one (Dk, Dv) pair."""
    out = [("value_stats", (True, False)), ("value_stats", (False, False)),
           ("value_stats", (True, True)), ("value_stats", (False, True)),
           # the preprocess per lse format: atomic (where not fused), deterministic (grid_rows)
           *[("bwd_pre", pre_args(natural, d_v)) for natural in (True, False)],
           *[("grid_rows", grid_rows_args(natural, d_qk, d_v)) for natural in (True, False)],
           ("grid_scatter", ()), ("grid_keys", ()),
           ("rerun_plan", (d_qk,)), ("rerun_slots", ())]
    for m in heads:
        out.append(("fwd", (m, d_qk, d_v)))
        out.append(("bwd_main", main_args(m, True, True, d_qk, d_v)))
        out.append(("bwd_main", main_args(m, True, False, d_qk, d_v)))
        if m in FUSED_TILES:  # the atomic first pass with the preprocess fused, per lse format
            for natural in (True, False):
                out.append(("bwd_main", main_args(m, False, True, d_qk, d_v, fused=True,
                                                  natural=natural)))
        else:
            out.append(("bwd_main", main_args(m, False, True, d_qk, d_v)))
        for deterministic in (True, False):
            if ("bwd_finish", finish_args(m, deterministic, d_qk)) not in out:
                out.append(("bwd_finish", finish_args(m, deterministic, d_qk)))
    return out


def _jit(name: str, args: tuple):
    """The jit function of ``name(*args)``: the main backward's two kernels share the name
    ``bwd_main``; its arguments' schedule record tells them apart (:func:`main_args`)."""
    jits = builders()
    if name == "bwd_main" and any(isinstance(a, TwoWarpgroupSchedule) for a in args):
        return jits["bwd_main_two_wg"]
    return jits[name]


def named(name: str, args: tuple) -> dict:
    """``{parameter: value}`` of ``name(*args)``, the builder's defaults filled in (tests and
    tools read a specialisation's arguments by name, never by position)."""
    sig = _jit(name, args).signature
    bound = sig.bind(*args)
    bound.apply_defaults()
    return dict(bound.arguments)


def build(name: str, args: tuple):
    """The compiled kernel ``name(*args)`` (TileLang caches it in ``TILELANG_CACHE_DIR``)."""
    return _jit(name, args)(*args)


def lower(name: str, args: tuple, pass_configs=None):
    """Lower ``name(*args)`` for ``settings.TARGET`` (sm_90a) on any machine.

    ``pass_configs`` defaults to the kernel's own (``settings.PASS_CONFIGS``); tests pass
    ``settings.pass_configs(...)`` overrides to show what a setting changes.

    Returns:
        TileLang's lowering artifact (``.kernel_source`` CUDA C++, ``.device_mod``).
    """
    from ... import settings

    tilelang = settings.import_tilelang()
    from tilelang import tvm

    jit_kernel = _jit(name, args)
    cfg = jit_kernel.pass_configs if pass_configs is None else pass_configs
    with tvm.transform.PassContext(opt_level=3, config=cfg), tvm.target.Target(settings.TARGET):
        tir = jit_kernel.get_tir(*args)
        return tilelang.lower(tir, target=settings.TARGET)
