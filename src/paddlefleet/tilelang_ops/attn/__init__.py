"""Sparse MQA-latent attention (DeepSeek-V3.2 DSA, absorbed MLA) with an attention sink.

One name stem, ``mqa_latent_sparse``, for the op family: kernels, reference and autograd op.

TileLang kernels (CUDA, Hopper sm_90a; Paddle or PyTorch tensors), module ``interface``:
    mqa_latent_sparse_fwd       forward: (out, lse)
    mqa_latent_sparse_bwd       backward: (dq, dkv, d_sink), deterministic by default

fp32/fp64 reference, any device (``reference``); the exact definition of the math:
    mqa_latent_sparse_fwd_ref   forward, the kernel's arguments
    mqa_latent_sparse_bwd_ref   backward, the kernel's arguments

The two LSE forms, any device (``lse``):
    lse_natural_to_log2_sink    natural sink-exclusive LSE -> base-2 sink-inclusive
    lse_log2_sink_to_natural    and back

Paddle training (``op``, ``config``, ``layer``, ``tp``):
    mqa_latent_sparse_attention autograd op (PyLayer); cu_seqlens: packed docs; deterministic
    MQALatentAttentionConfig    sizes of one attention block, validated when built
    get_preset, load_config     presets (deepseek_v32, deepseek_v32_small, deepseek_v4_*) or
                                a JSON file
    MQALatentAttention          tensor-parallel attention layer (paddle.nn.Layer)
    init_full_weights           the unsharded weights a layer built with a seed holds
    copy_to_tensor_parallel     identity forward, all-reduce backward
    reduce_from_tensor_parallel all-reduce forward, identity backward
    all_to_all                  all-to-all forward, the reverse one backward (sequence partition)
    gather_from_tensor_parallel all-gather forward, all-reduce + own slice backward

DeepSeek-V4 sparse attention, (Dk, Dv) = (512, 512) (``v4_config``, ``v4_layer``):
    DeepSeekV4AttentionConfig   sizes of one V4 block (presets deepseek_v4_flash, _small)
    DeepSeekV4Attention         tensor-parallel V4 block: window + compressed keys, compressor

Inputs and tests (``checks``, ``indices``):
    check_tensors, Dims         the shared tensor checks and the named sizes they return
    check_values                the value checks (index range, sink, lse): one device read
    causal_topk_indices         random causal top-k indices for tests and demos
    varlen_causal_topk_indices  the same per document of a packed row (cu_seqlens)
    cu_seqlens_from_lengths     document lengths -> int32 cu_seqlens boundaries
    window_compressed_indices   DeepSeek-V4 key sets: sliding window + compressed groups

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
    # the two LSE forms (any device)
    "lse_natural_to_log2_sink": "lse",
    "lse_log2_sink_to_natural": "lse",
    # input validation shared by every public entry point
    "check_tensors": "checks",
    "check_values": "checks",
    "Dims": "checks",
    # top-k indices for tests and demos (packed documents too)
    "causal_topk_indices": "indices",
    "varlen_causal_topk_indices": "indices",
    "cu_seqlens_from_lengths": "indices",
    "window_compressed_indices": "indices",
    # Paddle autograd op, model config and tensor-parallel layer
    "mqa_latent_sparse_attention": "op",
    "MQALatentAttentionConfig": "config",
    "get_preset": "config",
    "load_config": "config",
    "MQALatentAttention": "layer",
    "init_full_weights": "layer",
    "copy_to_tensor_parallel": "tp",
    "reduce_from_tensor_parallel": "tp",
    "all_to_all": "tp",
    "gather_from_tensor_parallel": "tp",
    # DeepSeek-V4 sparse attention
    "DeepSeekV4AttentionConfig": "v4_config",
    "DeepSeekV4Attention": "v4_layer",
}

__all__ = sorted(_EXPORTS)


class _LazyModule(types.ModuleType):
    """This package's module type: a public name is imported from its sub-module on first
    access.  Being methods of the module's class (not functions in its namespace), the hooks do
    not show up in ``help()``; ``dir()`` and ``__all__`` list every public name."""

    def __getattr__(self, name):
        try:
            module = _EXPORTS[name]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None
        value = getattr(import_module(f".{module}", self.__name__), name)
        setattr(self, name, value)
        return value

    def __dir__(self):
        # The public names (loaded or not), the sub-modules loaded so far and the module's own
        # dunders; not the helpers this file imports (sys, types, import_module).
        own = vars(self)
        loaded = [n for n, v in own.items() if isinstance(v, types.ModuleType)
                  and getattr(v, "__name__", "").startswith(self.__name__ + ".")]
        dunders = [n for n in own if n.startswith("__") and n.endswith("__")]
        if sys._getframe(1).f_globals.get("__name__") == "inspect":
            # help() (pydoc, through inspect.getmembers) reads every name dir() lists: the
            # names not loaded yet would import Paddle and add ~1,900 lines of inherited
            # docs; the package docstring is help()'s index of them instead.
            return sorted({*(n for n in own if n in _EXPORTS), *loaded, *dunders})
        return sorted({*__all__, *loaded, *dunders})


sys.modules[__name__].__class__ = _LazyModule
