"""TileLang kernels of sparse MQA-latent attention (no framework import), and their registry.

* ``sparse_fwd.sparse_fwd``: the forward (online softmax over top-k key blocks, sink folded in);
* ``value_stats.value_stats``: the wrappers' value checks (index range, NaN/+inf sinks, NaN
  lse) in one launch;
* the backward, in launch order: ``sparse_bwd.preprocess`` (Delta, the base-2 lse and the rows'
  ``d_sink`` terms; the atomic backward of 64-head tiles has it fused into ``main``'s prologue
  instead, ``main_args(..., fused=True)``, and the deterministic backward has it in
  ``exact_grid.grid_rows``) -> ``sparse_bwd.main``
  (dQ and dKV; ``mode="exact"`` for the deterministic backward, then once more with
  ``with_dq=False`` for the keys whose exactness bound failed; ``mode="atomic"`` otherwise)
  -> ``sparse_bwd.finish`` (the fp32 dKV accumulator to bf16: the 64-head tiles' column order
  undone, the exact mode's grids applied).
* around the exact dKV passes (``deterministic=True``), ``exact_grid``: the preprocess with the
  first pass's per-key grids (``grid_rows`` -> ``grid_scatter`` -> ``grid_keys``) and, after
  it, which keys
  re-run (``rerun_plan``, with a flag per batch that has any) and their slots (``rerun_slots``,
  which skips the unflagged batches): small kernels in place of ~40 framework ops.
* ``async_copy``: the 16-byte ``cp.async`` macros: the query tile (both warp-specialised
  kernels) and the key-block gather (the forward's producer).

:func:`build` maps a kernel name and its static arguments to the compiled kernel and
:func:`specs` lists every specialisation the host wrappers can ask for: the provider in
``attn/interface.py``, ``tools/precompile.py`` and the compile tests all use these two.  Every
kernel compiles with ``settings.PASS_CONFIGS``.  :func:`lower` lowers one specialisation for
``settings.TARGET`` without a GPU (tests, tools).
"""

#: Head tiles ``tiling.head_plan`` can give, and the (Dk, Dv) the kernels are built for.
HEAD_TILES = (16, 32, 64)
D_QK, D_V = 576, 512


def builders() -> dict:
    """``{name: TileLang jit function}`` of every kernel."""
    from . import exact_grid, sparse_bwd, sparse_fwd, value_stats

    return {"value_stats": value_stats.value_stats, "fwd": sparse_fwd.sparse_fwd,
            "bwd_pre": sparse_bwd.preprocess,
            "bwd_main": sparse_bwd.main, "bwd_finish": sparse_bwd.finish,
            "grid_rows": exact_grid.grid_rows, "grid_scatter": exact_grid.grid_scatter,
            "grid_keys": exact_grid.grid_keys, "rerun_plan": exact_grid.rerun_plan,
            "rerun_slots": exact_grid.rerun_slots}


#: ``sparse_bwd.main``'s schedule knobs between the key block and ``fused`` (threads ...
#: w1_right, row_extent, row_lanes, pred_red, tma_tiles, timeline), all at the kernel's defaults
#: (``None``, ``row_extent=True``)
MAIN_KNOB_DEFAULTS = (None, None, None, None, None, None, None, None, True, None, None, None,
                      None)
#: Head tiles whose atomic first pass can do the preprocess's work in its prologue
#: (``sparse_bwd._two_warpgroups``, ``fused``): the providers' ``fused_preprocess_tiles``.
FUSED_TILES = (64,)


def main_args(heads_per_cta: int, mode: str, with_dq: bool, d_qk: int = D_QK, d_v: int = D_V,
              fused: bool = False, natural: bool = True, knobs: tuple = ()):
    """Static arguments of ``sparse_bwd.main`` for one head tile (the key block follows it),
    then ``knobs``, the first schedule knobs (trials; none: the kernel's defaults).
    ``fused`` (the 64-head first pass with the preprocess in its prologue; ``natural``: the lse
    format it reads) only when set, after the remaining knobs at their defaults, so that the
    unfused kernels are built from the same arguments as before it existed."""
    from ..tiling import bwd_key_block

    args = (heads_per_cta, d_qk, d_v, mode, with_dq, bwd_key_block(heads_per_cta)) + tuple(knobs)
    if not fused:
        return args
    return args + MAIN_KNOB_DEFAULTS[len(knobs):] + (True, bool(natural))


def pre_args(natural: bool, d_v: int = D_V):
    """Static arguments of ``sparse_bwd.preprocess`` (the atomic backward's, where not fused)."""
    return (d_v, bool(natural))


def grid_rows_args(natural: bool, d_qk: int = D_QK, d_v: int = D_V):
    """Static arguments of ``exact_grid.grid_rows`` (the deterministic backward's preprocess)."""
    return (d_qk, d_v, bool(natural))


def finish_args(heads_per_cta: int, scaled: bool, d_qk: int = D_QK):
    """Static arguments of ``sparse_bwd.finish`` for the accumulator of one head tile."""
    from ..tiling import dkv_columns_permuted

    return (d_qk, dkv_columns_permuted(heads_per_cta), bool(scaled))


def specs(heads=HEAD_TILES) -> list:
    """``(name, args)`` of every specialisation the wrappers launch, for the head tiles given
    (the exact dKV's bookkeeping kernels do not depend on the head tile: always listed)."""
    out = [("value_stats", (True, False)), ("value_stats", (False, False)),
           ("value_stats", (True, True)), ("value_stats", (False, True)),
           # the preprocess per lse format: atomic (where not fused), deterministic (grid_rows)
           *[("bwd_pre", pre_args(natural)) for natural in (True, False)],
           *[("grid_rows", grid_rows_args(natural)) for natural in (True, False)],
           ("grid_scatter", ()), ("grid_keys", ()),
           ("rerun_plan", (D_QK,)), ("rerun_slots", ())]
    for m in heads:
        out.append(("fwd", (m, D_QK, D_V)))
        for mode, with_dq in (("exact", True), ("exact", False), ("atomic", True)):
            out.append(("bwd_main", main_args(m, mode, with_dq)))
        if m in FUSED_TILES:  # the atomic first pass with the preprocess fused, per lse format
            for natural in (True, False):
                out.append(("bwd_main", main_args(m, "atomic", True, fused=True, natural=natural)))
        for scaled in (True, False):
            if ("bwd_finish", finish_args(m, scaled)) not in out:
                out.append(("bwd_finish", finish_args(m, scaled)))
    return out


def build(name: str, args: tuple):
    """The compiled kernel ``name(*args)`` (TileLang caches it in ``TILELANG_CACHE_DIR``)."""
    return builders()[name](*args)


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

    jit_kernel = builders()[name]
    cfg = jit_kernel.pass_configs if pass_configs is None else pass_configs
    with tvm.transform.PassContext(opt_level=3, config=cfg), tvm.target.Target(settings.TARGET):
        tir = jit_kernel.get_tir(*args)
        return tilelang.lower(tir, target=settings.TARGET)
