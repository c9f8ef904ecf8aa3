"""MQALatentAttentionConfig.from_fleet_config: PaddleFleet's field names and rules, read from a
stand-in of its TransformerConfig (a dataclass with the same names and defaults)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import REPO_ROOT
from paddlefleet.tilelang_ops.attn.config import MQALatentAttentionConfig
from paddlefleet.tilelang_ops.attn.fleet_config import FLEET_FIELDS

SIZES = dict(hidden_size=256, num_attention_heads=16, q_lora_rank=96, kv_lora_rank=64,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)


@dataclasses.dataclass
class FleetTransformerConfig:
    """The fields PaddleFleet's TransformerConfig / ModelParallelConfig give them, with its
    defaults where it has them (transformer_config.py), small sizes otherwise."""
    hidden_size: int = 256
    num_attention_heads: int = 16
    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int | None = 32
    head_dim: int | None = None
    dsa_index_topk: int = 2048
    softmax_scale: float | None = None
    softmax_type: str = "vanilla"
    add_full_attention_sink_bias: bool = False
    mqa_sparse_attn_backward_backend: str = "cudnn"
    tensor_model_parallel_size: int = 1
    rope_theta: float = 10000.0
    rotary_base: float | None = None
    rotary_scaling_factor: float = 40
    mscale_all_dim: float = 0.0
    rms_norm_eps: float = 1e-5
    init_method_std: float = 0.02
    hybrid_mla_num_attention_heads: int | None = None
    hybrid_mla_q_lora_rank: int | None = None
    hybrid_mla_kv_lora_rank: int | None = None
    hybrid_mla_qk_nope_head_dim: int | None = None
    hybrid_mla_qk_rope_head_dim: int | None = None
    hybrid_mla_v_head_dim: int | None = None


def fleet(**changes):
    """A deterministic-backward fleet config (the one line a PaddleFleet user changes)."""
    return FleetTransformerConfig(**{"mqa_sparse_attn_backward_backend": "tilelang", **changes})


def test_every_field_maps_to_its_counterpart():
    cfg = MQALatentAttentionConfig.from_fleet_config(fleet(
        dsa_index_topk=128, add_full_attention_sink_bias=True, tensor_model_parallel_size=4,
        rope_theta=50000.0, rms_norm_eps=1e-6, init_method_std=0.006))
    assert cfg == MQALatentAttentionConfig(
        **SIZES, index_topk=128, softmax_scale=None, use_attn_sink=True,
        backward_backend="tilelang", tensor_parallel_degree=4, rope_theta=50000.0,
        rms_norm_eps=1e-6, initializer_range=0.006)


def test_scale_is_the_mha_head_width_not_the_latent():
    """PaddleFleet's MQALatentAttention keeps the MHA scale k_channels ** -0.5 with
    k_channels = qk_nope + qk_rope (48 here), not the absorbed width Dk = kv_lora + rope (80)."""
    cfg = MQALatentAttentionConfig.from_fleet_config(fleet())  # rotary 40, mscale_all_dim 0
    assert cfg.softmax_scale is None
    assert cfg.sm_scale == 48 ** -0.5
    assert cfg.sm_scale != cfg.kernel_dk ** -0.5


@pytest.mark.parametrize("factor, mscale_all_dim, mscale", [
    (4.0, 1.0, 1.1386294361119891),   # 0.1 * ln 4 + 1, PaddleFleet's own pinned value
    (16.0, 0.5, 1.1386294361119891),  # 0.05 * ln 16 + 1
    (1.0, 5.0, 1.0),                  # rotary_scaling_factor <= 1: no YaRN factor
])
def test_scale_takes_paddlefleets_yarn_mscale(factor, mscale_all_dim, mscale):
    cfg = MQALatentAttentionConfig.from_fleet_config(
        fleet(rotary_scaling_factor=factor, mscale_all_dim=mscale_all_dim))
    assert cfg.sm_scale == pytest.approx(mscale ** 2 / math.sqrt(48), rel=1e-12)
    assert (cfg.softmax_scale is None) == (mscale == 1.0)


def test_explicit_softmax_scale_and_overrides_win():
    assert MQALatentAttentionConfig.from_fleet_config(
        fleet(softmax_scale=0.125, mscale_all_dim=1.0)).sm_scale == 0.125
    cfg = MQALatentAttentionConfig.from_fleet_config(
        fleet(mscale_all_dim=1.0), softmax_scale=0.5, attention_partition="sequence")
    assert (cfg.sm_scale, cfg.attention_partition) == (0.5, "sequence")
    # the YaRN scale follows overridden head dims
    cfg = MQALatentAttentionConfig.from_fleet_config(
        fleet(rotary_scaling_factor=4.0, mscale_all_dim=1.0), qk_nope_head_dim=48)
    assert cfg.sm_scale == pytest.approx(1.1386294361119891 ** 2 / 8, rel=1e-12)


def test_hybrid_mla_sizes_win_when_set():
    cfg = MQALatentAttentionConfig.from_fleet_config(fleet(
        hybrid_mla_num_attention_heads=8, hybrid_mla_q_lora_rank=48, hybrid_mla_kv_lora_rank=32,
        hybrid_mla_qk_nope_head_dim=16, hybrid_mla_qk_rope_head_dim=8, hybrid_mla_v_head_dim=24,
        mscale_all_dim=1.0, rotary_scaling_factor=4.0))
    assert (cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim, cfg.v_head_dim) == (8, 48, 32, 16, 8, 24)
    assert cfg.sm_scale == pytest.approx(1.1386294361119891 ** 2 / math.sqrt(24), rel=1e-12)


def test_v_head_dim_none_follows_paddlefleets_post_init():
    assert MQALatentAttentionConfig.from_fleet_config(
        fleet(v_head_dim=None, head_dim=40)).v_head_dim == 40
    assert MQALatentAttentionConfig.from_fleet_config(
        fleet(v_head_dim=None)).v_head_dim == 256 // 16


@pytest.mark.parametrize("changes, sink", [
    (dict(softmax_type="learnable"), True),
    (dict(softmax_type="vanilla", add_full_attention_sink_bias=True), True),
    (dict(softmax_type="vanilla", add_full_attention_sink_bias=False), False),
])
def test_sink_switch(changes, sink):
    assert MQALatentAttentionConfig.from_fleet_config(fleet(**changes)).use_attn_sink is sink


def test_off_by_one_softmax_is_refused():
    with pytest.raises(ValueError, match="softmax_type='off-by-one'"):
        MQALatentAttentionConfig.from_fleet_config(fleet(softmax_type="off-by-one"))


def test_cudnn_backward_is_refused_unless_overridden():
    with pytest.raises(ValueError, match="mqa_sparse_attn_backward_backend='cudnn'.*'tilelang'"):
        MQALatentAttentionConfig.from_fleet_config(FleetTransformerConfig())
    cfg = MQALatentAttentionConfig.from_fleet_config(FleetTransformerConfig(),
                                                     backward_backend="reference")
    assert cfg.backward_backend == "reference"


def test_absent_fields_take_this_packages_defaults():
    ns = SimpleNamespace(**SIZES, dsa_index_topk=64)
    cfg = MQALatentAttentionConfig.from_fleet_config(ns)
    assert cfg == MQALatentAttentionConfig(**SIZES, index_topk=64)
    assert cfg.use_attn_sink and cfg.backward_backend is None and cfg.tensor_parallel_degree == 1


def test_missing_size_names_the_paddlefleet_field():
    ns = SimpleNamespace(**SIZES)
    with pytest.raises(ValueError, match="field dsa_index_topk is missing.*index_topk="):
        MQALatentAttentionConfig.from_fleet_config(ns)
    assert MQALatentAttentionConfig.from_fleet_config(ns, index_topk=8).index_topk == 8
    with pytest.raises(ValueError, match="q_lora_rank is missing or None .None there means no"):
        MQALatentAttentionConfig.from_fleet_config(fleet(q_lora_rank=None))


@pytest.mark.parametrize("field, value", [
    ("hidden_size", 256.0), ("num_attention_heads", True), ("q_lora_rank", "96"),
    ("kv_lora_rank", 0), ("qk_rope_head_dim", -16), ("dsa_index_topk", 2048.5),
    ("hybrid_mla_v_head_dim", "24"), ("tensor_model_parallel_size", "2"),
    ("softmax_scale", 0.0), ("softmax_scale", float("nan")), ("rms_norm_eps", -1e-6),
    ("init_method_std", "0.02"), ("rope_theta", float("inf")), ("rotary_base", 0),
    ("rotary_scaling_factor", "40"), ("mscale_all_dim", "1"),
    ("add_full_attention_sink_bias", 1), ("softmax_type", "Learnable"),
    ("mqa_sparse_attn_backward_backend", "TileLang"), ("mqa_sparse_attn_backward_backend", 1),
])
def test_a_wrong_type_or_value_names_the_paddlefleet_field(field, value):
    with pytest.raises(ValueError, match=rf"PaddleFleet config field {field}\b"):
        MQALatentAttentionConfig.from_fleet_config(fleet(**{field: value}))


def test_numpy_scalars_are_accepted():
    cfg = MQALatentAttentionConfig.from_fleet_config(
        fleet(num_attention_heads=np.int64(16), rms_norm_eps=np.float32(1e-6)))
    assert type(cfg.num_attention_heads) is int and cfg.num_attention_heads == 16


@pytest.mark.parametrize("field,extra", [("rope_theta", {}), ("rms_norm_eps", {}),
                                         ("hidden_size", {}), ("tensor_model_parallel_size", {}),
                                         ("mscale_all_dim", {"rotary_scaling_factor": 40})])
def test_a_huge_integer_is_named_with_its_paddlefleet_field(field, extra):
    """The config's rules (issue 41, item 4) for the PaddleFleet fields too: 10**400 in a float
    field raised a raw OverflowError from math.isfinite; a huge int is named by its size."""
    with pytest.raises(ValueError, match=rf"^PaddleFleet config field {field} must be .*, got an "
                                         r"integer of 1329 bits \(about 10\*\*400\)$"):
        MQALatentAttentionConfig.from_fleet_config(fleet(**{field: 10**400}, **extra))


def test_numpy_bool_sink_bias_is_taken_by_value():
    cfg = MQALatentAttentionConfig.from_fleet_config(fleet(add_full_attention_sink_bias=np.True_))
    assert cfg.use_attn_sink is True


def test_a_config_check_names_the_paddlefleet_fields_involved():
    with pytest.raises(ValueError, match="divisible by tensor_parallel_degree.*"
                                         "tensor_parallel_degree <- tensor_model_parallel_size"):
        MQALatentAttentionConfig.from_fleet_config(fleet(tensor_model_parallel_size=3))
    with pytest.raises(ValueError, match="unknown field.*no_such_field"):
        MQALatentAttentionConfig.from_fleet_config(fleet(), no_such_field=1)


def test_rotary_base_is_rope_thetas_former_name():
    ns = SimpleNamespace(**SIZES, dsa_index_topk=64, rotary_base=40000.0)
    assert MQALatentAttentionConfig.from_fleet_config(ns).rope_theta == 40000.0
    assert MQALatentAttentionConfig.from_fleet_config(fleet(rotary_base=10000.0)).rope_theta == 1e4
    with pytest.raises(ValueError, match="rope_theta=10000.0 and rotary_base=5000.0 differ"):
        MQALatentAttentionConfig.from_fleet_config(fleet(rotary_base=5000.0))


def test_docs_table_lists_every_mapped_field():
    section = (REPO_ROOT / "docs" / "layer.md").read_text().split(
        "## From a PaddleFleet model", 1)[1].split("\n## ", 1)[0]
    for ours, theirs in FLEET_FIELDS.items():
        for name in (ours, *theirs.split(" / ")):
            assert f"`{name}`" in section, name


def test_one_rank_group_is_rank_0_of_it():
    """Paddle 3.3.1 reports rank -1 to the member of a one-rank group (fleet's mp group at
    mp_degree 1), which gave the layer a negative TP rank after fleet.init."""
    from paddlefleet.tilelang_ops.attn.tp import group_rank

    assert group_rank(SimpleNamespace(rank=-1, nranks=1, ranks=[0])) == 0
    assert group_rank(SimpleNamespace(rank=1, nranks=2, ranks=[0, 1])) == 1
    with pytest.raises(ValueError, match=r"not a member of the tensor-parallel group \(ranks \[3"):
        group_rank(SimpleNamespace(rank=-1, nranks=2, ranks=[3, 4]))


def test_a_mapping_is_read_by_key():
    """Break-it 7: a ``dict`` said "field hidden_size is missing or None".  A mapping of the
    PaddleFleet names (a parsed config file) is now read by key, the same as the object."""
    cfg = fleet(dsa_index_topk=64, tensor_model_parallel_size=2, rms_norm_eps=1e-6)
    as_dict = dataclasses.asdict(cfg)
    assert (MQALatentAttentionConfig.from_fleet_config(as_dict)
            == MQALatentAttentionConfig.from_fleet_config(cfg))
    assert MQALatentAttentionConfig.from_fleet_config(as_dict).tensor_parallel_degree == 2


@pytest.mark.parametrize("config, shown", [(None, "None"), ("deepseek", "str"), (7, "int"),
                                           ([1, 2], "list")])
def test_a_value_that_is_no_config_is_a_type_error(config, shown):
    """Break-it 7: ``None`` said "field hidden_size is missing or None"."""
    with pytest.raises(TypeError, match=rf"^from_fleet_config: config: expected a PaddleFleet "
                                        rf"TransformerConfig .* got {shown}"):
        MQALatentAttentionConfig.from_fleet_config(config)
