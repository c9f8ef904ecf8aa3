"""CPU tests of the benchmark in ``tools/bench/`` (no timing is asserted).

The work model, statistics, table writer and plot's markdown run everywhere (the Paddle CI has
numpy but neither PyTorch nor matplotlib); the runs on CPU (the reference standing in for the
kernels, or the interface with ``helpers.CpuStandIn`` as its kernels) need PyTorch.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
import time

import pytest

from helpers import REPO_ROOT, CpuStandIn, cuda_available

BENCH = REPO_ROOT / "tools" / "bench"
sys.path.insert(0, str(BENCH))

import bench_sparse_mqa as bench  # noqa: E402
import harness  # noqa: E402
import model  # noqa: E402
import plot  # noqa: E402

REF = model.SHAPES["ref"]
META = {"gpu": "Test GPU", "torch": "9.9", "tilelang": "0.1.15", "timestamp": "T", "git": "abc"}


# --- the work model ----------------------------------------------------------------------------


def test_work_at_the_ref_shape_by_hand():
    # fwd: 2 * 4096 * 64 * 2048 * (576 + 512); bwd: the same slots times (2*512 + 3*576) = 2752
    assert model.work(REF, "fwd")[0] == 1_168_231_104_512
    assert model.work(REF, "bwd")[0] == 2_954_937_499_648
    # q 301,989,888 + kv 9,437,184 + indices 33,554,432 + out 268,435,456 + lse 1,048,576
    assert model.work(REF, "fwd")[1] == 614_465_536
    # 2 q + 2 kv + indices + 2 out (out, dO) + lse
    assert model.work(REF, "bwd")[1] == 1_194_328_064
    # the upstream example at ref: fwd 3.66 ms = 319 TFLOP/s, bwd 15.6 ms = 189 TFLOP/s
    row = harness.fill_rates({"ms": 15.6}, *model.work(REF, "bwd"), None, None)
    assert round(row["tflops"]) == 189
    with pytest.raises(ValueError, match="'fwd' or 'bwd'"):
        model.work(REF, "both")


def test_work_of_a_small_shape_by_hand():
    s = model.Shape("x", B=2, S=3, S_kv=5, H=7, topk=11, Dk=13, Dv=4)
    slots = 2 * 3 * 7 * 11  # 462
    # q 1092, kv 260, indices 264, out 336, lse 168 bytes
    q, kv, idx, out, lse = 2 * 3 * 7 * 13 * 2, 2 * 5 * 13 * 2, 2 * 3 * 11 * 4, 2 * 3 * 7 * 4 * 2, 2 * 3 * 7 * 4
    assert model.work(s, "fwd") == (2 * slots * 17, q + kv + idx + out + lse) == (15708, 2120)
    assert model.work(s, "bwd") == (2 * slots * 47, 2 * q + 2 * kv + idx + 2 * out + lse) \
        == (43428, 3808)


def test_floor_names_the_larger_term():
    f = model.floor(790e9, 1e6)  # 1 ms of compute at 790 TFLOP/s, 0.23 us of memory
    assert f["compute_ms"] == pytest.approx(1.0) and f["bound"] == "compute"
    assert f["memory_ms"] == pytest.approx(1e6 / 4.3e9)
    g = model.floor(1e6, 4.3e9)
    assert g["bound"] == "memory" and g["floor_ms"] == pytest.approx(1.0)


def test_gather_scatter_bytes_by_hand():
    rows = 4096 * 2048  # one head group per row up to 64 heads
    assert model.gather_scatter_bytes(model.SHAPES["tp8"]) == (rows * 576 * 2, rows * 576 * 4)
    assert model.gather_scatter_bytes(REF) == (9_663_676_416, 19_327_352_832)
    assert model.gather_scatter_bytes(model.SHAPES["h128"])[0] == 2 * 9_663_676_416


def test_select_shapes():
    assert [s.name for s in model.select_shapes(None)] == list(model.DEFAULT_SHAPES)
    assert [s.name for s in model.select_shapes("tp8, ref,tp8")] == ["tp8", "ref"]
    assert len(model.select_shapes("all")) == len(model.SHAPES)
    with pytest.raises(ValueError, match="--shapes: unknown shape 'nope'; known: ref"):
        model.select_shapes("ref,nope")
    with pytest.raises(ValueError, match="--x: no shape named"):
        model.select_shapes(" , ", "--x")


def test_partition_shapes():
    parts = model.partition_shapes(REF)
    assert [(tp, p) for tp, p, _ in parts] == [(t, p) for t in (1, 2, 4, 8) for p in ("heads", "seq")]
    dims = {(tp, p): (s.B, s.S, s.S_kv, s.H, s.topk) for tp, p, s in parts}
    assert dims[1, "heads"] == dims[1, "seq"] == (1, 4096, 8192, 64, 2048)
    assert parts[0][2] is REF and parts[1][2] is REF  # timed once
    assert dims[8, "heads"] == (1, 4096, 8192, 8, 2048)
    assert dims[8, "seq"] == (1, 512, 8192, 64, 2048)
    assert dims[2, "seq"] == (1, 2048, 8192, 64, 2048)
    # S not divisible by TP: the largest rank's rows
    odd = model.Shape("odd", 1, 100, 128, 8, 16)
    s_rows = {tp: s.S for tp, p, s in model.partition_shapes(odd) if p == "seq"}
    assert s_rows == {1: 100, 2: 50, 4: 25, 8: 13}
    assert {s.name for _, _, s in model.partition_shapes(odd)} >= {"odd", "odd-seq-tp8",
                                                                   "odd-heads-tp8"}
    with pytest.raises(ValueError, match="H=12 of h12 is not divisible by TP=8"):
        model.partition_shapes(model.Shape("h12", 1, 8, 8, 12, 4))


def test_sequence_all_to_all_bytes_by_hand():
    assert model.seq_a2a_bytes(REF, 1) == 0
    # TP=8: q [1, 4096, 8, 576] 37,748,736 B + out [1, 512, 64, 512] 33,554,432 B, 7/8 of each
    # sent out and back in the forward, the same in the backward
    assert model.seq_a2a_bytes(REF, 8) == 2 * 7 / 8 * (37_748_736 + 33_554_432) == 124_780_544
    assert model.seq_a2a_bytes(REF, 2) == 285_212_672  # 150,994,944 + 134,217,728
    odd = model.Shape("odd", 1, 100, 128, 8, 16, Dk=4, Dv=2)
    assert model.seq_a2a_bytes(odd, 8) == 2 * 7 / 8 * (100 * 1 * 4 * 2 + 13 * 8 * 2 * 2) == 2128


# --- statistics, rows and the table writer ----------------------------------------------------


def test_summarize_quantiles_by_hand():
    s = harness.summarize([7.0, 1.0, 10.0, 4.0, 2.0, 9.0, 3.0, 6.0, 5.0, 8.0])
    # linear interpolation over the sorted 1..10: p20 at position 1.8, p80 at 7.2
    assert s == pytest.approx({"ms": 5.5, "ms_p20": 2.8, "ms_p80": 8.2, "ms_min": 1.0,
                               "ms_max": 10.0, "reps": 10})
    assert harness.summarize([3.0])["ms_p20"] == 3.0


def test_table_writer():
    cols = (("name", "name", ""), ("x", "x", ".2f"), ("twice", lambda r: r["n"] * 2, "d"),
            ("ok", "ok", ""))
    rows = [{"name": "a", "x": 1.234, "n": 2, "ok": True},
            {"name": None, "x": "error: boom", "n": 0, "ok": False}]
    assert harness.table(cols, rows) == (
        "| name | x | twice | ok |\n"
        "|---|---:|---:|---|\n"
        "| a | 1.23 | 4 | yes |\n"
        "| - | error: boom | 0 | NO |")


def test_floors_table_is_the_one_in_the_performance_doc():
    text = (REPO_ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    table = harness.floors_table([model.SHAPES[n] for n in model.DEFAULT_SHAPES])
    assert table in text  # regenerate the doc's table (bench_sparse_mqa.py --dry-run) if not
    assert ("| ref | B=1 S=4096 S_kv=8192 H=64 topk=2048 | bwd | 2,955 | 1,194 | 3.74 | 0.278 "
            "| 3.74 | compute |") in table


def _rows():
    rows = []
    for variant, ms in (("fwd", 3.5), ("bwd_atomic", 15.0), ("bwd_det", 20.0)):
        r = harness.make_row(REF, variant, META, ms=ms, ms_p20=ms * 0.99, ms_p80=ms * 1.01,
                             reps=20, peak_mem_mb=1234.5, extra_mem_mb=600.0, repeatable=True)
        rows.append(harness.fill_rates(r, *model.work(REF, variant[:3]), 790.0, 4.3))
    rows.append(harness.make_row(model.SHAPES["tp8"], "bwd_det", META, status="skipped: oom"))
    harness.fill_det_ratio(rows)
    return rows


def test_rows():
    rows = _rows()
    assert set(rows[0]) == set(harness.FIELDS)
    assert {"sm_mhz", "power_w", "capped"} <= set(harness.FIELDS) and rows[0]["sm_mhz"] is None
    assert rows[0]["capped"] is None
    r = harness.make_row(REF, "fwd", META, ms=1.0, sm_mhz=1755.0, power_w=699.5, capped=0.4)
    assert (r["sm_mhz"], r["power_w"], r["capped"]) == (1755.0, 699.5, 0.4)
    assert rows[2]["det_over_atomic"] == pytest.approx(20 / 15)
    assert rows[1]["det_over_atomic"] is None and rows[3]["det_over_atomic"] is None
    assert rows[2]["x_floor"] == pytest.approx(20.0 / (2_954_937_499_648 / 790e9))
    assert rows[2]["tbs"] == pytest.approx(1_194_328_064 / 20e-3 / 1e12)
    with pytest.raises(ValueError, match="unknown fields"):
        harness.make_row(REF, "fwd", META, millis=1.0)


def test_gpu_sampler_without_nvml_gives_none(monkeypatch):
    def no_library():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(harness, "_nvml_lib", None)  # not tried yet in this process
    monkeypatch.setattr(harness, "_load_nvml", no_library)
    assert harness.nvml_reader() is None and harness.nvml_reader(pci_bus_id="0:1:0.0") is None
    with harness.GpuSampler(harness.nvml_reader()) as gpu:
        pass
    assert gpu.fields() == {"sm_mhz": None, "power_w": None, "capped": None}
    assert gpu.samples == []
    row = harness.make_row(REF, "fwd", META, ms=1.0, **gpu.fields())
    assert row["sm_mhz"] is None and row["power_w"] is None and row["capped"] is None


class FakeNvml:
    """The entry points the reader calls, as ctypes calls them (out-parameters by byref); no
    clock-event reasons (a library without either symbol): subclasses add them."""

    inits = 0

    def nvmlInit_v2(self):
        type(self).inits += 1
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = 100 + index.value
        return 0 if index.value < 2 else 2  # NVML_ERROR_INVALID_ARGUMENT

    def nvmlDeviceGetClockInfo(self, handle, clock_type, out):
        out._obj.value = 1755 if clock_type == harness.NVML_CLOCK_SM else 0
        return 0

    def nvmlDeviceGetPowerUsage(self, handle, out):
        out._obj.value = 699_500 if handle.value == 101 else 0
        return 0 if handle.value == 101 else 3  # NVML_ERROR_NOT_SUPPORTED


def _fake_nvml(monkeypatch, reasons=None, symbol="nvmlDeviceGetCurrentClocksEventReasons"):
    """:class:`FakeNvml` as the loaded NVML, not yet initialised; with ``reasons`` (a mask, or
    None: the call fails), the clock-event reasons under ``symbol``.  Returns the class."""
    calls = []

    def get_reasons(self, handle, out):
        # nvml.h: unsigned long long *: NVML writes 8 bytes, so a c_uint would overflow
        assert type(out._obj) is ctypes.c_ulonglong
        calls.append(handle.value)
        if reasons is None:
            return 3  # NVML_ERROR_NOT_SUPPORTED
        out._obj.value = reasons
        return 0

    lib = FakeNvml if symbol is None else type("FakeNvmlReasons", (FakeNvml,),
                                               {symbol: get_reasons, "calls": calls})
    lib.inits = 0
    monkeypatch.setattr(harness, "_nvml_lib", None)
    monkeypatch.setattr(harness, "_load_nvml", lib)
    return lib


def test_nvml_is_initialised_once_and_read_through_ctypes(monkeypatch):
    lib = _fake_nvml(monkeypatch, reasons=0x4)
    assert harness.nvml_reader(index=1)() == (1755, 699.5, True)
    # power unsupported: clock and reasons still read
    assert harness.nvml_reader(index=0)() == (1755, None, True)
    assert harness.nvml_reader(index=7) is None
    assert lib.inits == 1 and lib.calls == [101, 100]  # one reasons call per read, its GPU's


@pytest.mark.parametrize("reasons, capped", [
    (0x0, False), (0x1, False),  # none; the GPU idle only
    (0x2 | 0x10 | 0x100, False),  # application clocks, sync boost, display clock: not a cap
    (0x4, True), (0x1 | 0x4, True),  # the software power cap, also beside idle
    (0x8, True), (0x20, True), (0x40, True), (0x80, True),  # each other power/thermal bit
    (None, None),  # the call fails
])
def test_nvml_reader_flags_power_and_thermal_reasons(monkeypatch, reasons, capped):
    _fake_nvml(monkeypatch, reasons=reasons)
    assert harness.nvml_reader(index=1)() == (1755, 699.5, capped)


def test_nvml_reader_takes_the_older_throttle_reasons_name(monkeypatch):
    lib = _fake_nvml(monkeypatch, reasons=0x4, symbol="nvmlDeviceGetCurrentClocksThrottleReasons")
    assert not hasattr(lib(), "nvmlDeviceGetCurrentClocksEventReasons")
    read = harness.nvml_reader(index=1)
    assert read() == (1755, 699.5, True) and read() == (1755, 699.5, True)
    assert lib.calls == [101, 101]


def test_nvml_reader_without_either_reasons_symbol_reads_the_rest(monkeypatch):
    _fake_nvml(monkeypatch, symbol=None)
    assert harness.nvml_reader(index=1)() == (1755, 699.5, None)


def test_nvml_reader_looks_the_reasons_symbol_up_once(monkeypatch):
    lookups = []

    class CountingLookups(FakeNvml):
        def __getattr__(self, name):  # only names the class lacks: the two reasons symbols
            lookups.append(name)
            raise AttributeError(name)

    CountingLookups.inits = 0
    monkeypatch.setattr(harness, "_nvml_lib", None)
    monkeypatch.setattr(harness, "_load_nvml", CountingLookups)
    read = harness.nvml_reader(index=1)
    n = len(lookups)
    assert n == 2 and [read() for _ in range(3)] == [(1755, 699.5, None)] * 3
    assert len(lookups) == n  # none while sampling


def test_gpu_sampler_takes_medians_of_the_samples_on_its_thread():
    readings = iter([(1980, 300.0), (1760, 690.0), (1750, None), (1740, 700.0)])
    threads = []

    def read():
        threads.append(threading.get_ident())
        return next(readings)  # StopIteration after four: sampling stops, without an error

    with harness.GpuSampler(read, period_s=0.001) as gpu:
        deadline = time.monotonic() + 10
        while len(threads) < 5 and time.monotonic() < deadline:  # its thread is done
            time.sleep(0.001)
    assert gpu.samples == [(1980, 300.0), (1760, 690.0), (1750, None), (1740, 700.0)]
    # four samples and the failed fifth on the sampler's thread (beside the timed calls), then
    # the failed one on exit
    assert len(threads) == 6 and threading.get_ident() not in threads[:5]
    assert len(set(threads[:5])) == 1 and threads[5] == threading.get_ident()
    assert gpu.sm_mhz == 1755.0 and gpu.power_w == 690.0  # None left out of the median
    # pairs: no capped value in any sample
    assert gpu.fields() == {"sm_mhz": 1755.0, "power_w": 690.0, "capped": None}


def test_gpu_sampler_capped_is_the_fraction_of_known_samples():
    readings = [(1980, 300.0, False), (1800, 690.0, True), (1790, 695.0, None),
                (1780, 700.0, True), (1770, None, False), (1760, 700.0, True), (1750, 700.0)]
    with harness.GpuSampler(iter(readings).__next__, period_s=0.001) as gpu:
        deadline = time.monotonic() + 10
        while len(gpu.samples) < len(readings) and time.monotonic() < deadline:
            time.sleep(0.001)
    assert gpu.samples == readings
    # three True of five known: None and the pair (1750, 700.0) left out, not counted False
    assert gpu.capped == pytest.approx(3 / 5)
    assert gpu.fields() == {"sm_mhz": 1780.0, "power_w": 697.5, "capped": gpu.capped}
    with harness.GpuSampler(iter([(1980, 100.0, None)] * 2).__next__, period_s=60.0) as gpu:
        pass
    assert gpu.samples == [(1980, 100.0, None)] * 2 and gpu.capped is None


def test_gpu_sampler_samples_a_short_section_at_least_twice():
    calls = []

    def read():
        calls.append(time.monotonic())
        return (1980 - 10 * len(calls), 100.0 * len(calls))

    with harness.GpuSampler(read, period_s=60.0) as gpu:  # one sample on entry, one on exit
        pass
    assert len(calls) == 2 and (gpu.sm_mhz, gpu.power_w) == (1965.0, 150.0)


class _CountingClock(harness.Clock):
    """The host clock, counting syncs (a device's queue drains at each)."""

    def __init__(self):
        super().__init__()
        self.syncs = 0

    def sync(self):
        self.syncs += 1


def test_settle_drains_the_queue_then_idles(monkeypatch):
    slept = []
    clock = _CountingClock()
    monkeypatch.setattr(harness.time, "sleep", slept.append)
    harness.settle(clock, 1.5)
    harness.settle(clock, 0.0)  # no idle, still the sync
    assert slept == [1.5] and clock.syncs == 2


def test_sustained_ms_is_the_mean_over_the_measured_seconds_only():
    calls, entered = [], []

    class CallClock(_CountingClock):
        """Marks count the calls made so far: ms(a, b) is the number of calls between them."""

        def mark(self):
            return len(calls)

        def ms(self, start, end):
            return float(end - start)

    class Sampler:
        def __enter__(self):
            entered.append(len(calls))  # after the warm-up's calls

        def __exit__(self, *exc):
            entered.append(len(calls))

    def fn(x):
        calls.append(x)
        time.sleep(0.001)

    clock = CallClock()
    ms = harness.sustained_ms(clock, fn, ["a", "b", "c"], 0.02, 0.02, Sampler(), batch=4)
    warm, hot = entered[0], entered[1] - entered[0]
    assert warm >= 4 and warm % 4 == 0 and hot >= 4 and hot % 4 == 0  # whole batches
    assert calls[:6] == ["a", "b", "c", "a", "b", "c"]  # the inputs rotate across both phases
    assert calls[warm] == "abc"[warm % 3] and len(calls) == warm + hot
    # the span between the marks covers the measured calls only, divided by their number
    assert ms == 1.0
    assert clock.syncs == (warm + hot) // 4 + 1  # one per batch and one at the end
    # zero seconds still time one batch (no division by zero)
    calls.clear()
    assert harness.sustained_ms(clock, fn, ["a"], 0.0, 0.0) == 1.0 and len(calls) == 8


def test_table_has_the_sustained_time_where_rows_carry_it():
    rows = _rows()
    rows[0].update(sm_mhz=1980.0, ms_hot=1.234, sm_mhz_hot=1755.0)
    lines = harness.table(harness.result_cols(rows), rows).splitlines()
    assert "| p20-p80 | SM MHz | ms hot | hot MHz | TFLOP/s |" in lines[0]
    assert "| 1980 | 1.234 | 1755 |" in lines[2]
    assert "| - | - | - |" in lines[3]  # a row without them


def test_settle_and_hot_defaults_by_device():
    gpu = bench.parse_args([])
    assert (gpu.settle_s, gpu.hot_s) == (harness.SETTLE_S, harness.HOT_S) == (1.5, 1.0)
    cpu = bench.parse_args(["--cpu-standin"])
    assert (cpu.settle_s, cpu.hot_s) == (0.0, 0.0)
    assert bench.parse_args(["--settle-s", "0", "--hot-s", "2"]).hot_s == 2.0
    for bad in (["--hot-s", "-1"], ["--settle-s", "inf"], ["--hot-s", "nan"]):
        with pytest.raises(SystemExit):  # inf never ends, nan would skip the pause silently
            bench.parse_args(bad)


def test_table_has_the_capped_fraction_where_rows_carry_it():
    rows = _rows()
    rows[0].update(sm_mhz=1755.4, power_w=699.0)
    assert "capped" not in harness.table(harness.result_cols(rows), rows)
    rows[1].update(capped=0.4)
    lines = harness.table(harness.result_cols(rows), rows).splitlines()
    assert "| p20-p80 | SM MHz | capped | TFLOP/s |" in lines[0]
    assert "| 1755 | - | " in lines[2] and "| - | 40% | " in lines[3]
    rows[1].update(capped=0.0)  # never capped is still a recorded value
    assert harness.CAPPED_COL in harness.result_cols(rows)
    assert plot.markdown(rows, META).splitlines()[2] == lines[0]


def test_table_has_the_sm_clock_where_rows_carry_it():
    rows = _rows()
    assert "SM MHz" not in harness.table(harness.result_cols(rows), rows)
    rows[0].update(sm_mhz=1755.4, power_w=699.0)
    lines = harness.table(harness.result_cols(rows), rows).splitlines()
    assert lines[0].startswith("| shape | B | S | S_kv | H | topk | variant | ms (p50) | p20-p80 "
                               "| SM MHz | TFLOP/s | % of matmul peak |")
    assert "| fwd | 3.500 | 3.465-3.535 | 1755 | " in lines[2]
    assert "| bwd_det | 20.000 | 19.800-20.200 | - | 147.7 |" in lines[4]
    assert plot.markdown(rows, META).splitlines()[2] == lines[0]


def test_results_json_round_trip_through_plot_markdown(tmp_path, capsys):
    rows = _rows()
    meta = dict(META, peak_tflops=790.0, peak_source="measured matmul_bf16", copy_tbs=4.3,
                copy_source="measured")
    harness.write_json({"meta": meta, "rows": rows}, str(tmp_path / "results.json"))
    doc = tmp_path / "performance.md"
    text = (REPO_ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    doc.write_text(text, encoding="utf-8")
    assert plot.main(["--markdown", str(tmp_path / "results.json"), "--update", str(doc)]) == 0
    new = doc.read_text(encoding="utf-8")
    block = new.split(plot.BEGIN_MARK)[1].split(plot.END_MARK)[0]
    assert block.strip().splitlines()[0] == (
        "Run: Test GPU, torch 9.9, tilelang 0.1.15, T, commit abc; peak 790 TFLOP/s (measured "
        "matmul_bf16), copy 4.30 TB/s (measured); x floor = median ms over max(FLOPs / peak, "
        "min bytes / copy rate).")
    # 2,954.9 GFLOP in 20 ms = 147.7 TFLOP/s = 18.7% of 790; floor 3.74 ms -> 5.3x
    assert ("| ref | 1 | 4096 | 8192 | 64 | 2048 | bwd_det | 20.000 | 19.800-20.200 | 147.7 "
            "| 18.7% | 5.3 | 1,234 | 1.33 | yes |") in block
    assert "| tp8 | 1 | 4096 | 8192 | 8 | 2048 | bwd_det | skipped: oom | - |" in block
    assert new.split(plot.BEGIN_MARK)[0] == text.split(plot.BEGIN_MARK)[0]
    assert new.split(plot.END_MARK)[1] == text.split(plot.END_MARK)[1]
    bad = tmp_path / "bad.md"
    bad.write_text("no markers", encoding="utf-8")
    with pytest.raises(ValueError, match="markers"):
        plot.update_doc(str(bad), "x")


def test_plot_usage_errors(tmp_path, capsys):
    """plot.py: a missing, non-JSON or foreign results file, a document without the markers and
    --update without --markdown are usage errors naming the problem, never a traceback."""
    results = tmp_path / "results.json"
    harness.write_json({"meta": META, "rows": _rows()}, str(results))
    not_json = tmp_path / "notjson.json"
    not_json.write_text("{rows", encoding="utf-8")
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"shapes": []}', encoding="utf-8")
    no_marks = tmp_path / "doc.md"
    no_marks.write_text("no markers", encoding="utf-8")
    for args, message in (
            (["--markdown", str(tmp_path / "missing.json")], "cannot read it"),
            (["--markdown", str(not_json)], "not JSON"),
            (["--markdown", str(foreign)], "expected a benchmark results.json"),
            ([str(not_json)], "not JSON"),
            (["--markdown", str(results), "--update", str(no_marks)], "expected the markers"),
            ([str(results), "--update", str(no_marks)], "--update DOC needs --markdown")):
        with pytest.raises(SystemExit) as e:
            plot.main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err and message in err, (args, err)
    assert no_marks.read_text(encoding="utf-8") == "no markers"


def test_recorded_results_regenerate_the_doc_block():
    """docs/perf/h200-latest.json (a results.json of the old tool) still reads, and gives the
    block docs/performance.md holds."""
    text = (REPO_ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    body = plot.markdown(*plot.load_results(str(REPO_ROOT / "docs" / "perf" / "h200-latest.json")))
    assert plot.BEGIN_MARK + "\n" + body + "\n" + plot.END_MARK in text


# --- the partition mode's rows and table -------------------------------------------------------


def test_partition_rows_and_table():
    parts = model.partition_shapes(REF)
    meta = dict(META, peak_tflops=790.0, copy_tbs=4.3)
    rows = []
    for i, s in enumerate(dict.fromkeys(s for _, _, s in parts)):
        for v, ms in (("fwd", 1.0 + i), ("bwd_det", 10.0 + i)):
            rows.append(harness.make_row(s, v, meta, ms=ms, peak_mem_mb=100.0 + i,
                                         extra_mem_mb=50.0))
    rows[-1] = harness.make_row(parts[-1][2], "bwd_det", meta, status="skipped: out of memory")
    core = {r["variant"]: r for r in bench.partition_rows(parts, rows, meta)}
    assert list(core) == [f"core_{p}_tp{t}" for t in (1, 2, 4, 8) for p in ("heads", "seq")]
    assert core["core_heads_tp1"]["ms"] == core["core_seq_tp1"]["ms"] == 11.0
    assert core["core_seq_tp2"]["ms"] == 3.0 + 12.0  # the third shape timed: ref-seq-tp2
    assert (core["core_heads_tp8"]["shape"], core["core_heads_tp8"]["H"]) == ("ref", 8)
    assert core["core_seq_tp8"]["status"].startswith("not run: fwd ok; bwd_det skipped")
    assert core["core_seq_tp2"]["a2a_mb"] == pytest.approx(285.212672)
    assert core["core_heads_tp2"]["a2a_mb"] is None
    flops = sum(model.work(parts[3][2], p)[0] for p in ("fwd", "bwd"))
    assert core["core_seq_tp2"]["tflops"] == pytest.approx(flops / 15.0 / 1e9)
    table = bench.partition_table(list(core.values())).splitlines()
    assert table[0].startswith("| variant | S | H | fwd + bwd_det ms | x TP=1 |")
    assert table[5].startswith("| core_seq_tp2 | 2048 | 64 | 15.000 | 1.364 | 285.2 |")
    assert "| core_seq_tp8 | 512 | 64 | not run: fwd ok; bwd_det skipped" in table[9]


# --- the command line --------------------------------------------------------------------------


def test_parse_args(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    a = bench.parse_args([])
    assert (a.reps, a.warmup, a.sets, a.ref_reps, a.out) == (50, 5, 3, 3, str(BENCH / "results"))
    assert [s.name for s in a.shape_list] == list(model.DEFAULT_SHAPES)
    assert a.variant_list == list(bench.VARIANTS) and a.ref_shape_names == {"tiny", "tp8", "ref"}
    q = bench.parse_args(["--quick", "--no-ref", "--shapes", "ref,tp8,h128,fleet,b2,tp4"])
    assert (q.reps, q.warmup, q.variant_list) == (20, 2, ["fwd", "bwd_atomic", "bwd_det"])
    assert [s.name for s in bench.parse_args(["--cpu-standin"]).shape_list] == ["tiny"]
    part = bench.parse_args(["--partition"])
    assert part.variant_list == ["fwd", "bwd_det"] and len(part.shape_list) == 7  # tp1 once
    monkeypatch.setenv("OUT", "/somewhere")
    assert bench.parse_args([]).out == "/somewhere"


@pytest.mark.parametrize("args, message", [
    (["--shapes", "nosuch"], "--shapes: unknown shape 'nosuch'; known: "),
    (["--ref-shapes", "nosuch"], "--ref-shapes: unknown shape 'nosuch'"),
    (["--variants", "fwd,bogus"], "--variants: unknown ['bogus']"),
    (["--sets", "2"], "--sets must be >= 3"),
    (["--reps", "0"], "--reps: expected >= 1, got 0"),
    (["--ref-reps", "0"], "--ref-reps: expected >= 1, got 0"),
    (["--warmup", "-1"], "--warmup: expected >= 0, got -1"),
    (["--budget-s", "-1"], "--budget-s: expected a finite number of seconds >= 0, got -1.0"),
    (["--matmul-n", "-5"], "--matmul-n: expected >= 0 (0: skip), got -5"),
    (["--copy-mb", "-1"], "--copy-mb: expected >= 0 (0: skip), got -1"),
    (["--sm-scale", "0"], "--sm-scale: expected a finite number > 0, got 0.0"),
    (["--sm-scale", "nan"], "--sm-scale: expected a finite number > 0, got nan"),
    (["--shapes", ""], "--shapes: empty"),
    (["--variants", " , "], "--variants: empty"),
    (["--ref-shapes", ","], "--ref-shapes: empty"),
    (["--no-ref", "--variants", "ref_fwd"], "--variants: nothing left to time"),
    (["--out", __file__], "is a file, not a folder"),
    (["--partition", "--shapes", "ref,tp8"], "--partition: times fwd and bwd_det"),
    (["--partition", "--variants", "fwd"], "--partition: times fwd and bwd_det"),
    (["--stages", "--cpu-standin"], "--stages times the kernels' launches"),
])
def test_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        bench.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and message in errors[0], err


def test_dry_run_prints_the_floors_and_the_all_to_all_bytes(capsys):
    assert bench.main(["--dry-run", "--partition"]) == 0
    out = capsys.readouterr().out
    assert "| ref-seq-tp8 | B=1 S=512 S_kv=8192 H=64 topk=2048 | fwd | 146 |" in out
    assert "TP=2 285.2 MB, TP=4 213.9 MB, TP=8 124.8 MB" in out


@pytest.mark.skipif(cuda_available(), reason="checks the message printed where there is no CUDA")
def test_without_cuda_the_gpu_modes_say_so(tmp_path, capsys):
    pytest.importorskip("torch")
    assert bench.main(["--stages", "--out", str(tmp_path)]) == 2
    assert "no CUDA device; --cpu-standin runs the tool on CPU" in capsys.readouterr().err


# --- runs on CPU -------------------------------------------------------------------------------


def test_causal_indices_on_device_keep_the_causal_semantics():
    torch = pytest.importorskip("torch")
    s = model.Shape("t", B=2, S=40, S_kv=48, H=1, topk=16)
    idx = bench.causal_topk_indices_torch(torch, s, torch.Generator().manual_seed(3), "cpu",
                                          row_chunk=7)
    assert idx.shape == (2, 40, 16) and idx.dtype == torch.int32
    for b in range(2):
        for r in range(40):
            pos = s.S_kv - s.S + r
            n_valid = min(16, pos + 1)
            row = idx[b, r].tolist()
            assert row[n_valid:] == [-1] * (16 - n_valid), (b, r)  # -1 padding at the end
            assert len(set(row[:n_valid])) == n_valid and max(row[:n_valid]) <= pos, (b, r)
    assert idx[0, -1].tolist() != list(range(16)) and idx[0, -1].tolist() != idx[1, -1].tolist()


def _standin_run(tmp_path, *extra):
    return bench.main(["--cpu-standin", "--reps", "2", "--warmup", "0", "--ref-reps", "1",
                       "--no-progress", "--no-plot", "--out", str(tmp_path), *extra])


def test_cpu_standin_run_writes_every_output(tmp_path, capsys):
    pytest.importorskip("torch")
    assert _standin_run(tmp_path, "--matmul-n", "64", "--copy-mb", "1") == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    rows = payload["rows"]
    assert [r["variant"] for r in rows] == ["matmul_fp32", "copy", "fwd", "bwd_atomic",
                                            "bwd_det", "ref_fwd", "ref_bwd"]
    assert all(r["status"] == "ok" for r in rows) and all(set(r) == set(harness.FIELDS)
                                                          for r in rows)
    # on CPU the sampler has no GPU to read: the fields are there, empty; no sustained time
    # by default on CPU
    assert all(r["sm_mhz"] is None and r["power_w"] is None and r["capped"] is None
               for r in rows)
    assert all(r["ms_hot"] is None and r["sm_mhz_hot"] is None for r in rows)
    header = (tmp_path / "results.csv").read_text().splitlines()[0].split(",")
    assert header == list(harness.FIELDS)
    assert header.index("sm_mhz") == header.index("ms_max") + 1
    assert header.index("capped") == header.index("power_w") + 1
    meta = payload["meta"]
    assert meta["peak_tflops"] == rows[0]["tflops"] and meta["copy_tbs"] == rows[1]["tbs"]
    assert rows[1]["tbs"] == pytest.approx(2 * 2**20 / rows[1]["ms"] / 1e9)
    for r in rows[2:]:
        assert r["reps"] == (1 if r["variant"].startswith("ref") else 2)
        assert r["ms_min"] <= r["ms_p20"] <= r["ms"] <= r["ms_p80"] <= r["ms_max"]
        assert r["tflops"] == pytest.approx(model.work(model.SHAPES["tiny"], "fwd" if "fwd" in r["variant"] else "bwd")[0]
                                            / r["ms"] / 1e9)
        assert r["repeatable"] is (None if r["variant"].startswith("ref") else True)
    # the reference rows check our outputs (here: the reference itself, out rounded to bf16)
    assert rows[5]["note"].startswith("fwd vs reference, rel. L2: out ")
    errors = dict(x.rsplit(" ", 1) for x in rows[5]["note"].split(": ", 1)[1].split(", "))
    assert set(errors) == {"out", "lse"} and 1e-4 < float(errors["out"]) < 1e-2
    assert float(errors["lse"]) == 0.0
    assert rows[6]["note"] == "bwd_det vs reference, rel. L2: dq 0.0e+00, dkv 0.0e+00, d_sink 0.0e+00"
    det, atomic = rows[4], rows[3]
    assert det["det_over_atomic"] == pytest.approx(det["ms"] / atomic["ms"])
    assert det["note"] == "cpu-standin: reference"
    assert len((tmp_path / "results.csv").read_text().splitlines()) == 1 + len(rows)
    assert capsys.readouterr().out.rstrip().endswith((tmp_path / "table.txt").read_text().rstrip())


def test_cpu_standin_run_settles_and_times_sustained(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    slept = []
    monkeypatch.setattr(harness, "settle", lambda clock, seconds: slept.append(seconds))
    monkeypatch.setattr(harness, "HOT_WARM_S", 0.0)
    assert _standin_run(tmp_path, "--variants", "fwd,bwd_det,ref_fwd", "--matmul-n", "0",
                        "--copy-mb", "0", "--settle-s", "0.25", "--hot-s", "0.01") == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["fwd", "bwd_det", "ref_fwd"]
    assert slept == [0.25] * 3  # before every variant's timed calls, the reference's too
    assert all(r["ms_hot"] > 0 for r in rows[:2]) and rows[2]["ms_hot"] is None
    assert "| ms hot | hot MHz |" in (tmp_path / "table.txt").read_text()


def _failing(monkeypatch, variant, error):
    real = bench.load_functions

    def load(*args, **kwargs):
        fns = real(*args, **kwargs)

        def boom(inp, provider=None):
            raise error

        fns[variant] = boom
        return fns

    monkeypatch.setattr(bench, "load_functions", load)


def test_out_of_memory_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    _failing(monkeypatch, "bwd_atomic", torch.cuda.OutOfMemoryError("CUDA out of memory. Tried"))
    assert _standin_run(tmp_path, "--matmul-n", "0", "--copy-mb", "0", "--no-ref") == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert rows["fwd"]["status"] == "ok"
    assert rows["bwd_atomic"]["status"] == "skipped: out of memory (CUDA out of memory. Tried)"
    assert rows["bwd_det"]["status"] == rows["bwd_atomic"]["status"]  # the rest of the shape


def test_any_other_error_stops_the_run_after_saving(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    _failing(monkeypatch, "bwd_det", RuntimeError("kernel exploded"))
    with pytest.raises(RuntimeError, match="kernel exploded"):
        _standin_run(tmp_path, "--matmul-n", "0", "--copy-mb", "0", "--no-ref")
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["variant"], r["status"]) for r in rows] == [("fwd", "ok"), ("bwd_atomic", "ok")]


def test_our_wrappers_get_the_benchmark_arguments():
    """Without a provider, our wrappers reach their device check: the benchmark calls them with
    arguments they accept."""
    torch = pytest.importorskip("torch")
    fns = bench.load_functions(torch, cpu_standin=False, check_indices=False)
    inp = bench.make_input_sets(torch, model.SHAPES["tiny"], "cpu")[0]
    inp["out"], inp["lse"] = torch.zeros(1, 64, 16, 512, dtype=torch.bfloat16), torch.zeros(1, 64, 16)
    for v in bench.OURS:
        with pytest.raises(ValueError, match="(?i)cuda"):
            fns[v](inp)


@pytest.mark.parametrize("margin", [None, -40])
def test_stage_timing_through_the_interface_on_cpu(monkeypatch, margin):
    """--stages' provider around the CPU kernels of helpers.CpuStandIn: every launch is a stage,
    and the exact dKV's statistics count the keys of the inputs (all of them re-run when the first
    pass's grid is 2^40 too fine)."""
    torch = pytest.importorskip("torch")
    from paddlefleet.tilelang_ops.attn import exact_dkv

    if margin is not None:
        monkeypatch.setattr(exact_dkv, "GRID_MARGIN_BITS", margin)
    clock = harness.Clock()
    s = model.Shape("t", 1, 8, 24, 16, 8)
    sets = bench.make_input_sets(torch, s, "cpu")
    fns = bench.load_functions(torch, cpu_standin=False, check_indices=True)
    for inp in sets:
        inp["out"], inp["lse"] = fns["fwd"](inp, provider=CpuStandIn())
    reports = {v: bench.stage_report(torch, clock, fns[v], sets, 2, CpuStandIn())
               for v in bench.OURS}
    rest = ["rest of the call", "call"]
    assert list(reports["fwd"]) == ["fwd kernel"] + rest
    assert list(reports["bwd_atomic"]) == ["preprocess", "main", "finish"] + rest
    det = reports["bwd_det"]
    assert list(det) == ["preprocess", "grid", "main", "re-run plan", "main re-run",
                         "finish"] + rest + ["exact"]
    assert det["call"] > det["main"] > 0
    last = sets[2 % 3]["idx"]  # the last of the three calls
    keys, slots = torch.unique(last[last >= 0]).numel(), int((last >= 0).sum())
    e = det["exact"]
    assert e["keys"] == keys
    assert (e["keys_rerun"], e["slots_rerun"]) == ((0, 0) if margin is None else (keys, slots))
    room = e["headroom_bits"]
    assert room == sorted(room) and (room[0] >= 0 if margin is None else room[0] < 0)
    lines = bench.stage_lines("t bwd_det", det)
    assert lines[0].startswith("t bwd_det stages, ms (median): preprocess ")
    assert lines[1].startswith(f"t bwd_det exact dKV: {e['keys_rerun']} of {keys} keys re-run "
                               f"({e['slots_rerun']} slots); head-room bits min/p1/p50/p99/max ")


def test_source_digest_names_the_code_not_the_git_metadata(tmp_path):
    """The GPU host's copy of a working tree keeps a stale git HEAD: the run records a digest of
    the sources instead, which a local checkout of the measured commit reproduces."""
    for d in harness.DIGEST_DIRS:
        (tmp_path / d / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "k.py").write_text("x = 1\n")
    (tmp_path / "tools" / "run.sh").write_text("echo\n")
    (tmp_path / "docs").mkdir()
    first = harness.source_digest(str(tmp_path))
    assert len(first) == 12 and int(first, 16) >= 0
    (tmp_path / "docs" / "notes.md").write_text("not code\n")  # docs do not count
    (tmp_path / "src" / "pkg" / "__pycache__").mkdir()
    (tmp_path / "src" / "pkg" / "__pycache__" / "k.py").write_text("cache\n")
    assert harness.source_digest(str(tmp_path)) == first
    (tmp_path / "src" / "pkg" / "k.py").write_text("x = 2\n")  # one byte of a kernel
    assert harness.source_digest(str(tmp_path)) != first
    (tmp_path / "src" / "pkg" / "k.py").write_text("x = 1\n")
    (tmp_path / "tools" / "run.sh").rename(tmp_path / "tools" / "run2.sh")  # a path
    assert harness.source_digest(str(tmp_path)) != first
    meta = dict(META, sources=first)
    assert f"commit abc, sources {first}; peak" in harness.run_line(meta)


def test_trial_repeats_of_a_shape_take_the_providers_the_other_way(monkeypatch):
    """``kernel_trial --shapes ref,h128,ref,h128``: a provider timed right after another
    inherits the GPU's clock state from it, so every repeat of a shape reverses its previous
    order (a flip by position alone kept both shapes' order here, found by a review).  Needs no
    torch: the tool imports it in its GPU functions only (tests/test_torch_free.py runs this
    without torch)."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "tools" / "experiments"))
    import kernel_trial

    got = kernel_trial.provider_orders(["ref", "h128", "ref", "h128", "ref"], ["a", "b", "c"])
    assert got == [("ref", ["a", "b", "c"]), ("h128", ["a", "b", "c"]),
                   ("ref", ["c", "b", "a"]), ("h128", ["c", "b", "a"]),
                   ("ref", ["a", "b", "c"])]


# --- DeepSeek-V4's shapes, (Dk, Dv) = (512, 512) ---------------------------------------------


V4 = {n: model.SHAPES[n] for n in ("v4flash", "v4pro", "v4tp8", "v4tiny")}


def test_v4_work_by_hand():
    """FLOPs and bytes with the shape's own Dk = Dv = 512 (2*S*H*topk*(Dk+Dv) forward,
    2*S*H*topk*(3*Dk+2*Dv) backward): 1,024 + 1,024 per (row, head, key) forward, 2,560
    backward, where the (576, 512) shapes count 1,088 and 2,752."""
    flash, pro, tp8 = V4["v4flash"], V4["v4pro"], V4["v4tp8"]
    assert (flash.Dk, flash.Dv, flash.S_kv, flash.topk) == (512, 512, 4096 + 1024, 128 + 512)
    assert (pro.H, pro.topk, tp8.H) == (128, 128 + 1024, 8)
    assert model.work(flash, "fwd")[0] == 2 * 4096 * 64 * 640 * (512 + 512) == 343_597_383_680
    assert model.work(flash, "bwd")[0] == 2 * 4096 * 64 * 640 * (3 * 512 + 2 * 512) \
        == 858_993_459_200
    assert model.work(pro, "fwd")[0] == 2 * 4096 * 128 * 1152 * 1024 == 1_236_950_581_248
    assert model.work(pro, "bwd")[0] == 2 * 4096 * 128 * 1152 * 2560 == 3_092_376_453_120
    assert model.work(tp8, "fwd")[0] == 2 * 4096 * 8 * 640 * 1024 == 42_949_672_960
    assert model.work(tp8, "bwd")[0] == 2 * 4096 * 8 * 640 * 2560 == 107_374_182_400
    # q 268,435,456 + kv 5,242,880 + indices 10,485,760 + out 268,435,456 + lse 1,048,576
    q, kv, idx, out, lse = (4096 * 64 * 512 * 2, 5120 * 512 * 2, 4096 * 640 * 4,
                            4096 * 64 * 512 * 2, 4096 * 64 * 4)
    assert model.work(flash, "fwd")[1] == q + kv + idx + out + lse == 553_648_128
    assert model.work(flash, "bwd")[1] == 2 * q + 2 * kv + idx + 2 * out + lse == 1_095_761_920
    # the L2-side gather: 1,024 bytes per key at Dk = 512, 1,152 at 576 (fp32 dKV: twice that)
    assert model.gather_scatter_bytes(flash) == (4096 * 640 * 1024, 4096 * 640 * 2048)
    assert model.gather_scatter_bytes(pro)[0] == 2 * 4096 * 1152 * 1024  # two head groups
    assert model.gather_scatter_bytes(model.Shape("x", 1, 1, 1, 64, 1))[0] == 1152


def test_v4_shape_layouts():
    flash = V4["v4flash"]
    assert flash.tokens() == 4096 and flash.compressed_topk == 512
    assert model.SHAPES["ref"].compressed_topk is None
    assert flash.dims() == ("B=1 S=4096 S_kv=5120 H=64 topk=640 Dk=512 Dv=512 (128 window + "
                            "512 of ratio 4)")
    assert model.SHAPES["ref"].dims() == "B=1 S=4096 S_kv=8192 H=64 topk=2048"  # unchanged
    # the sequence split's rank keeps the T tokens: the last S rows of the layout
    seq = {p: s for tp, p, s in model.partition_shapes(flash) if tp == 8}["seq"]
    assert (seq.S, seq.S_kv, seq.tokens()) == (512, 5120, 4096)
    for kw, match in ((dict(window=128), "window and ratio go together"),
                      (dict(window=640, ratio=4), "1 <= window < topk"),
                      (dict(window=128, ratio=1), "ratio >= 2"),
                      (dict(window=128, ratio=4, S_kv=5124), "S_kv=5124 is no T \\+ T // 4")):
        with pytest.raises(ValueError, match=match):
            model.Shape("bad", **dict(dict(B=1, S=4096, S_kv=5120, H=64, topk=640, Dk=512,
                                           Dv=512), **kw))


def test_select_shapes_takes_groups():
    assert [s.name for s in model.select_shapes("v4")] == ["v4flash", "v4pro", "v4tp8"]
    assert [s.name for s in model.select_shapes("default,v4")] == list(model.DEFAULT_SHAPES) + [
        "v4flash", "v4pro", "v4tp8"]
    assert [s.name for s in model.select_shapes("v4pro, v4 ,ref")] == ["v4pro", "v4flash",
                                                                      "v4tp8", "ref"]
    assert [s.name for s in model.select_shapes("default")] == list(model.DEFAULT_SHAPES)
    assert {"v4tiny", "tiny"} <= {s.name for s in model.select_shapes("all")}
    with pytest.raises(ValueError, match=r"unknown shape 'v5'; known: ref, .*v4tiny, default "
                                         r"\(group\), v4 \(group\), all \(group\)"):
        model.select_shapes("v5")


def test_dry_run_prints_the_v4_rows_and_what_the_gpu_skips(capsys, monkeypatch):
    from paddlefleet.tilelang_ops.attn import kernels

    monkeypatch.setattr(kernels, "D_PAIRS", ((576, 512),), raising=False)
    assert bench.main(["--dry-run", "--shapes", "v4,ref"]) == 0
    out = capsys.readouterr().out
    dims = "B=1 S=4096 S_kv=5120 H=64 topk=640 Dk=512 Dv=512 (128 window + 512 of ratio 4)"
    assert f"| v4flash | {dims} | fwd | 344 | 554 | 0.43 | 0.129 | 0.43 | compute |" in out
    assert f"| v4flash | {dims} | bwd | 859 | 1,096 | 1.09 | 0.255 | 1.09 | compute |" in out
    assert "| v4pro | B=1 S=4096 S_kv=5120 H=128 topk=1152 Dk=512 Dv=512 (128 window + 1024 " \
           "of ratio 4) | bwd | 3,092 | 2,179 | 3.91 | 0.507 | 3.91 | compute |" in out
    assert "| v4tp8 | B=1 S=4096 S_kv=5120 H=8 topk=640 Dk=512 Dv=512 (128 window + 512 of " \
           "ratio 4) | fwd | 43 | 83 | 0.05 | 0.019 | 0.05 | compute |" in out
    assert ("on the GPU, skipped: v4flash, v4pro, v4tp8: kernels for (512, 512) not built "
            "(kernels.D_PAIRS lists (576, 512))") in out.splitlines()
    monkeypatch.setattr(kernels, "D_PAIRS", ((576, 512), (512, 512)))
    assert bench.main(["--dry-run", "--shapes", "v4,ref"]) == 0
    assert "skipped" not in capsys.readouterr().out


def test_v4_input_sets_hold_the_window_compressed_layout():
    torch = pytest.importorskip("torch")
    from paddlefleet.tilelang_ops.attn.indices import window_compressed_indices

    s = V4["v4tiny"]
    sets = bench.make_input_sets(torch, s, "cpu", sets=3, seed=2)
    for k, inp in enumerate(sets):
        want = window_compressed_indices(128, window=16, ratio=4, compressed_topk=16,
                                         seed=2000 + k)
        assert inp["idx"].dtype == torch.int32 and inp["idx"].numpy().tolist() == want.tolist()
        assert inp["q"].shape == (1, 128, 16, 512) and inp["kv"].shape == (1, 160, 512)
        assert inp["dO"].shape == (1, 128, 16, 512) and inp["Dv"] == 512
    assert not torch.equal(sets[0]["idx"], sets[1]["idx"])  # each set its own compressed picks
    # a sequence split's rank: the last S rows of the same T-token layout
    rank = {p: r for tp, p, r in model.partition_shapes(s, (4,)) if p == "seq"}["seq"]
    got = bench.make_input_sets(torch, rank, "cpu", sets=3, seed=2)[0]["idx"].numpy()
    assert got.shape == (1, 32, 32)
    assert got.tolist() == window_compressed_indices(128, window=16, ratio=4,
                                                     compressed_topk=16, seed=2000)[:, 96:].tolist()


def test_cpu_standin_runs_the_v4_tiny_shape(tmp_path):
    """The reference stands in for the kernels at (512, 512): every variant runs, the rates use
    the shape's own work, the reference rows compare."""
    import dataclasses

    pytest.importorskip("torch")
    assert _standin_run(tmp_path, "--shapes", "v4tiny", "--ref-shapes", "v4tiny",
                        "--matmul-n", "0", "--copy-mb", "0") == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    rows = payload["rows"]
    assert [r["variant"] for r in rows] == list(bench.VARIANTS)
    assert all(r["status"] == "ok" and (r["Dk"], r["Dv"]) == (512, 512) for r in rows)
    s = V4["v4tiny"]
    for r in rows:
        assert r["gflop"] == pytest.approx(model.work(s, "fwd" if "fwd" in r["variant"]
                                                      else "bwd")[0] / 1e9)
    assert rows[3]["note"].startswith("fwd vs reference, rel. L2: out ")
    assert rows[4]["note"] == ("bwd_det vs reference, rel. L2: dq 0.0e+00, dkv 0.0e+00, "
                               "d_sink 0.0e+00")
    assert payload["shapes"] == [dataclasses.asdict(s)]


def _fake_gpu(monkeypatch, torch):
    """Enough of torch.cuda for bench.run to start a GPU run on a CPU machine."""
    import types

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: types.SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(harness, "gpu_state", lambda: None)


def test_gpu_run_skips_shapes_whose_kernels_are_not_built(tmp_path, monkeypatch, capsys):
    """A GPU run records each variant of a (512, 512) shape as skipped, with the reason, while
    kernels.D_PAIRS lacks the pair, and goes on; once the pair is listed it runs the shape
    (here: reaches its inputs)."""
    torch = pytest.importorskip("torch")
    from paddlefleet.tilelang_ops.attn import kernels

    _fake_gpu(monkeypatch, torch)
    monkeypatch.setattr(kernels, "D_PAIRS", ((576, 512),), raising=False)
    args = ["--shapes", "v4flash,v4tp8", "--matmul-n", "0", "--copy-mb", "0", "--no-progress",
            "--no-plot", "--out", str(tmp_path)]
    assert bench.main(args) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    why = "skipped: kernels for (512, 512) not built (kernels.D_PAIRS lists (576, 512))"
    assert [(r["shape"], r["variant"], r["status"]) for r in rows] == [
        (n, v, why) for n in ("v4flash", "v4tp8") for v in ("fwd", "bwd_atomic", "bwd_det")]
    assert f"| v4flash | 1 | 4096 | 5120 | 64 | 640 | fwd | {why} |" in capsys.readouterr().out

    def reached(*a, **k):
        raise RuntimeError("made the inputs")

    monkeypatch.setattr(kernels, "D_PAIRS", ((576, 512), (512, 512)))
    monkeypatch.setattr(bench, "make_input_sets", reached)
    with pytest.raises(RuntimeError, match="made the inputs"):
        bench.main(args)


def test_the_gpu_suite_benchmarks_and_tests_the_v4_shapes():
    """tools/run_gpu_suite.sh's default benchmark takes the default and V4 shapes and its GPU
    tests take tests/single_card_tests, where the (512, 512) tests live; memcheck_case.py
    takes Dk."""
    import re

    script = (REPO_ROOT / "tools" / "run_gpu_suite.sh").read_text(encoding="utf-8")
    default = re.search(r"BENCH_ARGS=\$\{BENCH_ARGS:-(.*?)\}\s*\\?\s*bash tools/bench/run.sh",
                        script)
    a = bench.parse_args(default.group(1).split())
    assert [s.name for s in a.shape_list] == list(model.DEFAULT_SHAPES) + list(model.V4_SHAPES)
    assert a.quick and a.budget_s == 240
    assert "--durations=25 tests/single_card_tests " in script
    assert (REPO_ROOT / "tests" / "single_card_tests" / "test_sparse_attn_v4_gpu.py").is_file()
    assert 'CASES+=("8 512" "100 512")' in script and "memcheck_case.py \"$MH\" \"$MDK\"" in script
    case = (REPO_ROOT / "tests" / "single_card_tests" / "memcheck_case.py").read_text()
    assert "DK = int(sys.argv[2]) if len(sys.argv) > 2 else 576" in case


_FORCE_CUDA = """
import sys
sys.path.insert(0, {tests!r})
import helpers
helpers.cuda_available = lambda: True  # as on a GPU host: the gpu marker does not skip
import pytest
sys.exit(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", {path!r}]))
"""


@pytest.mark.skipif(cuda_available(), reason="checks the skip where the kernels are missing")
def test_v4_gpu_tests_skip_while_the_pair_is_not_built():
    """On a GPU host whose kernels.D_PAIRS lacks (512, 512), every test of
    test_sparse_attn_v4_gpu.py skips with that reason instead of failing (CUDA faked present,
    in a fresh process: the module decides at import)."""
    pytest.importorskip("torch")
    import re
    import subprocess

    from paddlefleet.tilelang_ops.attn import tiling

    if (512, 512) in tiling.kernel_dims():
        pytest.skip("kernels.D_PAIRS lists (512, 512): the tests run, nothing to skip")
    path = REPO_ROOT / "tests" / "single_card_tests" / "test_sparse_attn_v4_gpu.py"
    res = subprocess.run([sys.executable, "-c", _FORCE_CUDA.format(
        tests=str(REPO_ROOT / "tests"), path=str(path))], capture_output=True, text=True,
        cwd=str(REPO_ROOT), timeout=600)
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    summary = out.strip().splitlines()[-1]
    # none passed, failed or errored
    assert re.fullmatch(r"\d+ skipped(, \d+ warnings?)? in .*", summary), out[-3000:]
    why = ("kernels for (Dk, Dv) = (512, 512) not built: kernels.D_PAIRS lists [(576, 512)]; "
           "these tests run once it lists (512, 512)")
    lines = [ln for ln in out.splitlines() if ln.startswith("SKIPPED [")]
    assert lines and all(ln.endswith(why) for ln in lines), out[-3000:]
    skipped = int(summary.split()[0])
    assert skipped >= 18 and sum(int(ln[9:ln.index("]")]) for ln in lines) == skipped
