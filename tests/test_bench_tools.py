"""CPU tests of the benchmark tools in ``tools/bench/`` (no timing is asserted).

The pure parts (FLOP and byte counts, floors, percentiles, shape selection, CSV/JSON/table
writers, the bars) run everywhere, including the Paddle CI environment, which has neither
PyTorch nor matplotlib.  The CPU stand-in run and the index generator need PyTorch and skip
cleanly without it; the PNG is checked only where matplotlib is installed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import cuda_available

BENCH = Path(__file__).resolve().parent.parent / "tools" / "bench"
sys.path.insert(0, str(BENCH))

import bench_sparse_mqa  # noqa: E402
import harness  # noqa: E402
import plot  # noqa: E402

REF = harness.SHAPES["ref"]
TINY = harness.SHAPES["tiny"]


# --- FLOPs, bytes, floors ------------------------------------------------------------------


def test_flop_formulas_reproduce_the_recorded_upstream_rates():
    # Measured on our H200 (TileLang 0.1.15): the upstream example at the ref shape ran fwd 3.66 ms = 319 TFLOP/s
    # and bwd 15.6 ms = 189 TFLOP/s with these very counts.
    assert harness.fwd_flops(REF) == 2 * 4096 * 64 * 2048 * (576 + 512)
    assert harness.bwd_flops(REF) == 2 * 4096 * 64 * 2048 * (512 + 3 * 576 + 512)
    assert harness.tflops(harness.fwd_flops(REF), 3.66) == pytest.approx(319, abs=0.5)
    assert harness.tflops(harness.bwd_flops(REF), 15.6) == pytest.approx(189, abs=0.5)
    # field notes: 2.95 TFLOP of backward GEMMs -> 3.7 ms at 790 TFLOP/s
    assert harness.bwd_flops(REF) / 1e12 == pytest.approx(2.95, abs=0.01)


def test_flops_scale_with_heads_and_tokens():
    s = harness.SHAPES
    assert harness.bwd_flops(s["h128"]) == 2 * harness.bwd_flops(s["ref"])
    assert harness.bwd_flops(s["ref"]) == 8 * harness.bwd_flops(s["tp8"])
    assert harness.fwd_flops(s["tp4"]) * 4 == harness.fwd_flops(s["ref"])
    # b2 has the same B*S as ref, so the same work: its time compares directly
    assert harness.fwd_flops(s["b2"]) == harness.fwd_flops(s["ref"])
    assert harness.bwd_flops(s["b2"]) == harness.bwd_flops(s["ref"])


def test_min_bytes_count_each_tensor_once():
    s = harness.Shape("x", B=2, S=3, S_kv=5, H=7, topk=11, Dk=13, Dv=4)
    q, kv, idx = 2 * 3 * 7 * 13 * 2, 2 * 5 * 13 * 2, 2 * 3 * 11 * 4
    out, lse = 2 * 3 * 7 * 4 * 2, 2 * 3 * 7 * 4
    assert harness.fwd_min_bytes(s) == q + kv + idx + out + lse
    # backward: reads q kv idx out dO lse, writes dq (= q bytes) and dkv (= kv bytes)
    assert harness.bwd_min_bytes(s) == 2 * q + 2 * kv + idx + 2 * out + lse
    assert harness.bwd_min_bytes(s, index_bytes=8) - harness.bwd_min_bytes(s) == idx


def test_floor_takes_the_larger_term_and_names_it():
    f = harness.floor(790e9, 1e6)  # 1 ms of compute, ~0.23 us of memory
    assert f["compute_ms"] == pytest.approx(1.0)
    assert f["memory_ms"] == pytest.approx(1e6 / 4.3e12 * 1e3)
    assert f["floor_ms"] == f["compute_ms"] and f["bound"] == "compute"
    g = harness.floor(1e6, 4.3e9)
    assert g["bound"] == "memory" and g["floor_ms"] == pytest.approx(1.0)
    # every default shape is compute-bound on the H200 by a wide margin
    for name in harness.DEFAULT_SHAPES:
        s = harness.SHAPES[name]
        b = harness.floor(harness.bwd_flops(s), harness.bwd_min_bytes(s))
        assert b["bound"] == "compute" and b["memory_ms"] < b["compute_ms"] / 2, name


def test_floors_table_has_two_rows_per_shape():
    shapes = [harness.SHAPES[n] for n in harness.DEFAULT_SHAPES]
    text = harness.floors_table(shapes)
    body = [ln for ln in text.splitlines()[2:]]
    assert len(body) == 2 * len(shapes)
    assert "| ref | B=1 S=4096 S_kv=8192 H=64 topk=2048 | bwd | 2,955 |" in text


def test_gather_scatter_bytes_do_not_shrink_below_one_head_group():
    g8, s8 = harness.gather_scatter_bytes(harness.SHAPES["tp8"])
    g64, s64 = harness.gather_scatter_bytes(harness.SHAPES["ref"])
    g128, _ = harness.gather_scatter_bytes(harness.SHAPES["h128"])
    assert (g8, s8) == (g64, s64) == (4096 * 2048 * 576 * 2, 4096 * 2048 * 576 * 4)
    assert g128 == 2 * g64


def test_reference_memory_estimate_grows_with_the_problem():
    est = harness.reference_mem_bytes
    assert est(harness.SHAPES["h128"]) > est(REF) > est(harness.SHAPES["tp8"]) > est(TINY)
    assert est(REF, chunk_bytes=1 << 30) > est(REF)
    # fp32 dq alone at the ref shape is 0.6 GB; the estimate must cover it
    assert est(REF) > 4 * 4096 * 64 * 576


# --- statistics ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 50])
def test_quantile_matches_numpy(n):
    rng = np.random.default_rng(n)
    v = list(rng.exponential(3.0, size=n))
    for q in (0.0, 0.2, 0.5, 0.8, 1.0):
        assert harness.quantile(v, q) == pytest.approx(float(np.quantile(v, q)), rel=1e-12)
    s = harness.summarize(v)
    assert s["ms"] == pytest.approx(float(np.median(v)))
    assert s["ms_p20"] <= s["ms"] <= s["ms_p80"] and s["ms_min"] == min(v) and s["reps"] == n


def test_quantile_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        harness.quantile([], 0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        harness.quantile([1.0], 1.5)


# --- shapes ------------------------------------------------------------------------------------


def test_select_shapes():
    assert [s.name for s in harness.select_shapes(None)] == list(harness.DEFAULT_SHAPES)
    assert "tiny" not in harness.DEFAULT_SHAPES
    assert [s.name for s in harness.select_shapes("tp8, ref,tp8")] == ["tp8", "ref"]
    assert len(harness.select_shapes("all")) == len(harness.SHAPES)
    with pytest.raises(ValueError, match="'nope'.*known: ref"):
        harness.select_shapes("ref,nope")
    with pytest.raises(ValueError, match="no shape"):
        harness.select_shapes(" , ")


def test_shape_table_is_what_the_docs_state():
    s = harness.SHAPES
    assert (REF.B, REF.S, REF.S_kv, REF.H, REF.topk, REF.Dk, REF.Dv) == (1, 4096, 8192, 64, 2048,
                                                                         576, 512)
    assert (s["fleet"].S, s["fleet"].S_kv, s["fleet"].topk) == (8192, 8192, 640)
    assert (s["tp8"].H, s["tp4"].H, s["h128"].H) == (8, 16, 128)
    assert (s["b2"].B, s["b2"].S, s["b2"].S_kv) == (2, 2048, 8192)


# --- rows, writers, bars -----------------------------------------------------------------------

META = {"gpu": "Test GPU", "torch": "9.9", "tilelang": "0.1.15", "timestamp": "T", "git": "abc"}


def _rows(det_ms=20.0, atomic_ms=15.0, fwd_ms=3.5):
    rows = []
    for variant, ms, flops in (("fwd", fwd_ms, harness.fwd_flops(REF)),
                               ("bwd_atomic", atomic_ms, harness.bwd_flops(REF)),
                               ("bwd_det", det_ms, harness.bwd_flops(REF))):
        r = harness.make_row(REF, variant, META, ms=ms, ms_p20=ms * 0.99, ms_p80=ms * 1.01,
                             ms_min=ms * 0.98, reps=20, peak_mem_mb=1234.5, repeatable=True)
        rows.append(harness.fill_rates(r, flops, 790.0))
    rows.append(harness.make_row(harness.SHAPES["tp8"], "bwd_det", META,
                                 status="error: RuntimeError: boom"))
    harness.fill_det_ratio(rows)
    return rows


def test_make_row_fills_meta_and_rejects_unknown_fields():
    r = harness.make_row(REF, "fwd", META, ms=1.0)
    assert set(r) == set(harness.CSV_FIELDS)
    assert (r["gpu"], r["shape"], r["H"], r["status"], r["tflops"]) == ("Test GPU", "ref", 64,
                                                                        "ok", None)
    with pytest.raises(ValueError, match="unknown fields"):
        harness.make_row(REF, "fwd", META, millis=1.0)


def test_rates_and_det_ratio():
    rows = _rows()
    fwd, atomic, det = rows[:3]
    assert fwd["tflops"] == pytest.approx(harness.fwd_flops(REF) / 3.5e-3 / 1e12)
    assert fwd["frac_peak"] == pytest.approx(fwd["tflops"] / 790.0)
    assert fwd["gflop"] == pytest.approx(harness.fwd_flops(REF) / 1e9)
    assert det["det_over_atomic"] == pytest.approx(20.0 / 15.0)
    assert atomic["det_over_atomic"] is None and rows[3]["det_over_atomic"] is None


@pytest.mark.parametrize("det, atomic, fwd, verdicts", [
    (20.0, 15.0, 3.5, ["PASS", "PASS", "PASS"]),   # 1.33x, 15 ms, 334 TFLOP/s
    (25.0, 15.0, 4.0, ["FAIL", "PASS", "FAIL"]),   # 1.67x, 292 TFLOP/s
    (18.0, 16.5, 3.5, ["PASS", "FAIL", "PASS"]),
])
def test_bars(det, atomic, fwd, verdicts):
    bars = harness.check_bars(_rows(det, atomic, fwd))
    assert [b["verdict"] for b in bars] == verdicts
    assert all(b["shape"] == "ref" for b in bars)
    assert [b["verdict"] for b in harness.check_bars(_rows()[3:])] == ["n/a"] * 3


def test_csv_round_trip(tmp_path):
    rows = _rows()
    path = tmp_path / "r.csv"
    harness.write_csv(rows, str(path))
    header = path.read_text().splitlines()[0].split(",")
    assert tuple(header) == harness.CSV_FIELDS
    back = harness.read_csv(str(path))
    assert len(back) == len(rows)
    for a, b in zip(rows, back):
        for k in harness.CSV_FIELDS:
            if isinstance(a[k], float):
                assert b[k] == pytest.approx(a[k], rel=1e-5), k
            else:
                assert b[k] == a[k], k


def test_json_and_markdown_via_plot(tmp_path):
    rows = _rows()
    meta = dict(META, peak_tflops=790.0)
    path = tmp_path / "results.json"
    harness.write_json({"meta": meta, "rows": rows}, str(path))
    back, meta_back = plot.load_results(str(path))
    assert back == json.loads(json.dumps(rows)) and meta_back["gpu"] == "Test GPU"
    md = plot.markdown(back, meta_back)
    table = [ln for ln in md.splitlines() if ln.startswith("| ref ") or ln.startswith("| tp8 ")]
    assert len(table) == 4
    assert "| ref | 1 | 4096 | 8192 | 64 | 2048 | bwd_det | 20.000 |" in md
    assert "1.33 |" in md and "error: RuntimeError: boom" in md
    assert "| atomic bwd <= 16 ms | 15 | PASS |" in md
    # CSV input gives the same table body
    harness.write_csv(rows, str(tmp_path / "results.csv"))
    rows_csv, _ = plot.load_results(str(tmp_path / "results.csv"))
    assert harness.markdown_table(rows_csv) == harness.markdown_table(back)


def test_text_table():
    rows = _rows()
    bars = harness.check_bars(rows)
    text = harness.format_table(rows, dict(META, peak_tflops=790.0), bars)
    lines = text.splitlines()
    assert lines[0].startswith("GPU Test GPU | torch 9.9 | tilelang 0.1.15")
    assert any(ln.startswith("ref ") and "bwd_det" in ln and "20.000" in ln and "1.33" in ln
               for ln in lines)
    assert any("tp8" in ln and "error: RuntimeError: boom" in ln for ln in lines)
    assert lines[-1] == f"bar [ref] fwd >= 300 TFLOP/s: {rows[0]['tflops']:.3g} PASS"
    assert all(len(ln) <= 120 for ln in lines)


# --- the runner ------------------------------------------------------------------------------


def test_parse_args_defaults_and_errors(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    a = bench_sparse_mqa.parse_args([])
    assert (a.reps, a.warmup, a.sets, a.ref_reps) == (50, 5, 3, 3)
    assert a.reps >= 20 and a.out == str(BENCH / "results")
    assert a.ref_shape_names == {"tiny", "tp8", "ref"}
    q = bench_sparse_mqa.parse_args(["--quick", "--no-ref"])
    assert q.reps >= 20 and q.warmup < a.warmup and not set(q.variant_list) & {"ref_fwd",
                                                                               "ref_bwd"}
    monkeypatch.setenv("OUT", "/somewhere")
    assert bench_sparse_mqa.parse_args([]).out == "/somewhere"
    for bad in (["--sets", "2"], ["--variants", "fwd,bogus"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            bench_sparse_mqa.parse_args(bad)


@pytest.mark.parametrize("args, message", [
    (["--shapes", "nosuch"], "error: --shapes: unknown shape 'nosuch'; known: "),
    (["--shapes", " , "], "error: --shapes: no shape named in ' , '"),
    (["--ref-shapes", "nosuch"], "error: --ref-shapes: unknown shape 'nosuch'"),
])
def test_unknown_shape_is_a_usage_error(capsys, args, message):
    """A usage error (exit 2, one error line), not a ValueError traceback."""
    with pytest.raises(SystemExit) as e:
        bench_sparse_mqa.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and message in errors[0], err


def test_cpu_standin_defaults_to_the_tiny_shape(monkeypatch):
    """Without --shapes the stand-in would run the H200 shapes on CPU for minutes."""
    monkeypatch.delenv("OUT", raising=False)
    assert [s.name for s in bench_sparse_mqa.parse_args(["--cpu-standin", "--quick"]).shape_list] \
        == ["tiny"]
    assert [s.name for s in bench_sparse_mqa.parse_args(
        ["--cpu-standin", "--shapes", "tiny,tp8"]).shape_list] == ["tiny", "tp8"]
    assert [s.name for s in bench_sparse_mqa.parse_args([]).shape_list] \
        == list(harness.DEFAULT_SHAPES)


def test_dry_run_needs_no_torch(capsys):
    assert bench_sparse_mqa.main(["--dry-run", "--shapes", "tiny,ref"]) == 0
    out = capsys.readouterr().out
    assert "ref    B=1 S=4096 S_kv=8192 H=64 topk=2048" in out
    assert "fwd  1.168 TFLOP" in out and "bwd  2.955 TFLOP" in out


def test_causal_indices_on_device_keep_the_causal_semantics():
    torch = pytest.importorskip("torch")
    s = harness.Shape("t", B=2, S=40, S_kv=48, H=1, topk=16)
    g = torch.Generator().manual_seed(3)
    idx = bench_sparse_mqa.causal_topk_indices_torch(torch, s, g, "cpu", row_chunk=7)
    assert idx.shape == (2, 40, 16) and idx.dtype == torch.int32
    for b in range(2):
        for r in range(40):
            pos = s.S_kv - s.S + r
            row = idx[b, r].tolist()
            n_valid = min(16, pos + 1)
            valid = row[:n_valid]
            assert row[n_valid:] == [-1] * (16 - n_valid), (b, r)  # -1 padding at the end
            assert len(set(valid)) == n_valid and all(0 <= k <= pos for k in valid), (b, r)
    # random, not the first keys in order
    assert idx[0, -1].tolist() != list(range(16)) and idx[0, -1].tolist() != idx[1, -1].tolist()


def test_cpu_standin_run_writes_every_output(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "bench"
    rc = bench_sparse_mqa.main(["--cpu-standin", "--shapes", "tiny", "--reps", "3",
                                "--warmup", "1", "--ref-reps", "1", "--no-progress",
                                "--out", str(out)])
    assert rc == 0
    payload = json.loads((out / "results.json").read_text())
    rows = payload["rows"]
    assert [r["variant"] for r in rows] == ["matmul_fp32", "copy", "fwd", "bwd_atomic",
                                            "bwd_det", "ref_fwd", "ref_bwd"]
    assert all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]
    for r in rows:
        assert r["reps"] == (1 if r["variant"].startswith("ref") else 3)
        assert r["ms_p20"] <= r["ms"] <= r["ms_p80"]
        assert (r["tflops"] is None) == (r["variant"] == "copy")
        assert (r["tbs"] is None) == r["variant"].startswith("matmul")
    meta = payload["meta"]
    assert meta["peak_tflops"] == rows[0]["tflops"] and meta["copy_tbs"] == rows[1]["tbs"]
    for r in rows[2:]:
        assert r["x_floor"] == pytest.approx(r["ms"] / r["floor_ms"]) and r["x_floor"] > 0
        assert r["frac_peak"] == pytest.approx(r["tflops"] / meta["peak_tflops"])
    det = next(r for r in rows if r["variant"] == "bwd_det")
    atomic = next(r for r in rows if r["variant"] == "bwd_atomic")
    assert det["det_over_atomic"] == pytest.approx(det["ms"] / atomic["ms"])
    assert det["repeatable"] is True
    assert payload["meta"]["cpu_standin"] is True and payload["bars"][0]["verdict"] == "n/a"
    assert len(harness.read_csv(str(out / "results.csv"))) == len(rows)
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith((out / "table.txt").read_text().rstrip())
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert (out / "time_per_shape.png").exists() == has_mpl
    if has_mpl:
        assert (out / "time_per_shape.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_variant_that_fails_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    real = bench_sparse_mqa.load_functions

    def broken(*args, **kwargs):
        fns, skipped = real(*args, **kwargs)

        def boom(inp):
            raise RuntimeError("kernel exploded")

        fns["bwd_atomic"] = boom
        skipped["ref_fwd"] = "not importable (test)"
        fns.pop("ref_fwd", None)
        return fns, skipped

    monkeypatch.setattr(bench_sparse_mqa, "load_functions", broken)
    out = tmp_path / "b"
    rc = bench_sparse_mqa.main(["--cpu-standin", "--shapes", "tiny", "--reps", "2", "--warmup",
                                "0", "--ref-reps", "1", "--no-progress", "--no-plot",
                                "--matmul-n", "0", "--copy-mb", "0", "--out", str(out)])
    assert rc == 0
    rows = {r["variant"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert rows["bwd_atomic"]["status"] == "error: RuntimeError: kernel exploded"
    assert rows["ref_fwd"]["status"] == "skipped: not importable"
    assert rows["bwd_det"]["status"] == "ok" and rows["ref_bwd"]["status"] == "ok"
    assert rows["bwd_det"]["det_over_atomic"] is None
    assert rows["fwd"]["frac_peak"] is not None and not math.isnan(rows["fwd"]["frac_peak"])


def test_gpu_path_binds_the_interface_signatures():
    """Without a GPU, our wrappers must get as far as their device check: that proves the
    benchmark calls them with arguments in the agreed order and keywords."""
    torch = pytest.importorskip("torch")
    msgs = []
    fns, skipped = bench_sparse_mqa.load_functions(torch, bench_sparse_mqa.VARIANTS, False,
                                                   msgs.append, check_indices=False)
    if "fwd" in skipped:
        pytest.skip(f"interface not importable here: {skipped['fwd']}")
    assert set(fns) >= {"fwd", "bwd_det", "bwd_atomic"} and msgs == []
    s = TINY
    inp = bench_sparse_mqa.make_input_sets(
        torch, s, bench_sparse_mqa.parse_args(["--shapes", "tiny"]), "cpu")[0]
    inp["out"] = torch.zeros((s.B, s.S, s.H, s.Dv), dtype=torch.bfloat16)
    inp["lse"] = torch.zeros((s.B, s.S, s.H), dtype=torch.float32)
    for v in ("fwd", "bwd_det", "bwd_atomic"):
        with pytest.raises(ValueError, match="(?i)cuda"):
            fns[v](inp)


def test_performance_doc_floors_and_results_block_are_current(tmp_path):
    doc = BENCH.parent.parent / "docs" / "performance.md"
    text = doc.read_text(encoding="utf-8")
    shapes = [harness.SHAPES[n] for n in harness.DEFAULT_SHAPES]
    assert harness.floors_table(shapes) in text  # regenerate the doc's table if this fails
    copy = tmp_path / "performance.md"
    copy.write_text(text, encoding="utf-8")
    rows = _rows()
    plot.update_doc(str(copy), plot.markdown(rows, dict(META, peak_tflops=790.0)))
    new = copy.read_text(encoding="utf-8")
    assert "Placeholder: no GPU run recorded yet" not in new
    assert "| ref | 1 | 4096 | 8192 | 64 | 2048 | bwd_det | 20.000 |" in new
    head, tail = text.split(plot.BEGIN_MARK)[0], text.split(plot.END_MARK)[1]
    assert new.startswith(head) and new.endswith(tail)
    plot.update_doc(str(copy), "again")  # the markers survive an update
    assert plot.BEGIN_MARK + "\nagain\n" + plot.END_MARK in copy.read_text(encoding="utf-8")
    bad = tmp_path / "bad.md"
    bad.write_text("no markers", encoding="utf-8")
    with pytest.raises(ValueError, match="markers"):
        plot.update_doc(str(bad), "x")


def test_fill_rates_floor_and_bandwidth():
    r = harness.make_row(REF, "bwd_det", META, ms=7.48)
    harness.fill_rates(r, harness.bwd_flops(REF), 790.0, harness.bwd_min_bytes(REF), 4.3)
    assert r["floor_ms"] == pytest.approx(harness.bwd_flops(REF) / 790e12 * 1e3)
    assert r["x_floor"] == pytest.approx(7.48 / r["floor_ms"]) and 1.9 < r["x_floor"] < 2.1
    assert r["tbs"] == pytest.approx(harness.bwd_min_bytes(REF) / 7.48e-3 / 1e12)
    untimed = harness.fill_rates(harness.make_row(REF, "fwd", META), 1e12, 790.0, 1e9, 4.3)
    assert all(untimed[k] is None for k in ("tflops", "tbs", "floor_ms", "x_floor"))


def test_gpu_code_path_end_to_end_through_the_interface_on_cpu(monkeypatch):
    """The benchmark's non-stand-in path (our wrappers, out/lse from our forward, repeat check)
    with the interface's CPU stand-in provider in place of the TileLang kernels."""
    torch = pytest.importorskip("torch")
    try:
        from paddlefleet.tilelang_ops.attn import interface
        from helpers import CpuStandIn
    except Exception as e:  # noqa: BLE001 - interface or its stand-in not there (yet)
        pytest.skip(f"interface stand-in unavailable: {type(e).__name__}: {e}")
    monkeypatch.setattr(interface, "_DEFAULT_PROVIDER", CpuStandIn())
    a = bench_sparse_mqa.parse_args(["--shapes", "tiny", "--no-check-indices"])
    fns, skipped = bench_sparse_mqa.load_functions(torch, ["bwd_det", "bwd_atomic"], False,
                                                   print, check_indices=False)
    assert not skipped and set(fns) == {"fwd", "bwd_det", "bwd_atomic"}  # fwd: for out/lse
    sets = bench_sparse_mqa.make_input_sets(torch, TINY, a, "cpu")
    bench_sparse_mqa.add_out_lse(torch, sets, fns["fwd"])
    assert sets[0]["out"].dtype == torch.bfloat16 and sets[0]["lse"].dtype == torch.float32
    be = bench_sparse_mqa.Backend(torch, cpu=True)
    for v in ("bwd_det", "bwd_atomic"):
        res = bench_sparse_mqa.time_variant(be, fns[v], [(i,) for i in sets], warmup=0, reps=2,
                                            check_repeat=True)
        assert res["reps"] == 2 and res["note"] is None, v  # finite outputs
        if v == "bwd_det":
            assert res["repeatable"] is True
    # what the benchmark times is the backward of these inputs (fp32 reference, rel. L2)
    from paddlefleet.tilelang_ops.attn.reference import mqa_latent_sparse_bwd_ref

    i = sets[1]
    dq, dkv, d_sink = fns["bwd_det"](i)
    rq, rkv, rs = mqa_latent_sparse_bwd_ref(i["q"], i["kv"], i["out"], i["dO"], i["lse"],
                                            i["sink"], i["idx"], i["sm_scale"])
    for x, r in ((dq, rq), (dkv, rkv), (d_sink, rs)):
        err = (x.float() - r).norm() / r.norm()
        assert err < 1e-2, float(err)


# --- tools/kernel_timing.py ------------------------------------------------------------------


@pytest.mark.skipif(cuda_available(), reason="checks the message printed where there is no CUDA")
@pytest.mark.parametrize("args, message", [
    ([], "needs "),  # PyTorch with CUDA / a CUDA device, whichever is missing here
    (["--heads", "0"], "argument --heads: expected an int >= 1, got 0"),
])
def test_kernel_timing_without_cuda_is_a_usage_error(args, message):
    import subprocess

    res = subprocess.run([sys.executable, str(BENCH.parent / "kernel_timing.py"), *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    errors = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and message in errors[0], res.stderr
