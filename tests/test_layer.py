"""MQALatentAttention (one process) against an independent float64 formulation of MLA.

The reference below is the *un-absorbed*, dense form: per-head keys ``k = [c_kv @ W_UK^T,
rope(k_pe)]`` and values ``v = c_kv @ W_UV`` are materialised, every key is scored and the
top-k choice enters as a multiplicity mask; RoPE is applied as explicit 2x2 rotation matrices.
float64 Paddle autograd gives its gradients.  The layer (fp32, absorbed, sparse op) must match
in output, input gradient and every parameter gradient.
"""

from __future__ import annotations

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")  # the GPU host's torch-only env skips this module

from helpers import rel_l2  # noqa: E402

from paddlefleet.tilelang_ops.attn.config import get_preset
from paddlefleet.tilelang_ops.attn.indices import (
    causal_topk_indices,
    cu_seqlens_from_lengths,
    varlen_causal_topk_indices,
)
from paddlefleet.tilelang_ops.attn.layer import (
    REPLICATED,
    SHARD_AXIS,
    MQALatentAttention,
    init_full_weights,
    shard_of,
)

TOL = 5e-6  # fp32 layer vs float64 reference (measured ~6e-7)


def _rotation(S, d, theta):
    """``R [S, d, d]`` with ``rope(x)[s] = R[s] @ x[s]``: channel i pairs with i + d/2."""
    R = np.zeros((S, d, d))
    half = d // 2
    for i in range(half):
        ang = np.arange(S) * theta ** (-2.0 * i / d)
        c, s = np.cos(ang), np.sin(ang)
        R[:, i, i], R[:, i, i + half] = c, -s
        R[:, i + half, i], R[:, i + half, i + half] = s, c
    return R


def _reference(cfg, W, x, idx):
    B, S, _ = x.shape
    H, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim

    def rms(t, w):
        return t / paddle.sqrt((t * t).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    R = paddle.to_tensor(_rotation(S, rope, cfg.rope_theta))
    q = (rms(x @ W["wq_a"], W["q_norm_weight"]) @ W["wq_b"]).reshape([B, S, H, nope + rope])
    q_nope, q_pe = q[..., :nope], paddle.einsum("sed,bshd->bshe", R, q[..., nope:])
    kv_a = x @ W["wkv_a"]
    c_kv = rms(kv_a[..., : cfg.kv_lora_rank], W["kv_norm_weight"])
    k_pe = paddle.einsum("sed,bsd->bse", R, kv_a[..., cfg.kv_lora_rank :])
    k_nope = paddle.einsum("btc,hdc->bthd", c_kv, W["w_uk"])  # un-absorbed per-head keys
    v = paddle.einsum("btc,hcv->bthv", c_kv, W["w_uv"])  # per-head values
    scores = paddle.einsum("bshd,bthd->bsht", q_nope, k_nope)
    scores = (scores + paddle.einsum("bshr,btr->bsht", q_pe, k_pe)) * cfg.sm_scale
    counts = np.zeros((B, S, S))
    b, s, l = np.nonzero(idx >= 0)
    np.add.at(counts, (b, s, idx[b, s, l]), 1.0)
    with np.errstate(divide="ignore"):
        scores = scores + paddle.to_tensor(np.log(counts)[:, :, None, :])
    if "attn_sink" in W:
        scores = paddle.concat([scores, W["attn_sink"].reshape([1, 1, H, 1]).expand([B, S, H, 1])], -1)
    p = paddle.nn.functional.softmax(scores, -1)[..., :S]
    o = paddle.einsum("bsht,bthv->bshv", p, v).reshape([B, S, H * cfg.v_head_dim])
    return o @ W["wo"]


def _case(rng, sink=True, heads=16, B=2, S=40, topk=24):
    cfg = get_preset(
        "deepseek_v32_small", num_attention_heads=heads, use_attn_sink=sink, index_topk=topk,
        initializer_range=0.1, backward_backend="reference",
    )
    full = init_full_weights(cfg, seed=int(rng.integers(1 << 30)))
    for key in ("q_norm_weight", "kv_norm_weight"):
        full[key] = (1 + 0.1 * rng.standard_normal(full[key].shape)).astype(np.float32)
    x = rng.standard_normal((B, S, cfg.hidden_size)).astype(np.float32)
    idx = causal_topk_indices(B, S, S, topk, seed=int(rng.integers(1 << 30)))
    gy = rng.standard_normal((B, S, cfg.hidden_size)).astype(np.float32)
    return cfg, full, x, idx, gy


@pytest.mark.parametrize("sink", [True, False], ids=["sink", "nosink"])
def test_layer_matches_unabsorbed_dense_float64(rng, sink):
    cfg, full, x_np, idx, gy = _case(rng, sink=sink)
    layer = MQALatentAttention(cfg)
    layer.load_full_weights(full)
    x = paddle.to_tensor(x_np, stop_gradient=False)
    y = layer(x, paddle.to_tensor(idx))
    (y * paddle.to_tensor(gy)).sum().backward()
    assert y.dtype == paddle.float32 and list(y.shape) == list(x_np.shape)

    W = {k: paddle.to_tensor(v.astype(np.float64), stop_gradient=False) for k, v in full.items()}
    rx = paddle.to_tensor(x_np.astype(np.float64), stop_gradient=False)
    ry = _reference(cfg, W, rx, idx)
    (ry * paddle.to_tensor(gy.astype(np.float64))).sum().backward()

    errors = {"y": rel_l2(y, ry), "dx": rel_l2(x.grad, rx.grad)}
    for name, p in layer.named_parameters():
        errors["grad." + name] = rel_l2(p.grad, W[name].grad)
    assert set(errors) - {"y", "dx"} == {"grad." + k for k in full}
    bad = {k: e for k, e in errors.items() if not e < TOL}
    assert not bad, f"rel L2 above {TOL}: {bad}"


def test_float64_layer_matches_dense_float64_to_fp64_rounding(rng):
    """Issue 41, item 3c: an fp64 layer computed its RoPE tables in fp32, so that it agreed
    with fp64 math to ~8e-11 only; with fp64 tables (and fp64 weights loaded as fp64) it agrees
    to fp64 rounding.  Long rows (S = 200) make the fp32 angles' error visible."""
    cfg, full, _, idx, _ = _case(rng, S=200, topk=24, B=1)
    full = {k: v.astype(np.float64) * (1 + 1e-9 * rng.standard_normal(v.shape))
            for k, v in full.items()}  # fp64 weights that fp32 cannot hold
    full["attn_sink"] = full["attn_sink"].astype(np.float32).astype(np.float64)  # an fp32 param
    layer = _float64_layer(cfg, full)
    np.testing.assert_array_equal(layer.wq_a.numpy(), full["wq_a"])
    x_np = rng.standard_normal((1, 200, cfg.hidden_size))
    y = layer(paddle.to_tensor(x_np), paddle.to_tensor(idx))
    assert y.dtype == paddle.float64
    W = {k: paddle.to_tensor(v) for k, v in full.items()}
    ry = _reference(cfg, W, paddle.to_tensor(x_np), idx)
    assert rel_l2(y, ry) < 1e-13


def test_weights_are_slices_of_the_full_weights():
    cfg = get_preset("deepseek_v32_small")
    full = init_full_weights(cfg, seed=3)
    layer = MQALatentAttention(cfg, seed=3)
    for name, p in layer.named_parameters():
        np.testing.assert_array_equal(p.numpy(), full[name])
    assert set(full) == set(SHARD_AXIS) | set(REPLICATED)
    # Per-head generators: the slice for rank r of 4 is what a rank-r layer draws.
    H = cfg.num_attention_heads
    for name, axis in SHARD_AXIS.items():
        parts = [shard_of(name, full[name], r, 4) for r in range(4)]
        np.testing.assert_array_equal(np.concatenate(parts, axis=axis), full[name])
        assert parts[0].shape[axis] * 4 == full[name].shape[axis]
    assert full["wq_b"].shape[1] == H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    # what rank r of 4 draws itself (the layer's build on that rank) is that slice
    from paddlefleet.tilelang_ops.attn.layer import _init_weights

    for r in range(4):
        part = _init_weights(cfg.replace(tensor_parallel_degree=4), 3, r, 4)
        assert sorted(part) == sorted(full)
        for name, value in part.items():
            np.testing.assert_array_equal(value, shard_of(name, full[name], r, 4), err_msg=name)
    assert not np.array_equal(init_full_weights(cfg, seed=4)["wo"], full["wo"])


def test_build_copies_the_weights_without_paddles_assign_initializer(monkeypatch):
    """Assign took ~27 s for the deepseek_v32 preset's 117M-element wo on CPU (~49 s for the
    whole layer); the build writes each weight with one set_value instead.  Same values, and
    the parameters still take Paddle's default dtype."""

    def slow_assign(*args, **kwargs):
        raise AssertionError("the layer must not build its weights with initializer.Assign")

    monkeypatch.setattr(paddle.nn.initializer, "Assign", slow_assign)
    cfg = get_preset("deepseek_v32_small")
    full = init_full_weights(cfg, seed=5)
    layer = MQALatentAttention(cfg, seed=5)
    assert sorted(n for n, _ in layer.named_parameters()) == sorted(full)
    for name, p in layer.named_parameters():
        assert p.dtype == paddle.float32 and not p.stop_gradient, name
        np.testing.assert_array_equal(p.numpy(), full[name], err_msg=name)
    old = paddle.get_default_dtype()
    paddle.set_default_dtype("float64")
    try:
        layer64 = MQALatentAttention(cfg, seed=5)
    finally:
        paddle.set_default_dtype(old)
    assert layer64.wo.dtype == paddle.float64 and layer64.attn_sink.dtype == paddle.float32
    np.testing.assert_array_equal(layer64.wo.numpy(), full["wo"].astype(np.float64))


def test_errors():
    cfg = get_preset("deepseek_v32_small")
    with pytest.raises(ValueError, match="tensor_parallel_degree=2.*1 rank"):
        MQALatentAttention(cfg.replace(tensor_parallel_degree=2))
    with pytest.raises(TypeError, match="MQALatentAttentionConfig"):
        MQALatentAttention(cfg.to_dict())
    layer = MQALatentAttention(cfg)
    idx = paddle.to_tensor(causal_topk_indices(1, 8, 8, 4))
    with pytest.raises(ValueError, match="hidden_states"):
        layer(paddle.randn([1, 8, cfg.hidden_size + 1]), idx)
    x = paddle.randn([1, 8, cfg.hidden_size])
    for dtype in ("float64", "float16", "bfloat16"):
        with pytest.raises(
            TypeError,
            match=rf"^hidden_states: expected dtype float32 \(the layer's parameter dtype\), got {dtype}",
        ):
            layer(x.astype(dtype), idx)
    with pytest.raises(ValueError, match=r"^hidden_states: expected B >= 1 and S >= 1.*\[1, 0, 256\]"):
        layer(paddle.zeros([1, 0, cfg.hidden_size]), paddle.zeros([1, 0, 4], dtype="int32"))
    with pytest.raises(ValueError, match=r"^token_indices: expected \[B, S, L\] with B=1 and S=8 \(from hidden_states\)"):
        layer(x, idx[:, :7])
    with pytest.raises(TypeError, match="^token_indices: expected a paddle.Tensor or a numpy "
                                        "int32/int64 array, got list"):
        layer(x, idx.numpy().tolist())
    with pytest.raises(TypeError, match="^token_indices: expected dtype int32 or int64 .*got "
                                        "numpy float64"):
        layer(x, idx.numpy().astype(np.float64))
    full = init_full_weights(cfg)
    full["wo"] = full["wo"][:-1]
    with pytest.raises(ValueError, match="wo"):
        layer.load_full_weights(full)
    # The TileLang backward needs CUDA; the config's choice reaches the op.
    cpu_tl = MQALatentAttention(cfg.replace(backward_backend="tilelang"))
    with pytest.raises(ValueError, match="tilelang.*CUDA"):
        cpu_tl(paddle.randn([1, 8, cfg.hidden_size]), idx)


@pytest.mark.parametrize("partition", ["heads", "sequence"])
def test_numpy_token_indices_equal_tensor_indices(rng, partition):
    """Issue 42: causal_topk_indices returns numpy, and the layer refused it.  numpy int32 and
    int64 indices give the output and gradients of the same indices as a tensor, bit for bit."""
    cfg = get_preset("deepseek_v32_small", attention_partition=partition)
    layer = MQALatentAttention(cfg, seed=3)
    x_np = rng.standard_normal((2, 12, cfg.hidden_size)).astype(np.float32)
    idx = causal_topk_indices(2, 12, 12, 8, seed=int(rng.integers(1 << 30)))
    results = []
    for indices in (paddle.to_tensor(idx), idx, idx.astype(np.int64)):
        x = paddle.to_tensor(x_np, stop_gradient=False)
        y = layer(x, indices)
        (y * y).sum().backward()
        results.append([y.numpy(), x.grad.numpy()]
                       + [p.grad.numpy() for _, p in layer.named_parameters()])
        layer.clear_gradients()
    assert np.abs(results[0][1]).max() > 0
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            np.testing.assert_array_equal(got, want)


def test_load_full_weights_refuses_weights_it_would_drop(rng):
    """Issue 41, item 5: a trained sink loaded into a ``use_attn_sink=False`` layer, or a
    misspelled key, loaded without a word.  Keys that are no parameter of the layer raise,
    named, as missing ones do, and nothing is written before every key is checked."""
    cfg, full, _, _, _ = _case(rng, heads=8, S=8, topk=4)
    layer = MQALatentAttention(cfg.replace(use_attn_sink=False))
    before = {n: p.numpy().copy() for n, p in layer.named_parameters()}
    with pytest.raises(ValueError, match=r"^load_full_weights: weight\(s\) \['attn_sink'\] are not "
                                         r"parameters of this layer, which would drop them; "
                                         r"attn_sink is a weight of layers with use_attn_sink=True"):
        layer.load_full_weights(full)
    misspelled = {k: v for k, v in full.items() if k != "attn_sink"}
    misspelled["w_ou"] = misspelled["wo"]
    with pytest.raises(ValueError, match=r"^load_full_weights: weight\(s\) \['w_ou'\] are not "):
        layer.load_full_weights(misspelled)
    del misspelled["wo"]
    with pytest.raises(ValueError, match=r"^load_full_weights: missing weight\(s\) \['wo'\]"):
        layer.load_full_weights(misspelled)
    bad_shape = {k: v for k, v in full.items() if k != "attn_sink"}
    bad_shape["wo"] = bad_shape["wo"][:-1]
    with pytest.raises(ValueError, match="wo slice has shape"):
        layer.load_full_weights(bad_shape)
    for name, p in layer.named_parameters():  # untouched by the failed loads
        np.testing.assert_array_equal(p.numpy(), before[name], err_msg=name)
    layer.load_full_weights({k: v for k, v in full.items() if k != "attn_sink"})
    np.testing.assert_array_equal(layer.wo.numpy(), full["wo"])


@pytest.mark.parametrize("weight, value, error, match", [
    ("wo", lambda w: np.full_like(w, 1e300, dtype=np.float64), ValueError,
     r"^load_full_weights: wo: expected finite values within the range of the parameter's "
     r"float32, got \d+ NaN, infinite or out-of-range value\(s\) \(first: .*1e\+300"),
    ("wo", lambda w: np.where(np.arange(w.size).reshape(w.shape) == 3, np.nan, w), ValueError,
     r"^load_full_weights: wo: expected finite values .* got 1 NaN"),
    ("wo", lambda w: np.full_like(w, -np.inf), ValueError,
     r"^load_full_weights: wo: expected finite"),
    ("wo", lambda w: w + 1j, TypeError,
     r"^load_full_weights: wo: expected a real \(float, int or bool\) array, got dtype complex"),
    ("wo", lambda w: w.tolist(), TypeError,
     r"^load_full_weights: wo: expected a numpy array, got list"),
    ("wo", lambda w: None, TypeError, r"^load_full_weights: wo: expected a numpy array, got None"),
    ("attn_sink", lambda w: 1.0, TypeError,
     r"^load_full_weights: attn_sink: expected a numpy array, got float")])
def test_load_full_weights_refuses_values_it_cannot_load(rng, weight, value, error, match):
    """Break-it 4: 1e300 (inf in fp32), NaN and complex values loaded silently; a list, None or
    a float value raised a raw AttributeError.  Each is now refused, named, before anything is
    written (the layer is shared by the V3.2 and V4 layers)."""
    cfg, full, _, _, _ = _case(rng, heads=8, S=8, topk=4)
    layer = MQALatentAttention(cfg)
    before = {n: p.numpy().copy() for n, p in layer.named_parameters()}
    bad = dict(full)
    bad[weight] = value(full[weight])
    with pytest.raises(error, match=match):
        layer.load_full_weights(bad)
    for name, p in layer.named_parameters():
        np.testing.assert_array_equal(p.numpy(), before[name], err_msg=name)


@pytest.mark.parametrize("full", [None, [("wo", np.zeros(3))]])
def test_load_full_weights_wants_a_mapping(full):
    """Break-it 4: ``full=None`` raised a raw TypeError, a list "missing weight(s)"."""
    layer = MQALatentAttention(get_preset("deepseek_v32_small"))
    with pytest.raises(TypeError, match=r"^load_full_weights: full: expected a mapping of weight "
                                        r"name -> numpy array, got (None|list)"):
        layer.load_full_weights(full)


def test_load_full_weights_refuses_values_past_a_half_parameter_range(rng):
    """An fp32 value that a float16 parameter would hold as inf is refused for that dtype."""
    cfg, full, _, _, _ = _case(rng, heads=8, S=8, topk=4)
    layer = MQALatentAttention(cfg)
    layer.to(dtype="float16")
    bad = dict(full, wo=np.full_like(full["wo"], 1e5))
    with pytest.raises(ValueError, match=r"^load_full_weights: wo: .* parameter's float16"):
        layer.load_full_weights(bad)
    layer.load_full_weights(dict(full, wo=np.full_like(full["wo"], 6e4)))
    assert float(layer.wo.astype("float32").numpy().max()) == pytest.approx(6e4, rel=1e-3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("how", ["default_dtype", "to"])
def test_half_precision_layer_on_cpu_names_its_dtype(dtype, how):
    """Issue 41, item 7: a float16/bfloat16 layer on CPU failed inside Paddle's matmul ("kernel
    not registered").  Its first forward raises a TypeError naming the dtype and the ones that
    run on CPU (float32, float64: both run, also after ``layer.to(dtype=...)``)."""
    from paddlefleet.tilelang_ops.attn.layer import CPU_DTYPES

    assert CPU_DTYPES == ("float32", "float64")
    cfg = get_preset("deepseek_v32_small", num_attention_heads=4, index_topk=4)
    idx = paddle.to_tensor(causal_topk_indices(1, 8, 8, 4))
    x = paddle.randn([1, 8, cfg.hidden_size])
    for ok in CPU_DTYPES:
        layer = MQALatentAttention(cfg)
        layer.to(dtype=ok)
        y = layer(x.astype(ok), idx)
        assert y.dtype == getattr(paddle, ok) and bool(paddle.isfinite(y).all())
    if how == "to":
        layer = MQALatentAttention(cfg)
        layer.to(dtype=dtype)
    else:
        old = paddle.get_default_dtype()
        paddle.set_default_dtype(dtype)
        try:
            layer = MQALatentAttention(cfg)
        finally:
            paddle.set_default_dtype(old)
    with pytest.raises(TypeError, match=rf"^MQALatentAttention: the layer's parameters are {dtype}, "
                                        rf"which does not run on CPU .*runs in float32 or float64"):
        layer(x.astype(dtype), idx)


def test_initializer_range_that_overflows_fp32_weights():
    cfg = get_preset("deepseek_v32_small", num_attention_heads=4, initializer_range=3e38)
    with pytest.raises(ValueError, match=r"^config.initializer_range=3e\+38 draws non-finite fp32 "
                                         r"weights \(wq_a\)"):
        MQALatentAttention(cfg)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_load_full_weights_keeps_the_parameter_dtype(rng, dtype):
    """Weights load into a layer cast to bf16 (numpy has no bf16: the old code cast through
    ``param.numpy().dtype``, uint16) or fp64: each parameter keeps its dtype and holds the
    weight rounded to it."""
    cfg, full, _, _, _ = _case(rng, heads=8, S=8, topk=4)
    layer = MQALatentAttention(cfg)
    layer.to(dtype=dtype)
    layer.load_full_weights(full)
    names = [n for n, _ in layer.named_parameters()]
    assert names and set(names) <= set(full)
    for name, p in layer.named_parameters():
        assert p.dtype == getattr(paddle, dtype), name
        want = paddle.to_tensor(full[name]).astype(dtype).astype("float64").numpy()
        got = p.astype("float64").numpy()
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert np.abs(got - full[name]).max() <= 2.0**-8 * np.abs(full[name]).max(), name


def test_training_steps_reduce_a_loss(rng):
    # The layer trains: a few Adam steps on a fixed regression target lower the loss and every
    # parameter moves.
    cfg, full, x_np, idx, target = _case(rng, heads=8, S=24, topk=16)
    layer = MQALatentAttention(cfg)
    layer.load_full_weights(full)
    opt = paddle.optimizer.Adam(learning_rate=1e-2, parameters=layer.parameters())
    x, t = paddle.to_tensor(x_np), paddle.to_tensor(target)
    idx_t = paddle.to_tensor(idx)
    losses = []
    for _ in range(5):
        loss = ((layer(x, idx_t) - t) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    for name, p in layer.named_parameters():
        assert not np.array_equal(p.numpy(), full[name]), name


# --- packed documents (cu_seqlens) ---------------------------------------------------------
def _float64_layer(cfg, full):
    """The layer in fp64 (built under Paddle's fp64 default dtype; the sink stays fp32, as the
    layer and the op want it)."""
    old = paddle.get_default_dtype()
    paddle.set_default_dtype("float64")
    try:
        layer = MQALatentAttention(cfg)
    finally:
        paddle.set_default_dtype(old)
    layer.load_full_weights(full)
    assert layer.wq_a.dtype == paddle.float64
    return layer


def _run_layer(layer, x_np, idx, gy, cu=None):
    x = paddle.to_tensor(x_np, stop_gradient=False)
    y = layer(x, paddle.to_tensor(idx), cu_seqlens=cu)
    (y * paddle.to_tensor(gy)).sum().backward()
    grads = {name: p.grad.astype("float64").numpy() for name, p in layer.named_parameters()}
    layer.clear_gradients()
    return y.numpy(), x.grad.numpy(), grads


@pytest.mark.parametrize("sink", [True, False], ids=["sink", "nosink"])
def test_packed_equals_documents_alone_float64(rng, sink):
    """A packed batch (B = 1, RoPE restarting per document, per-document causal indices) equals
    each document run alone, stacked: the output and dx row for row, every parameter gradient
    as the sum over the documents.  fp64 on CPU, <= 1e-6 relative (measured ~6e-16; the fp32
    sink's gradient, rounded to fp32 per call, ~5e-8)."""
    lengths = [1, 23, 0, 7, 2, 40, 3]  # very different lengths, an empty document
    cfg, full, _, _, _ = _case(rng, sink=sink, heads=16, topk=12)
    cu = cu_seqlens_from_lengths(lengths)
    S = int(cu[-1])
    x = rng.standard_normal((1, S, cfg.hidden_size))
    gy = rng.standard_normal((1, S, cfg.hidden_size))
    idx = varlen_causal_topk_indices(cu, cfg.index_topk, seed=int(rng.integers(1 << 30)))
    layer = _float64_layer(cfg, full)

    y, dx, grads = _run_layer(layer, x, idx, gy, cu=paddle.to_tensor(cu))
    ys, dxs, sums = [], [], {name: 0.0 for name in grads}
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a == b:
            continue
        doc_idx = np.where(idx[:, a:b] >= 0, idx[:, a:b] - a, -1).astype(np.int32)
        y_d, dx_d, g_d = _run_layer(layer, x[:, a:b], doc_idx, gy[:, a:b])  # alone, no cu
        ys.append(y_d)
        dxs.append(dx_d)
        for name in sums:
            sums[name] = sums[name] + g_d[name]
    errors = {"y": rel_l2(y, np.concatenate(ys, 1)), "dx": rel_l2(dx, np.concatenate(dxs, 1))}
    for name, g in grads.items():
        errors["grad." + name] = rel_l2(g, sums[name])
        assert np.abs(g).max() > 0, name  # a real gradient, not zeros
    assert set(errors) - {"y", "dx"} == {"grad." + k for k in full}
    bad = {k: e for k, e in errors.items() if not e <= 1e-6}
    assert not bad, f"rel L2 above 1e-6: {bad}"
    # Tighter: the fp64 parts agree to fp64 rounding (measured ~6e-16).  RoPE scores depend
    # only on position differences, so shifted positions change the math by nothing but the
    # rounding of the angle table; the fp64 layer's tables are fp64 (issue 41), so positions
    # 0..S-1 over the whole row agree to fp64 rounding too (they left ~1e-7 with the fp32
    # tables it had).  That the positions restart is test_packed_rope_positions_restart_per_document.
    tight = {k: e for k, e in errors.items() if k != "grad.attn_sink" and not e <= 1e-12}
    assert not tight, f"rel L2 above 1e-12: {tight}"
    y_flat, _, _ = _run_layer(layer, x, idx, gy)
    assert rel_l2(y_flat, np.concatenate(ys, 1)) < 1e-12


def test_packed_rope_positions_restart_per_document():
    layer = MQALatentAttention(get_preset("deepseek_v32_small"))
    x = paddle.zeros([1, 12, layer.config.hidden_size])
    cu, pos = layer._packed_positions(x, paddle.to_tensor(np.array([0, 3, 3, 10, 12], np.int32)))
    np.testing.assert_array_equal(pos, [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 1])
    assert cu.dtype == np.int32 and cu.tolist() == [0, 3, 3, 10, 12]


def test_one_document_equals_no_cu_seqlens(rng):
    cfg, full, x, idx, gy = _case(rng, B=1, S=20, topk=8)
    layer = MQALatentAttention(cfg)
    layer.load_full_weights(full)
    y0, dx0, g0 = _run_layer(layer, x, idx, gy)
    y1, dx1, g1 = _run_layer(layer, x, idx, gy, cu=np.array([0, 20], np.int32))
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_array_equal(dx1, dx0)
    for name in g0:
        np.testing.assert_array_equal(g1[name], g0[name], err_msg=name)


@pytest.mark.parametrize("partition", ["heads", "sequence"])
def test_packed_errors(rng, partition):
    """The same messages for both attention partitions (with "sequence" the layer checks the
    indices itself, on all rows, before any exchange)."""
    cfg = get_preset("deepseek_v32_small", backward_backend="reference",
                     attention_partition=partition)
    layer = MQALatentAttention(cfg)
    cu = cu_seqlens_from_lengths([5, 9, 2])
    x = paddle.to_tensor(rng.standard_normal((1, 16, cfg.hidden_size)).astype(np.float32))
    idx = varlen_causal_topk_indices(cu, 6, seed=int(rng.integers(1 << 30)))
    t = paddle.to_tensor
    layer(x, t(idx), cu_seqlens=t(cu))  # good
    cases = [
        (t(cu.astype(np.int64)), TypeError, "^cu_seqlens: expected dtype int32, got int64"),
        (t(cu.astype(np.float32)), TypeError, "^cu_seqlens: expected dtype int32, got float32"),
        ([0, 5, 14, 16], TypeError, "^cu_seqlens: expected an int32 paddle.Tensor.*got list"),
        (t(np.array([2, 5, 14, 16], np.int32)), ValueError,
         r"^cu_seqlens: expected cu_seqlens\[0\] == 0, got 2"),
        (t(np.array([0, 5, 4, 16], np.int32)), ValueError,
         r"^cu_seqlens: expected non-decreasing values, got cu_seqlens\[2\]=4 < cu_seqlens\[1\]=5"),
        (t(np.array([0, 5, 14, 15], np.int32)), ValueError,
         r"^cu_seqlens: expected cu_seqlens\[-1\] == S=16 \(the packed rows\), got 15"),
        (t(np.array([0, 5, 14, 17], np.int32)), ValueError,
         r"^cu_seqlens: expected cu_seqlens\[-1\] == S=16"),
        (t(np.array([[0, 16]], np.int32)), ValueError, r"^cu_seqlens: expected 1 dim"),
    ]
    for value, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            layer(x, t(idx), cu_seqlens=value)
    with pytest.raises(ValueError, match=r"^hidden_states: packed documents \(cu_seqlens\) need "
                                         r"B=1.*\[2, 16, 256\]"):
        layer(paddle.concat([x, x]), t(np.concatenate([idx, idx])), cu_seqlens=t(cu))
    bad = idx.copy()
    bad[0, 14, 1] = 13  # row 14: document 2, rows [14, 16); key 13 is document 1's last row
    with pytest.raises(ValueError, match=r"^token_indices: row 14 \(document 2, rows \[14, 16\) "
                                         r"of cu_seqlens\) holds key 13, outside its document"):
        layer(x, t(bad), cu_seqlens=t(cu))
    bad[0, 5, 0] = 4  # row 5 (document 1, rows [5, 14)) sees key 4: now the first bad row
    with pytest.raises(ValueError, match=r"^token_indices: row 5 \(document 1, rows \[5, 14\).*"
                                         r"key 4.*\(2 such row\(s\)\)"):
        layer(x, t(bad), cu_seqlens=t(cu))


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("sink", [True, False], ids=["sink", "nosink"])
def test_sequence_partition_on_one_rank_is_the_heads_path(rng, sink, packed):
    """With one rank the "sequence" partition has nothing to exchange or pad: output and every
    gradient equal the "heads" run bit for bit (tests/multi_card_tests compare TP 2-8)."""
    cfg, full, x, idx, gy = _case(rng, sink=sink, B=1 if packed else 2, S=21, topk=8)
    cu = None
    if packed:
        cu = cu_seqlens_from_lengths([4, 0, 17])
        idx = varlen_causal_topk_indices(cu, 8, seed=int(rng.integers(1 << 30)))
    runs = []
    for partition in ("heads", "sequence"):
        layer = MQALatentAttention(cfg.replace(attention_partition=partition))
        layer.load_full_weights(full)
        runs.append(_run_layer(layer, x, idx, gy, cu=cu))
    (y0, dx0, g0), (y1, dx1, g1) = runs
    assert np.abs(y0).max() > 0 and np.abs(dx0).max() > 0
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_array_equal(dx1, dx0)
    assert set(g1) == set(g0)
    for name in g0:
        assert np.abs(g0[name]).max() > 0, name
        np.testing.assert_array_equal(g1[name], g0[name], err_msg=name)


@pytest.mark.parametrize("partition", ["heads", "sequence"])
@pytest.mark.parametrize("deterministic", [None, True, False])
def test_config_deterministic_reaches_the_op(rng, monkeypatch, partition, deterministic):
    """Issue 42: ``MQALatentAttentionConfig.deterministic`` is what the layer hands the op."""
    from paddlefleet.tilelang_ops.attn import layer as layer_mod

    seen = []
    real = layer_mod.mqa_latent_sparse_attention

    def op(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return real(*args, **kwargs)

    monkeypatch.setattr(layer_mod, "mqa_latent_sparse_attention", op)
    cfg, full, x, idx, _ = _case(rng, B=1, S=12, topk=4)
    layer = MQALatentAttention(cfg.replace(attention_partition=partition,
                                           deterministic=deterministic))
    layer(paddle.to_tensor(x), paddle.to_tensor(idx))
    assert seen == [deterministic]


def test_sequence_partition_checks_index_values_before_the_core(rng):
    cfg, full, x, idx, _ = _case(rng, B=1, S=12, topk=4)
    layer = MQALatentAttention(cfg.replace(attention_partition="sequence"))
    idx[0, 11, 0] = 12  # one past S_kv
    with pytest.raises(ValueError, match="token_indices"):
        layer(paddle.to_tensor(x), paddle.to_tensor(idx))
