"""An :class:`~.config.MQALatentAttentionConfig` from a PaddleFleet model config.

PaddleFleet (github.com/PaddlePaddle/PaddleFleet) describes a model with one
``TransformerConfig`` dataclass (``src/paddlefleet/transformer/transformer_config.py``, fields of
``ModelParallelConfig`` included).  :func:`from_fleet_config` reads the fields that describe its
absorbed-MQA sparse attention layer (``transformer/mqa_latent_attention.py``, the ``-2`` layers
of a DeepSeek model) with ``getattr``, so any object carrying those attribute names works: the
real config, a dataclass, a ``types.SimpleNamespace``; a mapping (a ``dict`` of the same names,
e.g. a parsed config file) is read by key.  The mapping (also docs/layer.md):

======================================================  ==========================================
PaddleFleet field                                       ``MQALatentAttentionConfig`` field
======================================================  ==========================================
``hidden_size``                                         ``hidden_size``
``num_attention_heads``, ``q_lora_rank``,               the same names; each ``hybrid_mla_<name>``,
``kv_lora_rank``, ``qk_nope_head_dim``,                 when set (not ``None``), wins, as in
``qk_rope_head_dim``, ``v_head_dim``                    the DeepSeek-V4 hybrid's ``-2`` layers
``dsa_index_topk``                                      ``index_topk``
``softmax_scale``; else ``rotary_scaling_factor``,      ``softmax_scale`` (rule below)
``mscale_all_dim``, the head dims
``add_full_attention_sink_bias``, ``softmax_type``      ``use_attn_sink``
``mqa_sparse_attn_backward_backend``                    ``backward_backend``
``tensor_model_parallel_size``                          ``tensor_parallel_degree``
``rope_theta`` (or ``rotary_base``)                     ``rope_theta``
``rms_norm_eps``                                        ``rms_norm_eps``
``init_method_std``                                     ``initializer_range``
======================================================  ==========================================

Rules, each PaddleFleet's own:

* ``v_head_dim`` ``None`` means ``head_dim``, and ``head_dim`` ``None`` means
  ``hidden_size // num_attention_heads`` (``TransformerConfig.__post_init__``).
* Softmax scale: an explicit ``softmax_scale`` is used as given.  Otherwise the scale is the one
  PaddleFleet's ``MLASelfAttention`` hands its core attention: ``mscale**2 / sqrt(qk_nope_head_dim
  + qk_rope_head_dim)``, the MHA head width (``k_channels``, not the 576-wide latent), with the
  YaRN factor ``mscale = 0.1 * mscale_all_dim * ln(rotary_scaling_factor) + 1`` when
  ``rotary_scaling_factor > 1``, else 1.  With ``mscale == 1`` (PaddleFleet's defaults:
  ``mscale_all_dim = 0``) the field stays ``None``, whose meaning is the same
  ``(nope + rope) ** -0.5``.  PaddleFleet's MLA layer itself does not read ``softmax_scale``
  (its dense attention does): leave it ``None`` for the MLA scale.
* Sink: ``add_full_attention_sink_bias=True`` promotes ``softmax_type`` to ``"learnable"`` (the
  MLA layers are full-attention layers); ``"learnable"`` -> a learned per-head sink
  (PaddleFleet's ``core_attention.softmax_offset``; ours is ``attn_sink``), ``"vanilla"`` -> none,
  ``"off-by-one"`` (a fixed zero sink that is not learned) -> ``ValueError``: the layer's sink is
  always a parameter.
* Backward: ``"tilelang"`` -> ``"tilelang"`` (the deterministic TileLang backward, which is what
  PaddleFleet's ``"tilelang"`` calls).  ``"cudnn"``, PaddleFleet's default, is cuDNN's atomic
  (not run-to-run reproducible) backward, which this package does not have: ``ValueError`` saying
  to set ``mqa_sparse_attn_backward_backend="tilelang"`` (the one line to change) or to pass
  ``backward_backend=`` (e.g. ``"reference"`` on CPU).  Silently running another kernel than the
  one configured would hide the switch.
* ``rotary_base`` is PaddleFleet's former name of ``rope_theta``: used when ``rope_theta`` is
  absent; both set and different is a ``ValueError``, as in PaddleFleet.

Not read (no counterpart in this layer): ``rope_type``/YaRN frequency scaling (the layer's RoPE is
plain rotate-half, docs/layer.md), ``rotary_interleaved``, ``init_method`` and
``output_layer_init_method`` (every weight is drawn with ``initializer_range``), ``params_dtype``
(parameters are Paddle's default dtype), ``csa_sparse_attn_backend`` (it picks the kernels of the
CSA/HCA layers, another layer kind), ``qk_pos_emb_head_dim`` (the DeepSeek-V4 CSA layers' rope
width), ``sequence_parallel`` and ``context_parallel_size``.  ``attention_partition`` has no
PaddleFleet field: pass it as an override.

A field that is absent falls back to the ``MQALatentAttentionConfig`` default (the sizes have
none: a missing size is a ``ValueError`` naming the PaddleFleet field).  ``overrides`` use this
package's field names and win over the mapped values; an overridden field is not read from the
PaddleFleet config at all.
"""

from __future__ import annotations

import math
import numbers
import re
import types
from collections.abc import Mapping
from typing import Any

from .adapter import type_name
from .config import (
    _SIZE_EXPECTED,
    _as_choice,
    _as_float,
    _as_positive_float,
    _as_size,
    _is_bool,
    _short_repr,
)

__all__ = ["from_fleet_config", "FLEET_FIELDS"]

#: ``MQALatentAttentionConfig`` field -> the PaddleFleet field it is read from (the sizes may be
#: replaced by ``hybrid_mla_<name>``; the scale has its rule, see the module docstring).
FLEET_FIELDS = {
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "index_topk": "dsa_index_topk",
    "softmax_scale": "softmax_scale",
    "use_attn_sink": "add_full_attention_sink_bias / softmax_type",
    "backward_backend": "mqa_sparse_attn_backward_backend",
    "tensor_parallel_degree": "tensor_model_parallel_size",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
    "initializer_range": "init_method_std",
}
# Sizes the DeepSeek-V4 hybrid model gives per MLA layer as hybrid_mla_<name>.
_HYBRID_SIZES = ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim")
_SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
_BACKWARD_BACKENDS = {"tilelang": "tilelang"}
_MISSING = object()


def _get(config, name: str):
    """``config.name``, or ``_MISSING`` when absent or ``None`` (PaddleFleet's "unset")."""
    value = getattr(config, name, None)
    return _MISSING if value is None else value


def _as_config_object(config):
    """``config`` as an object read with ``getattr``: a mapping becomes a namespace of its
    string keys; a value that cannot be a config is a ``TypeError`` (its sizes would otherwise
    be reported "missing", which hides the real mistake)."""
    if isinstance(config, Mapping):
        return types.SimpleNamespace(**{k: v for k, v in config.items() if isinstance(k, str)})
    if config is None or isinstance(config, (str, bytes, numbers.Number, list, tuple, set)):
        raise TypeError(
            f"from_fleet_config: config: expected a PaddleFleet TransformerConfig (an object "
            f"with its field names as attributes, or a mapping of them), got "
            f"{type_name(config)}"
        )
    return config


def _refuse(field: str, expected: str, value):
    raise ValueError(f"PaddleFleet config field {field} must be {expected}, got "
                     f"{_short_repr(value)}")


# The rules are the config's own (config._as_size, _as_positive_float, _as_choice), checked here
# already so that the message names the PaddleFleet field.
def _positive_int(value, field: str) -> int:
    as_int = _as_size(value)
    if as_int is None:
        _refuse(field, _SIZE_EXPECTED, value)
    return as_int


def _positive_float(value, field: str) -> float:
    as_float = _as_positive_float(value)
    if as_float is None:
        _refuse(field, "a finite number > 0", value)
    return as_float


def _optional(field: str, check):
    """A reader of an optional PaddleFleet field: ``_MISSING`` when unset, else checked."""
    def read(config):
        value = _get(config, field)
        return _MISSING if value is _MISSING else check(value, field)
    return read


def _choice(value, field: str, choices) -> str:
    stored = _as_choice(value, tuple(choices))
    if stored is None:
        _refuse(field, f"one of {tuple(choices)}", value)
    return stored


def _size(config, name: str) -> tuple[int, str]:
    """``(value, the PaddleFleet field it came from)`` for one of the sizes."""
    field = FLEET_FIELDS[name]
    if name in _HYBRID_SIZES and _get(config, f"hybrid_mla_{name}") is not _MISSING:
        field = f"hybrid_mla_{name}"
    value = _get(config, field)
    if value is _MISSING and name == "v_head_dim":  # TransformerConfig.__post_init__'s rule
        head_dim = _get(config, "head_dim")
        if head_dim is not _MISSING:
            return _positive_int(head_dim, "head_dim"), "head_dim"
        hidden, heads = _size(config, "hidden_size")[0], _size(config, "num_attention_heads")[0]
        return hidden // heads, "hidden_size // num_attention_heads"
    if value is _MISSING:
        what = (" (None there means no query down-projection, which this layer does not have)"
                if name == "q_lora_rank" else "")
        raise ValueError(
            f"PaddleFleet config field {field} is missing or None{what}; "
            f"MQALatentAttentionConfig.{name} needs it (or pass {name}=... to from_fleet_config)")
    return _positive_int(value, field), field


def _yarn_mscale(config) -> float:
    """PaddleFleet's ``_yarn_get_mscale(rotary_scaling_factor, mscale_all_dim)``."""
    factor = _get(config, "rotary_scaling_factor")
    mscale_all_dim = _get(config, "mscale_all_dim")
    if factor is _MISSING or mscale_all_dim is _MISSING:
        return 1.0
    factor = _positive_float(factor, "rotary_scaling_factor")
    mscale = _as_float(mscale_all_dim)
    if mscale is None or not math.isfinite(mscale):
        _refuse("mscale_all_dim", "a finite number", mscale_all_dim)
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _use_attn_sink(config):
    full_bias = _get(config, "add_full_attention_sink_bias")
    softmax_type = _get(config, "softmax_type")
    if full_bias is _MISSING and softmax_type is _MISSING:
        return _MISSING
    if full_bias is not _MISSING:
        if not _is_bool(full_bias):
            _refuse("add_full_attention_sink_bias", "a bool", full_bias)
        full_bias = bool(full_bias)
    if softmax_type is not _MISSING:
        softmax_type = _choice(softmax_type, "softmax_type", _SOFTMAX_TYPES)
    if full_bias is True:
        return True
    if softmax_type == "off-by-one":
        raise ValueError(
            "PaddleFleet config field softmax_type='off-by-one' (a fixed zero sink logit, not "
            "learned) has no counterpart: MQALatentAttention's sink is a learned per-head "
            "parameter; use softmax_type='learnable' or 'vanilla' (no sink)")
    return softmax_type == "learnable"


def _backward_backend(config):
    value = _get(config, "mqa_sparse_attn_backward_backend")
    if value is _MISSING:
        return _MISSING
    if value == "cudnn":
        raise ValueError(
            "PaddleFleet config field mqa_sparse_attn_backward_backend='cudnn' (PaddleFleet's "
            "default) selects cuDNN's backward, which accumulates dKV with atomics and is not "
            "run-to-run reproducible; this package has no cuDNN backward, its own is TileLang's "
            "(deterministic, or atomic with deterministic=False): set "
            "mqa_sparse_attn_backward_backend='tilelang', or pass backward_backend= "
            "('tilelang', 'reference' or None) to from_fleet_config")
    return _BACKWARD_BACKENDS[_choice(value, "mqa_sparse_attn_backward_backend",
                                      ("cudnn", *_BACKWARD_BACKENDS))]


def _rope_theta(config):
    theta, base = _get(config, "rope_theta"), _get(config, "rotary_base")
    if theta is not _MISSING:
        theta = _positive_float(theta, "rope_theta")
    if base is not _MISSING:
        base = _positive_float(base, "rotary_base")
        if theta is not _MISSING and not math.isclose(theta, base):
            raise ValueError(f"PaddleFleet config fields rope_theta={theta} and rotary_base={base} "
                             "differ; rotary_base is rope_theta's former name: set rope_theta only")
    return theta if theta is not _MISSING else base


def from_fleet_config(config: Any, *, cls=None, **overrides):
    """An ``MQALatentAttentionConfig`` from a PaddleFleet ``TransformerConfig`` (or any object
    with its field names), mapped as the module docstring's table says.

    Args:
        config: the PaddleFleet config; read with ``getattr`` only, or a mapping (``dict``)
            read by key (its string keys, as attributes).  A field that is absent or ``None``
            takes this package's default (a size has none and must be present).
        cls: the config class to build (``MQALatentAttentionConfig`` by default; the classmethod
            ``MQALatentAttentionConfig.from_fleet_config`` passes its own class).
        **overrides: ``MQALatentAttentionConfig`` fields, e.g. ``backward_backend="reference"``
            on CPU or ``attention_partition="sequence"``; they win over the mapped values, and
            an overridden field is not read from ``config``.

    Raises:
        TypeError: ``config`` is ``None``, a string, a number or a list/tuple (no config).
        ValueError: a PaddleFleet field of the wrong type or value (the message names the
            PaddleFleet field), a missing size, ``softmax_type="off-by-one"``,
            ``mqa_sparse_attn_backward_backend="cudnn"``, different ``rope_theta`` and
            ``rotary_base``; an unknown override; a resulting config that fails
            ``MQALatentAttentionConfig``'s own checks (e.g. heads not divisible by
            ``tensor_model_parallel_size``; the message adds the PaddleFleet fields involved).
    """
    if cls is None:
        from .config import MQALatentAttentionConfig as cls
    config = _as_config_object(config)
    values, sources = {}, {}
    for name in ("hidden_size", *_HYBRID_SIZES, "index_topk"):
        if name not in overrides:
            values[name], sources[name] = _size(config, name)
    readers = {
        "use_attn_sink": _use_attn_sink,
        "backward_backend": _backward_backend,
        "rope_theta": _rope_theta,
        "tensor_parallel_degree": _optional("tensor_model_parallel_size", _positive_int),
        "rms_norm_eps": _optional("rms_norm_eps", _positive_float),
        "initializer_range": _optional("init_method_std", _positive_float),
    }
    for name, read in readers.items():
        if name not in overrides and (value := read(config)) is not _MISSING:
            values[name], sources[name] = value, FLEET_FIELDS[name]
    if "softmax_scale" not in overrides:
        scale = _get(config, "softmax_scale")
        if scale is not _MISSING:
            values["softmax_scale"] = _positive_float(scale, "softmax_scale")
            sources["softmax_scale"] = "softmax_scale"
        elif (mscale := _yarn_mscale(config)) != 1.0:
            nope = overrides.get("qk_nope_head_dim", values.get("qk_nope_head_dim"))
            rope = overrides.get("qk_rope_head_dim", values.get("qk_rope_head_dim"))
            if isinstance(nope, int) and isinstance(rope, int):  # else from_dict names them
                values["softmax_scale"] = mscale * mscale / math.sqrt(nope + rope)
                sources["softmax_scale"] = "rotary_scaling_factor, mscale_all_dim, head dims"
    try:
        return cls.from_dict({**values, **overrides})
    except ValueError as e:
        # A check of the config itself ("MQALatentAttentionConfig.<field> must ..."): add the
        # PaddleFleet fields its values came from.
        named = set(re.findall(r"\w+", str(e))) if re.match(r"MQALatentAttentionConfig\.\w+ ",
                                                               str(e)) else set()
        involved = [f"{ours} <- {theirs}" for ours, theirs in sources.items() if ours in named]
        if not involved:
            raise
        raise ValueError(f"{e} (from_fleet_config: {'; '.join(involved)})") from None
