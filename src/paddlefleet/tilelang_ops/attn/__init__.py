"""Sparse MQA-latent attention (DeepSeek-V3.2 DSA, absorbed MLA) with an attention sink.

Public names are loaded lazily so that importing this package pulls in neither Paddle, PyTorch
nor TileLang until a function that needs them is used.  The math of every function here is in
docs/conventions.md; the exact definition is ``attn/reference.py``.
"""

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
    # top-k indices for tests and demos
    "causal_topk_indices": "indices",
    # Paddle autograd op, model config and tensor-parallel layer
    "sparse_mqa_attention": "op",
    "MLAAttentionConfig": "config",
    "get_preset": "config",
    "load_config": "config",
    "MQALatentAttention": "layer",
    "init_full_weights": "layer",
    "copy_to_tensor_parallel": "tp",
    "reduce_from_tensor_parallel": "tp",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
