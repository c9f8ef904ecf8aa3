"""Timing and reporting for tools/bench: a device clock, the median and spread of per-call
times, result rows, one (markdown) table writer, JSON/CSV output, the run's environment.

Units: ms, TFLOP/s (1e12 FLOP/s), TB/s (1e12 B/s), MB (1e6 bytes), MHz, W.  The work model is
model.py.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

import model


class Clock:
    """Marks on the device's timeline: CUDA events on a GPU (host work inside a call counts
    where it keeps the device waiting, as in training), ``time.perf_counter`` on the CPU."""

    def __init__(self, torch=None):
        self.cuda = torch is not None
        self._torch = torch

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        if self.cuda:
            self._torch.cuda.synchronize()

    def ms(self, start, end) -> float:
        """Time between two marks (after :meth:`sync`)."""
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


def time_calls(clock: Clock, fn: Callable, inputs: Sequence, warmup: int, reps: int) -> list:
    """ms of each of ``reps`` calls ``fn(input)`` after ``warmup`` calls; the inputs rotate call
    by call so that the L2 never holds what the next call reads."""
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    clock.sync()
    marks = []
    for i in range(reps):
        start = clock.mark()
        fn(inputs[(warmup + i) % len(inputs)])
        marks.append((start, clock.mark()))
    clock.sync()
    return [clock.ms(a, b) for a, b in marks]


#: Seconds of idle before each timing (:func:`settle`), of back-to-back calls before a sustained
#: timing and of the sustained timing (:func:`sustained_ms`): the benchmark's defaults and
#: ``tools/experiments/kernel_trial.py --state cool / hot``.
SETTLE_S, HOT_WARM_S, HOT_S = 1.5, 1.5, 1.0


def settle(clock: Clock, seconds: float) -> None:
    """Let the device finish its queue and then idle ``seconds``, so that a timing starts from
    the same state whatever ran before it: under sustained load the H200 reaches its 700 W
    limit within about a second and lowers its clock: in run 88 the same forward ran 7% slower
    timed after other shapes' backward rows than as the first row (docs/performance.md, "How
    it is measured")."""
    clock.sync()
    if seconds > 0:
        time.sleep(seconds)


def sustained_ms(clock: Clock, fn: Callable, inputs: Sequence, warm_s: float, hot_s: float,
                 sampler=None, batch: int = 4) -> float:
    """Mean ms per call of ``fn(input)`` over ``hot_s`` seconds of back-to-back calls, after
    ``warm_s`` seconds of them, as in a training loop (the 64- and 128-head shapes reach the
    H200's 700 W limit that way; the 8- and 16-head ones stay at 1980 MHz).  A sync
    every ``batch`` calls keeps the queue short enough to stop on time (its host gaps, ~1% at
    the benchmark's shapes, are the same for every variant); the inputs rotate as in
    :func:`time_calls`.  ``sampler`` (e.g. a :class:`GpuSampler`) is entered around the
    measured seconds only."""
    done = 0

    def busy(seconds):
        nonlocal done
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < seconds or n == 0:
            for _ in range(batch):
                fn(inputs[done % len(inputs)])
                done += 1
            n += batch
            clock.sync()
        return n

    busy(warm_s)
    with sampler if sampler is not None else contextlib.nullcontext():
        start = clock.mark()
        n = busy(hot_s)
        end = clock.mark()
        clock.sync()
    return clock.ms(start, end) / n


def summarize(samples_ms: Sequence[float]) -> dict:
    """Median, p20, p80 (numpy's linear interpolation), min, max and count."""
    p20, p50, p80 = np.quantile(samples_ms, [0.2, 0.5, 0.8])
    return {"ms": float(p50), "ms_p20": float(p20), "ms_p80": float(p80),
            "ms_min": min(samples_ms), "ms_max": max(samples_ms), "reps": len(samples_ms)}


# --- the GPU's clock and power while a variant runs ---------------------------------------------

#: nvmlClockType_t's NVML_CLOCK_SM.
NVML_CLOCK_SM = 1
#: The bits of NVML's clock-event reasons (nvmlClocksEventReasons, nvml.h) that mean power or
#: heat holds the clock down; not idle (0x1), application clocks (0x2), sync boost (0x10) or
#: display clock (0x100), which say nothing of a slow state.  Why: the forward's sustained
#: slow state is the software power cap (run 95); a row's median SM clock hides it when the
#: cap covers only part of the row.
CAP_REASONS = (0x4     # nvmlClocksEventReasonSwPowerCap: power above the software power limit
               | 0x8   # nvmlClocksEventReasonHwSlowdown: hardware slowdown (power or heat)
               | 0x20  # nvmlClocksEventReasonSwThermalSlowdown: software thermal slowdown
               | 0x40  # nvmlClocksEventReasonHwThermalSlowdown: hardware thermal slowdown
               | 0x80)  # nvmlClocksEventReasonHwPowerBrakeSlowdown: hardware power brake
_nvml_lib = None  # NVML after nvmlInit_v2; False where that failed (tried once per process)


def _load_nvml():
    return ctypes.CDLL("libnvidia-ml.so.1")


def _nvml():
    """The initialised NVML library, or None (no driver: CPU machines, CI)."""
    global _nvml_lib
    if _nvml_lib is None:
        try:
            lib = _load_nvml()
            _nvml_lib = lib if lib.nvmlInit_v2() == 0 else False
        except (OSError, AttributeError):
            _nvml_lib = False
    return _nvml_lib or None


def nvml_reader(index: int = 0, pci_bus_id: str | None = None) -> Callable | None:
    """A function returning ``(SM clock MHz, board power W, capped)`` of one GPU, each None
    where NVML fails; ``capped``: whether a :data:`CAP_REASONS` bit of the current clock-event
    reasons is set (bool).  The GPU by ``pci_bus_id`` (``"0000:1b:00.0"``) if given, else by
    NVML ``index``.  None where NVML or the GPU cannot be reached."""
    lib = _nvml()
    if lib is None:
        return None
    handle = ctypes.c_void_p()
    try:
        rc = (lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(handle))
              if pci_bus_id else
              lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)))
    except AttributeError:  # a driver without the _v2 entry points
        return None
    if rc != 0:
        return None
    mhz, mw, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
    reasons_fn = None  # looked up here, not per sample: the sampler runs every 5 ms
    for name in ("nvmlDeviceGetCurrentClocksEventReasons",
                 "nvmlDeviceGetCurrentClocksThrottleReasons"):  # its older name, older drivers
        try:
            reasons_fn = getattr(lib, name)
            break
        except AttributeError:
            pass

    def read():
        ok_mhz = lib.nvmlDeviceGetClockInfo(handle, NVML_CLOCK_SM, ctypes.byref(mhz)) == 0
        ok_mw = lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(mw)) == 0
        ok_why = reasons_fn is not None and reasons_fn(handle, ctypes.byref(reasons)) == 0
        return ((mhz.value if ok_mhz else None), (mw.value / 1e3 if ok_mw else None),
                (bool(reasons.value & CAP_REASONS) if ok_why else None))

    return read


class GpuSampler:
    """Context manager: samples ``read()`` (``(SM clock MHz, board power W, capped)``, e.g. of
    :func:`nvml_reader`; a pair without ``capped`` will do) every ``period_s`` on a daemon
    thread, once more on exit, and then holds ``sm_mhz`` and ``power_w``, the medians over the
    samples, and ``capped``, the fraction (0..1) of the samples with a known ``capped`` that
    have it True (each None where there is none, e.g. ``read`` None).  Why: at the power limit
    the clock, and with it the time, drops; a median clock hides a cap that covers only part
    of the samples, the fraction names it (run 95: the forward's sustained slow state)."""

    def __init__(self, read: Callable | None, period_s: float = 0.005):
        self.read, self.period_s = read, period_s
        self.samples: list[tuple] = []
        self.sm_mhz = self.power_w = self.capped = None
        self._stop = threading.Event()
        self._thread = None

    def _sample(self) -> bool:
        try:
            self.samples.append(self.read())
            return True
        except Exception:  # noqa: BLE001 - never fail a benchmark over its context
            return False

    def _loop(self) -> None:
        while self._sample() and not self._stop.wait(self.period_s):
            pass

    def __enter__(self):
        if self.read is not None:
            self._thread = threading.Thread(target=self._loop, name="GpuSampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()  # a section shorter than the period still gets one under load
        for k, field in enumerate(("sm_mhz", "power_w")):
            vals = [s[k] for s in self.samples if s is not None and s[k] is not None]
            setattr(self, field, float(np.median(vals)) if vals else None)
        flags = [bool(s[2]) for s in self.samples
                 if s is not None and len(s) > 2 and s[2] is not None]
        self.capped = sum(flags) / len(flags) if flags else None
        return False

    def fields(self) -> dict:
        """``{"sm_mhz": MHz, "power_w": W, "capped": fraction 0..1}`` (None where unknown)
        for a row."""
        return {"sm_mhz": self.sm_mhz, "power_w": self.power_w, "capped": self.capped}


def clock_note(mhz: float | None) -> str:
    """`` at N MHz`` for a printed timing, or nothing where the clock is unknown."""
    return f" at {mhz:.0f} MHz" if mhz is not None else ""


# --- result rows -------------------------------------------------------------------------------

#: Keys of every row (results.json rows, results.csv columns); the meta ones repeat on each row
#: so that CSVs of several runs can be concatenated.
FIELDS = ("gpu", "torch", "tilelang", "timestamp", "git",
          "shape", "B", "S", "S_kv", "H", "topk", "Dk", "Dv",
          "variant", "status", "reps", "ms", "ms_p20", "ms_p80", "ms_min", "ms_max",
          "sm_mhz", "power_w", "capped", "ms_hot", "sm_mhz_hot",
          "gflop", "tflops", "frac_peak", "tbs", "floor_ms", "x_floor", "peak_mem_mb",
          "extra_mem_mb", "det_over_atomic", "repeatable", "first_call_s", "a2a_mb", "note")
META_FIELDS = FIELDS[:5]


def make_row(s: model.Shape | None, variant: str, meta: dict, **fields) -> dict:
    """A row with every :data:`FIELDS` key (None where unknown), status "ok" unless given."""
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise ValueError(f"make_row: unknown fields {sorted(unknown)}")
    row = dict.fromkeys(FIELDS)
    row.update({k: meta.get(k) for k in META_FIELDS}, variant=variant, status="ok")
    if s is not None:
        row.update(shape=s.name, B=s.B, S=s.S, S_kv=s.S_kv, H=s.H, topk=s.topk, Dk=s.Dk, Dv=s.Dv)
    row.update(fields)
    return row


def fill_rates(row: dict, flops: float | None, nbytes: float | None, peak_tflops: float | None,
               bw_tbs: float | None) -> dict:
    """``gflop``, ``tflops``, ``frac_peak`` (of ``peak_tflops``), ``tbs`` and, with both
    ceilings, ``floor_ms`` and ``x_floor`` of a timed row (in place; returns it)."""
    ms = row.get("ms")
    if not ms:
        return row
    if flops is not None:
        row.update(gflop=flops / 1e9, tflops=flops / ms / 1e9)
        if peak_tflops:
            row["frac_peak"] = row["tflops"] / peak_tflops
    if nbytes is not None:
        row["tbs"] = nbytes / ms / 1e9
    if flops is not None and nbytes is not None and peak_tflops and bw_tbs:
        row["floor_ms"] = model.floor(flops, nbytes, peak_tflops, bw_tbs)["floor_ms"]
        row["x_floor"] = ms / row["floor_ms"]
    return row


def fill_det_ratio(rows: list[dict]) -> None:
    """``det_over_atomic`` on each shape's ``bwd_det`` row: its median over ``bwd_atomic``'s."""
    atomic = {r["shape"]: r["ms"] for r in rows
              if r["variant"] == "bwd_atomic" and r["status"] == "ok"}
    for r in rows:
        if r["variant"] == "bwd_det" and r["status"] == "ok" and atomic.get(r["shape"]):
            r["det_over_atomic"] = r["ms"] / atomic[r["shape"]]


# --- the table writer --------------------------------------------------------------------------


def _cell(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    try:
        return format(v, spec)
    except (TypeError, ValueError):  # a status text where a number would be
        return str(v)


def table(cols: Sequence[tuple], rows: Sequence) -> str:
    """A markdown table.  ``cols``: ``(header, key or function of the row, format spec)``; a
    column with a format spec is right-aligned."""
    out = ["| " + " | ".join(c[0] for c in cols) + " |",
           "|" + "|".join("---:" if c[2] else "---" for c in cols) + "|"]
    for r in rows:
        cells = (_cell(get(r) if callable(get) else r.get(get), spec) for _, get, spec in cols)
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def ms_or_status(r):
    return r["ms"] if r["status"] == "ok" else r["status"]


def _spread(r):
    return None if r.get("ms_p20") is None else f"{r['ms_p20']:.3f}-{r['ms_p80']:.3f}"


RESULT_COLS = (
    ("shape", "shape", ""), ("B", "B", "d"), ("S", "S", "d"), ("S_kv", "S_kv", "d"),
    ("H", "H", "d"), ("topk", "topk", "d"), ("variant", "variant", ""),
    ("ms (p50)", ms_or_status, ".3f"), ("p20-p80", _spread, "s"), ("TFLOP/s", "tflops", ".1f"),
    ("% of matmul peak", "frac_peak", ".1%"), ("x floor", "x_floor", ".1f"),
    ("peak mem MB", "peak_mem_mb", ",.0f"), ("det/atomic", "det_over_atomic", ".2f"),
    ("bitwise repeatable", "repeatable", ""),
)
#: The median SM clock while a variant ran, after ``p20-p80``: the time it explains.
SM_MHZ_COL = ("SM MHz", "sm_mhz", ".0f")
#: The fraction of its NVML samples with a power/thermal clock-event reason, after the clock:
#: the slow state a high clock reading can hide (:data:`CAP_REASONS`).
CAPPED_COL = ("capped", "capped", ".0%")
#: The sustained time (:func:`sustained_ms`) and its clock, after the clock (and capped).
HOT_COLS = (("ms hot", "ms_hot", ".3f"), ("hot MHz", "sm_mhz_hot", ".0f"))


def result_cols(rows: Sequence[dict]) -> tuple:
    """:data:`RESULT_COLS` with :data:`SM_MHZ_COL` after ``p20-p80`` where a row has a clock,
    then :data:`CAPPED_COL` where a row has a capped fraction, then :data:`HOT_COLS` where a
    row has a sustained time: results of runs that did not record them (older files under
    docs/perf/) keep their table."""
    have = {k for k in ("sm_mhz", "capped", "ms_hot") if any(r.get(k) is not None for r in rows)}
    extra = (((SM_MHZ_COL,) if "sm_mhz" in have else ())
             + ((CAPPED_COL,) if "capped" in have else ())
             + (HOT_COLS if "ms_hot" in have else ()))
    i = [c[0] for c in RESULT_COLS].index("p20-p80") + 1
    return RESULT_COLS[:i] + extra + RESULT_COLS[i:]


def floors_table(shapes: Sequence[model.Shape], peak_tflops: float = model.H200_MATMUL_TFLOPS,
                 bw_tbs: float = model.H200_COPY_TBS) -> str:
    """FLOPs, fewest bytes and floors of each shape's two passes (docs/performance.md)."""
    rows = []
    for s in shapes:
        for p in ("fwd", "bwd"):
            flops, nbytes = model.work(s, p)
            rows.append(dict(model.floor(flops, nbytes, peak_tflops, bw_tbs), shape=s.name,
                             dims=s.dims(), p=p, gflop=flops / 1e9, mb=nbytes / 1e6))
    return table((("shape", "shape", ""), ("dims", "dims", ""), ("pass", "p", ""),
                  ("GFLOP", "gflop", ",.0f"), ("min MB", "mb", ",.0f"),
                  (f"compute ms @{peak_tflops:g} TFLOP/s", "compute_ms", ".2f"),
                  (f"memory ms @{bw_tbs:g} TB/s", "memory_ms", ".3f"),
                  ("floor ms", "floor_ms", ".2f"), ("bound", "bound", "")), rows)


def run_line(meta: dict) -> str:
    """One line naming the run: GPU, versions, time, commit and the ceilings used."""
    return (f"Run: {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, tilelang "
            f"{meta.get('tilelang', '?')}, {meta.get('timestamp', '?')}, commit "
            f"{meta.get('git') or '?'}"
            f"{', sources ' + meta['sources'] if meta.get('sources') else ''}; peak {_cell(meta.get('peak_tflops'), '.0f')} TFLOP/s "
            f"({meta.get('peak_source', '?')}), copy {_cell(meta.get('copy_tbs'), '.2f')} TB/s "
            f"({meta.get('copy_source', '?')}); x floor = median ms over "
            "max(FLOPs / peak, min bytes / copy rate).")


# --- output and environment --------------------------------------------------------------------


def write_json(payload: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, default=str)
        f.write("\n")


def write_csv(rows: Sequence[dict], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


def _output(*cmd: str) -> str | None:
    """stdout of a short read-only command, or None where it is missing or fails."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def gpu_state() -> str | None:
    """Clocks, power and temperature (``nvidia-smi``), recorded before and after a run."""
    return _output("nvidia-smi", "--format=csv", "--query-gpu=name,clocks.sm,clocks.max.sm,"
                   "clocks.mem,power.draw,power.limit,temperature.gpu")


#: What :func:`source_digest` hashes: the package, the tools and the tests.
DIGEST_DIRS = ("src", "tools", "tests")


def source_digest(repo: str) -> str:
    """12 hex digits of sha256 over the relative path and bytes of every ``*.py`` / ``*.sh`` file
    under ``DIGEST_DIRS`` (sorted): names the code a run measured where the checkout's git
    metadata cannot (the GPU host's copy of a working tree keeps a stale ``HEAD``).  The same
    call on a local checkout of a commit gives the same digest."""
    h = hashlib.sha256()
    root = Path(repo)
    files = sorted(f for d in DIGEST_DIRS for pat in ("*.py", "*.sh")
                   for f in (root / d).rglob(pat) if "__pycache__" not in f.parts)
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def run_meta(repo: str, gpu: str, torch_version: str) -> dict:
    """The meta columns of every row, and what else a reader of results.json needs."""
    sha = _output("git", "-C", repo, "rev-parse", "--short=12", "HEAD")
    dirty = _output("git", "-C", repo, "status", "--porcelain", "--untracked-files=no")
    tilelang = None
    for dist in ("tilelang", "tilelang-paddle"):
        try:
            tilelang = tilelang or importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"gpu": gpu, "torch": torch_version, "tilelang": tilelang,
            "timestamp": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git": sha and sha + ("+dirty" if dirty else ""), "sources": source_digest(repo),
            "python": platform.python_version(),
            "host": platform.node(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
