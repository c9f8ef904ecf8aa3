"""Sparse MQA-latent attention (DeepSeek-V3.2 DSA, absorbed MLA) with an attention sink.

TileLang kernels (CUDA, Hopper sm_90a; Paddle or PyTorch tensors), module ``interface``:
    mqa_latent_sparse_fwd       forward: (out, lse)
    mqa_latent_sparse_bwd       backward: (dq, dkv, d_sink), deterministic by default

fp32/fp64 reference, any device (``reference``); the exact definition of the math:
    mqa_latent_sparse_fwd_ref   forward, the kernel's arguments (also ``sparse_mqa_fwd_ref``)
    mqa_latent_sparse_bwd_ref   backward, the kernel's arguments
    sparse_mqa_bwd_ref          deprecated: the backward in its old argument order
    lse_natural_to_log2_sink    natural sink-exclusive LSE -> base-2 sink-inclusive
    lse_log2_sink_to_natural    and back

Paddle training (``op``, ``config``, ``layer``, ``tp``):
    sparse_mqa_attention        autograd op (paddle.autograd.PyLayer), cu_seqlens: packed docs
    MLAAttentionConfig          sizes of one attention block, validated when built
    get_preset, load_config     presets (deepseek_v32, deepseek_v32_small) or a JSON file
    MQALatentAttention          tensor-parallel attention layer (paddle.nn.Layer)
    init_full_weights           the unsharded weights a layer built with a seed holds
    copy_to_tensor_parallel     identity forward, all-reduce backward
    reduce_from_tensor_parallel all-reduce forward, identity backward
    all_to_all                  all-to-all forward, the reverse one backward (sequence partition)
    gather_from_tensor_parallel all-gather forward, all-reduce + own slice backward

Inputs and tests (``checks``, ``indices``):
    validate_inputs, Dims       the shared input checks and the named sizes they return
    causal_topk_indices         random causal top-k indices for tests and demos
    varlen_causal_topk_indices  the same per document of a packed row (cu_seqlens)
    cu_seqlens_from_lengths     document lengths -> int32 cu_seqlens boundaries

Every name is loaded on first use, so importing this package pulls in neither Paddle, PyTorch
nor TileLang; ``help(name)`` documents each one (shapes, dtypes, errors).  The math is
docs/conventions.md; the layer and op are docs/layer.md.
"""

import sys
import types
from importlib import import_module

_EXPORTS = {
    # TileLang kernels behind host wrappers (CUDA; Paddle or PyTorch tensors)
    "mqa_latent_sparse_fwd": "interface",
    "mqa_latent_sparse_bwd": "interface",
    # fp32/fp64 reference (any device)
    "mqa_latent_sparse_fwd_ref": "reference",
    "mqa_latent_sparse_bwd_ref": "reference",
    "sparse_mqa_fwd_ref": "reference",
    "sparse_mqa_bwd_ref": "reference",
    "lse_natural_to_log2_sink": "reference",
    "lse_log2_sink_to_natural": "reference",
    # input validation shared by every public entry point
    "validate_inputs": "checks",
    "Dims": "checks",
    # top-k indices for tests and demos (packed documents too)
    "causal_topk_indices": "indices",
    "varlen_causal_topk_indices": "indices",
    "cu_seqlens_from_lengths": "indices",
    # Paddle autograd op, model config and tensor-parallel layer
    "sparse_mqa_attention": "op",
    "MLAAttentionConfig": "config",
    "get_preset": "config",
    "load_config": "config",
    "MQALatentAttention": "layer",
    "init_full_weights": "layer",
    "copy_to_tensor_parallel": "tp",
    "reduce_from_tensor_parallel": "tp",
    "all_to_all": "tp",
    "gather_from_tensor_parallel": "tp",
}

__all__ = sorted(_EXPORTS)


class _LazyModule(types.ModuleType):
    """This package's module type: a public name is imported from its sub-module on first
    access.  Being methods of the module's class (not functions in its namespace), the hooks do
    not show up in ``help()``; ``dir()`` lists what is loaded, ``__all__`` every public name."""

    def __getattr__(self, name):
        try:
            module = _EXPORTS[name]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None
        value = getattr(import_module(f".{module}", self.__name__), name)
        setattr(self, name, value)
        return value


sys.modules[__name__].__class__ = _LazyModule
