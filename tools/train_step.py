#!/usr/bin/env python
"""A few training steps of a sparse attention layer: DeepSeek-V3.2's MLA or DeepSeek-V4's.

Builds the tensor-parallel attention layer (MQALatentAttention, or DeepSeekV4Attention for a V4
config) from a config (a preset name or a JSON file), then runs forward / backward / AdamW steps on a fixed regression target,
printing per step the loss, the global gradient norm and the gradient norm of every parameter
(tensor-parallel shards are combined, so the numbers are the same for any --nproc).  Exits
with status 1 and one "error: non-finite ..." line as soon as a loss, a gradient or a parameter
after an optimizer step is not finite, with status 1 when the config cannot run (unknown preset,
heads not divisible by --nproc, tilelang without a GPU), 2 on a bad option, and 130 / 143 when
stopped by Ctrl-C / SIGTERM (every rank is stopped too).

Examples:
    # CPU, small preset, reference backward (a few seconds)
    python tools/train_step.py --config deepseek_v32_small
    # the same, heads split over 4 ranks (re-launches itself with paddle.distributed.launch;
    # the terminal shows rank 0's lines, every rank's full log is in the folder it names)
    python tools/train_step.py --config deepseek_v32_small --nproc 4
    # 8 ranks, the attention core split by query rows (all heads on S/8 rows per rank)
    python tools/train_step.py --config deepseek_v32_small --attention-partition sequence --nproc 8
    # packed documents of 100, 412 and 0 tokens in one row (B = 1, cu_seqlens, per-document
    # causal top-k indices, RoPE restarting in each document)
    python tools/train_step.py --config deepseek_v32_small --doc-lens 100,412,0
    # DeepSeek-V4's block (D 512 = value, window 128 + 64 compressed picks, ratio 4), 8 ranks
    python tools/train_step.py --config deepseek_v4_small --nproc 8
    # Hopper GPU with paddlepaddle-gpu + tilelang-paddle: DeepSeek-V3.2 attention shape
    # (S = 4096, top-k 2048, 128 heads, Dk 576 / Dv 512), TileLang forward and backward
    python tools/train_step.py --config deepseek_v32 --backward-backend tilelang

Defaults: on CPU the small preset, batch 1, 512 tokens; on a GPU the DeepSeek-V3.2 preset,
batch 1, 4096 tokens.  The top-k width is min(config index_topk, seq_len); indices come
from causal_topk_indices (random causal keys; the DSA indexer is out of scope).  With
--doc-lens the row packs documents of those lengths (S = their sum, B = 1); indices come from
varlen_causal_topk_indices and the default top-k width is min(config index_topk, longest
document).  A DeepSeek-V4 config (deepseek_v4_*, a DeepSeekV4Attention) attends to its window
and compressed keys instead; a ratio-4 layer's compressed picks come from
v4_layer.random_compressed_picks (the indexer is out of scope) and --topk does not apply.  The
progress bar is drawn only on a terminal.

Stopping: Ctrl-C (or SIGTERM) during a step's backward pass lets that backward finish (it is not
cut in the middle) and says so at once; a second Ctrl-C stops at once.  A multi-rank run stops
its ranks at once.  Its rank logs go to --log-dir, or to a temporary folder that is removed
after a successful run (kept, and named, when the run fails or is stopped).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(REPO, "src")
if SRC not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, SRC)

# Printed by every `import paddle` on a machine without ccache; not about this script.
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)

from launch import (  # noqa: E402  (tools/launch.py, next to this script)
    CONSOLE_ENV,
    LaunchInterrupted,
    StopSignals,
    launch_ranks,
)

# Set by paddle.distributed.launch in every rank it starts.
_IN_LAUNCHED_RANK = "PADDLE_TRAINER_ID" in os.environ and "PADDLE_TRAINERS_NUM" in os.environ


def _arg_type(convert, ok, expected: str):
    """An argparse ``type=`` that converts with ``convert`` and accepts values where ``ok`` holds
    (0 is an error where it is not accepted, never "use the default")."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


_positive_int = _arg_type(int, lambda v: v >= 1, "an int >= 1")
_non_negative_int = _arg_type(int, lambda v: v >= 0, "an int >= 0")  # numpy seeds
# finite and > 0: rejects nan, inf, 0 and negatives
_positive_float = _arg_type(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
# "100,412,0": document lengths, empty documents allowed, at least one token in all
_doc_lens = _arg_type(lambda text: [int(n) for n in text.split(",")],
                      lambda v: min(v) >= 0 and sum(v) >= 1,
                      "comma-separated document lengths >= 0 with a sum >= 1, e.g. 100,412")


#: The default --lr: one at which the loss falls on each of the default 5 steps.  AdamW moves
#: every weight by about lr per step whatever its gradient, so the change of a projection's
#: output grows with its width: at deepseek_v32's hidden 7168, 1e-3 made the loss rise by step 3
#: (issue 42); at 1e-4 it falls on every step (CPU, reference backward, 512 tokens: 1.0234,
#: 1.0057, 0.9946, 0.9855, 0.9772).  deepseek_v32_small (hidden 256) falls at 1e-3 (0.99771 ..
#: 0.99188; tests/test_train_step.py).
_NARROW_HIDDEN = 1024
_LR_NARROW, _LR_WIDE = 1e-3, 1e-4


def _default_lr(cfg) -> float:
    return _LR_NARROW if cfg.hidden_size <= _NARROW_HIDDEN else _LR_WIDE


def _parser() -> argparse.ArgumentParser:
    intro, rest = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(prog="train_step.py", description=intro, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="preset name (deepseek_v32, deepseek_v32_small, deepseek_v4_flash, "
                        "deepseek_v4_small) or JSON path "
                        "(default: deepseek_v32 on a GPU, deepseek_v32_small on CPU)")
    p.add_argument("--backward-backend", choices=("tilelang", "reference"), default=None,
                   help="override the config's backward_backend (default: the config's)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="override the config's deterministic: --deterministic for the bitwise "
                        "repeatable TileLang backward, --no-deterministic for the atomic one "
                        "(default: the config's; None there follows FLAGS_cudnn_deterministic, "
                        "else on; the CPU reference backward is deterministic either way)")
    p.add_argument("--attention-partition", choices=("heads", "sequence"), default=None,
                   help="override the config's attention_partition: split the attention core "
                        "over the --nproc ranks by heads, or by query rows with all heads per "
                        "rank (all-to-all before and after the core; default: the config's)")
    p.add_argument("--steps", type=_positive_int, default=5,
                   help="training steps (default: %(default)s)")
    p.add_argument("--batch", type=_positive_int, default=1,
                   help="sequences per step (default: %(default)s)")
    p.add_argument("--seq-len", type=_positive_int, default=None,
                   help="tokens per sequence (default: 4096 on a GPU, 512 on CPU)")
    p.add_argument("--topk", type=_positive_int, default=None,
                   help="keys per query row, at most --seq-len "
                        "(default: min(config index_topk, --seq-len))")
    p.add_argument("--lr", type=_positive_float, default=None,
                   help=f"AdamW learning rate (default: {_LR_NARROW:g} for a config with "
                        f"hidden_size <= {_NARROW_HIDDEN}, as deepseek_v32_small; {_LR_WIDE:g} "
                        "for a wider one, as deepseek_v32)")
    p.add_argument("--seed", type=_non_negative_int, default=0,
                   help="seed of the weights, inputs and indices (default: %(default)s)")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto: the GPU when Paddle sees one (default: %(default)s)")
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help="tensor-parallel ranks; >1 re-launches this script with "
                        "paddle.distributed.launch (default: the config's "
                        "tensor_parallel_degree, 1 for the presets; a JSON config whose "
                        "tensor_parallel_degree is not 1 runs on that many ranks only)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="folder for the rank logs of a multi-rank run, kept (default: a "
                        "temporary folder, removed after a successful run, kept and named when "
                        "the run fails or is stopped)")
    p.add_argument("--timeout", type=_positive_float, default=600.0,
                   help="seconds before a multi-rank run is killed (a broken rendezvous hangs; "
                        "default: %(default)g)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is drawn only on a terminal anyway)")
    p.add_argument("--inject-nan", type=int, default=None, metavar="STEP",
                   help="put a NaN into the input at this step, in [0, --steps) (tests the "
                        "non-finite exit; default: none)")
    p.add_argument("--doc-lens", type=_doc_lens, default=None, metavar="N,N,...",
                   help="pack documents of these lengths into one row (B 1, S = their sum, "
                        "cu_seqlens, per-document causal top-k; the top-k default becomes "
                        "min(config index_topk, longest document); default: none, no packing)")
    return p


def _resolve(p: argparse.ArgumentParser, args, on_gpu: bool | None) -> None:
    """Device-dependent defaults, and the checks that relate two arguments (usage errors).
    ``on_gpu`` None: the device is not known yet (before Paddle is imported); what depends on
    it is left for a second call, which checks the rest again."""
    if args.doc_lens is not None:  # packed documents: S is their sum, in one row
        total = sum(args.doc_lens)
        if args.seq_len is not None and args.seq_len != total:
            p.error(f"--doc-lens sums to {total} tokens, --seq-len says {args.seq_len}; "
                    "give one of them (or equal values)")
        if args.batch != 1:
            p.error(f"--doc-lens packs the documents into one row: --batch must be 1, got "
                    f"{args.batch}")
        args.seq_len = total
    if args.seq_len is None and on_gpu is not None:
        args.seq_len = 4096 if on_gpu else 512
    _check_sizes_fit(p, args)
    if args.topk is not None and args.seq_len is not None and args.topk > args.seq_len:
        # every slot past the sequence would be an empty (-1) slot: slower, nothing learned
        p.error(f"argument --topk: expected at most the sequence length {args.seq_len} "
                f"({'the --doc-lens sum' if args.doc_lens is not None else '--seq-len'}), "
                f"got {args.topk}")
    if args.inject_nan is not None and not 0 <= args.inject_nan < args.steps:
        p.error(f"argument --inject-nan: expected a step in [0, {args.steps}) (--steps "
                f"{args.steps}), got {args.inject_nan}")


_INT32_MAX = 2**31 - 1


def _host_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_sizes_fit(p: argparse.ArgumentParser, args) -> None:
    """Usage errors, before anything is allocated, for sizes that cannot run: a sequence past
    int32 (the top-k indices are int32 key rows, and so is each tensor dimension), and a batch
    whose int32 top-k indices alone (``4 * batch * seq_len * topk`` bytes, ``topk`` at least 1
    where not given yet) would not fit in this machine's memory (numpy would otherwise fail
    with a raw ArrayMemoryError deep in the step)."""
    for flag, value in (("--batch", args.batch), ("--seq-len", args.seq_len)):
        if value is not None and value > _INT32_MAX:
            p.error(f"argument {flag}: expected at most {_INT32_MAX} (a tensor dimension; the "
                    f"top-k indices are int32), got {value}")
    if args.seq_len is None:
        return
    topk = args.topk or 1
    need = 4 * args.batch * args.seq_len * topk
    memory = _host_memory()
    if memory is not None and need > memory:
        p.error(f"argument --seq-len: --batch {args.batch} x --seq-len {args.seq_len} x top-k "
                f"{topk} int32 indices alone need {need / 2**30:.1f} GiB, more than this "
                f"machine's {memory / 2**30:.1f} GiB of memory")


def _resolve_nproc(p: argparse.ArgumentParser, args) -> None:
    """``args.nproc`` from the config where not given: a JSON config's tensor_parallel_degree
    (its ranks), 1 for a preset.  An explicit --nproc that differs from a JSON config's
    tensor_parallel_degree other than 1 (the field's default, written by every saved preset)
    is a usage error naming both."""
    from paddlefleet.tilelang_ops.attn.config import PRESETS, load_config

    config_tp = None
    if args.config is not None and args.config not in PRESETS and os.path.isfile(args.config):
        try:
            config_tp = load_config(args.config).tensor_parallel_degree
        except (ValueError, TypeError, OSError) as e:
            raise SystemExit(f"error: --config {args.config}: {e}") from None
    if args.nproc is None:
        args.nproc = config_tp or 1
    elif config_tp not in (None, 1, args.nproc):
        p.error(f"argument --nproc: {args.nproc} ranks, but --config {args.config} says "
                f"tensor_parallel_degree {config_tp}; leave --nproc out to run on its "
                f"{config_tp} ranks, or give the same value")


def _check_before_paddle(p: argparse.ArgumentParser, args) -> None:
    """Usage and config errors that need no Paddle, before it is imported (7-10 s): the
    argument checks, --nproc against the config, and the config itself (heads divisible by
    --nproc, the JSON file's fields).  Only what depends on the device waits for Paddle when
    --device is not cpu: the GPU defaults (config, sequence length) and TileLang on CPU."""
    on_gpu = False if args.device == "cpu" else None
    _resolve(p, args, on_gpu)
    _resolve_nproc(p, args)
    if args.config is not None or on_gpu is not None:
        _load_config(args, on_gpu, args.nproc)


def _relaunch(args, argv) -> int:
    """Run this script on ``args.nproc`` ranks; returns the exit status (124 on timeout).

    The terminal gets rank 0's own lines only (through the launch console); the launcher's and
    Paddle's output stays in the rank logs, whose folder is named first."""
    devices = range(args.nproc) if _use_gpu(args.device) else None
    # The bar is drawn on this process's stdout (copied from rank 0): only if it is a terminal.
    progress = not args.no_progress and sys.stdout.isatty()
    rank_argv = list(argv) + ([] if progress else ["--no-progress"])
    temporary = args.log_dir is None
    log_dir = tempfile.mkdtemp(prefix="train_step_logs_") if temporary else args.log_dir
    print(f"launching {args.nproc} ranks; their logs: {log_dir}/workerlog.0 .. "
          f"workerlog.{args.nproc - 1}"
          + (" (removed after a successful run; --log-dir keeps them)" if temporary else ""),
          flush=True)
    # LaunchInterrupted (Ctrl-C, SIGTERM) goes up with the folder kept: main names it.
    res = launch_ranks(os.path.abspath(__file__), args.nproc, rank_argv, timeout=args.timeout,
                       devices=devices, console=True, log_dir=log_dir)
    if res.timed_out:
        print(f"error: {args.nproc}-rank run timed out after {args.timeout:.0f} s; "
              f"see {res.log_dir}/workerlog.*", file=sys.stderr)
    elif res.returncode != 0:
        print(f"error: the {args.nproc}-rank run exited with status {res.returncode}; see "
              f"{res.log_dir}/workerlog.*", file=sys.stderr)
    elif temporary:
        shutil.rmtree(log_dir, ignore_errors=True)
    return res.returncode


def _use_gpu(device: str) -> bool:
    import paddle

    if device == "cpu":
        return False
    has_gpu = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if device == "gpu" and not has_gpu:
        raise SystemExit("error: --device gpu, but this Paddle build sees no CUDA device")
    return has_gpu


def _grad_norms(layer, group) -> dict:
    """Full-model gradient norms: per-rank shards' squares are summed over the group."""
    import paddle
    import paddle.distributed as dist

    from paddlefleet.tilelang_ops.attn.layer import SHARD_AXIS
    from paddlefleet.tilelang_ops.attn.tp import group_world_size

    SHARD_AXIS = getattr(layer, "shard_axis", SHARD_AXIS)  # a DeepSeekV4Attention's own

    names, squares, sharded = [], [], []
    for name, p in layer.named_parameters():
        g = p.grad
        names.append(name)
        squares.append((g.astype("float32") ** 2).sum() if g is not None else paddle.zeros([]))
        sharded.append(name in SHARD_AXIS)
    sq = paddle.stack(squares)
    if group_world_size(group) > 1:
        part = sq * paddle.to_tensor([1.0 if s else 0.0 for s in sharded])
        dist.all_reduce(part, group=group)
        sq = paddle.where(paddle.to_tensor(sharded), part, sq)
    sq = sq.numpy().astype("float64")
    norms = {n: math.sqrt(v) for n, v in zip(names, sq)}
    norms["total"] = math.sqrt(float(sq.sum()))
    return norms


def _non_finite_parameters(layer, group) -> list:
    """Names of the parameters holding a NaN or inf on any rank of ``group`` (the same list on
    every rank, so that all of them stop at the same step)."""
    import paddle
    import paddle.distributed as dist

    from paddlefleet.tilelang_ops.attn.tp import group_world_size

    names, flags = [], []
    for name, p in layer.named_parameters():
        names.append(name)
        flags.append((~paddle.isfinite(p)).any().astype("float32"))
    flag = paddle.stack(flags)
    if group_world_size(group) > 1:
        dist.all_reduce(flag, group=group)
    return [n for n, f in zip(names, flag.numpy().tolist()) if f > 0]


def _load_config(args, on_gpu: bool | None, world: int):
    """``(name, config)`` for ``world`` tensor-parallel ranks; a bad config (heads not divisible
    by ``world`` included) exits with a message naming ``--config``.  ``on_gpu`` None (device
    not known yet): ``args.config`` must be given; TileLang on CPU is not checked."""
    from paddlefleet.tilelang_ops.attn.config import load_config

    overrides = {"tensor_parallel_degree": world}
    if args.backward_backend is not None:
        overrides["backward_backend"] = args.backward_backend
    if args.attention_partition is not None:
        overrides["attention_partition"] = args.attention_partition
    if args.deterministic is not None:
        overrides["deterministic"] = args.deterministic
    name = args.config or ("deepseek_v32" if on_gpu else "deepseek_v32_small")
    try:
        cfg = load_config(name, **overrides)
    except (ValueError, TypeError, OSError) as e:
        raise SystemExit(f"error: --config {name} with --nproc {world}: {e}") from None
    if cfg.backward_backend == "tilelang" and on_gpu is False:
        if args.backward_backend == "tilelang":
            raise SystemExit(
                "error: --backward-backend tilelang needs a CUDA GPU (the TileLang kernels are "
                "built for Hopper, sm_90a) and this Paddle build sees none; use "
                "--backward-backend reference on CPU"
            )
        raise SystemExit(
            f"error: config {name!r} asks for backward_backend='tilelang', which needs a CUDA "
            "GPU. On CPU: --config deepseek_v32_small (a few seconds), or --backward-backend "
            f"reference to run {name!r} on the fp32 reference{_cpu_cost(cfg)}"
        )
    return name, cfg


def _cpu_cost(cfg) -> str:
    """What the CPU reference costs at the deepseek_v32 sizes (measured), for the hint."""
    from paddlefleet.tilelang_ops.attn.config import get_preset

    full = get_preset("deepseek_v32", backward_backend=None,
                      tensor_parallel_degree=cfg.tensor_parallel_degree)
    if cfg.replace(backward_backend=None) != full:
        return " (slow at full model sizes)"
    return _DEEPSEEK_V32_CPU_COST


#: Measured with --config deepseek_v32 --backward-backend reference on 2 CPU cores (defaults:
#: batch 1, 512 tokens, top-k 512): peak RSS 4.9 GB and steps of 125-161 s on a busy machine;
#: 76 s per step on an idle one (issue 12).
_DEEPSEEK_V32_CPU_COST = (" (slow: ~5 GB of memory and 1-3 minutes per step on 2 cores, at the "
                          "default 512 tokens)")


def _rank_output(rank: int):
    """``(out, progress_file)``: where this process's own lines and its progress bar go.

    Rank 0 of a ``--nproc`` run writes to the launch console (copied to the terminal of the
    process that launched it); every other process to stdout / stderr.  ``out`` is None for
    ranks other than 0 (they print nothing of their own)."""
    if rank != 0:
        return None, None
    console = os.environ.get(CONSOLE_ENV) if _IN_LAUNCHED_RANK else None
    if console:
        f = open(console, "a", encoding="utf-8", buffering=1)  # line-buffered: lines arrive whole
        return f, f
    return sys.stdout, sys.stderr


def train(p: argparse.ArgumentParser, args, stop: StopSignals | None = None) -> int:
    """The training run of one rank.  With ``stop`` (active), SIGINT / SIGTERM end it with one
    line and the status 128 + signal."""
    import numpy as np
    import paddle
    import paddle.distributed as dist
    from tqdm import tqdm

    from paddlefleet.tilelang_ops.attn.indices import (
        causal_topk_indices,
        cu_seqlens_from_lengths,
        varlen_causal_topk_indices,
    )
    from paddlefleet.tilelang_ops.attn.layer import MQALatentAttention
    from paddlefleet.tilelang_ops.attn.op import resolve_deterministic

    on_gpu = _use_gpu(args.device)
    _resolve(p, args, on_gpu)
    if not on_gpu:
        paddle.set_device("cpu")
    world, rank = 1, 0
    if _IN_LAUNCHED_RANK and int(os.environ["PADDLE_TRAINERS_NUM"]) > 1:
        dist.init_parallel_env()  # on GPU this also selects the rank's device
        world, rank = dist.get_world_size(), dist.get_rank()
    elif on_gpu:
        paddle.set_device("gpu")
    out, bar_file = _rank_output(rank)
    to_console = out is not None and out is not sys.stdout

    def log(msg: str) -> None:
        if out is None:
            return
        tqdm.write(msg, file=out)
        if to_console:
            print(msg, flush=True)  # and into this rank's own log

    name, cfg = _load_config(args, on_gpu, world)
    S, B = args.seq_len, args.batch
    v4 = not hasattr(cfg, "index_topk")  # a DeepSeekV4AttentionConfig: window + compressed keys
    if v4 and args.topk is not None:
        raise SystemExit(f"error: --topk does not apply to {name!r}: its rows attend to the "
                         f"window and compressed keys (compressed_topk is a config field)")
    if v4:
        L = cfg.keys_per_row(S)
    else:
        L = args.topk if args.topk is not None else min(cfg.index_topk, S)
    cu_np = cu_seqlens = None
    if args.doc_lens is not None:  # packed documents (_resolve checked B 1 and S = their sum)
        cu_np = cu_seqlens_from_lengths(args.doc_lens)
        if not v4:
            L = args.topk if args.topk is not None else min(cfg.index_topk, max(args.doc_lens))
        # on the host: the layer reads it for RoPE positions and checks only (no device sync)
        cu_seqlens = paddle.to_tensor(cu_np, place=paddle.CPUPlace())
    if world == 1:
        split = "all in one process"
    elif cfg.attention_partition == "sequence":  # all heads on 1/TP of the query rows
        split = f"all {cfg.num_attention_heads} on every rank, query rows split over TP {world}"
    else:
        split = f"{cfg.heads_per_rank} per rank x TP {world}"
    log(f"config {name}: hidden {cfg.hidden_size}, heads {cfg.num_attention_heads} "
        f"({split}), Dk {cfg.kernel_dk}, Dv {cfg.kernel_dv}, "
        f"sink {cfg.use_attn_sink}, backward {cfg.backward_backend or 'auto'} "
        f"(deterministic {resolve_deterministic(cfg.deterministic)}), "
        f"attention partition {cfg.attention_partition}, device {'gpu' if on_gpu else 'cpu'}")

    if v4:
        from paddlefleet.tilelang_ops.attn.v4_layer import (
            DeepSeekV4Attention,
            random_compressed_picks,
        )

        layer = DeepSeekV4Attention(cfg, seed=args.seed)
    else:
        layer = MQALatentAttention(cfg, seed=args.seed)  # group: fleet's mp group, else the world
    lr = args.lr if args.lr is not None else _default_lr(cfg)
    opt = paddle.optimizer.AdamW(learning_rate=lr, parameters=layer.parameters())
    rng = np.random.default_rng(args.seed + 1)  # same inputs on every rank
    x = paddle.to_tensor(rng.standard_normal((B, S, cfg.hidden_size)).astype("float32"))
    target = paddle.to_tensor(rng.standard_normal((B, S, cfg.hidden_size)).astype("float32"))
    if v4:  # the ratio-4 layer's compressed picks (None for the other layer types)
        picks = random_compressed_picks(cfg, S, batch=B, cu_seqlens=cu_np, seed=args.seed + 2)
        idx = None if picks is None else paddle.to_tensor(picks)
    elif cu_np is None:
        idx = paddle.to_tensor(causal_topk_indices(B, S, S, L, seed=args.seed + 2))
    else:
        idx = paddle.to_tensor(varlen_causal_topk_indices(cu_np, L, seed=args.seed + 2))
    packed = "" if cu_np is None else (
        f", {len(args.doc_lens)} packed documents (lengths {','.join(map(str, args.doc_lens))})")
    keys = (f"keys per row {L} (window {cfg.window_size}, compress_ratio {cfg.compress_ratio})"
            if v4 else f"top-k {L}")
    log(f"inputs: B {B}, S {S}, {keys}, sm_scale {cfg.sm_scale:.6g}{packed}; AdamW lr {lr:g}")

    # A bar only where it can be drawn: on a terminal, or on the console of a launch whose
    # caller is on one (it passes --no-progress otherwise).
    show_bar = out is not None and not args.no_progress and (to_console or bar_file.isatty())
    status = 0
    losses = []
    step = 0
    try:
        for step in tqdm(range(args.steps), desc="train", disable=not show_bar,
                         file=bar_file or sys.stderr):
            t0 = time.perf_counter()
            x_step = x
            if step == args.inject_nan:
                x_step = x.clone()
                x_step[0, 0, 0] = float("nan")
            y = layer(x_step, idx, cu_seqlens=cu_seqlens)
            loss = ((y - target) ** 2).mean()
            # (not cut in the middle: a signal there is acted on when the backward is done)
            with stop.deferred() if stop else contextlib.nullcontext():
                loss.backward()
            norms = _grad_norms(layer, layer.group)
            loss_v = float(loss)
            finite = math.isfinite(loss_v) and all(math.isfinite(v) for v in norms.values())
            bad_params = []
            if finite:
                opt.step()
                # a finite gradient can still make a non-finite update (a huge --lr)
                bad_params = _non_finite_parameters(layer, layer.group)
            opt.clear_grad()
            ms = (time.perf_counter() - t0) * 1e3
            parts = " ".join(f"{k} {v:.3e}" for k, v in norms.items() if k != "total")
            log(f"step {step}: loss {loss_v:.6f}  grad_norm {norms['total']:.4e}  ({ms:.0f} ms)")
            log(f"  grad norms: {parts}")
            losses.append(loss_v)
            if not finite or bad_params:
                bad = [k for k, v in norms.items() if not math.isfinite(v)]
                msg = (f"error: non-finite loss/gradient at step {step} (loss {loss_v}, "
                       f"non-finite grad norms: {bad or 'none'})" if not finite else
                       f"error: non-finite parameters after the optimizer step at step {step} "
                       f"({', '.join(bad_params)}; the update diverged: lower --lr, now "
                       f"{lr:g})")
                print(msg, file=sys.stderr, flush=True)
                if to_console:
                    log(msg)
                status = 1
                break
    except (KeyboardInterrupt, Exception):
        # Ctrl-C or SIGTERM (a second one inside the backward reaches here as Paddle's OSError)
        if not (stop and stop.received):
            raise
        print(f"interrupted by {stop.received[0].name} at step {step} of {args.steps}",
              file=sys.stderr, flush=True)
        return 128 + stop.received[0]
    if status == 0:
        n = len(losses)
        log(f"done: {n} step{'s' if n != 1 else ''}, loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    return status


def _announce_deferred_stop(signum) -> None:
    """Said at once when a first Ctrl-C / SIGTERM arrives inside the backward (which is not cut
    in the middle, and may take minutes at the deepseek_v32 sizes on CPU): on a line of its
    own, above the progress bar (tqdm.write), where the bar is drawn (stderr)."""
    from tqdm import tqdm

    again = "Ctrl-C again" if signum == signal.SIGINT else "a second SIGTERM or Ctrl-C"
    tqdm.write(f"{signal.Signals(signum).name} received: stopping once this step's backward "
               f"pass ends; {again} stops now", file=sys.stderr)
    sys.stderr.flush()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = _parser()
    args = p.parse_args(argv)
    if _IN_LAUNCHED_RANK:
        # The launcher ends its ranks with SIGTERM; the process that launched them reports it.
        return train(p, args)
    _check_before_paddle(p, args)
    try:
        # Paddle installs a SIGTERM handler of its own when imported (it prints a C++ stack
        # and aborts): import it first, so that ours below replaces it.
        import paddle  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            f"error: Paddle is not installed ({e}): pip install -e \".[cpu]\" for the CPU "
            "build, or paddlepaddle-gpu on a CUDA machine (README.md, 'Installing on a CUDA "
            "machine')"
        ) from None
    except KeyboardInterrupt:
        print("interrupted by SIGINT before the first step", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    with StopSignals(on_deferred=_announce_deferred_stop) as stop:
        try:
            if args.nproc == 1:
                return train(p, args, stop)
            # Fail here, in one process, on what needed the device to check (the GPU defaults,
            # TileLang on CPU), instead of in every launched rank.
            on_gpu = _use_gpu(args.device)
            _resolve(p, args, on_gpu)
            _load_config(args, on_gpu, args.nproc)
            return _relaunch(args, argv)
        except LaunchInterrupted as e:
            print(f"interrupted by {e.signum.name}: stopped all {args.nproc} ranks; their "
                  f"logs: {e.log_dir}", file=sys.stderr, flush=True)
            return 128 + e.signum
        except KeyboardInterrupt:  # before the first step (imports, config, layer build)
            signum = stop.received[0] if stop.received else signal.SIGINT
            print(f"interrupted by {signum.name} before the first step", file=sys.stderr,
                  flush=True)
            return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
