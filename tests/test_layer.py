"""MQALatentAttention (one process) against an independent float64 formulation of MLA.

The reference below is the *un-absorbed*, dense form: per-head keys ``k = [c_kv @ W_UK^T,
rope(k_pe)]`` and values ``v = c_kv @ W_UV`` are materialised, every key is scored and the
top-k choice enters as a multiplicity mask; RoPE is applied as explicit 2x2 rotation matrices.
float64 Paddle autograd gives its gradients.  The layer (fp32, absorbed, sparse op) must match
in output, input gradient and every parameter gradient.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")  # the GPU host's torch-only env skips this module

from conftest import REPO_ROOT, rel_l2, run_until_signalled  # noqa: E402

from paddlefleet.tilelang_ops.attn.config import get_preset
from paddlefleet.tilelang_ops.attn.indices import causal_topk_indices
from paddlefleet.tilelang_ops.attn.layer import (
    REPLICATED,
    SHARD_AXIS,
    MQALatentAttention,
    init_full_weights,
    shard_of,
)
from paddlefleet.tilelang_ops.attn.tp import (
    copy_to_tensor_parallel,
    default_tensor_parallel_group,
    reduce_from_tensor_parallel,
)

CONFIG_DIR = REPO_ROOT / "configs"
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
    with pytest.raises(TypeError, match="MLAAttentionConfig"):
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
    with pytest.raises(TypeError, match="^token_indices: expected a paddle.Tensor, got numpy.ndarray"):
        layer(x, idx.numpy())
    full = init_full_weights(cfg)
    full["wo"] = full["wo"][:-1]
    with pytest.raises(ValueError, match="wo"):
        layer.load_full_weights(full)
    # The TileLang backward needs CUDA; the config's choice reaches the op.
    cpu_tl = MQALatentAttention(cfg.replace(backward_backend="tilelang"))
    with pytest.raises(ValueError, match="tilelang.*CUDA"):
        cpu_tl(paddle.randn([1, 8, cfg.hidden_size]), idx)


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


def test_collectives_on_one_rank_and_their_pylayers(rng, monkeypatch):
    """On one rank the wrappers return ``x`` itself.  The PyLayers behind them are run directly
    with ``all_reduce`` replaced by a stand-in for three identical ranks (sum = 3 x), so each
    direction shows: CopyToTensorParallel is the identity forward and sums the gradient,
    ReduceFromTensorParallel sums forward and passes the gradient through."""
    from paddlefleet.tilelang_ops.attn import tp

    assert default_tensor_parallel_group() is None and tp.group_world_size() == 1
    x = paddle.to_tensor(rng.standard_normal((3, 4)).astype(np.float32), stop_gradient=False)
    assert copy_to_tensor_parallel(x) is x and reduce_from_tensor_parallel(x) is x

    calls = []

    def fake_all_reduce(t, op=None, group=None):
        calls.append(group)
        t.scale_(3.0)  # in place, as dist.all_reduce works

    monkeypatch.setattr(tp.dist, "all_reduce", fake_all_reduce)
    x_np = x.numpy().copy()
    w = rng.standard_normal((3, 4)).astype(np.float32)
    group = object()
    y = tp.ReduceFromTensorParallel.apply(tp.CopyToTensorParallel.apply(x, group) * 2.0, group)
    np.testing.assert_allclose(y.numpy(), 3.0 * 2.0 * x_np, rtol=1e-6)
    np.testing.assert_array_equal(x.numpy(), x_np)  # out of place: the input is untouched
    assert calls == [group]  # forward: only the reduce
    (y * paddle.to_tensor(w)).sum().backward()
    assert calls == [group, group]  # backward: only the copy
    np.testing.assert_allclose(x.grad.numpy(), 3.0 * 2.0 * w, rtol=1e-6)


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


# --- tools/train_step.py (the main job), single process ------------------------------------
TRAIN_STEP = REPO_ROOT / "tools" / "train_step.py"


def _train_step(*args, timeout=120, progress=False):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src"))
    return subprocess.run(
        [sys.executable, str(TRAIN_STEP), *([] if progress else ["--no-progress"]), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )


def test_train_step_runs_and_loss_falls():
    res = _train_step("--config", "deepseek_v32_small", "--steps", "3", "--seq-len", "128",
                      "--topk", "24")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "inputs: B 1, S 128, top-k 24," in res.stdout, res.stdout
    losses = [float(m) for m in re.findall(r"step \d+: loss ([0-9.]+)", res.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], res.stdout
    assert "grad_norm" in res.stdout and "attn_sink" in res.stdout


def test_train_step_terminal_holds_only_its_own_lines():
    """No "No ccache found" warning from `import paddle`, and no progress bar when the output
    is not a terminal (tqdm's carriage-return frames used to interleave with the step lines in
    a file), even without --no-progress."""
    res = _train_step("--config", "deepseek_v32_small", "--steps", "2", "--seq-len", "32",
                      progress=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stderr == ""
    lines = res.stdout.splitlines()
    assert len(lines) == 2 + 2 * 2 + 1, res.stdout  # config, inputs, 2 x (step, norms), done
    assert "\r" not in res.stdout and "it/s" not in res.stdout


def test_train_step_help_shows_defaults_and_examples():
    res = _train_step("--help", timeout=60)
    assert res.returncode == 0, res.stderr
    out = " ".join(res.stdout.split())  # as one line: independent of the terminal width
    for text in ("--steps STEPS training steps (default: 5)",
                 "--batch BATCH sequences per step (default: 1)",
                 "--lr LR AdamW learning rate (default: 0.001)",
                 "--seed SEED seed of the weights, inputs and indices (default: 0)",
                 "--seq-len SEQ_LEN tokens per sequence (default: 4096 on a GPU, 512 on CPU)",
                 "(default: min(config index_topk, --seq-len))",
                 "--timeout TIMEOUT seconds before", "default: 600)",
                 "--config CONFIG preset name", "(default: deepseek_v32 on a GPU, "):
        assert text in out, text
    assert "Examples: # CPU, small preset" in out
    assert "python tools/train_step.py --config deepseek_v32_small --nproc 4" in out


@pytest.mark.parametrize("sig_name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_train_step_stops_on_ctrl_c_and_sigterm_with_one_line(sig_name, code):
    import signal

    rc, out, err, seconds, _ = run_until_signalled(
        TRAIN_STEP, ["--config", "deepseek_v32_small", "--steps", "100000", "--seq-len", "32",
                     "--no-progress"], "step 1:", getattr(signal, sig_name))
    assert rc == code, out + err
    assert seconds < 20
    assert re.fullmatch(rf"interrupted by {sig_name} at step \d+ of 100000\n", err), err


def test_train_step_exits_nonzero_on_nan():
    res = _train_step("--steps", "3", "--seq-len", "64", "--inject-nan", "1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "non-finite loss/gradient at step 1" in res.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (("--seq-len", "0"), "argument --seq-len: expected an int >= 1, got 0"),
        (("--topk", "0"), "argument --topk: expected an int >= 1, got 0"),
        (("--seq-len", "-5"), "argument --seq-len: expected an int >= 1, got -5"),
        (("--topk", "-1"), "argument --topk: expected an int >= 1, got -1"),
        (("--batch", "-2"), "argument --batch: expected an int >= 1, got -2"),
        (("--lr", "nan"), "argument --lr: expected a finite number > 0, got nan"),
        (("--lr", "inf"), "argument --lr: expected a finite number > 0, got inf"),
        (("--lr", "0"), "argument --lr: expected a finite number > 0, got 0.0"),
        (("--lr=-1e-3",), "argument --lr: expected a finite number > 0, got -0.001"),
        # more keys than tokens: most slots would be padding (16x slower, nothing learned)
        (("--topk", "600"), "argument --topk: expected at most the sequence length 512 "
                            "(--seq-len), got 600"),
        (("--seq-len", "64", "--topk", "65"), "argument --topk: expected at most the sequence "
                                              "length 64 (--seq-len), got 65"),
        (("--inject-nan", "-1"), "argument --inject-nan: expected a step in [0, 5) (--steps 5), "
                                 "got -1"),
        (("--steps", "3", "--inject-nan", "99"), "argument --inject-nan: expected a step in "
                                                 "[0, 3) (--steps 3), got 99"),
    ],
)
def test_train_step_argument_errors(args, message):
    """0 is an error, never silently "the default" (the script used `args.x or default`)."""
    res = _train_step(*args, timeout=60)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_train_step_nproc_must_divide_heads():
    """Checked once, before any rank is launched (the small preset has 16 heads)."""
    res = _train_step("--nproc", "3", "--device", "cpu", timeout=60)
    assert res.returncode != 0
    assert "num_attention_heads must be divisible by tensor_parallel_degree" in res.stderr
    assert "launching" not in res.stdout, res.stdout


def test_train_step_config_errors(tmp_path):
    res = _train_step("--config", str(CONFIG_DIR / "deepseek_v32.json"), "--device", "cpu")
    assert res.returncode != 0 and "tilelang" in res.stderr
    # The config asks for tilelang: the hint names the cheap way and what the costly one costs.
    res = _train_step("--config", "deepseek_v32", "--device", "cpu", timeout=60)
    assert res.returncode == 1
    assert "config 'deepseek_v32' asks for backward_backend='tilelang'" in res.stderr
    assert "--config deepseek_v32_small" in res.stderr and "~5 GB" in res.stderr, res.stderr
    # The flag asks for tilelang: the message says so, not "the config".
    res = _train_step("--config", "deepseek_v32_small", "--backward-backend", "tilelang",
                      "--device", "cpu", timeout=60)
    assert res.returncode == 1
    assert res.stderr.startswith("error: --backward-backend tilelang needs a CUDA GPU"), res.stderr
    assert "config" not in res.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 8}')
    res = _train_step("--config", str(bad))
    assert res.returncode != 0 and "missing required field" in res.stderr
