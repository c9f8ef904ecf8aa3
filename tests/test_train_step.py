"""tools/train_step.py (the main job) in one process: a few training steps, packed documents,
the terminal output, Ctrl-C / SIGTERM, exits and argument errors.  Multi-rank runs
(``--nproc``) are tests/multi_card_tests/test_train_step_tp.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

pytest.importorskip("paddle")  # the GPU host's torch-only env skips this module

from helpers import REPO_ROOT, run_until_signalled  # noqa: E402

TRAIN_STEP = REPO_ROOT / "tools" / "train_step.py"


def _train_step(*args, timeout=120, progress=False):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src"))
    return subprocess.run(
        [sys.executable, str(TRAIN_STEP), *([] if progress else ["--no-progress"]), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )


def _in_fresh_process(code: str, *args, timeout=120):
    """``python -c code args`` with tools/ and src/ importable (``import train_step``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        str(REPO_ROOT / d) for d in ("tools", "src")))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _losses(stdout: str) -> list:
    return [float(m) for m in re.findall(r"step \d+: loss ([0-9.]+)", stdout)]


def test_train_step_runs_and_loss_falls():
    res = _train_step("--config", "deepseek_v32_small", "--steps", "3", "--seq-len", "128",
                      "--topk", "24")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "inputs: B 1, S 128, top-k 24," in res.stdout, res.stdout
    losses = _losses(res.stdout)
    assert len(losses) == 3 and losses[-1] < losses[0], res.stdout
    assert "grad_norm" in res.stdout and "attn_sink" in res.stdout


def test_train_step_default_run_loss_falls_at_the_default_lr():
    """Issue 42, item 5c: the documented CPU run (small preset, 512 tokens, 5 steps) at the
    default --lr, which depends on the config's width: the loss falls on every step.  (The
    deepseek_v32 preset's 1e-4 was checked by hand: its CPU steps take minutes.)"""
    res = _train_step("--config", "deepseek_v32_small", "--device", "cpu", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "inputs: B 1, S 512, top-k 64, sm_scale 0.144338; AdamW lr 0.001\n" in res.stdout
    losses = _losses(res.stdout)
    assert len(losses) == 5 and all(b < a for a, b in zip(losses, losses[1:])), res.stdout
    assert re.search(r"^done: 5 steps, loss ", res.stdout, re.M), res.stdout


def test_train_step_one_step_is_singular_and_the_header_names_the_split():
    res = _train_step("--config", "deepseek_v32_small", "--steps", "1", "--seq-len", "16",
                      "--lr", "2e-3")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "heads 16 (all in one process)," in res.stdout, res.stdout
    assert "AdamW lr 0.002\n" in res.stdout
    assert re.search(r"^done: 1 step, loss [0-9.]+ -> [0-9.]+$", res.stdout, re.M), res.stdout


@pytest.mark.parametrize("flag,env,want", [
    ([], {}, "True"),                                    # the package's default
    (["--no-deterministic"], {}, "False"),               # the option overrides the config
    ([], {"FLAGS_cudnn_deterministic": "0"}, "False"),   # None follows Paddle's flag
    (["--deterministic"], {"FLAGS_cudnn_deterministic": "0"}, "True"),
])
def test_train_step_deterministic_option_and_header(flag, env, want, monkeypatch):
    """Fresh-user review: the main job can choose the backward's determinism and its header
    says which one runs (resolved: the option, else the config, else Paddle's flag)."""
    monkeypatch.delenv("FLAGS_cudnn_deterministic", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = _train_step("--config", "deepseek_v32_small", "--steps", "1", "--seq-len", "16", *flag)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"backward reference (deterministic {want})," in res.stdout, res.stdout


def test_train_step_packed_documents():
    """--doc-lens: one row of packed documents (an empty one too), per-document indices, the
    layer given cu_seqlens; the loss falls as without packing."""
    res = _train_step("--config", "deepseek_v32_small", "--steps", "3", "--doc-lens",
                      "7,90,0,1,30", "--seq-len", "128")
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("inputs: B 1, S 128, top-k 64, sm_scale 0.144338, 5 packed documents "
            "(lengths 7,90,0,1,30)") in res.stdout, res.stdout
    losses = [float(m) for m in re.findall(r"step \d+: loss ([0-9.]+)", res.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], res.stdout


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
                 "--lr LR AdamW learning rate (default: 0.001 for a config with hidden_size <= "
                 "1024, as deepseek_v32_small; 0.0001 for a wider one, as deepseek_v32)",
                 "--nproc NPROC tensor-parallel ranks;", "(default: the config's "
                 "tensor_parallel_degree, 1 for the presets;",
                 "--log-dir DIR folder for the rank logs of a multi-rank run, kept (default: a "
                 "temporary folder, removed after a successful run,",
                 "--seed SEED seed of the weights, inputs and indices (default: 0)",
                 "--seq-len SEQ_LEN tokens per sequence (default: 4096 on a GPU, 512 on CPU)",
                 "(default: min(config index_topk, --seq-len))",
                 "--timeout TIMEOUT seconds before", "default: 600)",
                 "--config CONFIG preset name", "(default: deepseek_v32 on a GPU, ",
                 "--attention-partition {heads,sequence} override the config's "
                 "attention_partition"):
        assert text in out, text
    assert "Examples: # CPU, small preset" in out
    # plain text, no Sphinx markup (issue 42, item 5g)
    for markup in ("``", ":class:", ":func:", ":meth:", ":mod:"):
        assert markup not in res.stdout, markup
    assert "python tools/train_step.py --config deepseek_v32_small --nproc 4" in out
    assert ("python tools/train_step.py --config deepseek_v32_small --attention-partition "
            "sequence --nproc 8") in out


@pytest.mark.parametrize("sig_name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_train_step_stops_on_ctrl_c_and_sigterm_with_one_line(sig_name, code):
    rc, out, err, seconds, _ = run_until_signalled(
        TRAIN_STEP, ["--config", "deepseek_v32_small", "--steps", "100000", "--seq-len", "32",
                     "--no-progress"], "step 1:", getattr(signal, sig_name))
    assert rc == code, out + err
    assert seconds < 20
    # (a signal that lands inside a backward is announced first: the next test)
    assert re.fullmatch(rf"({sig_name} received: stopping once this step's backward pass ends; "
                        rf"[^\n]* now\n)?interrupted by {sig_name} at step \d+ of 100000\n",
                        err), err


# train_step.main() with paddle.Tensor.backward wrapped: at step 1 the signals given in argv[1]
# arrive inside the backward (where the first one is deferred), before the real backward runs.
_SIGNALS_IN_BACKWARD = """
import os, signal, sys
import train_step  # first: it silences import paddle's "No ccache found" warning
import paddle

backward, calls = paddle.Tensor.backward, []

def backward_with_signals(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        for name in sys.argv[1].split(","):
            os.kill(os.getpid(), getattr(signal, name))
        print("rest of the backward", file=sys.stderr, flush=True)
    return backward(self, *args, **kwargs)

paddle.Tensor.backward = backward_with_signals
sys.exit(train_step.main(sys.argv[2:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
@pytest.mark.parametrize("signals, code, again", [
    ("SIGINT", 130, "Ctrl-C again stops now"),
    ("SIGTERM", 143, "a second SIGTERM or Ctrl-C stops now"),
    ("SIGINT,SIGINT", 130, "Ctrl-C again stops now"),
])
def test_a_signal_inside_the_backward_is_announced_at_once(signals, code, again):
    """Issue 42, item 4: the first Ctrl-C inside a backward waits for it (21 s on deepseek_v32,
    minutes under load) and printed nothing meanwhile.  It says at once, on a line of its own,
    what happens: the line comes before the rest of that backward runs; the run then stops at
    that step's end.  A second Ctrl-C stops at once (the rest of the backward never runs)."""
    res = _in_fresh_process(_SIGNALS_IN_BACKWARD, signals, "--config", "deepseek_v32_small",
                            "--steps", "3", "--seq-len", "16", "--no-progress")
    first = signals.split(",")[0]
    rest = "" if "," in signals else "rest of the backward\n"
    assert res.returncode == code, res.stdout + res.stderr
    assert res.stderr == (f"{first} received: stopping once this step's backward pass ends; "
                          f"{again}\n{rest}interrupted by {first} at step 1 of 3\n"), res.stderr
    assert "step 0: loss" in res.stdout and "step 1:" not in res.stdout, res.stdout


# train_step.main(argv) in a fresh process: its exit status, and whether Paddle was imported
_MAIN_WITHOUT_PADDLE = """
import json, sys
import train_step
try:
    code = train_step.main(sys.argv[1:])
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
    if not isinstance(e.code, int):
        print(e.code, file=sys.stderr)
print(json.dumps({"code": code, "paddle": "paddle" in sys.modules}))
"""


def _json_config(tmp_path, **fields):
    from paddlefleet.tilelang_ops.attn.config import get_preset

    path = tmp_path / "config.json"
    get_preset("deepseek_v32_small", **fields).to_json_file(path)
    return str(path)


@pytest.mark.parametrize("args, code, message", [
    (("--config", "deepseek_v32_small", "--nproc", "3"), 1,
     "num_attention_heads must be divisible by tensor_parallel_degree"),
    (("--device", "cpu", "--nproc", "5"), 1,
     "num_attention_heads must be divisible by tensor_parallel_degree"),
    (("--config", "deepseek_v32", "--device", "cpu"), 1,
     "config 'deepseek_v32' asks for backward_backend='tilelang'"),
    (("--config", "no_such_preset"), 1, "is neither a preset"),
    (("--device", "cpu", "--topk", "600"), 2,
     "argument --topk: expected at most the sequence length 512 (--seq-len), got 600"),
    (("--doc-lens", "10,20", "--seq-len", "31"), 2,
     "--doc-lens sums to 30 tokens, --seq-len says 31"),
    (("--config", "{tp8}", "--nproc", "2"), 2,
     "argument --nproc: 2 ranks, but --config {tp8} says tensor_parallel_degree 8; leave "
     "--nproc out to run on its 8 ranks, or give the same value"),
    (("--config", "{bad}"), 1, "missing required field"),
])
def test_train_step_config_errors_come_before_paddle_is_imported(tmp_path, args, code,
                                                                 message):
    """Issue 42, item 5b: usage and config errors took 7-10 s, the time to import Paddle."""
    files = {"tp8": _json_config(tmp_path, tensor_parallel_degree=8),
             "bad": str(tmp_path / "bad.json")}
    (tmp_path / "bad.json").write_text('{"hidden_size": 8}')
    args = [a.format(**files) for a in args]
    res = _in_fresh_process(_MAIN_WITHOUT_PADDLE, *args)
    got = json.loads(res.stdout.splitlines()[-1])
    assert got == {"code": code, "paddle": False}, res.stderr
    assert message.format(**files) in res.stderr, res.stderr


# The ranks a run gets (train_step's checks before Paddle, which resolve --nproc)
_NPROC = """
import sys
import train_step
args = train_step._parser().parse_args(sys.argv[1:])
train_step._check_before_paddle(train_step._parser(), args)
print(args.nproc, "paddle" in sys.modules)
"""


def test_train_step_nproc_defaults_to_the_json_configs_tensor_parallel_degree(tmp_path):
    """Issue 42, item 5a: a JSON config's tensor_parallel_degree was replaced by --nproc's
    default 1 without a word.  Left out, --nproc is the config's; given, it must agree with a
    config's degree other than 1 (the default every saved preset holds: test above); a preset
    or a degree-1 file runs on any --nproc that divides the heads."""
    tp4, tp1 = _json_config(tmp_path, tensor_parallel_degree=4), None
    tp1_path = tmp_path / "tp1"
    tp1_path.mkdir()
    tp1 = _json_config(tp1_path)
    for args, nproc in [(("--config", tp4), 4), (("--config", tp4, "--nproc", "4"), 4),
                        (("--config", tp1), 1), (("--config", tp1, "--nproc", "2"), 2),
                        (("--config", "deepseek_v32_small"), 1),
                        (("--config", "deepseek_v32_small", "--nproc", "8"), 8)]:
        res = _in_fresh_process(_NPROC, *args, "--device", "cpu")
        assert res.stdout == f"{nproc} False\n", (args, res.stdout + res.stderr)


def test_train_step_exits_nonzero_on_nan():
    res = _train_step("--steps", "3", "--seq-len", "64", "--inject-nan", "1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "non-finite loss/gradient at step 1" in res.stderr


def test_train_step_diverging_update_ends_with_one_line():
    """Issue 41, item 6: ``--lr 1e308`` makes every parameter non-finite after the first
    optimizer step while the loss and gradients are finite; the next forward ended in a
    traceback (``ValueError: attn_sink ...``).  The parameters are checked after each step: one
    ``error: non-finite ...`` line on stderr naming them, status 1, no traceback."""
    res = _train_step("--steps", "3", "--seq-len", "16", "--lr", "1e308")
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr == (
        "error: non-finite parameters after the optimizer step at step 0 (wq_a, q_norm_weight, "
        "wq_b, wkv_a, kv_norm_weight, w_uk, w_uv, wo, attn_sink; the update diverged: lower "
        "--lr, now 1e+308)\n"), res.stderr
    assert "step 0: loss" in res.stdout and "step 1:" not in res.stdout, res.stdout


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
        (("--doc-lens", "100,-4"), "argument --doc-lens: expected comma-separated document "
                                   "lengths >= 0 with a sum >= 1, e.g. 100,412, got [100, -4]"),
        (("--doc-lens", "0,0"), "argument --doc-lens: expected comma-separated document "
                                "lengths >= 0 with a sum >= 1, e.g. 100,412, got [0, 0]"),
        (("--doc-lens", "100;412"), "argument --doc-lens: expected comma-separated document "
                                    "lengths >= 0 with a sum >= 1, e.g. 100,412, got '100;412'"),
        (("--doc-lens", "10,20", "--seq-len", "31"),
         "--doc-lens sums to 30 tokens, --seq-len says 31"),
        (("--doc-lens", "10,20", "--batch", "2"),
         "--doc-lens packs the documents into one row: --batch must be 1, got 2"),
        (("--doc-lens", "10,20", "--topk", "31"),
         "argument --topk: expected at most the sequence length 30 (the --doc-lens sum), got 31"),
        # more keys than tokens: most slots would be padding (16x slower, nothing learned)
        (("--topk", "600"), "argument --topk: expected at most the sequence length 512 "
                            "(--seq-len), got 600"),
        (("--seq-len", "64", "--topk", "65"), "argument --topk: expected at most the sequence "
                                              "length 64 (--seq-len), got 65"),
        # break-it 8: a raw numpy ArrayMemoryError traceback, after Paddle's import
        (("--seq-len", "10000000000000"), "argument --seq-len: expected at most 2147483647"),
        (("--batch", "3000000000"), "argument --batch: expected at most 2147483647"),
        (("--seq-len", "2000000000", "--batch", "2000000000"),
         "argument --seq-len: --batch 2000000000 x --seq-len 2000000000 x top-k 1 int32 "
         "indices alone need"),
        (("--attention-partition", "rows"),
         "argument --attention-partition: invalid choice: 'rows'"),
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
    from paddlefleet.tilelang_ops.attn.config import get_preset

    json_file = tmp_path / "deepseek_v32.json"
    get_preset("deepseek_v32").to_json_file(json_file)
    res = _train_step("--config", str(json_file), "--device", "cpu")
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


def test_train_step_deeply_nested_config_is_a_named_error(tmp_path):
    """Break-it 6: a ``'[' * 100000`` --config file gave a raw RecursionError traceback."""
    path = tmp_path / "deep.json"
    path.write_text("[" * 100000 + "]" * 100000)
    res = _train_step("--config", str(path), "--device", "cpu", timeout=60)
    assert res.returncode == 1, res.stderr
    assert "is not valid JSON: nested too deeply" in res.stderr and str(path) in res.stderr
    assert "Traceback" not in res.stderr
