"""attn/v4_layer.py and attn/v4_config.py: DeepSeek-V4's attention block against a dense fp64
formulation of the same math written row by row (forward, every parameter's gradient and the
input's), for the three layer types, packed documents and both partitions; the config."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import rel_l2

paddle = pytest.importorskip("paddle")

from paddlefleet.tilelang_ops.attn import config as config_mod  # noqa: E402
from paddlefleet.tilelang_ops.attn.indices import cu_seqlens_from_lengths  # noqa: E402
from paddlefleet.tilelang_ops.attn.v4_config import (  # noqa: E402
    DeepSeekV4AttentionConfig,
    get_preset,
)
from paddlefleet.tilelang_ops.attn.v4_layer import (  # noqa: E402
    DeepSeekV4Attention,
    init_full_weights,
    random_compressed_picks,
)

TINY = dict(hidden_size=16, num_attention_heads=4, q_lora_rank=8, o_lora_rank=6, o_groups=2,
            head_dim=16, qk_rope_head_dim=4, window_size=3, backward_backend="reference")


def tiny(**over) -> DeepSeekV4AttentionConfig:
    return DeepSeekV4AttentionConfig(**{**TINY, **over})


# --- the dense formulation -------------------------------------------------------------------
def _rope(x, pos, theta):
    """Rotate-half RoPE of ``x [n, ..., r]`` at positions ``pos [n]`` (written out), with
    float64 tables (``layer._rope`` builds them in float64 for an fp64 layer, issue 41)."""
    r = x.shape[-1]
    ang = np.outer(pos, 1.0 / theta ** (np.arange(0, r, 2) / r))  # [n, r/2], float64
    shape = [len(pos)] + [1] * (x.ndim - 2) + [r // 2]
    cos = paddle.to_tensor(np.cos(ang).reshape(shape))
    sin = paddle.to_tensor(np.sin(ang).reshape(shape))
    x1, x2 = x[..., : r // 2], x[..., r // 2:]
    return paddle.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _tail(x, pos, theta, r):
    return paddle.concat([x[..., :-r], _rope(x[..., -r:], pos, theta)], axis=-1)


def _rms(x, w, eps):
    return x / paddle.sqrt((x * x).mean(axis=-1, keepdim=True) + eps) * w


def dense_block(cfg, P, x, picks, docs):
    """One batch row ``x [S, hidden]`` through the block, document by document, row by row."""
    D, r, H, W, eps = cfg.head_dim, cfg.qk_rope_head_dim, cfg.num_attention_heads, \
        cfg.window_size, cfg.rms_norm_eps
    ratio = cfg.compress_ratio
    theta = cfg.rope_theta if ratio is None else cfg.compress_rope_theta
    outs = []
    for a, b in docs:
        n = b - a
        if n == 0:
            continue
        xd, pos = x[a:b], np.arange(n)
        q = paddle.matmul(_rms(paddle.matmul(xd, P["wq_a"]), P["q_norm_weight"], eps), P["wq_b"])
        q = _tail(_rms(q.reshape([n, H, D]), 1.0, eps), pos, theta, r)
        kv = _tail(_rms(paddle.matmul(xd, P["wkv"]), P["kv_norm_weight"], eps), pos, theta, r)
        comp = []
        if ratio is not None:
            kvf, sc = paddle.matmul(xd, P["wkv_c"]), paddle.matmul(xd, P["wgate_c"])
            for j in range(n // ratio):
                rows = slice(j * ratio, (j + 1) * ratio)
                if ratio == 4:  # previous group through the first D columns, own through the last
                    ent_kv, ent_sc = [kvf[rows, D:]], [sc[rows, D:] + P["ape"][:, D:]]
                    if j > 0:
                        prev = slice((j - 1) * ratio, j * ratio)
                        ent_kv.insert(0, kvf[prev, :D])
                        ent_sc.insert(0, sc[prev, :D] + P["ape"][:, :D])
                    e_kv, e_sc = paddle.concat(ent_kv, 0), paddle.concat(ent_sc, 0)
                else:
                    e_kv, e_sc = kvf[rows], sc[rows] + P["ape"]
                w = paddle.exp(e_sc - e_sc.max(axis=0, keepdim=True))
                pooled = (e_kv * w).sum(0) / w.sum(0)
                pooled = _rms(pooled.reshape([1, D]), P["norm_c"], eps)
                comp.append(_tail(pooled, np.array([j * ratio]), theta, r))
        sink = P["attn_sink"].astype("float64") if "attn_sink" in P else None
        rows_out = []
        for s in range(n):
            keys = [kv[t] for t in range(max(0, s - W + 1), s + 1)]
            if ratio == 128:
                keys += [comp[j][0] for j in range(n // ratio) if (j + 1) * ratio <= s + 1]
            elif ratio == 4:
                keys += [comp[j][0] for j in picks[a + s] if 0 <= j and (j + 1) * ratio <= s + 1]
            K = paddle.stack(keys)  # [nk, D]
            logits = paddle.matmul(q[s], K, transpose_y=True) * cfg.sm_scale  # [H, nk]
            if sink is not None:
                logits = paddle.concat([logits, sink.reshape([H, 1])], axis=1)
            p = paddle.nn.functional.softmax(logits, axis=1)[:, : len(keys)]
            rows_out.append(paddle.matmul(p, K))
        o = _tail(paddle.stack(rows_out), -pos, theta, r)  # [n, H, D], RoPE undone
        o = o.reshape([n, cfg.o_groups, -1])
        o = paddle.einsum("sgd,grd->sgr", o, P["wo_a"]).reshape([n, -1])
        outs.append(paddle.matmul(o, P["wo_b"]))
    return paddle.concat(outs, 0)


def run_dense(cfg, x, picks, docs, seed, R):
    P = {k: paddle.to_tensor(v.astype(np.float64) if k != "attn_sink" else v,
                             stop_gradient=False)
         for k, v in init_full_weights(cfg, seed).items()}
    xt = paddle.to_tensor(x, stop_gradient=False)
    y = paddle.stack([dense_block(cfg, P, xt[b], None if picks is None else picks[b], docs)
                      for b in range(x.shape[0])])
    (y * paddle.to_tensor(R)).sum().backward()
    return y.numpy(), xt.grad.numpy(), {k: v.grad.numpy() for k, v in P.items()}


def run_layer(cfg, x, picks, cu, seed, R):
    prev = paddle.get_default_dtype()
    paddle.set_default_dtype("float64")
    try:
        layer = DeepSeekV4Attention(cfg, seed=seed)
    finally:
        paddle.set_default_dtype(prev)
    xt = paddle.to_tensor(x, stop_gradient=False)
    y = layer(xt, None if picks is None else paddle.to_tensor(picks),
              cu_seqlens=None if cu is None else paddle.to_tensor(cu))
    (y * paddle.to_tensor(R)).sum().backward()
    # (no gradient: a parameter that took no part, the compressor's at S < ratio)
    return y.numpy(), xt.grad.numpy(), {
        n: np.zeros(p.shape) if p.grad is None else p.grad.numpy()
        for n, p in layer.named_parameters()}


def compare(cfg, B, S, rng, cu=None, picks="random", seed=3):
    x = rng.standard_normal((B, S, cfg.hidden_size))
    R = rng.standard_normal((B, S, cfg.hidden_size))
    if isinstance(picks, str):  # "random"
        picks = random_compressed_picks(cfg, S, batch=B, cu_seqlens=cu, seed=seed)
    docs = [(0, S)] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    got = run_layer(cfg, x, picks, cu, seed, R)
    want = run_dense(cfg, x, picks, docs, seed, R)
    assert rel_l2(got[0], want[0]) < 1e-12, "out"
    assert rel_l2(got[1], want[1]) < 1e-11, "dx"
    assert sorted(got[2]) == sorted(want[2])
    for name, g in got[2].items():
        tol = 1e-6 if name == "attn_sink" else 1e-10  # the sink is fp32
        assert rel_l2(g, want[2][name]) < tol, name
        assert np.abs(want[2][name]).max() > 0, name  # every parameter takes part
    return got


@pytest.mark.parametrize("partition", ["heads", "sequence"])
def test_window_only(rng, partition):
    compare(tiny(attention_partition=partition), 2, 11, rng)


@pytest.mark.parametrize("partition", ["heads", "sequence"])
def test_ratio_4_with_picks(rng, partition):
    """Ratio 4 (overlapping groups), 2 picks of 4 groups, plus a duplicate pick and picks the
    row may not see yet (which become empty slots)."""
    cfg = tiny(compress_ratio=4, compressed_topk=3, attention_partition=partition)
    S = 18
    picks = random_compressed_picks(cfg, S, batch=2, seed=1)
    picks[0, 17] = [2, 2, 0]  # a duplicate counts twice
    picks[1, 5] = [3, 0, 1]  # groups 1 and 3 are not complete at row 5: dropped
    picks[1, 7] = [1, -1, 0]  # group 1 (tokens 4..7) is complete at row 7: kept
    compare(cfg, 2, S, rng, picks=picks)


def test_ratio_128_every_group(rng):
    cfg = tiny(compress_ratio=128, window_size=4)
    compare(cfg, 1, 262, rng)  # two groups, the last 6 tokens in none


def test_packed_documents_equal_each_document_alone(rng):
    """Documents of 9, 0, 10 and 3 tokens (the last with no complete group) in one row: the
    dense formulation restarts positions, windows and groups per document; the layer's packed
    rows also equal each document run alone."""
    cfg = tiny(compress_ratio=4, compressed_topk=2)
    lengths = [9, 0, 10, 3]
    cu = cu_seqlens_from_lengths(lengths)
    S = sum(lengths)
    x = rng.standard_normal((1, S, cfg.hidden_size))
    R = rng.standard_normal((1, S, cfg.hidden_size))
    picks = random_compressed_picks(cfg, S, cu_seqlens=cu, seed=5)
    docs = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    got = run_layer(cfg, x, picks, cu, 2, R)
    want = run_dense(cfg, x, picks, docs, 2, R)
    assert rel_l2(got[0], want[0]) < 1e-12 and rel_l2(got[1], want[1]) < 1e-11
    for name, g in got[2].items():
        assert rel_l2(g, want[2][name]) < (1e-6 if name == "attn_sink" else 1e-10), name
    for a, b in docs:
        if b > a:
            alone = run_layer(cfg, x[:, a:b], picks[:, a:b], None, 2, R[:, a:b])
            assert rel_l2(got[0][:, a:b], alone[0]) < 1e-12
            assert rel_l2(got[1][:, a:b], alone[1]) < 1e-11


def test_picks_stand_in_and_sizes():
    cfg = tiny(compress_ratio=4, compressed_topk=3)
    p = random_compressed_picks(cfg, 20, batch=2, seed=0)
    assert p.shape == (2, 20, 3) and p.dtype == np.int32
    for s in range(20):
        n = min(3, (s + 1) // 4)
        assert ((p[:, s, :n] >= 0) & (p[:, s, :n] < (s + 1) // 4)).all()
        assert (p[:, s, n:] == -1).all()
    assert random_compressed_picks(tiny(compress_ratio=128), 20) is None
    assert cfg.keys_per_row(20) == 6 and tiny(compress_ratio=128).keys_per_row(300) == 5
    assert tiny().keys_per_row(20) == 3


def test_forward_errors():
    c4 = DeepSeekV4Attention(tiny(compress_ratio=4, compressed_topk=2))
    win = DeepSeekV4Attention(tiny())
    x = paddle.zeros([1, 8, 16])
    ok = np.zeros((1, 8, 2), np.int32)
    with pytest.raises(ValueError, match="^compressed_indices: a ratio-4 layer needs"):
        c4(x)
    with pytest.raises(ValueError, match="^compressed_indices: expected None for a window-only"):
        win(x, ok)
    with pytest.raises(ValueError, match=r"^compressed_indices: expected \[B, S, K\]"):
        c4(x, ok[:, :4])
    with pytest.raises(TypeError, match="^compressed_indices: expected dtype int32 or int64"):
        c4(x, ok.astype(np.float32))
    with pytest.raises(TypeError, match="^compressed_indices: expected a paddle.Tensor"):
        c4(x, ok.tolist())
    bad = ok.copy()
    bad[0, 6, 1] = 2  # 8 tokens: groups 0 and 1 only
    with pytest.raises(ValueError, match=r"group number in \[0, 2\).*got 2 at \[0, 6, 1\]"):
        c4(x, bad)
    with pytest.raises(TypeError, match="^hidden_states: expected dtype float32"):
        win(x.astype("float64"))
    with pytest.raises(ValueError, match=r"^hidden_states: expected \[B, S, hidden_size=16\]"):
        win(paddle.zeros([1, 8, 15]))
    with pytest.raises(ValueError, match="need B=1"):
        win(paddle.zeros([2, 8, 16]), cu_seqlens=cu_seqlens_from_lengths([3, 5]))
    with pytest.raises(TypeError, match="^config: expected DeepSeekV4AttentionConfig"):
        DeepSeekV4Attention(config_mod.get_preset("deepseek_v32_small"))
    with pytest.raises(ValueError, match="tensor_parallel_degree must equal"):
        DeepSeekV4Attention(tiny(tensor_parallel_degree=2))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_layer_on_cpu_names_its_dtype(dtype):
    """The V3.2 layer's CPU rule (issue 41, item 7) holds for the V4 layer too: a float16 /
    bfloat16 layer on CPU used to fail inside Paddle's matmul; it raises a TypeError naming the
    dtype and layer.CPU_DTYPES, while float32 and float64 layers run."""
    cfg = tiny()
    x = paddle.randn([1, 8, cfg.hidden_size])
    for ok in ("float32", "float64"):
        lay = DeepSeekV4Attention(cfg)
        lay.to(dtype=ok)
        y = lay(x.astype(ok))
        assert y.dtype == getattr(paddle, ok) and bool(paddle.isfinite(y).all())
    lay = DeepSeekV4Attention(cfg)
    lay.to(dtype=dtype)
    with pytest.raises(TypeError, match=rf"^DeepSeekV4Attention: the layer's parameters are "
                                        rf"{dtype}, which does not run on CPU .*runs in float32 "
                                        rf"or float64"):
        lay(x.astype(dtype))


def test_fp64_layer_uses_fp64_rope_tables():
    """An fp64 layer rotates with float64 tables (issue 41: the V3.2 layer's rule, through the
    shared layer._rope); fp32 angles would be off by ~1e-4 at position 10**5."""
    from paddlefleet.tilelang_ops.attn.v4_layer import _rope_tail

    pos = np.array([0, 7, 10**5, 3 * 10**5])
    x = np.random.default_rng(0).standard_normal((4, 8))
    got = _rope_tail(paddle.to_tensor(x), pos, 160000.0, 4).numpy()
    ang = np.outer(pos, 1.0 / 160000.0 ** (np.arange(0, 4, 2) / 4))
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[:, 4:6], x[:, 6:]
    want = np.concatenate([x[:, :4], x1 * c - x2 * s, x2 * c + x1 * s], axis=1)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_load_full_weights_is_strict():
    """The V3.2 layer's load_full_weights (shared): keys that are no parameter of the layer (a
    trained sink into a use_attn_sink=False layer, a misspelled name) and missing keys raise,
    named, before anything is written; a good load fills every parameter."""
    cfg = tiny(use_attn_sink=False, compress_ratio=128)
    lay = DeepSeekV4Attention(cfg, seed=1)
    before = {n: p.numpy().copy() for n, p in lay.named_parameters()}
    full = init_full_weights(cfg.replace(use_attn_sink=True), seed=2)
    with pytest.raises(ValueError, match=r"^load_full_weights: weight\(s\) \['attn_sink'\] are "
                                         r"not parameters of this layer, which would drop them; "
                                         r"attn_sink is a weight of layers with "
                                         r"use_attn_sink=True"):
        lay.load_full_weights(full)
    del full["attn_sink"]
    misspelled = dict(full, wkv_comp=full["wkv_c"])
    with pytest.raises(ValueError, match=r"^load_full_weights: weight\(s\) \['wkv_comp'\] are not"):
        lay.load_full_weights(misspelled)
    del misspelled["wkv_c"]
    with pytest.raises(ValueError, match=r"^load_full_weights: missing weight\(s\) \['wkv_c'\]"):
        lay.load_full_weights(misspelled)
    for name, p in lay.named_parameters():  # untouched by the failed loads
        np.testing.assert_array_equal(p.numpy(), before[name], err_msg=name)
    full = init_full_weights(cfg, seed=2)
    lay.load_full_weights(full)
    for name, p in lay.named_parameters():
        np.testing.assert_array_equal(p.numpy(), full[name], err_msg=name)


def test_initializer_range_that_overflows_fp32_weights():
    """The V3.2 layer's rule: a std near fp32's largest number drew inf weights silently; the
    build raises naming the field and the first parameter."""
    with pytest.raises(ValueError, match=r"^config.initializer_range=3e\+38 draws non-finite fp32 "
                                         r"weights \(wq_a\)"):
        DeepSeekV4Attention(tiny(initializer_range=3e38))


def test_weights_are_slices_of_the_full_weights():
    """Per-unit generators: a rank's weights are its slice of init_full_weights at every TP
    degree (heads for wq_b and the sink, head groups for wo_a and wo_b)."""
    from paddlefleet.tilelang_ops.attn.v4_layer import _init_weights, shard_of

    cfg = tiny(compress_ratio=4, compressed_topk=2)
    full = init_full_weights(cfg, seed=4)
    for rank in range(2):
        part = _init_weights(cfg.replace(tensor_parallel_degree=2), 4, rank, 2)
        assert sorted(part) == sorted(full)
        for name, value in part.items():
            np.testing.assert_array_equal(value, shard_of(name, full[name], rank, 2),
                                          err_msg=name)
    lay = DeepSeekV4Attention(cfg, seed=4)
    for name, p in lay.named_parameters():
        np.testing.assert_array_equal(p.numpy(), full[name], err_msg=name)


@pytest.mark.parametrize("partition", ["heads", "sequence"])
@pytest.mark.parametrize("deterministic", [None, False])
def test_config_deterministic_and_fp32_sink_reach_the_op(monkeypatch, partition, deterministic):
    """The layers' one sparse core (layer._TensorParallelAttention._sparse_core): the V4
    config's deterministic, its scale, Dv and the fp32 sink are what the op gets."""
    from paddlefleet.tilelang_ops.attn import layer as layer_mod

    seen = []
    real = layer_mod.mqa_latent_sparse_attention

    def op(*args, **kwargs):
        seen.append((kwargs["deterministic"], kwargs["d_v"], args[3], args[4].dtype))
        return real(*args, **kwargs)

    monkeypatch.setattr(layer_mod, "mqa_latent_sparse_attention", op)
    cfg = tiny(attention_partition=partition, deterministic=deterministic)
    lay = DeepSeekV4Attention(cfg)
    lay.to(dtype="float64")
    lay(paddle.randn([1, 6, cfg.hidden_size]).astype("float64"))
    assert seen == [(deterministic, 16, 0.25, paddle.float32)]


# --- config ---------------------------------------------------------------------------------
def test_presets_through_config_module(tmp_path):
    flash = config_mod.get_preset("deepseek_v4_flash")
    assert isinstance(flash, DeepSeekV4AttentionConfig)
    assert (flash.hidden_size, flash.num_attention_heads, flash.head_dim, flash.o_groups,
            flash.compress_ratio, flash.compressed_topk) == (4096, 64, 512, 8, 4, 512)
    assert (flash.kernel_dk, flash.kernel_dv, flash.sm_scale) == (512, 512, 512 ** -0.5)
    assert flash.keys_per_row(4096) == 640
    small = config_mod.load_config("deepseek_v4_small", tensor_parallel_degree=8)
    assert (small.heads_per_rank, small.groups_per_rank, small.head_dim) == (8, 1, 512)
    path = tmp_path / "v4.json"
    small.to_json_file(path)
    assert json.loads(path.read_text())["compress_ratio"] == 4
    assert config_mod.load_config(str(path)) == small
    assert config_mod.load_config(str(path), compress_ratio=None, compressed_topk=None) == \
        small.replace(compress_ratio=None, compressed_topk=None)
    c128 = get_preset("deepseek_v4_flash", compress_ratio=128, compressed_topk=None)
    assert c128.layer_rope_theta == 160000.0 and c128.keys_per_row(4096) == 160
    assert get_preset("deepseek_v4_small", compress_ratio=None,
                      compressed_topk=None).layer_rope_theta == 10000.0
    with pytest.raises(ValueError, match="unknown preset 'x'.*deepseek_v4_flash"):
        config_mod.get_preset("x")


@pytest.mark.parametrize(
    "over,pattern",
    [
        (dict(hidden_size=0), "hidden_size must be a positive int .*, got 0$"),
        (dict(head_dim=True), "head_dim must be a positive int .*, got True$"),
        (dict(qk_rope_head_dim=3), "qk_rope_head_dim must be even"),
        (dict(qk_rope_head_dim=32), "qk_rope_head_dim must be even .* at most head_dim=16"),
        (dict(o_groups=3), "o_groups must be a divisor of num_attention_heads=4"),
        (dict(tensor_parallel_degree=4), "o_groups must be divisible by tensor_parallel_degree"),
        (dict(compress_ratio=8), r"compress_ratio must be one of \[None, 4, 128\], got 8"),
        (dict(compress_ratio=4), "compressed_topk must be a positive int with compress_ratio=4"),
        (dict(compressed_topk=4), "compressed_topk must be None with compress_ratio=None"),
        (dict(backward_backend="x"), "backward_backend must be one of"),
        (dict(attention_partition="rows"), "attention_partition must be one of"),
        (dict(softmax_scale=0.0), "softmax_scale must be None or a finite number > 0"),
        (dict(compress_rope_theta=float("nan")), "compress_rope_theta must be a finite number > 0"),
        (dict(use_attn_sink=1), "use_attn_sink must be a bool"),
    ],
)
def test_config_errors(over, pattern):
    with pytest.raises(ValueError, match="^DeepSeekV4AttentionConfig." + pattern):
        tiny(**over)


def test_config_takes_numpy_scalars_by_value_and_saves(tmp_path):
    """Issue 41's rules for the V4 config too: ``np.int64`` sizes, ``np.float32`` scale and eps,
    ``np.bool_`` flags and ``compress_ratio=np.int64(4)`` were refused (or, for floats, kept
    as numpy scalars that JSON cannot write); they are taken by value, stored as Python
    numbers, and the config saves and loads back."""
    plain = tiny(compress_ratio=4, compressed_topk=2, softmax_scale=0.125, rope_theta=5e5,
                 deterministic=False)
    cfg = tiny(hidden_size=np.int32(16), num_attention_heads=np.int64(4),
               compress_ratio=np.int64(4), compressed_topk=np.int16(2),
               softmax_scale=np.float32(0.125), rope_theta=np.float64(5e5),
               rms_norm_eps=np.float32(1e-6), use_attn_sink=np.bool_(True),
               deterministic=np.False_)
    for name in ("hidden_size", "num_attention_heads", "compress_ratio", "compressed_topk"):
        assert type(getattr(cfg, name)) is int, name
    for name in ("softmax_scale", "rope_theta", "rms_norm_eps"):
        assert type(getattr(cfg, name)) is float, name
    assert cfg.use_attn_sink is True and cfg.deterministic is False
    assert cfg.rms_norm_eps == float(np.float32(1e-6))
    assert cfg.replace(rms_norm_eps=1e-6) == plain
    assert hash(cfg.replace(rms_norm_eps=1e-6)) == hash(plain)
    path = tmp_path / "v4.json"
    cfg.to_json_file(path)
    assert json.loads(path.read_text())["softmax_scale"] == 0.125
    assert config_mod.load_config(str(path)) == cfg
    for name, value in (("num_attention_heads", np.bool_(True)), ("hidden_size", np.float64(16)),
                        ("compress_ratio", 4.0), ("compress_ratio", True),
                        ("use_attn_sink", np.int64(1)), ("deterministic", 1)):
        with pytest.raises(ValueError, match=rf"^DeepSeekV4AttentionConfig\.{name} must be"):
            tiny(**{name: value})


@pytest.mark.parametrize(
    "field,value,shown",
    [
        ("rms_norm_eps", 1e-320, "1e-320"),  # 0 in fp32: an all-zero row normalises to NaN
        ("rms_norm_eps", 1e-39, "1e-39"),  # subnormal in fp32
        ("initializer_range", 1e300, "1e+300"),  # inf weights in fp32
        ("compress_rope_theta", 10**400, "an integer of 1329 bits (about 10**400)"),
        ("hidden_size", 10**400, "an integer of 1329 bits (about 10**400)"),
        ("window_size", 2**31, "2147483648"),
    ],
    ids=["eps_zero_in_fp32", "eps_subnormal_in_fp32", "init_inf_in_fp32", "theta_1e400",
         "hidden_1e400", "window_over_int32"],
)
def test_config_values_that_cannot_work_name_the_field(field, value, shown):
    """The V3.2 config's ranges (issue 41, item 4): eps=1e-320 was accepted (0 in the fp32
    layer) and a 401-digit int shown in full."""
    import re

    with pytest.raises(ValueError, match=rf"^DeepSeekV4AttentionConfig\.{field} must be .*, got "
                                         rf"{re.escape(shown)}$"):
        tiny(**{field: value})


@pytest.mark.parametrize("field,value", [("hidden_size", 0), ("rms_norm_eps", 1e-320),
                                         ("rope_theta", float("nan")), ("softmax_scale", -1.0),
                                         ("backward_backend", "x"), ("deterministic", "yes"),
                                         ("attention_partition", "rows")])
def test_both_configs_give_the_same_message(field, value):
    """One validation: a field both blocks have is refused with the same words."""
    with pytest.raises(ValueError) as v32:
        config_mod.get_preset("deepseek_v32_small", **{field: value})
    with pytest.raises(ValueError) as v4:
        tiny(**{field: value})
    assert str(v32.value).startswith("MQALatentAttentionConfig.")
    assert str(v4.value) == str(v32.value).replace("MQALatentAttentionConfig.",
                                                   "DeepSeekV4AttentionConfig.")


# --- the main job in one process ------------------------------------------------------------
def test_train_step_runs_v4_packed_and_refuses_topk():
    import os
    import re
    import subprocess
    import sys

    from helpers import REPO_ROOT

    def run(*args):
        return subprocess.run(
            [sys.executable, str(REPO_ROOT / "tools" / "train_step.py"), "--no-progress",
             "--config", "deepseek_v4_small", *args], capture_output=True, text=True,
            timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src")))

    res = run("--steps", "3", "--doc-lens", "20,0,13")
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("inputs: B 1, S 33, keys per row 192 (window 128, compress_ratio 4), sm_scale "
            "0.0441942, 3 packed documents") in res.stdout, res.stdout
    losses = [float(v) for v in re.findall(r"step \d+: loss ([0-9.]+)", res.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], res.stdout
    assert " wkv_c " in res.stdout and " wo_b " in res.stdout
    res = run("--topk", "8", "--seq-len", "16")
    assert res.returncode == 1 and "--topk does not apply to 'deepseek_v4_small'" in res.stderr
