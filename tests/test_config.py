"""attn/config.py: MQALatentAttentionConfig's derived sizes, validation naming the field,
(de)serialisation, presets."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from paddlefleet.tilelang_ops.attn.config import (
    ATTENTION_PARTITIONS,
    PRESETS,
    MQALatentAttentionConfig,
    get_preset,
    load_config,
)



def test_deepseek_v32_sizes():
    cfg = get_preset("deepseek_v32")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (
        7168, 128, 1536, 512,
    )
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.index_topk) == (
        128, 64, 128, 2048,
    )
    # Absorbed MLA: the kernel sees Dk = 512 latent + 64 rope and Dv = the 512 latent.
    assert cfg.kernel_dk == 576 and cfg.kernel_dv == 512
    assert cfg.sm_scale == pytest.approx(192**-0.5)
    assert cfg.replace(softmax_scale=0.1).sm_scale == 0.1


def test_small_preset_splits_over_eight_ranks():
    cfg = get_preset("deepseek_v32_small", tensor_parallel_degree=8)
    assert cfg.heads_per_rank * 8 == cfg.num_attention_heads
    assert cfg.kernel_dk == cfg.kv_lora_rank + cfg.qk_rope_head_dim


@pytest.mark.parametrize(
    "field,value",
    [
        ("hidden_size", 0),
        ("num_attention_heads", -4),
        ("q_lora_rank", 1.5),
        ("kv_lora_rank", None),
        ("qk_nope_head_dim", 0),
        ("qk_rope_head_dim", 0),
        ("v_head_dim", True),
        ("index_topk", 0),
        ("tensor_parallel_degree", 0),
        ("softmax_scale", -1.0),
        ("rope_theta", 0.0),
        ("rms_norm_eps", -1e-6),
        ("softmax_scale", float("inf")),
        ("softmax_scale", float("nan")),
        ("softmax_scale", 1e39),  # inf in float32, the kernels' scalar
        ("softmax_scale", 0),
        ("rope_theta", float("inf")),
        ("rms_norm_eps", float("nan")),
        ("initializer_range", float("inf")),
        ("use_attn_sink", "yes"),
        ("backward_backend", "flash"),
        ("deterministic", "yes"),
        ("deterministic", 1),
        ("qk_rope_head_dim", 15),
    ],
)
def test_bad_field_named(field, value):
    with pytest.raises(ValueError, match=rf"MQALatentAttentionConfig\.{field}"):
        get_preset("deepseek_v32_small", **{field: value})


@pytest.mark.parametrize("value", ["Sequence", "seq", "", None, 1, ["heads"]])
def test_bad_attention_partition_names_the_field_and_the_choices(value):
    with pytest.raises(ValueError) as e:
        get_preset("deepseek_v32_small", attention_partition=value)
    assert str(e.value) == (
        "MQALatentAttentionConfig.attention_partition must be one of ('heads', 'sequence'), got "
        f"{value!r}"
    )


@pytest.mark.parametrize("field,choice", [("attention_partition", "sequence"),
                                          ("backward_backend", "reference")])
def test_choice_fields_take_strings_only_and_store_plain_str(tmp_path, field, choice):
    """A 0-d numpy string array compares equal to a choice (``np.array('heads') == 'heads'``),
    so a membership test alone let it in: the config then could not be hashed or written to
    JSON.  Non-strings are rejected; str subclasses (numpy strings, str enums) are stored as
    the plain str, so the config equals, hashes and serialises like one built from the str."""
    import enum

    import numpy as np

    with pytest.raises(ValueError, match=rf"^MQALatentAttentionConfig\.{field} must be one of .*got "
                                         r"array\("):
        get_preset("deepseek_v32_small", **{field: np.array(choice)})

    class Choice(str, enum.Enum):
        member = choice

    plain = get_preset("deepseek_v32_small", **{field: choice})
    for value in (np.str_(choice), Choice.member):
        cfg = get_preset("deepseek_v32_small", **{field: value})
        assert type(getattr(cfg, field)) is str and getattr(cfg, field) == choice
        assert f"{getattr(cfg, field)}" == choice  # log lines print the choice, not the enum
        assert cfg == plain and hash(cfg) == hash(plain)
        path = tmp_path / f"{field}.json"
        cfg.to_json_file(path)
        assert json.loads(path.read_text())[field] == choice and load_config(str(path)) == plain


def test_attention_partition_default_choices_and_json(tmp_path):
    assert ATTENTION_PARTITIONS == ("heads", "sequence")
    for name in PRESETS:  # today's behaviour unless asked, in the presets and as JSON files
        assert get_preset(name).attention_partition == "heads"
        get_preset(name).to_json_file(tmp_path / f"{name}.json")
        assert json.loads((tmp_path / f"{name}.json").read_text())["attention_partition"] == "heads"
    cfg = get_preset("deepseek_v32_small", attention_partition="sequence", tensor_parallel_degree=8)
    path = tmp_path / "seq.json"
    cfg.to_json_file(path)
    assert json.loads(path.read_text())["attention_partition"] == "sequence"
    assert load_config(str(path)) == cfg
    assert load_config("deepseek_v32_small", attention_partition="sequence").attention_partition == (
        "sequence"
    )


def test_heads_must_divide_over_ranks():
    with pytest.raises(ValueError, match="num_attention_heads.*tensor_parallel_degree=3"):
        get_preset("deepseek_v32_small", tensor_parallel_degree=3)
    with pytest.raises(ValueError, match="tensor_parallel_degree"):
        get_preset("deepseek_v32").replace(tensor_parallel_degree=5)


def test_dict_round_trip_and_unknown_keys():
    cfg = get_preset("deepseek_v32_small", backward_backend=None, softmax_scale=0.25)
    assert MQALatentAttentionConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown field.*num_heads"):
        MQALatentAttentionConfig.from_dict({**cfg.to_dict(), "num_heads": 8})
    data = cfg.to_dict()
    del data["v_head_dim"]
    with pytest.raises(ValueError, match="missing.*v_head_dim"):
        MQALatentAttentionConfig.from_dict(data)
    with pytest.raises(TypeError):
        MQALatentAttentionConfig.from_dict([("hidden_size", 8)])


@pytest.mark.parametrize("value", [None, True, False])
def test_deterministic_round_trips(tmp_path, value):
    """Issue 42: the backward's determinism is a config field (default None: Paddle's
    FLAGS_cudnn_deterministic where set, else True), kept through dict, JSON and replace."""
    assert get_preset("deepseek_v32").deterministic is None
    cfg = get_preset("deepseek_v32_small", deterministic=value)
    assert cfg.deterministic is value
    assert MQALatentAttentionConfig.from_dict(cfg.to_dict()) == cfg
    path = tmp_path / "cfg.json"
    cfg.to_json_file(path)
    assert json.loads(path.read_text())["deterministic"] is value
    assert load_config(path).deterministic is value
    assert cfg.replace(deterministic=not value).deterministic is (not value)


def test_deterministic_takes_numpy_bools_by_value(tmp_path):
    """Like use_attn_sink (issue 41: numpy scalars by value), np.bool_ is stored as a bool, so
    the config still saves as JSON."""
    cfg = get_preset("deepseek_v32_small", deterministic=np.False_)
    assert cfg.deterministic is False
    cfg.to_json_file(tmp_path / "cfg.json")
    assert load_config(tmp_path / "cfg.json").deterministic is False


def test_json_round_trip(tmp_path):
    cfg = get_preset("deepseek_v32", tensor_parallel_degree=8)
    path = tmp_path / "cfg.json"
    cfg.to_json_file(path)
    assert MQALatentAttentionConfig.from_json_file(path) == cfg
    assert load_config(str(path)) == cfg
    assert load_config(path, tensor_parallel_degree=2).tensor_parallel_degree == 2


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_as_json_files(name, tmp_path):
    """The presets live in the code only; each one written to a file loads back unchanged."""
    path = tmp_path / f"{name}.json"
    get_preset(name).to_json_file(path)
    assert MQALatentAttentionConfig.from_json_file(path) == get_preset(name)
    assert load_config(str(path)) == load_config(name)
    assert json.loads(path.read_text())["hidden_size"] > 0


def test_load_config_errors():
    assert load_config("deepseek_v32_small") == get_preset("deepseek_v32_small")
    with pytest.raises(ValueError, match="neither a preset"):
        load_config("deepseek_v99")
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("nope")


def test_json_and_preset_paths_raise_the_same(tmp_path):
    """Unknown overrides are the same ValueError for a preset and a JSON file (the file path
    used to give a TypeError from __init__), and replace() agrees."""
    path = tmp_path / "cfg.json"
    get_preset("deepseek_v32_small").to_json_file(path)
    for source in ("deepseek_v32_small", str(path)):
        with pytest.raises(ValueError, match=r"unknown field\(s\) \['foo'\]"):
            load_config(source, foo=1)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['foo'\]"):
        get_preset("deepseek_v32_small").replace(foo=1)
    assert load_config(str(path), softmax_scale=0.5).softmax_scale == 0.5


def test_bad_json_file_named(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"config file '.*broken\.json' is not valid JSON"):
        load_config(str(bad))
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"broken\.json': expected a JSON object.*got a JSON list"):
        MQALatentAttentionConfig.from_json_file(bad)


def test_json_field_given_twice_is_an_error(tmp_path):
    """A field written twice in a JSON file (an edit that added a line instead of changing
    one) used to be read silently as its last value: the run used "heads" although the file
    also says "sequence".  It is a ValueError naming the file and the field."""
    data = get_preset("deepseek_v32_small").to_dict()
    del data["attention_partition"]
    body = json.dumps(data)[:-1] + ', "attention_partition": "sequence", "attention_partition": "heads"}'
    path = tmp_path / "dup.json"
    path.write_text(body)
    assert json.loads(body)["attention_partition"] == "heads"  # what plain json.load makes of it
    with pytest.raises(ValueError, match=r"^config file '.*dup\.json': field "
                                         r"'attention_partition' is given 2 times \(values "
                                         r"'sequence', 'heads'\)$"):
        load_config(str(path))
    path.write_text(json.dumps(data)[:-1] + ', "attention_partition": "sequence"}')
    assert load_config(str(path)).attention_partition == "sequence"  # once: fine


def test_numpy_scalars_are_taken_by_value_and_saved(tmp_path):
    """Issue 41, item 1: ``softmax_scale=np.float32(0.125)`` was stored unconverted, so that
    ``to_json_file`` raised ``TypeError: Object of type float32 is not JSON serializable``
    (after truncating the file), and ``num_attention_heads=np.int64(16)`` was refused.  Numbers
    are taken by value and stored as Python ``int`` / ``float`` / ``bool``; bools are still not
    numbers."""
    import numpy as np

    plain = get_preset("deepseek_v32_small", softmax_scale=0.125, rope_theta=5e5)
    cfg = get_preset("deepseek_v32_small", softmax_scale=np.float32(0.125),
                     num_attention_heads=np.int64(16), hidden_size=np.int32(256),
                     rope_theta=np.float64(5e5), rms_norm_eps=np.float32(1e-6),
                     use_attn_sink=np.bool_(True))
    assert type(cfg.softmax_scale) is float and cfg.softmax_scale == 0.125
    assert type(cfg.num_attention_heads) is int and cfg.num_attention_heads == 16
    assert type(cfg.hidden_size) is int and type(cfg.use_attn_sink) is bool
    assert type(cfg.rms_norm_eps) is float and cfg.rms_norm_eps == float(np.float32(1e-6))
    assert cfg.replace(rms_norm_eps=1e-6) == plain and hash(cfg.replace(rms_norm_eps=1e-6)) == hash(plain)
    path = tmp_path / "cfg.json"
    cfg.to_json_file(path)
    assert json.loads(path.read_text())["softmax_scale"] == 0.125
    assert load_config(str(path)) == cfg
    # ints in float fields are stored as floats (same value, same JSON round trip)
    assert type(get_preset("deepseek_v32_small", rope_theta=10000).rope_theta) is float
    for field, value in (("num_attention_heads", np.bool_(True)), ("hidden_size", True),
                         ("hidden_size", np.float64(256.0)), ("softmax_scale", True),
                         ("rope_theta", np.bool_(True)), ("use_attn_sink", np.int64(1))):
        with pytest.raises(ValueError, match=rf"^MQALatentAttentionConfig\.{field} must be"):
            get_preset("deepseek_v32_small", **{field: value})


def test_failed_save_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """Issue 41, item 1: a save that fails (here: serialisation) must not harm the file it
    would replace, and leaves no temporary file behind; a good save replaces it whole and keeps
    its permission bits."""
    import os

    import numpy as np

    from paddlefleet.tilelang_ops.attn import config as config_mod

    path = tmp_path / "cfg.json"
    good = get_preset("deepseek_v32_small")
    good.to_json_file(path)
    before = path.read_bytes()
    os.chmod(path, 0o640)
    bad = good.replace(softmax_scale=0.5)
    # a value json cannot write, however it got past validation (here: set behind its back)
    unwritable = good.replace(softmax_scale=0.5)
    object.__setattr__(unwritable, "softmax_scale", np.float32(0.5))
    with pytest.raises(TypeError, match="not JSON serializable"):
        unwritable.to_json_file(path)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["cfg.json"]
    bad.to_json_file(path)
    assert load_config(str(path)) == bad and sorted(os.listdir(tmp_path)) == ["cfg.json"]
    assert os.stat(path).st_mode & 0o777 == 0o640
    # a failure while writing (a full disk, say) leaves the old file too
    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(config_mod.os, "fsync", no_space)
    with pytest.raises(OSError, match="No space left"):
        good.to_json_file(path)
    assert load_config(str(path)) == bad and sorted(os.listdir(tmp_path)) == ["cfg.json"]


@pytest.mark.parametrize(
    "field,value,shown",
    [
        # 0 in fp32: an all-zero hidden row normalised to NaN
        ("rms_norm_eps", 1e-320, "1e-320"),
        ("rms_norm_eps", 1e-39, "1e-39"),  # subnormal in fp32
        ("rms_norm_eps", 1e39, "1e+39"),  # inf in fp32
        ("initializer_range", 1e300, "1e+300"),  # inf weights in fp32
        ("initializer_range", 1e-40, "1e-40"),
        # raised a raw OverflowError from math.isfinite
        ("rope_theta", 10**400, "an integer of 1329 bits (about 10**400)"),
        ("hidden_size", 10**400, "an integer of 1329 bits (about 10**400)"),
        ("index_topk", 2**31, "2147483648"),
    ],
    ids=["eps_zero_in_fp32", "eps_subnormal_in_fp32", "eps_inf_in_fp32", "init_inf_in_fp32",
         "init_subnormal_in_fp32", "theta_1e400", "hidden_1e400", "topk_over_int32"],
)
def test_values_that_cannot_work_name_the_field(field, value, shown):
    """Issue 41, item 4."""
    with pytest.raises(ValueError, match=rf"^MQALatentAttentionConfig\.{field} must be .*, got "
                                         rf"{re.escape(shown)}$"):
        get_preset("deepseek_v32_small", **{field: value})


def test_edges_of_the_float_ranges_are_accepted():
    import numpy as np

    tiny, big = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    for field in ("rms_norm_eps", "initializer_range"):
        assert getattr(get_preset("deepseek_v32_small", **{field: tiny}), field) == tiny
        assert getattr(get_preset("deepseek_v32_small", **{field: big}), field) == big
    assert get_preset("deepseek_v32_small", rope_theta=1e300).rope_theta == 1e300


def test_file_errors_name_the_file(tmp_path):
    """Issue 41, item 4: a 401-digit JSON integer raised a raw OverflowError; one over Python's
    4300-digit limit and a non-UTF-8 file raised errors that did not name the file."""
    path = tmp_path / "cfg.json"
    get_preset("deepseek_v32_small").to_json_file(path)
    text = path.read_text()
    assert '"rope_theta": 10000.0' in text
    path.write_text(text.replace('"rope_theta": 10000.0', '"rope_theta": 1' + "0" * 400))
    with pytest.raises(ValueError, match=r"^config file '.*cfg\.json': MQALatentAttentionConfig"
                                         r"\.rope_theta must be a finite number > 0, got an "
                                         r"integer of 1329 bits \(about 10\*\*400\)$"):
        load_config(str(path))
    path.write_text(text.replace('"rope_theta": 10000.0', '"rope_theta": 1' + "0" * 5000))
    with pytest.raises(ValueError, match=r"^config file '.*cfg\.json' is not valid JSON: .*4300 "
                                         r"digits"):
        load_config(str(path))
    path.write_bytes(text.replace('"heads"', '"h\xe9ads"').encode("latin-1"))
    with pytest.raises(ValueError, match=r"^config file '.*cfg\.json' is not UTF-8 text: "):
        load_config(str(path))
    # a bad override is named as one, with the file it was applied to
    path.write_text(text)
    with pytest.raises(ValueError, match=r"^config file '.*cfg\.json' with overrides "
                                         r"\['rms_norm_eps'\]: MQALatentAttentionConfig\."
                                         r"rms_norm_eps must be"):
        load_config(str(path), rms_norm_eps=0.0)


@pytest.mark.parametrize("extra", [{1: 2, "x": 3}, {None: 2}, {("a",): 1}])
def test_from_dict_names_keys_that_are_not_strings(extra):
    """Break-it 7: mixed key types raised a raw TypeError from sorted()."""
    base = get_preset("deepseek_v32_small").to_dict()
    with pytest.raises(TypeError, match=r"^MQALatentAttentionConfig: field names must be "
                                        r"strings, got key\(s\) "):
        MQALatentAttentionConfig.from_dict({**base, **extra})


def test_load_config_classifies_by_the_fields(tmp_path):
    """Break-it 6: a valid DeepSeek-V4 file without ``compress_ratio`` (a window-only layer,
    whose default it is) loaded as a V3.2 config and failed with "unknown field(s)"."""
    from paddlefleet.tilelang_ops.attn.v4_config import DeepSeekV4AttentionConfig

    v4 = get_preset("deepseek_v4_small", compress_ratio=None, compressed_topk=None)
    data = v4.to_dict()
    del data["compress_ratio"]
    path = tmp_path / "v4.json"
    path.write_text(json.dumps(data))
    got = load_config(str(path))
    assert type(got) is DeepSeekV4AttentionConfig and got == v4
    v3 = get_preset("deepseek_v32_small")
    path3 = tmp_path / "v3.json"
    v3.to_json_file(path3)
    assert load_config(str(path3)) == v3
    both = tmp_path / "both.json"
    both.write_text(json.dumps({**data, "kv_lora_rank": 64}))
    with pytest.raises(ValueError, match=r"^config file .*both.json' mixes the fields of both "
                                         r"configs: \['kv_lora_rank'\] are "
                                         r"MQALatentAttentionConfig's .*'head_dim'"):
        load_config(str(both))


def test_a_deeply_nested_json_file_is_a_value_error(tmp_path):
    """Break-it 6: ``'[' * 100000`` raised a raw RecursionError."""
    path = tmp_path / "deep.json"
    path.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ValueError, match=r"^config file .*deep.json' is not valid JSON: nested "
                                         r"too deeply"):
        load_config(str(path))


def test_derived_sizes_past_int32_are_refused():
    """Break-it 9: ``kv_lora_rank=2**31-1`` gave ``kernel_dk = 2**31 + 15``; V4's ``window_size
    + compressed_topk`` could pass int32 too."""
    with pytest.raises(ValueError, match=r"^MQALatentAttentionConfig: kernel_dk = kv_lora_rank "
                                         r"\+ qk_rope_head_dim = 2147483663 must be at most "
                                         r"2147483647 .* got kv_lora_rank=2147483647, "
                                         r"qk_rope_head_dim=16"):
        get_preset("deepseek_v32_small", kv_lora_rank=2**31 - 1)
    with pytest.raises(ValueError, match=r"qk_nope_head_dim \+ qk_rope_head_dim = 2147483663"):
        get_preset("deepseek_v32_small", qk_nope_head_dim=2**31 - 1)
    with pytest.raises(ValueError, match=r"^DeepSeekV4AttentionConfig: the top-k width L = "
                                         r"window_size \+ compressed_topk = 4294967294"):
        get_preset("deepseek_v4_small", window_size=2**31 - 1, compressed_topk=2**31 - 1)
    assert get_preset("deepseek_v32_small", kv_lora_rank=2**31 - 17).kernel_dk == 2**31 - 1


def test_to_json_file_refuses_a_read_only_file(tmp_path):
    """Break-it 10: a 0444 file was silently replaced (open(path, "w") refuses it)."""
    path = tmp_path / "ro.json"
    path.write_text("{}")
    os.chmod(path, 0o444)
    with pytest.raises(PermissionError, match=r"not writable.*ro.json"):
        get_preset("deepseek_v32_small").to_json_file(path)
    assert path.read_text() == "{}" and sorted(os.listdir(tmp_path)) == ["ro.json"]


def test_to_json_file_names_a_dangling_symlinks_target(tmp_path):
    """Break-it 10: a dangling symlink's error named the hidden temporary file."""
    link = tmp_path / "cfg.json"
    os.symlink(tmp_path / "nowhere" / "x.json", link)
    with pytest.raises(FileNotFoundError) as info:
        get_preset("deepseek_v32_small").to_json_file(link)
    text = str(info.value)
    assert "nowhere" in text and str(link) in text and ".tmp" not in text
    with pytest.raises(IsADirectoryError, match="over a folder"):
        get_preset("deepseek_v32_small").to_json_file(tmp_path)
