"""TileLang kernels of sparse MQA-latent attention (no framework import; one variant per file):

* ``sparse_fwd.sparse_fwd``: the forward (online softmax over top-k key blocks, sink folded in);
* the backward, in launch order: ``sparse_bwd.preprocess`` (Delta) -> ``sparse_bwd.main``
  (dQ and dKV) -> ``sparse_bwd.slot_reduce`` (ordered deterministic mode, the default:
  ``main(..., slot_partials=True)`` writes per-slot dKV rows and this adds them per key in a
  fixed order) or ``sparse_bwd.postprocess`` (fixed-point mode: int64 -> bf16 dKV); the atomic
  mode (``deterministic=False``) needs neither.

Host wrappers: ``attn/interface.py``.  Every kernel compiles with ``settings.PASS_CONFIGS``.
:func:`lower` lowers one specialisation for ``settings.TARGET`` without a GPU (tests, tools).
"""


def lower(jit_kernel, args, pass_configs=None, kwargs=None):
    """Lower ``jit_kernel(*args, **kwargs)`` for ``settings.TARGET`` (sm_90a) on any machine.

    ``pass_configs`` defaults to the kernel's own (``settings.PASS_CONFIGS``); tests pass
    ``settings.pass_configs(...)`` overrides to show what a setting changes.

    Returns:
        TileLang's lowering artifact (``.kernel_source`` CUDA C++, ``.device_mod``).
    """
    from ... import settings

    tilelang = settings.import_tilelang()
    from tilelang import tvm

    cfg = jit_kernel.pass_configs if pass_configs is None else pass_configs
    with tvm.transform.PassContext(opt_level=3, config=cfg), tvm.target.Target(settings.TARGET):
        tir = jit_kernel.get_tir(*args, **(kwargs or {}))
        return tilelang.lower(tir, target=settings.TARGET)
