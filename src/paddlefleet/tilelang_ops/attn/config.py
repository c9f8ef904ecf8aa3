"""Model configuration for DeepSeek-V3.2-style MLA/DSA attention (:class:`MQALatentAttention`).

:class:`MQALatentAttentionConfig` (formerly ``MLAAttentionConfig``, still an alias) holds the
sizes of one attention block in the form the DeepSeek-V3 / V3.2 model configs publish them
(``hidden_size``, ``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``index_topk``) plus what this
package adds (attention sink, backward backend, tensor-parallel degree).

What the sparse kernel sees (absorbed MLA, MQA form; see docs/conventions.md):
    Dk = kv_lora_rank + qk_rope_head_dim   (576 for DeepSeek-V3.2: 512 latent + 64 rope)
    Dv = kv_lora_rank                      (512 for DeepSeek-V3.2)
The per-head up-projections W_UK (qk_nope_head_dim -> kv_lora_rank) and W_UV (kv_lora_rank ->
v_head_dim) are absorbed into the query and applied after the attention respectively, so every
head attends over the same latent kv row.  :attr:`MQALatentAttentionConfig.kernel_dk` and
:attr:`MQALatentAttentionConfig.kernel_dv` give these sizes.

The config is validated when it is built: a bad field raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from .checks import check_sm_scale

__all__ = [
    "MQALatentAttentionConfig",
    "MLAAttentionConfig",
    "ATTENTION_PARTITIONS",
    "BACKWARD_BACKENDS",
    "PRESETS",
    "get_preset",
    "load_config",
]

#: Backward implementations :func:`~paddlefleet.tilelang_ops.attn.op.mqa_latent_sparse_attention`
#: accepts; ``None`` picks ``"tilelang"`` on CUDA and ``"reference"`` on CPU.
BACKWARD_BACKENDS = ("tilelang", "reference")

#: How :class:`~paddlefleet.tilelang_ops.attn.layer.MQALatentAttention` splits the sparse core
#: over the tensor-parallel group: ``"heads"`` (each rank: its ``H/TP`` heads, all ``S`` rows)
#: or ``"sequence"`` (each rank: all ``H`` heads, ``S/TP`` query rows, after an all-to-all).
ATTENTION_PARTITIONS = ("heads", "sequence")

_POSITIVE_INT_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_topk",
    "tensor_parallel_degree",
)


@dataclasses.dataclass(frozen=True)
class MQALatentAttentionConfig:
    """Sizes and options of one DeepSeek-V3.2-style sparse MLA attention block.

    Attributes:
        hidden_size: model width (input and output features of the block).
        num_attention_heads: query heads over all tensor-parallel ranks.
        q_lora_rank: width of the low-rank query latent (q down-projection output).
        kv_lora_rank: width of the shared kv latent; the kernel's ``Dv``.
        qk_nope_head_dim: per-head query/key width without position encoding.
        qk_rope_head_dim: per-head (query) / shared (key) rotary width.
        v_head_dim: per-head value width after the W_UV up-projection.
        index_topk: keys each query row attends to (DSA top-k, ``L``).
        softmax_scale: multiplies ``q.k``; ``None`` means ``(qk_nope_head_dim +
            qk_rope_head_dim) ** -0.5``, the scale of the un-absorbed head (DeepSeek-V3's YaRN
            ``mscale`` correction is not applied).  Read the resolved value from
            :attr:`sm_scale`.
        use_attn_sink: learn a per-head sink logit (docs/conventions.md).
        backward_backend: ``"tilelang"``, ``"reference"`` or ``None`` (tilelang on CUDA,
            reference on CPU).
        tensor_parallel_degree: ranks the heads are split over; must divide the heads.
        attention_partition: how the sparse attention core is split over those ranks:
            ``"heads"`` (default; each rank runs its ``H/TP`` heads on all ``S`` query rows) or
            ``"sequence"`` (each rank runs all ``H`` heads on ``ceil(S/TP)`` query rows, with
            an all-to-all before and after the core; docs/layer.md).  The parameters are split
            by heads either way.
        rope_theta: base of the rotary frequencies.
        rms_norm_eps: epsilon of the RMSNorms on the q and kv latents.
        initializer_range: standard deviation of the random weight initialisation.
    """

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_topk: int
    softmax_scale: float | None = None
    use_attn_sink: bool = True
    backward_backend: str | None = None
    tensor_parallel_degree: int = 1
    attention_partition: str = "heads"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self):
        for name in _POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"MQALatentAttentionConfig.{name} must be a positive int, got {value!r}"
                )
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                "MQALatentAttentionConfig.qk_rope_head_dim must be even (rotary pairs), got "
                f"{self.qk_rope_head_dim}"
            )
        if self.num_attention_heads % self.tensor_parallel_degree:
            raise ValueError(
                "MQALatentAttentionConfig.num_attention_heads must be divisible by "
                f"tensor_parallel_degree, got {self.num_attention_heads} heads and "
                f"tensor_parallel_degree={self.tensor_parallel_degree}"
            )
        # Strings only (a 0-d numpy array compares equal to a choice, and would then break
        # hash() and to_json_file); str subclasses (numpy strings, str enums) are stored as
        # the plain str.
        backend = self.backward_backend
        if backend is not None and not (isinstance(backend, str) and backend in BACKWARD_BACKENDS):
            raise ValueError(
                f"MQALatentAttentionConfig.backward_backend must be one of {BACKWARD_BACKENDS} "
                f"or None, got {backend!r}"
            )
        partition = self.attention_partition
        if not (isinstance(partition, str) and partition in ATTENTION_PARTITIONS):
            raise ValueError(
                f"MQALatentAttentionConfig.attention_partition must be one of "
                f"{ATTENTION_PARTITIONS}, got {partition!r}"
            )
        if backend is not None:
            object.__setattr__(self, "backward_backend", str.__str__(backend))
        object.__setattr__(self, "attention_partition", str.__str__(partition))
        if self.softmax_scale is not None:
            # The op's own rule (finite and > 0, also in float32), checked here already so
            # that a bad config fails when it is built, not at the first forward.
            try:
                check_sm_scale(self.softmax_scale)
            except (TypeError, ValueError):
                raise ValueError(
                    "MQALatentAttentionConfig.softmax_scale must be None or a finite number > 0 "
                    f"(also finite and > 0 in float32), got {self.softmax_scale!r}"
                ) from None
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(
                    f"MQALatentAttentionConfig.{name} must be a finite positive number, got "
                    f"{value!r}"
                )
        if not isinstance(self.use_attn_sink, bool):
            raise ValueError(
                f"MQALatentAttentionConfig.use_attn_sink must be a bool, got {self.use_attn_sink!r}"
            )

    # --- derived sizes -----------------------------------------------------------------------
    @property
    def sm_scale(self) -> float:
        """The resolved softmax scale (``softmax_scale`` or ``(nope + rope) ** -0.5``)."""
        if self.softmax_scale is not None:
            return float(self.softmax_scale)
        return float((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5)

    @property
    def kernel_dk(self) -> int:
        """Absorbed query/key width the kernel sees: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kernel_dv(self) -> int:
        """Value width the kernel sees: ``kv_lora_rank`` (the latent, before W_UV)."""
        return self.kv_lora_rank

    @property
    def heads_per_rank(self) -> int:
        return self.num_attention_heads // self.tensor_parallel_degree

    # --- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MQALatentAttentionConfig":
        """Build from a mapping; unknown keys raise ``ValueError`` naming them (a typo in a
        JSON file should not be silently ignored)."""
        if not isinstance(data, Mapping):
            raise TypeError(
                f"{cls.__name__}.from_dict expects a mapping, got {type(data).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{cls.__name__}: unknown field(s) {unknown}; known fields: "
                f"{sorted(known)}"
            )
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name not in data
        )
        if missing:
            raise ValueError(f"{cls.__name__}: missing required field(s) {missing}")
        return cls(**dict(data))

    @classmethod
    def from_json_file(cls, path: str | os.PathLike, **overrides) -> "MQALatentAttentionConfig":
        """Build from a JSON object file, fields overridable.

        Raises:
            OSError: the file cannot be read.
            ValueError: the file is not valid JSON or not a JSON object, or gives a field twice
                (the message names the file), or a field is unknown, missing or invalid.
        """
        return cls.from_dict({**_read_json_object(path), **overrides})

    def to_json_file(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    def replace(self, **changes) -> "MQALatentAttentionConfig":
        """A copy with some fields changed (validated again; an unknown field is a
        ``ValueError`` naming it, as in :meth:`from_dict`)."""
        return type(self).from_dict({**self.to_dict(), **changes})


#: Deprecated (until the next release): the config's former name.
MLAAttentionConfig = MQALatentAttentionConfig


def _read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object in ``path``; malformed JSON or another JSON type is a ``ValueError``
    naming the file."""
    def no_duplicates(pairs):
        # json.load keeps the last of a repeated key silently; in a config that hides an edit
        seen = {}
        for key, value in pairs:
            seen.setdefault(key, []).append(value)
        for key, values in seen.items():
            if len(values) > 1:
                raise ValueError(
                    f"config file {os.fspath(path)!r}: field {key!r} is given {len(values)} "
                    f"times (values {', '.join(map(repr, values))})"
                )
        return {key: values[0] for key, values in seen.items()}

    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f, object_pairs_hook=no_duplicates)
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {os.fspath(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"config file {os.fspath(path)!r}: expected a JSON object of config fields, got a "
            f"JSON {type(data).__name__}"
        )
    return data


#: Published attention sizes of DeepSeek-V3.2-Exp (its ``config.json``: hidden 7168, 128 heads,
#: q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head_dim 128, index_topk 2048).
_DEEPSEEK_V32 = dict(
    hidden_size=7168,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    index_topk=2048,
    use_attn_sink=True,
    backward_backend="tilelang",
)

#: Same structure, tiny sizes, for CPU runs: 16 heads (2 per rank at TP=8), Dk = 64 + 16 = 80,
#: Dv = 64.  Steps take well under a second on 2 cores.
_DEEPSEEK_V32_SMALL = dict(
    hidden_size=256,
    num_attention_heads=16,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_topk=64,
    use_attn_sink=True,
    backward_backend="reference",
)

#: The presets, by name: their one source (no JSON copies to drift from them; a preset as a file
#: is ``get_preset(name).to_json_file(path)``).  The fields not named take the defaults.
PRESETS: dict = {"deepseek_v32": _DEEPSEEK_V32, "deepseek_v32_small": _DEEPSEEK_V32_SMALL}


def _v4():
    # DeepSeek-V4's config and presets (attn/v4_config.py, which imports this module)
    from . import v4_config

    return v4_config


def get_preset(name: str, **overrides):
    """A preset by name (``"deepseek_v32"`` or ``"deepseek_v32_small"``; DeepSeek-V4's
    ``"deepseek_v4_flash"`` and ``"deepseek_v4_small"`` give a
    :class:`~.v4_config.DeepSeekV4AttentionConfig`), fields overridable."""
    if name in _v4().PRESETS:
        return _v4().DeepSeekV4AttentionConfig.from_dict({**_v4().PRESETS[name], **overrides})
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of "
                         f"{sorted(PRESETS) + sorted(_v4().PRESETS)}")
    return MQALatentAttentionConfig.from_dict({**PRESETS[name], **overrides})


def load_config(name_or_path: str | os.PathLike, **overrides):
    """A preset name or a path to a JSON file (a JSON object of config fields, e.g. written by
    :meth:`MQALatentAttentionConfig.to_json_file`), fields overridable.  A file with a
    ``compress_ratio`` field is a DeepSeek-V4 block's (:class:`~.v4_config.DeepSeekV4AttentionConfig`).

    Raises:
        ValueError: neither a preset nor a file; malformed JSON (naming the file); an unknown,
            missing or invalid field (overrides included; the same error for both sources).
        OSError: the file cannot be read.
    """
    s = os.fspath(name_or_path)
    if s in PRESETS or s in _v4().PRESETS:
        return get_preset(s, **overrides)
    if os.path.isfile(s):
        data = _read_json_object(s)
        # a DeepSeek-V4 block's file names its compress_ratio, a field only that config has
        cls = (_v4().DeepSeekV4AttentionConfig if "compress_ratio" in data
               else MQALatentAttentionConfig)
        return cls.from_dict({**data, **overrides})
    raise ValueError(
        f"config {s!r} is neither a preset ({sorted(PRESETS) + sorted(_v4().PRESETS)}) nor "
        f"an existing JSON file"
    )
