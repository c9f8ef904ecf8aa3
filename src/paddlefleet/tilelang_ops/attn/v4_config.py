"""Configuration of DeepSeek-V4's sparse attention block (:class:`~.v4_layer.DeepSeekV4Attention`).

:class:`DeepSeekV4AttentionConfig` holds the sizes of one attention block of DeepSeek-V4, in
the terms of its public training code (radixark/miles ``miles_plugins/models/deepseek_v4/``:
``deepseek_v4.py``, ``ARCHITECTURE.md``), plus what this package adds (backward backend,
tensor-parallel degree, attention partition).  What the sparse kernel sees::

    Dk = Dv = head_dim          (512: one single-head kv row is key and value; RoPE on its
                                 last qk_rope_head_dim = 64 columns)
    L  = window_size + compressed slots (compressed_topk, or S // compress_ratio, or 0)

The three layer types of V4 are one field, ``compress_ratio``: ``None`` (sliding window only),
``4`` (window + ``compressed_topk`` compressed tokens picked by a learned indexer, which is out
of scope: the caller passes the picks) and ``128`` (window + every complete past group).

Built from a preset (``get_preset("deepseek_v4_flash")`` / ``"deepseek_v4_small"``, also
through ``config.get_preset`` and ``config.load_config``), a mapping or a JSON file; a bad
field raises ``ValueError`` naming the field when the config is built.
"""

from __future__ import annotations

import dataclasses

from .config import _AttentionConfig

__all__ = ["DeepSeekV4AttentionConfig", "COMPRESS_RATIOS", "PRESETS", "get_preset"]

#: ``compress_ratio`` values of DeepSeek-V4's layers (``None``: window only).
COMPRESS_RATIOS = (None, 4, 128)

_POSITIVE_INT_FIELDS = ("hidden_size", "num_attention_heads", "q_lora_rank", "head_dim",
                        "qk_rope_head_dim", "o_lora_rank", "o_groups", "window_size",
                        "tensor_parallel_degree")


@dataclasses.dataclass(frozen=True)
class DeepSeekV4AttentionConfig(_AttentionConfig):
    """Sizes and options of one DeepSeek-V4 sparse attention block.

    Attributes:
        hidden_size: model width (input and output features of the block); V4-Flash 4096.
        num_attention_heads: query heads over all tensor-parallel ranks; V4-Flash 64.
        q_lora_rank: width of the low-rank query (``wq_a`` output); V4-Flash 1024.
        head_dim: query, key and value width ``D`` (``Dk = Dv``); 512.
        qk_rope_head_dim: rotary width, the last columns of q, kv and the output; 64.
        o_lora_rank: width of each head group's low-rank output (``wo_a``); 1024.
        o_groups: head groups of the grouped output projection; 8.  Must divide the heads and
            be divisible by ``tensor_parallel_degree`` (each rank holds whole groups).
        window_size: causal sliding window of every row; 128.
        compress_ratio: ``None`` (window only), ``4`` or ``128`` tokens per compressed kv row.
        compressed_topk: compressed keys the indexer picks per row (ratio 4 only, where it is
            required: V4-Flash 512, V4-Pro 1024); ``None`` otherwise.
        softmax_scale: multiplies ``q.k``; ``None`` means ``head_dim ** -0.5``.  Read the
            resolved value from :attr:`sm_scale`.
        use_attn_sink: learn a per-head sink logit (fp32; docs/conventions.md).
        backward_backend: ``"tilelang"``, ``"reference"`` or ``None`` (op's default).
        deterministic: bitwise-repeatable backward (``True``), the atomic one (``False``) or
            ``None`` (Paddle's ``FLAGS_cudnn_deterministic`` where set, else ``True``), as for
            the V3.2 block (``MQALatentAttentionConfig.deterministic``).
        tensor_parallel_degree: ranks the heads (and head groups) are split over.
        attention_partition: ``"heads"`` or ``"sequence"``, as for the V3.2 block
            (``config.ATTENTION_PARTITIONS``; docs/layer.md).
        rope_theta: RoPE base of a window-only layer (V4: 10000).
        compress_rope_theta: RoPE base of a layer with compression, for q, kv and the
            compressed kv alike (V4: 160000; miles ``deepseek_v4.py`` picks the layer's base by
            its ``compress_ratio``).
        rms_norm_eps: epsilon of every RMSNorm; in float32's normal range ``[1.18e-38,
            3.4e38]``, as for the V3.2 block.
        initializer_range: standard deviation of the random (fp32) weight initialisation; in
            float32's normal range.

    The fields are checked as the V3.2 block's are (``MQALatentAttentionConfig``): sizes are
    ints in ``[1, 2**31 - 1]``; numbers may be given as numpy scalars and are stored as Python
    ``int`` / ``float`` / ``bool``; a bad field raises ``ValueError`` naming
    ``DeepSeekV4AttentionConfig.<field>``.
    """

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    window_size: int = 128
    compress_ratio: int | None = None
    compressed_topk: int | None = None
    softmax_scale: float | None = None
    use_attn_sink: bool = True
    backward_backend: str | None = None
    deterministic: bool | None = None
    tensor_parallel_degree: int = 1
    attention_partition: str = "heads"
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self):
        # the V3.2 config's field checks (config._AttentionConfig), with its messages
        self._check_sizes(*_POSITIVE_INT_FIELDS)
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            self._refuse("qk_rope_head_dim", f"even (rotary pairs) and at most head_dim="
                                             f"{self.head_dim}")
        if self.num_attention_heads % self.o_groups:
            self._refuse("o_groups", f"a divisor of num_attention_heads={self.num_attention_heads}")
        self._check_divisible("o_groups", "tensor_parallel_degree",
                              " (each rank holds whole head groups)")
        self._check_choice("compress_ratio", COMPRESS_RATIOS[1:], optional=True,
                           expected=f"one of {list(COMPRESS_RATIOS)}")
        if self.compress_ratio == 4:
            self._check_sizes("compressed_topk",
                              qualifier=" with compress_ratio=4, the indexer's top-k")
            self._check_sum_fits("the top-k width L", "window_size", "compressed_topk")
        elif self.compressed_topk is not None:
            self._refuse("compressed_topk", f"None with compress_ratio={self.compress_ratio!r} "
                                            "(only ratio-4 layers pick their compressed keys)")
        self._check_shared_options()
        self._check_float("compress_rope_theta", "positive")

    # --- derived sizes -----------------------------------------------------------------------
    @property
    def sm_scale(self) -> float:
        """The resolved softmax scale (``softmax_scale`` or ``head_dim ** -0.5``)."""
        return float(self.softmax_scale if self.softmax_scale is not None
                     else self.head_dim ** -0.5)

    @property
    def kernel_dk(self) -> int:
        """Query/key width the kernel sees: ``head_dim``."""
        return self.head_dim

    @property
    def kernel_dv(self) -> int:
        """Value width the kernel sees: ``head_dim`` (the whole kv row)."""
        return self.head_dim

    @property
    def groups_per_rank(self) -> int:
        return self.o_groups // self.tensor_parallel_degree

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def layer_rope_theta(self) -> float:
        """The RoPE base of this layer: ``compress_rope_theta`` with compression, else
        ``rope_theta``."""
        return float(self.rope_theta if self.compress_ratio is None else self.compress_rope_theta)

    def keys_per_row(self, seq_len: int) -> int:
        """``L`` of the top-k indices at ``seq_len`` tokens: the window plus
        ``compressed_topk`` (ratio 4), ``seq_len // 128`` (ratio 128) or nothing."""
        if self.compress_ratio is None:
            return self.window_size
        if self.compressed_topk is not None:
            return self.window_size + self.compressed_topk
        return self.window_size + seq_len // self.compress_ratio


#: DeepSeek-V4-Flash's attention sizes (miles ``ARCHITECTURE.md`` and the asserts of
#: ``deepseek_v4.py``: hidden 4096, 64 heads, q_lora_rank 1024, head_dim 512 with 64 rope,
#: o_lora_rank 1024 in 8 groups, window 128), as its ratio-4 layer (indexer top-k 512).
_DEEPSEEK_V4_FLASH = dict(
    hidden_size=4096,
    num_attention_heads=64,
    q_lora_rank=1024,
    o_lora_rank=1024,
    o_groups=8,
    head_dim=512,
    qk_rope_head_dim=64,
    window_size=128,
    compress_ratio=4,
    compressed_topk=512,
)

#: The same structure at CPU sizes, with the real (512, 512) head and V4-Flash's per-rank layout
#: at TP 8 (64 heads in 8 groups: 8 heads, one group per rank), ratio 4 with 64 compressed
#: picks; a step at 512 tokens takes ~10 s on 2 busy cores.
_DEEPSEEK_V4_SMALL = dict(
    hidden_size=256,
    num_attention_heads=64,
    q_lora_rank=96,
    o_lora_rank=64,
    o_groups=8,
    head_dim=512,
    qk_rope_head_dim=64,
    window_size=128,
    compress_ratio=4,
    compressed_topk=64,
    backward_backend="reference",
)

#: DeepSeek-V4 presets by name (their one source; ``config.get_preset`` finds them too).
PRESETS: dict = {"deepseek_v4_flash": _DEEPSEEK_V4_FLASH, "deepseek_v4_small": _DEEPSEEK_V4_SMALL}


def get_preset(name: str, **overrides) -> DeepSeekV4AttentionConfig:
    """A DeepSeek-V4 preset by name (``"deepseek_v4_flash"``, ``"deepseek_v4_small"``), fields
    overridable (``compress_ratio=128, compressed_topk=None`` gives the ratio-128 layer).

    Raises:
        ValueError: an unknown name, or a bad field (named).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown DeepSeek-V4 preset {name!r}; choose one of {sorted(PRESETS)}")
    return DeepSeekV4AttentionConfig.from_dict({**PRESETS[name], **overrides})
