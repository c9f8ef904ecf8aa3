"""Benchmark harness shared by the scripts in ``tools/bench/``.

Two halves:

* pure helpers (no third-party import at module load, so the Paddle CI environment can test
  them): the shape table, FLOP and byte counts, the compute/memory floors, percentiles, the
  det/atomic ratio, the bars of this round, and CSV/JSON/text-table writers;
* timers: :class:`CudaTimer` (device events, PyTorch imported lazily) and :class:`HostTimer`
  (``time.perf_counter``, for the CPU stand-in run).

Units everywhere: time in ms, rates in TFLOP/s (1e12 FLOP/s), bandwidth in TB/s (1e12 B/s),
memory in MB (1e6 bytes) -- decimal units, as GPU datasheets use them.

FLOP counts (the five/two GEMMs of the kernels; softmax and Delta are not counted, and every
top-k slot is counted, including ``-1`` slots, because the kernels process them masked):

    forward  = 2 * B * S * H * topk * (Dk + Dv)          # S = Q K^T over Dk, O = P V over Dv
    backward = 2 * B * S * H * topk * (2 * Dv + 3 * Dk)  # dP = dO V^T (Dv), dV = P^T dO (Dv),
                                                          # S recompute (Dk), dQ = dS K (Dk),
                                                          # dK = dS^T Q (Dk)

These are the counts the upstream TileLang example prints, so TFLOP/s compare one to one.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark problem: ``query [B, S, H, Dk]``, ``kv [B, S_kv, Dk]``,
    ``token_indices [B, S, topk]``."""

    name: str
    B: int
    S: int
    S_kv: int
    H: int
    topk: int
    Dk: int = 576
    Dv: int = 512
    note: str = ""

    def dims(self) -> str:
        return f"B={self.B} S={self.S} S_kv={self.S_kv} H={self.H} topk={self.topk}"


#: Every shape the sparse-MQA benchmark knows, in run order.  ``tiny`` is for the CPU stand-in
#: and tests only; the others are the defaults (``DEFAULT_SHAPES``).
SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("ref", 1, 4096, 8192, 64, 2048,
              note="upstream TileLang example's shape (DeepSeek-V3.2, H=64 per rank pair)"),
        Shape("tp8", 1, 4096, 8192, 8, 2048, note="ref shape, one TP=8 rank of 64 heads"),
        Shape("tp4", 1, 4096, 8192, 16, 2048, note="ref shape, one TP=4 rank of 64 heads"),
        Shape("h128", 1, 4096, 8192, 128, 2048, note="ref shape, all 128 heads on one card"),
        Shape("fleet", 1, 8192, 8192, 64, 640,
              note="PaddleFleet docstring's shape (S=S_kv, L=640)"),
        Shape("b2", 2, 2048, 8192, 64, 2048,
              note="two sequences; same B*S and FLOPs as ref, every row has >= topk keys"),
        Shape("tiny", 1, 64, 128, 16, 32, note="CPU stand-in / tests only"),
    )
}

DEFAULT_SHAPES: tuple[str, ...] = ("ref", "tp8", "tp4", "h128", "fleet", "b2")

#: The shape the bars of this round are judged at.
BAR_SHAPE = "ref"


def select_shapes(spec: str | None, option: str = "--shapes") -> list[Shape]:
    """Parse ``--shapes``: ``None``/``""``/``"default"`` -> defaults, ``"all"`` -> every shape,
    else a comma-separated list of names from :data:`SHAPES` (order kept).  ``option`` is the
    command-line option the messages name.

    Raises:
        ValueError: on an unknown name (the message lists the known ones).
    """
    if spec is None or spec.strip() in ("", "default"):
        return [SHAPES[n] for n in DEFAULT_SHAPES]
    if spec.strip() == "all":
        return list(SHAPES.values())
    out = []
    for name in (p.strip() for p in spec.split(",")):
        if not name:
            continue
        if name not in SHAPES:
            raise ValueError(f"{option}: unknown shape {name!r}; known: {', '.join(SHAPES)}")
        if SHAPES[name] not in out:
            out.append(SHAPES[name])
    if not out:
        raise ValueError(f"{option}: no shape named in {spec!r}; known: {', '.join(SHAPES)}")
    return out


# --------------------------------------------------------------------------------------------
# FLOPs, bytes, floors
# --------------------------------------------------------------------------------------------

#: Planning numbers measured on our H200 (TileLang 0.1.15 era): dense bf16 8192^3 matmul and
#: a device-to-device copy.  The benchmark measures the matmul again in every run and uses that.
H200_MATMUL_TFLOPS = 790.0
H200_COPY_TBS = 4.3


def fwd_flops(s: Shape) -> int:
    """``2 * B * S * H * topk * (Dk + Dv)``: Q K^T over Dk plus P V over Dv."""
    return 2 * s.B * s.S * s.H * s.topk * (s.Dk + s.Dv)


def bwd_flops(s: Shape) -> int:
    """``2 * B * S * H * topk * (2 * Dv + 3 * Dk)``: the five GEMMs of the backward."""
    return 2 * s.B * s.S * s.H * s.topk * (2 * s.Dv + 3 * s.Dk)


def fwd_min_bytes(s: Shape, index_bytes: int = 4) -> int:
    """Fewest HBM bytes of the forward: read q, kv, indices once; write out (bf16) and lse
    (fp32).  The per-row kv gathers are not counted: kv (B*S_kv*Dk*2 bytes, 9.4 MB at S_kv=8192)
    fits in L2, so they are L2 traffic."""
    q = s.B * s.S * s.H * s.Dk * 2
    kv = s.B * s.S_kv * s.Dk * 2
    idx = s.B * s.S * s.topk * index_bytes
    out = s.B * s.S * s.H * s.Dv * 2
    lse = s.B * s.S * s.H * 4
    return q + kv + idx + out + lse


def bwd_min_bytes(s: Shape, index_bytes: int = 4) -> int:
    """Fewest HBM bytes of the backward: read q, kv, indices, out, dO (bf16/int) and lse
    (fp32); write dq and dkv (bf16).  d_sink and attn_sink ([H] fp32) are negligible."""
    q = s.B * s.S * s.H * s.Dk * 2
    kv = s.B * s.S_kv * s.Dk * 2
    idx = s.B * s.S * s.topk * index_bytes
    out = s.B * s.S * s.H * s.Dv * 2
    dout = out
    lse = s.B * s.S * s.H * 4
    dq = q
    dkv = kv
    return q + kv + idx + out + dout + lse + dq + dkv


def head_groups(s: Shape, block_h: int = 64) -> int:
    """CTAs per query row when one CTA takes up to ``block_h`` heads (the upstream example's
    scheme: one head group up to H=64)."""
    return max(1, math.ceil(s.H / block_h))


def gather_scatter_bytes(s: Shape, block_h: int = 64) -> tuple[int, int]:
    """(kv bytes gathered, dKV fp32 bytes scattered) per backward when every CTA gathers its
    row's ``topk x Dk`` bf16 kv rows and scatters ``topk x Dk`` fp32 dKV partials: the traffic
    that does not shrink with H."""
    rows = s.B * s.S * head_groups(s, block_h) * s.topk
    return rows * s.Dk * 2, rows * s.Dk * 4


def floor(flops: int, nbytes: int, peak_tflops: float = H200_MATMUL_TFLOPS,
          bw_tbs: float = H200_COPY_TBS) -> dict:
    """Compute time ``flops / peak`` and memory time ``bytes / bandwidth`` in ms; the larger is
    the floor and names the bound."""
    compute_ms = flops / (peak_tflops * 1e12) * 1e3
    memory_ms = nbytes / (bw_tbs * 1e12) * 1e3
    return {
        "compute_ms": compute_ms,
        "memory_ms": memory_ms,
        "floor_ms": max(compute_ms, memory_ms),
        "bound": "compute" if compute_ms >= memory_ms else "memory",
    }


def floors_table(shapes: Sequence[Shape], peak_tflops: float = H200_MATMUL_TFLOPS,
                 bw_tbs: float = H200_COPY_TBS) -> str:
    """A markdown table of each shape's FLOPs, minimum bytes and floors (docs/performance.md)."""
    lines = [
        f"| shape | dims | pass | GFLOP | min MB | compute ms @{peak_tflops:g} TFLOP/s "
        f"| memory ms @{bw_tbs:g} TB/s | floor ms | bound |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in shapes:
        for pass_, fl, by in (("fwd", fwd_flops(s), fwd_min_bytes(s)),
                              ("bwd", bwd_flops(s), bwd_min_bytes(s))):
            f = floor(fl, by, peak_tflops, bw_tbs)
            lines.append(
                f"| {s.name} | {s.dims()} | {pass_} | {fl / 1e9:,.0f} | {by / 1e6:,.0f} "
                f"| {f['compute_ms']:.2f} | {f['memory_ms']:.3f} | {f['floor_ms']:.2f} "
                f"| {f['bound']} |"
            )
    return "\n".join(lines)


def reference_mem_bytes(s: Shape, chunk_bytes: int = 256 << 20, safety: float = 1.5) -> int:
    """Rough peak device memory (bytes) of the fp32 reference backward, its larger pass.

    ``attn/reference.py`` walks the query rows in chunks whose per-row intermediates fit in
    ``chunk_bytes`` (its ``_CHUNK_BYTES``; the chunk's temporaries stay under ~4x that), and
    holds whole fp32 ``dq [B, S, H, Dk]``, the fp32 cast of ``kv`` and two fp32 ``dkv``
    (the scatter is out of place).  Times ``safety`` for allocator slack.
    """
    whole = 4 * (s.B * s.S * s.H * s.Dk + 3 * s.B * s.S_kv * s.Dk)
    return int(safety * (whole + 4 * chunk_bytes))


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method) of a non-empty sequence.

    Raises:
        ValueError: when ``values`` is empty or ``q`` is outside [0, 1].
    """
    if not values:
        raise ValueError("quantile: values is empty")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile: q must be in [0, 1], got {q}")
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float]) -> dict:
    """Median, 20th and 80th percentile, min and count of per-call times (ms)."""
    return {
        "ms": quantile(samples_ms, 0.5),
        "ms_p20": quantile(samples_ms, 0.2),
        "ms_p80": quantile(samples_ms, 0.8),
        "ms_min": min(samples_ms),
        "reps": len(samples_ms),
    }


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    return flops / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------------------------
# Timers
# --------------------------------------------------------------------------------------------


class HostTimer:
    """Host clock around each call (CPU stand-in).  ``sync`` runs after each call."""

    name = "host"

    def __init__(self, sync: Callable[[], None] | None = None):
        self._sync = sync or (lambda: None)

    def measure(self, fn: Callable, arg_sets: Sequence[tuple], warmup: int, reps: int) -> list:
        n = len(arg_sets)
        for i in range(warmup):
            fn(*arg_sets[i % n])
        self._sync()
        out = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(*arg_sets[(warmup + i) % n])
            self._sync()
            out.append((time.perf_counter() - t0) * 1e3)
        return out


class CudaTimer:
    """CUDA events around each call, input sets rotated call by call so that no call finds its
    inputs in L2 from the previous one.  Host work inside ``fn`` (validation, padding, launch)
    counts when it delays the device, as it would in training."""

    name = "cuda-events"

    def __init__(self):
        import torch  # lazy: the CI environment has no torch

        self._torch = torch

    def measure(self, fn: Callable, arg_sets: Sequence[tuple], warmup: int, reps: int) -> list:
        torch = self._torch
        n = len(arg_sets)
        for i in range(warmup):
            fn(*arg_sets[i % n])
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            args = arg_sets[(warmup + i) % n]
            starts[i].record()
            fn(*args)
            ends[i].record()
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in zip(starts, ends)]


# --------------------------------------------------------------------------------------------
# Result rows and writers
# --------------------------------------------------------------------------------------------

#: CSV columns, in order (one row per shape x variant; the meta columns repeat on every row so
#: that CSVs from several runs can be concatenated, as Liger's harness does).
CSV_FIELDS = (
    "gpu", "torch", "tilelang", "timestamp", "git",
    "shape", "B", "S", "S_kv", "H", "topk", "Dk", "Dv",
    "variant", "status", "reps", "ms", "ms_p20", "ms_p80", "ms_min",
    "gflop", "tflops", "frac_peak", "tbs", "floor_ms", "x_floor", "peak_mem_mb", "extra_mem_mb",
    "det_over_atomic", "repeatable", "first_call_s", "note",
)

META_FIELDS = ("gpu", "torch", "tilelang", "timestamp", "git")

#: Columns read back as text even when they look numeric (a version "2.10" is not 2.1).
TEXT_FIELDS = META_FIELDS + ("shape", "variant", "status", "note")


def make_row(spec: Shape | None, variant: str, meta: Mapping[str, Any], **fields) -> dict:
    """A result row with every :data:`CSV_FIELDS` key (missing values ``None``)."""
    row = {k: None for k in CSV_FIELDS}
    for k in META_FIELDS:
        row[k] = meta.get(k)
    if spec is not None:
        row.update(shape=spec.name, B=spec.B, S=spec.S, S_kv=spec.S_kv, H=spec.H,
                   topk=spec.topk, Dk=spec.Dk, Dv=spec.Dv)
    row["variant"] = variant
    row["status"] = "ok"
    unknown = set(fields) - set(CSV_FIELDS)
    if unknown:
        raise ValueError(f"make_row: unknown fields {sorted(unknown)}")
    row.update(fields)
    return row


def fill_rates(row: dict, flops: float | None, peak_tflops: float | None,
               nbytes: float | None = None, bw_tbs: float | None = None) -> dict:
    """Set the rates of a timed row (in place; returns it): ``gflop``, ``tflops`` and
    ``frac_peak`` from ``flops``; ``tbs`` (``nbytes`` per time, TB/s) from ``nbytes``; and with
    all four, ``floor_ms`` (:func:`floor` at ``peak_tflops``/``bw_tbs``) and ``x_floor``
    (measured / floor)."""
    ms = row.get("ms")
    if not ms:
        return row
    if flops is not None:
        row["gflop"] = flops / 1e9
        row["tflops"] = tflops(flops, ms)
        if peak_tflops:
            row["frac_peak"] = row["tflops"] / peak_tflops
    if nbytes is not None:
        row["tbs"] = nbytes / (ms * 1e-3) / 1e12
    if flops is not None and nbytes is not None and peak_tflops and bw_tbs:
        row["floor_ms"] = floor(flops, nbytes, peak_tflops, bw_tbs)["floor_ms"]
        row["x_floor"] = ms / row["floor_ms"]
    return row


def fill_det_ratio(rows: list[dict], det: str = "bwd_det", atomic: str = "bwd_atomic") -> None:
    """Set ``det_over_atomic`` (median det ms / median atomic ms) on each shape's det row."""
    by_key = {(r["shape"], r["variant"]): r for r in rows}
    for r in rows:
        if r["variant"] != det or r.get("status") != "ok":
            continue
        a = by_key.get((r["shape"], atomic))
        if a and a.get("status") == "ok" and a.get("ms"):
            r["det_over_atomic"] = r["ms"] / a["ms"]


#: Bars of this round, judged at :data:`BAR_SHAPE`: (name, variant, field, op, limit).
BARS = (
    ("det bwd <= 1.5x atomic bwd", "bwd_det", "det_over_atomic", "<=", 1.5),
    ("atomic bwd <= 16 ms", "bwd_atomic", "ms", "<=", 16.0),
    ("fwd >= 300 TFLOP/s", "fwd", "tflops", ">=", 300.0),
)


def check_bars(rows: Iterable[dict], shape: str = BAR_SHAPE) -> list[dict]:
    """Each bar with the measured value and ``"PASS"``/``"FAIL"``/``"n/a"`` (not measured)."""
    by_variant = {r["variant"]: r for r in rows if r.get("shape") == shape}
    out = []
    for name, variant, field, op, limit in BARS:
        r = by_variant.get(variant)
        value = r.get(field) if r and r.get("status") == "ok" else None
        if value is None:
            verdict = "n/a"
        else:
            ok = value <= limit if op == "<=" else value >= limit
            verdict = "PASS" if ok else "FAIL"
        out.append({"bar": name, "shape": shape, "value": value, "verdict": verdict})
    return out


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def write_csv(rows: Sequence[dict], path: str) -> None:
    """Write rows with the :data:`CSV_FIELDS` header (``None`` -> empty cell)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r.get(k)) for k in CSV_FIELDS})


def read_csv(path: str) -> list[dict]:
    """Read rows written by :func:`write_csv`; numbers come back as int/float, empty as None."""
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for raw in csv.DictReader(f):
            rows.append({k: (v or None) if k in TEXT_FIELDS else _parse_cell(v)
                         for k, v in raw.items()})
    return rows


def _parse_cell(v: str) -> Any:
    if v == "":
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    if v in ("True", "False"):
        return v == "True"
    return v


def write_json(payload: Mapping[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, sort_keys=False, default=str)
        f.write("\n")


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


_TABLE_COLS = (
    # header, key, format, width
    ("shape", "shape", "", 6),
    ("H", "H", "d", 4),
    ("S", "S", "d", 5),
    ("S_kv", "S_kv", "d", 5),
    ("topk", "topk", "d", 5),
    ("variant", "variant", "", 11),  # "matmul_bf16" is the longest name
    ("ms", "ms", ".3f", 9),
    ("p20", "ms_p20", ".3f", 9),
    ("p80", "ms_p80", ".3f", 9),
    ("TFLOP/s", "tflops", ".1f", 8),
    ("%peak", "frac_peak", ".1%", 6),
    ("xfloor", "x_floor", ".1f", 6),
    ("mem MB", "peak_mem_mb", ",.0f", 8),
    ("det/at", "det_over_atomic", ".2f", 6),
    ("rep", "repeatable", "", 3),
)


def format_table(rows: Sequence[dict], meta: Mapping[str, Any] | None = None,
                 bars: Sequence[dict] | None = None) -> str:
    """The compact text table printed at the end of a run (fixed-width columns)."""
    lines = []
    if meta:
        lines.append(
            f"GPU {meta.get('gpu')} | torch {meta.get('torch')} | tilelang {meta.get('tilelang')}"
            f" | {meta.get('timestamp')} | peak {_fmt(meta.get('peak_tflops'), '.0f')} TFLOP/s"
            f" ({meta.get('peak_source', 'measured')}) | copy {_fmt(meta.get('copy_tbs'), '.2f')}"
            " TB/s"
        )
    head = " ".join(h.rjust(w) if fmt else h.ljust(w) for h, _, fmt, w in _TABLE_COLS)
    lines.append(head)
    lines.append("-" * len(head))
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"{str(r.get('shape') or '-'):<6} {r['variant']:<11} {r['status'][:100]}")
            continue
        cells = []
        for _, key, fmt, w in _TABLE_COLS:
            text = _fmt(r.get(key), fmt) if fmt else ("-" if r.get(key) is None else
                                                       _fmt(r.get(key), ""))
            cells.append(text.rjust(w) if fmt else text.ljust(w))
        lines.append(" ".join(cells))
    for b in bars or ():
        v = b["value"]
        lines.append(f"bar [{b['shape']}] {b['bar']}: {_fmt(v, '.3g')} {b['verdict']}")
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict]) -> str:
    """The results as a markdown table (docs/performance.md "Results (H200)")."""
    out = [
        "| shape | B | S | S_kv | H | topk | variant | ms (p50) | p20-p80 | TFLOP/s | % of matmul peak "
        "| x floor | peak mem MB | det/atomic | bitwise repeatable |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("status") != "ok":
            out.append(f"| {r.get('shape') or '-'} | | | | | | {r['variant']} | {r['status']} "
                       "| | | | | | | |")
            continue
        spread = (f"{r['ms_p20']:.3f}-{r['ms_p80']:.3f}"
                  if r.get("ms_p20") is not None and r.get("ms_p80") is not None else "-")
        out.append(
            f"| {r.get('shape') or '-'} | {_fmt(r.get('B'), 'd')} | {_fmt(r.get('S'), 'd')} "
            f"| {_fmt(r.get('S_kv'), 'd')} | {_fmt(r.get('H'), 'd')} | {_fmt(r.get('topk'), 'd')} "
            f"| {r['variant']} | {_fmt(r.get('ms'), '.3f')} | {spread} "
            f"| {_fmt(r.get('tflops'), '.1f')} | {_fmt(r.get('frac_peak'), '.1%')} "
            f"| {_fmt(r.get('x_floor'), '.1f')} | {_fmt(r.get('peak_mem_mb'), ',.0f')} | {_fmt(r.get('det_over_atomic'), '.2f')} "
            f"| {_fmt(r.get('repeatable'), '')} |"
        )
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        mod = sys.modules.get(dist)
        return getattr(mod, "__version__", None) if mod else None


def git_commit(repo: str) -> str | None:
    """The checkout's commit (``+dirty`` when it has changes), or None without git."""
    try:
        sha = subprocess.run(["git", "-C", repo, "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_state() -> dict | None:
    """Clocks, power and temperature from a read-only ``nvidia-smi`` query, or None."""
    fields = "name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu"
    try:
        p = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if p.returncode != 0:
        return None
    return {"nvidia_smi": [line.strip() for line in p.stdout.strip().splitlines()],
            "fields": fields}


def run_meta(repo: str, gpu: str, torch_version: str | None) -> dict:
    """Meta columns of every row plus what else a reader of the JSON needs."""
    return {
        "gpu": gpu,
        "torch": torch_version,
        "tilelang": package_version("tilelang") or package_version("tilelang-paddle"),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git": git_commit(repo),
        "python": platform.python_version(),
        "host": platform.node(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
