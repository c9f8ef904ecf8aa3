"""Tensor-parallel DeepSeek-V3.2-style sparse MLA attention in absorbed (MQA) form.

:class:`MQALatentAttention` is one attention block of MLA (DeepSeek-V2, arXiv:2405.04434) with
DeepSeek Sparse Attention (DeepSeek-V3.2 report): every query row attends to the top-k keys
given by ``token_indices`` (the lightning indexer that picks them is out of scope; tests and
demos use :func:`~paddlefleet.tilelang_ops.attn.indices.causal_topk_indices`).

Data flow for ``x: [B, S, hidden]`` with ``h = heads / TP`` heads on this rank::

    c_q  = RMSNorm(x @ wq_a)                      [B, S, q_lora]       replicated
    q    = copy_to_tp(c_q) @ wq_b                 [B, S, h, nope+rope] column-parallel
    q_lat = q_nope @ W_UK[h]                      [B, S, h, kv_lora]   W_UK absorbed
    c_kv, k_pe = x @ wkv_a                        [B, S, kv_lora], [B, S, rope]  replicated
    kv   = copy_to_tp([RMSNorm(c_kv), rope(k_pe)])  [B, S, Dk]         shared latent (MQA)
    o_lat = mqa_latent_sparse_attention([q_lat, rope(q_pe)], kv, token_indices, sink[h])
                                                  [B, S, h, kv_lora]   (Dk = kv_lora + rope)
    o    = o_lat @ W_UV[h]                        [B, S, h, v_head]    W_UV applied after
    y    = reduce_from_tp(o.reshape(B, S, h*v_head) @ wo[h rows])  [B, S, hidden] row-parallel

Absorption is exact: ``q_nope . (c_kv @ W_UK^T) = (q_nope @ W_UK) . c_kv`` per head, so the
scores equal those of the un-absorbed head of width ``nope + rope`` and the default softmax
scale is ``(nope + rope) ** -0.5``.  ``copy_to_tp`` (identity forward, all-reduce backward) sits
on the replicated activations where the per-rank computation starts, so the gradients of the
replicated weights (``wq_a``, ``q_norm``, ``wkv_a``, ``kv_norm``) and of ``x`` are full and
identical on every rank; the per-rank weights get exactly their slice of the single-process
gradient.

``config.attention_partition`` picks how the sparse core (the ``o_lat`` line) is split; the
parameters are split by heads either way, so a checkpoint serves both:

    "heads"     (default) as above: this rank's ``h`` heads on all ``S`` rows, sink[h].
    "sequence"  all ``H`` heads on ``R = ceil(S/TP)`` rows per rank::

        q_rows = all_to_all(pad_rows(query), rows -> heads)   [B, R, H, Dk]   rows r*R ..
        o_rows = mqa_latent_sparse_attention(q_rows, kv, token_indices[rows of r, -1 padded],
                                             all_gather(sink))  [B, R, H, kv_lora]
        o_lat  = all_to_all(o_rows, heads -> rows)[:, :S]     [B, S, h, kv_lora]

    The exchanges sit after RoPE and the bf16 cast (so they move the kernel's dtype) and
    before W_UV; their backward is the reverse exchange.  ``kv``'s gradient on a rank covers
    its rows only and is summed by the same ``copy_to_tp`` all-reduce as in "heads"; the
    gathered sink's gradient is all-reduced and sliced (``tp.gather_from_tensor_parallel``).
    Communication and when it pays: docs/layer.md.

Simplifications (documented, not hidden):
    * RoPE uses the rotate-half layout (first half / second half of the rope channels) with
      positions ``0 .. S-1`` and base ``rope_theta``; DeepSeek uses interleaved pairs, which is
      the same rotation after a fixed permutation of the rope output channels of ``wq_b`` and
      ``wkv_a``.  No YaRN scaling.
    * Self-attention over one sequence: keys are the same ``S`` positions (``S_kv = S``).

Packed documents (``forward(..., cu_seqlens=...)``, the THD layout): ``B = 1`` and the
documents lie back to back along ``S``.  The only per-document parts of the block are the RoPE
positions, which restart at 0 in every document, and the keys each row attends to, which the
top-k indices must keep inside the row's own document (checked by the op, with its other value
checks).  Everything else acts row by row, so a packed forward and backward equal each document
run alone (``tests/test_layer.py``, to fp64 rounding).  RoPE scores depend only on position
differences, so the restart changes no score in exact arithmetic; it gives every document the
rotation tables of its lone run (the fp32 angles of a late document in a long packed row would
otherwise lose precision) and the positions a document-aware model expects.

Parameters are created in Paddle's default dtype (fp32); ``attn_sink`` is always fp32 (the
op's sink dtype; a layer cast with ``layer.to(dtype=...)`` hands the op an fp32 copy).  On CUDA
the attention inputs are cast to bf16 (the kernel's dtype) and the output back.  On CPU the
layer runs in float32 or float64 only (:data:`CPU_DTYPES`: Paddle's CPU matmul has no
float16/bfloat16 kernel; such a layer raises a ``TypeError`` saying so at its first forward).
RoPE tables are computed in float64 and rounded to float32 for an fp32 layer (the angles too);
an fp64 layer uses them in float64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

from .adapter import type_name
from .checks import check_cu_seqlens, check_indices_in_documents, check_tensors, check_values
from .config import MQALatentAttentionConfig
from .op import index_tensor, mqa_latent_sparse_attention
from .tp import (
    all_to_all,
    copy_to_tensor_parallel,
    default_tensor_parallel_group,
    gather_from_tensor_parallel,
    group_rank,
    group_world_size,
    reduce_from_tensor_parallel,
)

__all__ = ["MQALatentAttention", "init_full_weights", "shard_of", "SHARD_AXIS", "REPLICATED",
           "CPU_DTYPES"]

#: Per-rank parameters and the axis along which they are split by heads (head-major blocks).
SHARD_AXIS = {"wq_b": 1, "w_uk": 0, "w_uv": 0, "wo": 0, "attn_sink": 0}
#: Parameters every rank holds whole.
REPLICATED = ("wq_a", "q_norm_weight", "wkv_a", "kv_norm_weight")
#: RMSNorm weights (replicated, initialised to 1).
_NORMS = ("q_norm_weight", "kv_norm_weight")
#: Parameter dtypes the layer runs in on CPU (Paddle 3.3's CPU matmul has no fp16/bf16 kernel).
CPU_DTYPES = ("float32", "float64")


def _full_shapes(cfg: MQALatentAttentionConfig) -> dict:
    H = cfg.num_attention_heads
    shapes = {
        "wq_a": (cfg.hidden_size, cfg.q_lora_rank),
        "q_norm_weight": (cfg.q_lora_rank,),
        "wq_b": (cfg.q_lora_rank, H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)),
        "wkv_a": (cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
        "kv_norm_weight": (cfg.kv_lora_rank,),
        "w_uk": (H, cfg.qk_nope_head_dim, cfg.kv_lora_rank),
        "w_uv": (H, cfg.kv_lora_rank, cfg.v_head_dim),
        "wo": (H * cfg.v_head_dim, cfg.hidden_size),
    }
    if cfg.use_attn_sink:
        shapes["attn_sink"] = (H,)
    return shapes


def _draw_weights(cfg, shapes: dict, seed: int, rank: int, tp: int, *, norms, shard_axis,
                  units) -> dict:
    """Rank ``rank``'s weights (of ``tp`` ranks) of the parameters ``shapes`` (full shapes, in
    a fixed order); the replicated ones whole, the ``norms`` ones 1.

    A per-rank parameter ``name`` (split along ``shard_axis[name]`` into ``units[name]``
    heads or head groups) is drawn unit by unit from its own generator ``(seed, parameter,
    unit)``, so a rank draws only its units and every TP degree holds slices of the same full
    weights (no rank materialises the whole model).  The sink is a logit, not a weight: unit
    scale so it matters from step 0; the others take ``cfg.initializer_range``.

    Raises:
        ValueError: ``cfg.initializer_range`` so large that fp32 draws overflow.
    """
    std = cfg.initializer_range
    out = {}
    with np.errstate(over="ignore"):  # an overflowing std is reported below, by name
        for pid, (name, shape) in enumerate(shapes.items()):
            if name in norms:
                out[name] = np.ones(shape, np.float32)
                continue
            if name not in shard_axis:
                draw = np.random.default_rng([seed, pid]).standard_normal(shape)
                out[name] = (draw * std).astype(np.float32)
                continue
            axis = shard_axis[name]
            block = list(shape)
            block[axis] //= units[name]
            per_rank = units[name] // tp
            scale = 1.0 if name == "attn_sink" else std
            blocks = [
                np.random.default_rng([seed, pid, unit]).standard_normal(block) * scale
                for unit in range(rank * per_rank, (rank + 1) * per_rank)
            ]
            out[name] = np.concatenate(blocks, axis=axis).astype(np.float32)
    for name, value in out.items():
        if not np.isfinite(value).all():  # std near fp32's largest number: draws overflow
            raise ValueError(
                f"config.initializer_range={cfg.initializer_range!r} draws non-finite fp32 "
                f"weights ({name}); use a standard deviation far below float32's largest number"
            )
    return out


def _init_weights(cfg: MQALatentAttentionConfig, seed: int, rank: int, tp: int) -> dict:
    """Rank ``rank``'s weights of ``tp`` ranks (:func:`_draw_weights`): per-rank parameters
    drawn head by head."""
    H = cfg.num_attention_heads
    return _draw_weights(cfg, _full_shapes(cfg), seed, rank, tp, norms=_NORMS,
                         shard_axis=SHARD_AXIS, units=dict.fromkeys(SHARD_AXIS, H))


def init_full_weights(config: MQALatentAttentionConfig, seed: int = 0) -> dict:
    """The unsharded weights (numpy fp32, keyed by parameter name) a layer built with
    ``seed`` holds, all heads.  Shapes: ``wq_a [hidden, q_lora]``, ``q_norm_weight [q_lora]``,
    ``wq_b [q_lora, H*(nope+rope)]`` (head-major columns), ``wkv_a [hidden, kv_lora+rope]``,
    ``kv_norm_weight [kv_lora]``, ``w_uk [H, nope, kv_lora]``, ``w_uv [H, kv_lora, v_head]``,
    ``wo [H*v_head, hidden]`` (head-major rows), ``attn_sink [H]`` (with a sink)."""
    return _init_weights(config, seed, 0, 1)


def _weight_array(name: str, value) -> np.ndarray:
    """A weight given to ``load_full_weights`` as a real host array (a ``paddle.Tensor`` is read
    back; bf16/fp16 through fp32, which holds them exactly)."""
    if isinstance(value, paddle.Tensor):
        if value.dtype not in (paddle.float32, paddle.float64) and value.is_floating_point():
            value = value.astype("float32")
        value = value.numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"load_full_weights: {name}: expected a numpy array, got "
                        f"{type_name(value)}")
    if value.dtype.kind not in "biuf":
        raise TypeError(f"load_full_weights: {name}: expected a real (float, int or bool) "
                        f"array, got dtype {value.dtype}")
    return value


#: the largest finite value of each parameter dtype (numpy has no bfloat16)
_DTYPE_MAX = {paddle.float64: float(np.finfo(np.float64).max),
              paddle.float32: float(np.finfo(np.float32).max),
              paddle.float16: float(np.finfo(np.float16).max),
              paddle.bfloat16: 3.3895313892515355e38}


def _in_range(name: str, value: np.ndarray, dtype) -> np.ndarray:
    """``value`` in the host dtype it is loaded through (fp64 for an fp64 parameter, else
    fp32), refused where it is NaN, infinite or beyond ``dtype``'s largest finite value (it
    would load as inf)."""
    host = np.float64 if dtype == paddle.float64 else np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        wide = np.asarray(value, dtype=np.float64)
        bad = ~(np.abs(wide) <= _DTYPE_MAX.get(dtype, _DTYPE_MAX[paddle.float32]))
    if bad.any():
        raise ValueError(
            f"load_full_weights: {name}: expected finite values within the range of the "
            f"parameter's {str(dtype).rsplit('.', 1)[-1]}, got {int(bad.sum())} NaN, infinite "
            f"or out-of-range value(s) (first: {wide[bad].ravel()[0]!r})"
        )
    return np.asarray(value, dtype=host)


def shard_of(name: str, full: np.ndarray, rank: int, world_size: int, axes=None) -> np.ndarray:
    """This rank's slice of a full parameter (or of its gradient); replicated ones whole.
    ``axes``: the split axis of each per-rank parameter, :data:`SHARD_AXIS` by default."""
    axes = SHARD_AXIS if axes is None else axes
    if name not in axes:
        return full
    return np.split(np.asarray(full), world_size, axis=axes[name])[rank]


def _rms_norm(x, weight, eps):
    var = paddle.mean(x * x, axis=-1, keepdim=True)
    return x * paddle.rsqrt(var + eps) * weight


def _rope(x, positions, theta):
    """Rotate-half RoPE over the last dim of ``x [..., S, (h,) d]``; ``positions [S]``."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    ang = np.outer(positions, inv_freq)  # [S, d/2], float64
    if x.dtype != paddle.float64:
        # fp32 angles (and tables) below fp64: the fp32 layer's numbers as they always were;
        # an fp64 layer gets fp64 tables, so that it agrees with fp64 math to fp64 rounding
        ang = ang.astype(np.float32)
    cos = paddle.to_tensor(np.concatenate([np.cos(ang)] * 2, -1), place=x.place)
    sin = paddle.to_tensor(np.concatenate([np.sin(ang)] * 2, -1), place=x.place)
    if x.ndim == 4:  # [B, S, h, d]: broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    x1, x2 = paddle.split(x, 2, axis=-1)
    rotated = paddle.concat([-x2, x1], axis=-1)
    return x * cos + rotated * sin


class _TensorParallelAttention(paddle.nn.Layer):
    """What the attention layers (:class:`MQALatentAttention`, DeepSeek-V4's
    :class:`~.v4_layer.DeepSeekV4Attention`) share: the tensor-parallel group, the weights
    (built from ``_init_weights``, loaded whole by :meth:`load_full_weights`), the checks of
    ``hidden_states`` (the CPU dtype rule included), packed-document positions, the ranks'
    agreement on the input checks, and the sparse core (bf16 on CUDA, the two attention
    partitions, the fp32 sink).  A subclass names its config class, its weights' builder and
    split axes; this class reads from the config only fields both configs have
    (``tensor_parallel_degree``, ``heads_per_rank``, ``use_attn_sink``, ``hidden_size``,
    ``attention_partition``, ``sm_scale``, ``kernel_dv``, ``backward_backend``,
    ``deterministic``)."""

    # A subclass sets:
    #   config_class: the config class the layer takes;
    #   shard_axis: the split axis of every per-rank parameter (shard_of);
    #   _init_weights: staticmethod (config, seed, rank, tp) -> {name: numpy fp32 weight},
    #       this rank's weights (replicated ones whole).

    def __init__(self, config, group=None, seed: int = 0):
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"config: expected {self.config_class.__name__}, got {type(config).__name__}"
            )
        self.config = config
        self.group = group if group is not None else default_tensor_parallel_group()
        self.tp_size = group_world_size(self.group)
        self.tp_rank = group_rank(self.group)
        if self.tp_size != config.tensor_parallel_degree:
            raise ValueError(
                "config.tensor_parallel_degree must equal the tensor-parallel group size, got "
                f"tensor_parallel_degree={config.tensor_parallel_degree} and a group of "
                f"{self.tp_size} rank(s)"
            )
        self.num_local_heads = config.heads_per_rank
        for name, value in self._init_weights(config, seed, self.tp_rank, self.tp_size).items():
            dtype = "float32" if name == "attn_sink" else paddle.get_default_dtype()
            # Zeros, then one copy of the values: Paddle's Assign initializer takes ~27 s for
            # the 117M-element wo of the deepseek_v32 preset on CPU, this ~1 s.
            param = self.create_parameter(
                shape=list(value.shape),
                dtype=dtype,
                default_initializer=paddle.nn.initializer.Constant(0.0),
            )
            param.set_value(paddle.to_tensor(value).astype(param.dtype))
            setattr(self, name, param)
        if not config.use_attn_sink:
            self.attn_sink = None

    def load_full_weights(self, full: dict) -> None:
        """Copy unsharded weights (numpy, :func:`init_full_weights` layout) into this rank's
        parameters, slicing the per-rank ones.

        Every key of ``full`` must be a parameter of this layer and every parameter must be
        given: a weight this layer would drop (a trained ``attn_sink`` loaded into a
        ``use_attn_sink=False`` layer, a misspelled name) is an error, not a silent loss.
        Each value is a real ``numpy.ndarray`` (float, int or bool; a ``paddle.Tensor`` is
        read back to the host) whose values are finite in the parameter's dtype.
        Everything is checked before any parameter is written.

        Not versioned by Paddle: loading between an op's forward and its backward is not
        detected and gives wrong gradients (``op.mqa_latent_sparse_attention``).

        Raises:
            TypeError: ``full`` not a mapping, a value that is not an array (a list, ``None``,
                a float), or an array of complex, string or object dtype (the weight named).
            ValueError: missing, unknown or unused keys (each named), a slice whose shape
                differs from its parameter's, or a value that is NaN, infinite or beyond the
                parameter dtype's range (``1e300`` into fp32: the weight and its count named).
        """
        if not isinstance(full, Mapping):
            raise TypeError(f"load_full_weights: full: expected a mapping of weight name -> "
                            f"numpy array, got {type_name(full)}")
        params = dict(self.named_parameters())
        missing = [name for name in params if name not in full]
        if missing:
            raise ValueError(f"load_full_weights: missing weight(s) {missing}")
        extra = sorted(map(str, set(full) - set(params)))
        if extra:
            sink = ("; attn_sink is a weight of layers with use_attn_sink=True, this one has "
                    "none" if "attn_sink" in extra and not self.config.use_attn_sink else "")
            raise ValueError(
                f"load_full_weights: weight(s) {extra} are not parameters of this layer, which "
                f"would drop them{sink} (parameters: {sorted(params)})"
            )
        values = {}
        for name, param in params.items():
            # the whole weight is checked, not this rank's slice: every rank refuses alike
            full_value = _in_range(name, _weight_array(name, full[name]), param.dtype)
            value = shard_of(name, full_value, self.tp_rank, self.tp_size, self.shard_axis)
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"load_full_weights: {name} slice has shape {list(value.shape)}, parameter "
                    f"expects {list(param.shape)}"
                )
            values[name] = value
        for name, param in params.items():
            # cast in Paddle to the parameter's dtype (numpy has no bf16: param.numpy() is
            # uint16 there) without reading the parameter back to the host; an fp64 parameter
            # takes the value in fp64 (not through fp32)
            param.set_value(paddle.to_tensor(values[name]).astype(param.dtype))

    def _sink(self):
        """The sink logits in fp32, the op's sink dtype (``layer.to(dtype=...)`` casts them
        with the other parameters; the cast is differentiable), or ``None``."""
        if self.attn_sink is None or self.attn_sink.dtype == paddle.float32:
            return self.attn_sink
        return self.attn_sink.astype("float32")

    def _check_hidden_states(self, hidden_states, **tensors) -> tuple:
        """``(B, S)`` of ``hidden_states [B, S, hidden_size]`` in the parameters' dtype;
        ``tensors`` (by argument name) must be paddle Tensors too.  Errors are named after the
        layer's own arguments and raised before any projection runs."""
        c = self.config
        for name, t in (("hidden_states", hidden_states), *tensors.items()):
            if not isinstance(t, paddle.Tensor):
                raise TypeError(f"{name}: expected a paddle.Tensor, got {type_name(t)}")
        if hidden_states.ndim != 3 or hidden_states.shape[-1] != c.hidden_size:
            raise ValueError(
                f"hidden_states: expected [B, S, hidden_size={c.hidden_size}], got shape "
                f"{list(hidden_states.shape)}"
            )
        # The projections are matmuls with the parameters: their dtype is the only one that
        # works (Paddle fails deep inside matmul otherwise).
        want = self.wq_a.dtype
        name_of = str(want).replace("paddle.", "")
        if self.wq_a.place.is_cpu_place() and name_of not in CPU_DTYPES:
            raise TypeError(
                f"{type(self).__name__}: the layer's parameters are {name_of}, which does not "
                f"run on CPU (Paddle's CPU matmul has no {name_of} kernel); on CPU the layer runs "
                f"in {' or '.join(CPU_DTYPES)} (paddle.set_default_dtype before building it, or "
                f"layer.to(dtype='float32')); {name_of} runs on CUDA"
            )
        if hidden_states.dtype != want:
            raise TypeError(
                f"hidden_states: expected dtype {name_of} (the layer's parameter dtype), got "
                f"{str(hidden_states.dtype).replace('paddle.', '')}"
            )
        B, S, _ = hidden_states.shape
        if B < 1 or S < 1:
            raise ValueError(
                f"hidden_states: expected B >= 1 and S >= 1 in [B, S, hidden_size], got shape "
                f"{list(hidden_states.shape)}"
            )
        return B, S

    def _packed_positions(self, hidden_states, cu_seqlens):
        """``(cu_seqlens as a host int32 array, RoPE positions [S])``: positions count from 0
        in every document."""
        B, S, _ = hidden_states.shape
        cu = check_cu_seqlens(cu_seqlens, S)
        if B != 1:
            raise ValueError(
                f"hidden_states: packed documents (cu_seqlens) need B=1, all documents back to "
                f"back in one row, got shape {list(hidden_states.shape)}"
            )
        starts = np.repeat(cu[:-1], np.diff(cu))  # first row of every row's document
        return cu.astype(np.int32), np.arange(S) - starts

    def _agree_before_exchange(self, error, dims) -> None:
        """``attention_partition="sequence"``: every rank calls this exactly once per forward,
        before the first exchange, with the error its input checks raised (or ``None``) and
        its ``[B, S, L]`` (``None`` when the checks failed before they were known).  One small
        all-reduce tells every rank which ranks failed and every rank's shape; then each rank
        raises (its own error, or a ``ValueError`` naming the failing ranks, or one listing
        differing shapes) or none does.  The inputs must be the same on every rank, but a
        caller's bug that breaks them on some ranks must not leave the others waiting in the
        all-to-all (gloo times out after ~30 s with an opaque error or aborts on the next
        collective; NCCL waits on).  No-op on one rank."""
        if self.tp_size == 1:
            if error is not None:
                raise error
            return
        info = np.zeros((self.tp_size, 4), np.int64)
        info[self.tp_rank] = [error is not None, *(dims if dims is not None else (0, 0, 0))]
        info_t = paddle.to_tensor(info)  # the default place: the rank's device for NCCL
        dist.all_reduce(info_t, op=dist.ReduceOp.SUM, group=self.group)
        info = info_t.numpy()
        if error is not None:
            raise error
        failed = np.flatnonzero(info[:, 0]).tolist()
        if failed:
            raise ValueError(
                f"{type(self).__name__} (attention_partition='sequence'): the input checks failed "
                f"on rank(s) {failed} of the tensor-parallel group (the error is raised there); "
                "hidden_states, token_indices and cu_seqlens must be the same on every rank"
            )
        if (info[:, 1:] != info[self.tp_rank, 1:]).any():
            shapes = ", ".join(f"rank {r}: {row[1:].tolist()}" for r, row in enumerate(info))
            raise ValueError(
                "hidden_states, token_indices: expected the same [B, S, L] on every rank of the "
                "tensor-parallel group (attention_partition='sequence' exchanges rows between "
                f"them), got {shapes}"
            )

    @contextlib.contextmanager
    def _inputs_checked_on_every_rank(self):
        """Around a forward's input checks: with ``attention_partition="sequence"`` an error
        raised inside is first handed to :meth:`_agree_before_exchange` (the ranks whose inputs
        pass are on their way to the same agreement), then raised."""
        try:
            yield
        except Exception as e:
            if self.config.attention_partition == "sequence":
                self._agree_before_exchange(e, None)
            raise

    def _sparse_core(self, query, kv, token_indices, cu_seqlens=None):
        """The sparse attention of ``query [B, S, h, Dk]`` (this rank's heads) over ``kv``:
        ``[B, S, h, Dv]`` in ``query``'s dtype.  On CUDA the op gets bf16 (the kernels' dtype);
        ``config.attention_partition`` picks the heads path (the op on this rank's heads) or
        :meth:`_sequence_partitioned_core`."""
        c = self.config
        compute_dtype = query.dtype
        if query.place.is_gpu_place():  # the kernels take bf16
            query, kv = query.astype("bfloat16"), kv.astype("bfloat16")
        if c.attention_partition == "sequence":
            o = self._sequence_partitioned_core(query, kv, token_indices, cu_seqlens)
        else:
            o = mqa_latent_sparse_attention(
                query, kv, token_indices, c.sm_scale, self._sink(), c.backward_backend,
                d_v=c.kernel_dv, cu_seqlens=cu_seqlens, deterministic=c.deterministic,
            )
        return o.astype(compute_dtype)

    def _sequence_partitioned_core(self, query, kv, token_indices, cu_seqlens):
        """The sparse core with ``attention_partition="sequence"``: ``query [B, S, h, Dk]``
        (this rank's heads, every row, RoPE applied) -> ``o_lat [B, S, h, Dv]``, computed on
        this rank as all ``H`` heads of rows ``r*R .. (r+1)*R - 1``, ``R = ceil(S / TP)``.

        ``S`` is padded to ``R * TP`` with zero query rows whose indices are all ``-1``: such a
        row has no key, so its output, ``lse`` contributions, ``dq``, ``dkv`` and ``d_sink``
        terms are exactly 0 (docs/conventions.md, "Rows with no valid key"), and the pad is cut
        off after the inverse exchange.  ``kv`` is whole on every rank; its gradient here covers
        this rank's rows only and is summed over the group by ``copy_to_tensor_parallel``'s
        backward all-reduce on ``kv`` (the one of the heads partition).  The sink shards are
        gathered to ``[H]``; :class:`~.tp.GatherFromTensorParallel` sums their gradient over the
        group and keeps this rank's slice.
        """
        c = self.config
        tp, group = self.tp_size, self.group
        B, S = query.shape[:2]
        # Index values are checked here, on all S rows and on every rank, before any exchange:
        # the op below sees this rank's rows only, and an error raised by some ranks alone
        # would leave the others waiting in the inverse all-to-all.
        error = None
        try:
            check_values(check_tensors(query, kv, token_indices, d_v=c.kernel_dv), token_indices)
            if cu_seqlens is not None:
                # The op's packed check needs its query rows to be the keys (S_kv = S); here
                # they are a slice of them, so the check runs on the full indices instead.
                check_indices_in_documents(token_indices, cu_seqlens)
        except Exception as e:  # noqa: BLE001 (raised on every rank by the agreement)
            error = e
        self._agree_before_exchange(error, (B, S, int(token_indices.shape[-1])))
        rows = -(-S // tp)
        pad = rows * tp - S
        if pad:  # zero rows after row S - 1 (pads from the first axis to the last)
            query = F.pad(query, [0, 0, 0, pad, 0, 0, 0, 0])
        q_rows = all_to_all(query, 1, 2, group)  # [B, rows, H, Dk]
        lo, hi = min(self.tp_rank * rows, S), min((self.tp_rank + 1) * rows, S)
        idx_rows = token_indices[:, lo:hi]
        if hi - lo < rows:  # this rank holds pad rows: all slots empty (-1)
            idx_rows = F.pad(idx_rows, [0, 0, 0, rows - (hi - lo), 0, 0], value=-1)
        sink = self._sink()
        sink = None if sink is None else gather_from_tensor_parallel(sink, group)
        o_rows = mqa_latent_sparse_attention(
            q_rows, kv, idx_rows, c.sm_scale, sink, c.backward_backend, d_v=c.kernel_dv,
            deterministic=c.deterministic,
        )
        o_lat = all_to_all(o_rows, 2, 1, group)  # [B, rows * TP, h, Dv]
        return o_lat[:, :S] if pad else o_lat


class MQALatentAttention(_TensorParallelAttention):
    """DeepSeek-V3.2-style sparse MLA attention, heads split over a tensor-parallel group.

    Args:
        config: :class:`~paddlefleet.tilelang_ops.attn.config.MQALatentAttentionConfig`;
            ``config.tensor_parallel_degree`` must equal the group's size.
        group: the tensor-parallel group (a ``paddle.distributed`` group); ``None`` uses fleet's
            model-parallel group when hybrid parallel is initialised, else the world group.
        seed: seeds the weights (see :func:`init_full_weights`); equal seeds give every TP
            degree the same model.

    ``config.attention_partition`` (``"heads"`` or ``"sequence"``) picks how the attention
    core is split over the group (module docstring); outputs and gradients are the same
    either way (up to fp32 summation order).

    Dtypes: the parameters take Paddle's default dtype when the layer is built (fp32
    normally; ``attn_sink`` stays fp32).  On CPU the layer runs in float32 and float64 only;
    float16 and bfloat16 layers run on CUDA (Paddle 3.3's CPU matmul has neither kernel).

    Forward:
        hidden_states: ``[B, S, hidden_size]`` in the parameters' dtype (Paddle's default
            dtype when the layer was built, fp32 normally).
        token_indices: ``[B, S, L]`` int32/int64 top-k key positions in ``[0, S)`` or ``-1``
            (``L`` is usually ``config.index_topk``; causality is carried by the indices); a
            paddle.Tensor or a numpy int32/int64 array (as ``indices.causal_topk_indices``
            returns), copied once to ``hidden_states``' place.
        cu_seqlens: ``None``, or the ``[num_docs + 1]`` int32 boundaries of documents packed
            into the one row of a ``B = 1`` batch (a ``paddle.Tensor`` on any place, best the
            CPU, or a ``numpy.ndarray``): starts at 0, non-decreasing, ends at ``S``; document
            ``d`` is rows ``cu_seqlens[d] .. cu_seqlens[d+1] - 1``.  RoPE positions restart at
            0 in every document, and every index of a row must be ``-1`` or a row of its own
            document (``indices.varlen_causal_topk_indices`` builds such indices).  The same on
            every TP rank.
        ``hidden_states``, ``token_indices`` and ``cu_seqlens`` must be the same on every rank.
        With ``"sequence"`` the index values (range, documents) are checked on all rows on
        every rank before the first exchange, so a bad index raises on every rank alike; inputs
        that fail the checks on some ranks only, or differ in ``[B, S, L]``, make every rank
        raise too (one small all-reduce before the exchange; the ranks that passed raise a
        ``ValueError`` naming the failing ranks).
        Returns ``[B, S, hidden_size]`` in ``hidden_states``' dtype, identical on every rank.

    Raises:
        ValueError: ``config.tensor_parallel_degree`` differs from the group size.
        ValueError: ``config.initializer_range`` so large that fp32 weights overflow.
        TypeError (forward): ``hidden_states`` not a paddle.Tensor in the parameters' dtype
            (fp32 by default), or ``token_indices`` not a paddle.Tensor or a numpy int32/int64
            array; a float16/bfloat16
            layer on CPU (named, with the dtypes that run there).
        ValueError (forward): ``hidden_states`` not ``[B, S, hidden_size]`` with ``B, S >= 1``,
            or ``token_indices`` not ``[B, S, L]``; index values as in the op.
        TypeError (forward, with ``cu_seqlens``): ``cu_seqlens`` not an int32 tensor/array.
        ValueError (forward, with ``cu_seqlens``): ``cu_seqlens`` not 1-D with >= 2 entries,
            not starting at 0, decreasing or not ending at ``S`` (checked before any
            projection), ``B != 1``, or an index outside its query's document (raised by the
            op's value checks; the message names the first bad row).
    """

    config_class = MQALatentAttentionConfig
    shard_axis = SHARD_AXIS
    _init_weights = staticmethod(_init_weights)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"heads={c.num_attention_heads}, local_heads={self.num_local_heads}, "
            f"tp_rank={self.tp_rank}/{self.tp_size}, Dk={c.kernel_dk}, Dv={c.kernel_dv}, "
            f"v_head_dim={c.v_head_dim}, topk={c.index_topk}, sink={c.use_attn_sink}"
        )

    def _check_forward_inputs(self, hidden_states, token_indices) -> None:
        B, S = self._check_hidden_states(hidden_states)
        if not isinstance(token_indices, paddle.Tensor):  # numpy was converted by forward
            raise TypeError(f"token_indices: expected a paddle.Tensor or a numpy int32/int64 "
                            f"array, got {type_name(token_indices)}")
        if token_indices.ndim != 3 or list(token_indices.shape[:2]) != [B, S]:
            raise ValueError(
                f"token_indices: expected [B, S, L] with B={B} and S={S} (from hidden_states), "
                f"got shape {list(token_indices.shape)}"
            )

    def forward(
        self,
        hidden_states: paddle.Tensor,
        token_indices: paddle.Tensor,
        cu_seqlens=None,
    ) -> paddle.Tensor:
        c = self.config
        with self._inputs_checked_on_every_rank():
            if isinstance(hidden_states, paddle.Tensor):  # else the check below names it
                token_indices = index_tensor(token_indices, hidden_states)
            self._check_forward_inputs(hidden_states, token_indices)
            B, S, _ = hidden_states.shape
            if cu_seqlens is None:
                positions = np.arange(S)
            else:
                # Read to the host once; the op gets the host copy (no second device read).
                cu_seqlens, positions = self._packed_positions(hidden_states, cu_seqlens)
        h, nope, rope = self.num_local_heads, c.qk_nope_head_dim, c.qk_rope_head_dim

        # Query path: replicated down-projection, then this rank's heads.
        c_q = _rms_norm(paddle.matmul(hidden_states, self.wq_a), self.q_norm_weight, c.rms_norm_eps)
        c_q = copy_to_tensor_parallel(c_q, self.group)
        q = paddle.matmul(c_q, self.wq_b).reshape([B, S, h, nope + rope])
        q_nope, q_pe = paddle.split(q, [nope, rope], axis=-1)
        q_lat = paddle.einsum("bshd,hdc->bshc", q_nope, self.w_uk)  # absorb W_UK
        query = paddle.concat([q_lat, _rope(q_pe, positions, c.rope_theta)], axis=-1)

        # Shared latent kv (one MQA head), replicated on every rank.
        kv_a = paddle.matmul(hidden_states, self.wkv_a)
        c_kv, k_pe = paddle.split(kv_a, [c.kv_lora_rank, rope], axis=-1)
        kv = paddle.concat(
            [_rms_norm(c_kv, self.kv_norm_weight, c.rms_norm_eps), _rope(k_pe, positions, c.rope_theta)],
            axis=-1,
        )
        kv = copy_to_tensor_parallel(kv, self.group)

        o_lat = self._sparse_core(query, kv, token_indices, cu_seqlens)

        o = paddle.einsum("bshc,hcv->bshv", o_lat, self.w_uv)  # W_UV after the attention
        y = paddle.matmul(o.reshape([B, S, h * c.v_head_dim]), self.wo)
        return reduce_from_tensor_parallel(y, self.group)
