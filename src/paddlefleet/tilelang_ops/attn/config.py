"""Model configuration for DeepSeek-V3.2-style MLA/DSA attention (:class:`MQALatentAttention`).

:class:`MQALatentAttentionConfig` holds the
sizes of one attention block in the form the DeepSeek-V3 / V3.2 model configs publish them
(``hidden_size``, ``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``index_topk``) plus what this
package adds (attention sink, backward backend, determinism, tensor-parallel degree).

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
import errno
import json
import math
import numbers
import os
import secrets
import stat
from typing import Any, Mapping

import numpy as np

from .checks import check_sm_scale

__all__ = [
    "MQALatentAttentionConfig",
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

#: Sizes are tensor dimensions: at most the largest int32.
_MAX_SIZE = 2**31 - 1

#: float32's smallest normal number: the layer computes in fp32 (Paddle's default dtype), where
#: a smaller rms_norm_eps or initializer_range is subnormal or 0.
_FP32_TINY = float(np.finfo(np.float32).tiny)
_FP32_MAX = float(np.finfo(np.float32).max)


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def _as_int(value):
    """``value`` as a Python int if it is an integer (numpy integers included, by value; bools
    excluded), else ``None``."""
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _as_float(value):
    """``value`` as a Python float if it is a real number (numpy scalars included, by value;
    bools excluded) that a float can hold, else ``None`` (10**400 overflows a float)."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except (OverflowError, ValueError, TypeError):
        return None


def _short_repr(value) -> str:
    """``repr(value)``, with a huge integer shown by its size (its repr may be too long to read,
    or refused by Python's limit on int-to-str conversion)."""
    as_int = _as_int(value)
    if as_int is not None and abs(as_int) >= 10**30:
        digits = int(as_int.bit_length() * math.log10(2))
        return f"an integer of {as_int.bit_length()} bits (about 10**{digits})"
    return repr(value)


def _in_fp32_normal_range(value: float) -> bool:
    """In ``[fp32 tiny, fp32 max]``, also after rounding to float32."""
    with np.errstate(over="ignore", under="ignore"):
        v32 = float(np.float32(value))
    return all(_FP32_TINY <= v <= _FP32_MAX for v in (value, v32))


#: What a size must be (:func:`_as_size`), as the messages say it.
_SIZE_EXPECTED = f"a positive int (at most {_MAX_SIZE}, a tensor dimension)"


def _as_size(value):
    """``value`` as a Python int if it is an integer in ``[1, 2**31 - 1]`` (a tensor dimension;
    numpy integers by value, bools never), else ``None``."""
    as_int = _as_int(value)
    return as_int if as_int is not None and 0 < as_int <= _MAX_SIZE else None


def _as_positive_float(value):
    """``value`` as a Python float if it is a finite real number ``> 0`` (numpy scalars by
    value, bools never), else ``None``."""
    as_float = _as_float(value)
    return as_float if as_float is not None and math.isfinite(as_float) and as_float > 0 else None


def _as_choice(value, choices: tuple):
    """``value`` if it is one of ``choices``, stored plain, else ``None``.  String choices
    take strings only (a 0-d numpy array compares equal to a choice, and would then break
    hash() and to_json_file) and give str subclasses (numpy strings, str enums) as the plain
    str; int choices take ints by value."""
    if all(isinstance(c, str) for c in choices):
        stored = str.__str__(value) if isinstance(value, str) else None
    else:
        stored = _as_int(value)
    return stored if stored is not None and stored in choices else None


#: The rules of the float fields (``rule`` of :meth:`_AttentionConfig._check_float`): a
#: predicate and what the message says is expected.  RoPE tables are computed in float64 (any
#: finite base > 0 works); an RMSNorm eps is added to a mean square in the layer's dtype (fp32
#: by default), where a smaller eps is subnormal or 0; the weights are drawn in fp32.
_FP32_RANGE = (f"a number in [{_FP32_TINY:.6g}, {_FP32_MAX:.6g}], float32's normal range (also "
               "after rounding to float32)")
_FLOAT_RULES = {
    "positive": (lambda v: _as_positive_float(v) is not None, "a finite number > 0"),
    "eps": (_in_fp32_normal_range, (
        f"{_FP32_RANGE}: the fp32 layer adds it to a mean square, and a smaller eps is "
        "subnormal or 0 there (an all-zero row then normalises to NaN)")),
    "std": (_in_fp32_normal_range, f"{_FP32_RANGE}: the standard deviation of fp32 weights"),
}


class _AttentionConfig:
    """What the attention configs (this module's, DeepSeek-V4's in :mod:`.v4_config`) share:
    the field checks their ``__post_init__`` run, (de)serialisation and ``heads_per_rank``.

    Every field check raises ``ValueError("<ClassName>.<field> must be <expected>, got
    <value>")`` and stores what it accepted in its plain Python form (numbers taken by value,
    numpy scalars included, as ``int`` / ``float`` / ``bool``; choices as the plain ``str``),
    so that a config compares, hashes and serialises the same whatever built it.
    """

    def _refuse(self, name: str, expected: str):
        raise ValueError(f"{type(self).__name__}.{name} must be {expected}, got "
                         f"{_short_repr(getattr(self, name))}")

    def _store(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # the configs are frozen dataclasses

    def _check_sizes(self, *names: str, qualifier: str = "") -> None:
        """Positive ints of at most ``2**31 - 1`` (tensor dimensions)."""
        for name in names:
            value = _as_size(getattr(self, name))
            if value is None:
                self._refuse(name, _SIZE_EXPECTED.replace("a positive int",
                                                          f"a positive int{qualifier}"))
            self._store(name, value)

    def _check_sum_fits(self, what: str, *names: str) -> None:
        """A size derived as the sum of the (checked) sizes ``names`` is a tensor dimension too:
        at most ``2**31 - 1``."""
        total = sum(getattr(self, n) for n in names)
        if total > _MAX_SIZE:
            given = ", ".join(f"{n}={getattr(self, n)}" for n in names)
            raise ValueError(f"{type(self).__name__}: {what} = {' + '.join(names)} = {total} "
                             f"must be at most {_MAX_SIZE} (a tensor dimension), got {given}")

    def _check_divisible(self, name: str, by: str, why: str = "") -> None:
        """The size ``name`` a multiple of the size ``by`` (both checked sizes already)."""
        value, divisor = getattr(self, name), getattr(self, by)
        if value % divisor:
            raise ValueError(f"{type(self).__name__}.{name} must be divisible by {by}{why}, got "
                             f"{name}={value} and {by}={divisor}")

    def _check_float(self, name: str, rule: str) -> None:
        """A real number by the rule of :data:`_FLOAT_RULES`: ``"positive"`` (finite, > 0),
        ``"eps"`` or ``"std"`` (in float32's normal range)."""
        ok, expected = _FLOAT_RULES[rule]
        value = _as_float(getattr(self, name))
        if value is None or not ok(value):
            self._refuse(name, expected)
        self._store(name, value)

    def _check_softmax_scale(self) -> None:
        """``None`` or the op's rule (finite and > 0, also in float32), checked here already so
        that a bad config fails when it is built, not at the first forward."""
        if self.softmax_scale is None:
            return
        scale = _as_float(self.softmax_scale)
        try:
            check_sm_scale(scale)
        except (TypeError, ValueError):
            self._refuse("softmax_scale", "None or a finite number > 0 (also finite and > 0 in "
                                          "float32)")
        self._store("softmax_scale", scale)

    def _check_bool(self, name: str, *, optional: bool = False) -> None:
        """``bool`` or ``np.bool_`` (``None`` too where ``optional``); never a number."""
        value = getattr(self, name)
        if value is None and optional:
            return
        if not _is_bool(value):
            self._refuse(name, "True, False or None" if optional else "a bool")
        self._store(name, bool(value))

    def _check_choice(self, name: str, choices: tuple, *, optional: bool = False,
                      expected: str | None = None) -> None:
        """One of ``choices`` (``None`` too where ``optional``), by :func:`_as_choice`."""
        value = getattr(self, name)
        if value is None and optional:
            return
        stored = _as_choice(value, choices)
        if stored is None:
            self._refuse(name, expected or f"one of {choices}{' or None' if optional else ''}")
        self._store(name, stored)

    def _check_shared_options(self) -> None:
        """The fields every attention config has besides its sizes: backward backend,
        attention partition, softmax scale, RoPE base, RMSNorm eps, initializer range,
        determinism and the sink."""
        self._check_choice("backward_backend", BACKWARD_BACKENDS, optional=True)
        self._check_choice("attention_partition", ATTENTION_PARTITIONS)
        self._check_softmax_scale()
        self._check_float("rope_theta", "positive")
        self._check_float("rms_norm_eps", "eps")
        self._check_float("initializer_range", "std")
        self._check_bool("deterministic", optional=True)
        self._check_bool("use_attn_sink")

    # --- derived sizes -----------------------------------------------------------------------
    @property
    def heads_per_rank(self) -> int:
        return self.num_attention_heads // self.tensor_parallel_degree

    # --- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """Build from a mapping; unknown keys raise ``ValueError`` naming them (a typo in a
        JSON file should not be silently ignored), keys that are not strings ``TypeError``."""
        if not isinstance(data, Mapping):
            raise TypeError(
                f"{cls.__name__}.from_dict expects a mapping, got {type(data).__name__}"
            )
        not_str = [k for k in data if not isinstance(k, str)]
        if not_str:
            raise TypeError(f"{cls.__name__}: field names must be strings, got key(s) "
                            f"{', '.join(map(_short_repr, not_str))}")
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
    def from_json_file(cls, path: str | os.PathLike, **overrides):
        """Build from a JSON object file, fields overridable.

        Raises:
            OSError: the file cannot be read.
            ValueError: the file is not UTF-8 text, not valid JSON (an integer of more than
                Python's 4300 digits included) or not a JSON object, or gives a field twice, or
                a field is unknown, missing or invalid; every message names the file.
        """
        return _from_file_data(cls, path, _read_json_object(path), overrides)

    def to_json_file(self, path: str | os.PathLike) -> None:
        """Write the config as a JSON object (``indent=2``) to ``path``, atomically.

        The text is made first, then written to a temporary file in the same folder and moved
        over ``path`` with ``os.replace``: a failed save (serialisation, full disk) leaves an
        existing file as it was, and a reader never sees half a file.  An existing file keeps
        its permission bits; a symlink keeps pointing where it did (its target is replaced).

        Raises:
            OSError: the folder cannot be written; ``PermissionError`` where ``path`` exists and
                is not writable, or has no write permission bit at all (a read-only file is
                refused, as ``open(path, "w")`` refuses it, not replaced; also for root);
                ``FileNotFoundError`` where the folder (for a symlink: of its target, which is
                named) does not exist; ``IsADirectoryError`` for a folder.  Each names
                ``path``, never the temporary file.
        """
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"
        given = os.fspath(path)
        target = os.path.realpath(given)
        folder, base = os.path.split(target)
        via = "" if target == os.path.abspath(given) else f" (a symlink to {target!r})"
        if os.path.isdir(target):
            raise IsADirectoryError(errno.EISDIR, f"cannot write a config file over a "
                                                  f"folder{via}", given)
        if os.path.exists(target) and not (
                os.access(target, os.W_OK)
                and os.stat(target).st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)):
            # no write bit at all: read-only by intent, also for root (whom os.access lets by)
            raise PermissionError(errno.EACCES, f"the config file{via} is not writable; it is "
                                                f"left as it is", given)
        if not os.path.isdir(folder):
            raise FileNotFoundError(errno.ENOENT, f"no folder {folder!r} to write the config "
                                                  f"file in{via}", given)
        tmp = os.path.join(folder, f".{base}.{secrets.token_hex(6)}.tmp")
        try:
            # 0o666 less the umask, as open(path, "w") would give a new file
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
            except FileNotFoundError:
                pass
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def replace(self, **changes):
        """A copy with some fields changed (validated again; an unknown field is a
        ``ValueError`` naming it, as in :meth:`from_dict`)."""
        return type(self).from_dict({**self.to_dict(), **changes})


@dataclasses.dataclass(frozen=True)
class MQALatentAttentionConfig(_AttentionConfig):
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
        deterministic: the TileLang backward's dKV, passed to
            :func:`~paddlefleet.tilelang_ops.attn.op.mqa_latent_sparse_attention`: ``True``
            bitwise repeatable (exact per-key grids), ``False`` fp32 atomics, ``None`` Paddle's
            ``FLAGS_cudnn_deterministic`` where the user set it, else ``True``.
        tensor_parallel_degree: ranks the heads are split over; must divide the heads.
        attention_partition: how the sparse attention core is split over those ranks:
            ``"heads"`` (default; each rank runs its ``H/TP`` heads on all ``S`` query rows) or
            ``"sequence"`` (each rank runs all ``H`` heads on ``ceil(S/TP)`` query rows, with
            an all-to-all before and after the core; docs/layer.md).  The parameters are split
            by heads either way.
        rope_theta: base of the rotary frequencies; finite and ``> 0``.
        rms_norm_eps: epsilon of the RMSNorms on the q and kv latents; in float32's normal
            range ``[1.18e-38, 3.4e38]`` (a smaller eps is 0 or subnormal in the fp32 layer,
            where an all-zero row would normalise to NaN).
        initializer_range: standard deviation of the random (fp32) weight initialisation; in
            float32's normal range.

    Sizes are ints in ``[1, 2**31 - 1]``; numbers may be given as numpy scalars
    (``np.int64(16)``, ``np.float32(0.125)``) and are stored as Python ``int`` / ``float``
    (``bool`` is never a number here; ``use_attn_sink`` takes ``bool`` or ``np.bool_``).
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
    deterministic: bool | None = None
    tensor_parallel_degree: int = 1
    attention_partition: str = "heads"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self):
        self._check_sizes(*_POSITIVE_INT_FIELDS)
        if self.qk_rope_head_dim % 2:
            self._refuse("qk_rope_head_dim", "even (rotary pairs)")
        self._check_sum_fits("kernel_dk", "kv_lora_rank", "qk_rope_head_dim")
        self._check_sum_fits("the query/key head width", "qk_nope_head_dim", "qk_rope_head_dim")
        self._check_divisible("num_attention_heads", "tensor_parallel_degree")
        self._check_shared_options()

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

    @classmethod
    def from_fleet_config(cls, config, **overrides) -> "MQALatentAttentionConfig":
        """From a PaddleFleet ``TransformerConfig`` (or any object with its field names), fields
        overridable; the field mapping and its errors: :mod:`.fleet_config`."""
        from .fleet_config import from_fleet_config

        return from_fleet_config(config, cls=cls, **overrides)


class _FieldGivenTwice(ValueError):
    pass


def _config_class(path, fields: dict):
    """The config class a file's fields describe (:func:`load_config`)."""
    v3 = {f.name for f in dataclasses.fields(MQALatentAttentionConfig)}
    v4 = {f.name for f in dataclasses.fields(_v4().DeepSeekV4AttentionConfig)}
    names = {k for k in fields if isinstance(k, str)}
    only_v3, only_v4 = sorted(names & (v3 - v4)), sorted(names & (v4 - v3))
    if only_v3 and only_v4:
        raise ValueError(
            f"config file {os.fspath(path)!r} mixes the fields of both configs: {only_v3} are "
            f"MQALatentAttentionConfig's (DeepSeek-V3.2) only, {only_v4} "
            f"DeepSeekV4AttentionConfig's only"
        )
    return _v4().DeepSeekV4AttentionConfig if only_v4 else MQALatentAttentionConfig


def _from_file_data(cls, path, data: dict, overrides: dict):
    """``cls`` from the fields read from ``path`` and ``overrides``; a field's ``ValueError``
    names the file (and the overrides)."""
    try:
        return cls.from_dict({**data, **overrides})
    except ValueError as e:
        given = f" with overrides {sorted(overrides)}" if overrides else ""
        raise ValueError(f"config file {os.fspath(path)!r}{given}: {e}") from None


def _read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object in ``path``; text that is not UTF-8, malformed JSON (integers beyond
    Python's int-to-str digit limit included) or another JSON type is a ``ValueError`` naming
    the file."""
    def no_duplicates(pairs):
        # json.load keeps the last of a repeated key silently; in a config that hides an edit
        seen = {}
        for key, value in pairs:
            seen.setdefault(key, []).append(value)
        for key, values in seen.items():
            if len(values) > 1:
                raise _FieldGivenTwice(
                    f"config file {os.fspath(path)!r}: field {key!r} is given {len(values)} "
                    f"times (values {', '.join(map(_short_repr, values))})"
                )
        return {key: values[0] for key, values in seen.items()}

    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {os.fspath(path)!r} is not UTF-8 text: {e}") from None
    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except _FieldGivenTwice:
        raise
    except RecursionError:
        raise ValueError(f"config file {os.fspath(path)!r} is not valid JSON: nested too deeply "
                         f"(a config is one flat JSON object)") from None
    except ValueError as e:
        # JSONDecodeError, and the ValueError of an integer literal over Python's
        # int-to-str digit limit (4300 digits), which json.loads does not wrap
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
        return _v4().get_preset(name, **overrides)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of "
                         f"{sorted(PRESETS) + sorted(_v4().PRESETS)}")
    return MQALatentAttentionConfig.from_dict({**PRESETS[name], **overrides})


def load_config(name_or_path: str | os.PathLike, **overrides):
    """A preset name or a path to a JSON file (a JSON object of config fields, e.g. written by
    :meth:`MQALatentAttentionConfig.to_json_file`), fields overridable.  The file's fields (and
    the overrides) pick the class: a field only :class:`~.v4_config.DeepSeekV4AttentionConfig`
    has (``head_dim``, ``window_size``, ``compress_ratio``, ...) makes it a DeepSeek-V4 block's,
    a field only :class:`MQALatentAttentionConfig` has (``kv_lora_rank``, ``index_topk``, ...)
    a V3.2 layer's, and fields of both are an error; shared fields only: V3.2's.

    Raises:
        ValueError: neither a preset nor a file; malformed JSON (naming the file); fields of
            both configs (each side's named); an unknown, missing or invalid field (overrides
            included; the same error for both sources).
        OSError: the file cannot be read.
    """
    s = os.fspath(name_or_path)
    if s in PRESETS or s in _v4().PRESETS:
        return get_preset(s, **overrides)
    if os.path.isfile(s):
        data = _read_json_object(s)
        return _from_file_data(_config_class(s, {**data, **overrides}), s, data, overrides)
    raise ValueError(
        f"config {s!r} is neither a preset ({sorted(PRESETS) + sorted(_v4().PRESETS)}) nor "
        f"an existing JSON file"
    )
