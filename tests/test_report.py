"""Reports (tuner/report/: command, benchmark, results, pages): CSV schema and arithmetic, end-to-end CPU (interpreter) run,
re-rendering, comparison mode, CSVs from elsewhere, the implementation registry and the HTML in
headless Chromium."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tsdecode.config import tables
from tsdecode.config.space import KernelConfig, fit_config
from tsdecode.config.tables import TableEntry
from tsdecode.device import INTERPRETER, device_properties
from tuner import measure
from tuner import report as R
from tuner.report import benchmark as B
from tuner.report import html as H
from tuner.report import impls as I
from tuner.report import pages as P
from tuner.report import results as Res
from tuner.grids import PRESETS, ShapeSpec
from tuner.table_writer import merge_entries, table_path

ROOT = Path(__file__).resolve().parent.parent

# Two of the smoke preset's shapes: the table below has an entry for the B=3 one only.
FILTER = "^B1_L40_|^B3_L130_"
TABLE_SPEC = ShapeSpec(3, 130, num_qo_heads=4, num_kv_heads=2, head_dim=64)
TABLE_CONFIG = KernelConfig(block_n=16, block_m=2, num_kv_splits=2, num_warps=2, num_stages=1)

needs_cpu_kernels = pytest.mark.skipif(
    not INTERPRETER, reason="CPU runs need TRITON_INTERPRET=1 set before triton is imported"
)


def write_cpu_table() -> Path:
    """The CPU's table in the user cache folder, with an entry for TABLE_SPEC's bucket only."""
    shape = TABLE_SPEC.to_problem_shape()
    entry = TableEntry(TABLE_CONFIG, 10.0, 1.0, None, TABLE_CONFIG, 10.0, 1.0, tuned_batch_size=3)
    path = table_path(device_properties("cpu"))
    merge_entries(path, device_properties("cpu"),
                  {tables.problem_class_key(shape): {tables.bucket_of(3, 130): entry}}, {})
    return path


@pytest.fixture(autouse=True)
def _own_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(tables.CONFIG_DIR_ENV, raising=False)
    tables.clear_cache()


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One end-to-end report over two tiny smoke shapes, on the CPU through the interpreter, with
    a tuned table (in a user cache folder of its own) for one of them."""
    if not INTERPRETER:
        pytest.skip("CPU runs need TRITON_INTERPRET=1 set before triton is imported")
    out = tmp_path_factory.mktemp("report")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    mp.delenv(tables.CONFIG_DIR_ENV, raising=False)
    mp.setattr(tables, "shipped_config_dir", lambda: None)
    tables.clear_cache()
    try:
        path = write_cpu_table()
        code = R.main(["--preset", "smoke", "--filter", FILTER, "--device", "cpu", "--out", str(out),
                       "--check-requests", "8"])
    finally:
        mp.undo()
        tables.clear_cache()
    return code, out, path


def load(out):
    with open(out / "results.csv", newline="") as f:
        header = next(csv.reader(f))
    return header, Res.read_csv(out / "results.csv")


def close(a, b, rel=1e-6):
    return math.isclose(a, b, rel_tol=rel)


# ---------------------------------------------------------------------------------------------
# End to end on CPU


def test_report_runs_and_writes_outputs(smoke_run):
    code, out, _ = smoke_run
    assert code == 0
    assert (out / "results.csv").stat().st_size > 0
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "TIMINGS ARE MEANINGLESS" in page
    assert page.count("<svg") >= 4  # bandwidth, % copy, tuned heatmap, latency (one family)
    assert '<table class="data sortable">' in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # no network needed
    assert "https://" not in page


def test_csv_schema(smoke_run):
    _, out, _ = smoke_run
    header, rows = load(out)
    for col in ("shape", *Res.SPEC_FIELDS, "impl", "status", "time_us_median", "time_us_min",
                "time_us_max", "bytes_moved", "bandwidth_gbs", "fraction_of_copy", "copy_bandwidth_gbs",
                "speedup_vs_heuristic", "speedup_vs_torch_sdpa", "speedup_vs_flex_attention",
                "speedup_vs_flashinfer", "rel_error", "config", "config_source", "timing_method",
                "device", "sm_count", "compute_capability", "torch_version", "triton_version", "date"):
        assert col in header, col
    assert len(header) == len(set(header))
    shapes = {r["shape"] for r in rows}
    assert shapes == {s.name for s in PRESETS["smoke"] if re.search(FILTER, s.name)}
    assert len(shapes) == 2
    for r in rows:
        assert r["timing_method"] == Res.INTERPRETER
        assert "MEANINGLESS" in r["timing_note"]
        assert r["status"] in ("ok", "skipped", "failed")
        assert r["status"] != "failed", (r["impl"], r["reason"])
        assert Res.spec_of(r).name == r["shape"]


def test_csv_numbers_consistent(smoke_run):
    _, out, _ = smoke_run
    _, rows = load(out)
    by = {(r["shape"], r["impl"]): r for r in rows}
    for r in rows:
        spec = Res.spec_of(r)
        assert r["bytes_moved"] == measure.bytes_moved(spec)  # fixed lengths, SQ=1
        if r["status"] != "ok":
            assert r["time_us_median"] is None and r["reason"]
            continue
        t = r["time_us_median"]
        assert r["time_us_min"] <= t <= r["time_us_max"]
        assert close(r["bandwidth_gbs"], r["bytes_moved"] / (t * 1e-6) / 1e9)
        assert close(r["fraction_of_copy"], r["bandwidth_gbs"] / r["copy_bandwidth_gbs"])
        for other in ("heuristic", "torch_sdpa", "flex_attention"):
            o = by.get((r["shape"], other))
            if o and o["status"] == "ok":
                assert close(r[f"speedup_vs_{other}"], o["time_us_median"] / t)
            else:
                assert r[f"speedup_vs_{other}"] is None
        if r["impl"] in ("heuristic", "torch_sdpa", "flex_attention"):
            assert close(r[f"speedup_vs_{r['impl']}"], 1.0)
        assert r["checked_requests"] == spec.batch_size  # --check-requests 8 covers all
        if r["impl_kind"] == "tsdecode":
            assert r["rel_error"] <= measure.tolerance(spec) and r["error_ok"]
    assert len({r["copy_bandwidth_gbs"] for r in rows}) == 1  # measured once per run


def test_tuned_rows_only_where_a_table_entry_exists(smoke_run):
    _, out, path = smoke_run
    _, rows = load(out)
    for shape in {r["shape"] for r in rows}:
        spec = ShapeSpec(**{f: next(r for r in rows if r["shape"] == shape)[f] for f in Res.SPEC_FIELDS})
        impls = {r["impl"]: r for r in rows if r["shape"] == shape}
        heur = impls["heuristic"]
        assert heur["config_source"] == "heuristic"
        assert KernelConfig.from_dict(json.loads(heur["config"])).validate() is None
        if spec == TABLE_SPEC:
            tuned = impls["tuned"]
            assert tuned["status"] == "ok" and tuned["config_source"] == "table"
            assert json.loads(tuned["config"]) == fit_config(TABLE_CONFIG, spec.to_problem_shape())[0].to_dict()
            assert str(path) in tuned["config_note"]
            assert close(tuned["speedup_vs_heuristic"], heur["time_us_median"] / tuned["time_us_median"])
        else:
            assert "tuned" not in impls  # no separate row: it would be the heuristic again
            assert "no tuned table entry" in heur["config_note"]


def test_a_cpu_report_describes_the_cpu(smoke_run):
    """Finding 2: rows and page name this machine's CPU and its cores, never an H200's SMs."""
    _, out, _ = smoke_run
    _, rows = load(out)
    assert {(r["device"], r["sm_count"], r["compute_capability"]) for r in rows} == {
        ("cpu (Triton interpreter)", os.cpu_count(), "0.0")}
    page = (out / "report.html").read_text(encoding="utf-8")
    assert f"&#x27;cpu (Triton interpreter)&#x27; ({os.cpu_count()} CPU cores)" in page
    assert "SMs" not in page and "H200" not in page


def test_report_names_config_fields(smoke_run):
    """Finding 8: the page shows configs by KernelConfig's field names, as the tuner prints them."""
    _, out, _ = smoke_run
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "block_n=16 block_m=2 num_kv_splits=2 num_warps=2 num_stages=1" in page  # the tuned row
    assert not re.search(r">n\d+ m\d+ ", page)


@needs_cpu_kernels
def test_report_without_out_writes_under_the_user_cache(tmp_path, monkeypatch, capsys):
    """Finding 4: ``tsdecode-tune report`` run from a checkout writes nothing into it."""
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    from tuner.cli import main

    assert main(["report", "--preset", "smoke", "--filter", "^B1_L40_", "--impls", "heuristic"]) == 0
    printed = capsys.readouterr().out
    root = tables.user_tables_dir().parent / "reports" / "cpu-triton-interpreter"
    (folder,) = root.iterdir()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d{6}Z", folder.name)
    assert sorted(p.name for p in folder.iterdir()) == ["report.html", "results.csv"]
    assert f"wrote {folder / 'results.csv'} and {folder / 'report.html'}" in printed
    assert list(cwd.iterdir()) == []
    assert main(["report", "--compare", str(folder / "results.csv"), str(folder / "results.csv")]) == 0
    (compare,) = (root.parent / "compare").iterdir()
    assert f"wrote {compare / 'compare.html'}" in capsys.readouterr().out and list(cwd.iterdir()) == []


@pytest.mark.parametrize("flag", ["--check-requests", "--cpu-repeats"])
def test_report_counts_below_1_exit_2_naming_the_flag(flag, tmp_path, capsys):
    from tuner.cli import main

    out = tmp_path / "out"
    for run in (R.main, lambda argv: main(["report", *argv])):
        assert run(["--preset", "smoke", "--device", "cpu", "--out", str(out), flag, "0"]) == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: expected an integer >= 1, got '0'" in err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_peers_skip_with_reason(smoke_run):
    _, out, _ = smoke_run
    _, rows = load(out)
    fi = [r for r in rows if r["impl"] in ("flashinfer", "flashinfer_tc")]
    assert len(fi) == 4
    for r in fi:
        assert r["status"] == "skipped" and r["reason"]
        assert r["impl_kind"] == "peer"
    flex = [r for r in rows if r["impl"] == "flex_attention"]
    assert all(r["status"] == "ok" and r["error_ok"] for r in flex), [r["reason"] for r in flex]


def test_from_csv_roundtrip_and_rerender(smoke_run, tmp_path):
    _, out, _ = smoke_run
    rows = Res.read_csv(out / "results.csv")
    Res.write_csv(rows, tmp_path / "again.csv")
    assert Res.read_csv(tmp_path / "again.csv") == rows
    assert R.main(["--from-csv", str(out / "results.csv"), "--out", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    for shape in {r["shape"] for r in rows}:
        assert shape in page
    assert "TIMINGS ARE MEANINGLESS" in page


def test_results_csv_is_never_left_partial(smoke_run, tmp_path):
    """The benchmark rewrites results.csv after every shape: a write that dies half-way must
    leave the previous file whole (and no temporary file behind)."""
    _, out, _ = smoke_run
    rows = Res.read_csv(out / "results.csv")
    path = tmp_path / "results.csv"
    Res.write_csv(rows, path)
    before = path.read_bytes()

    class Unprintable:
        def __str__(self):
            raise RuntimeError("killed mid-write")

    broken = [dict(r) for r in rows]
    broken[-1]["reason"] = Unprintable()
    with pytest.raises(RuntimeError, match="killed mid-write"):
        Res.write_csv(broken, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv"]


def test_compare_mode(smoke_run, tmp_path):
    _, out, _ = smoke_run
    rows = Res.read_csv(out / "results.csv")
    faster = []
    for r in rows:  # "B": every time halved, bandwidth doubled
        r = dict(r)
        if r["status"] == "ok":
            for k in ("time_us_median", "time_us_min", "time_us_max"):
                r[k] /= 2
            r["bandwidth_gbs"] *= 2
            r["fraction_of_copy"] *= 2
        faster.append(r)
    b = tmp_path / "b" / "results.csv"
    b.parent.mkdir()
    Res.write_csv(faster, b)
    assert R.main(["--compare", str(out / "results.csv"), str(b), "--out", str(tmp_path / "cmp")]) == 0
    page = (tmp_path / "cmp" / "compare.html").read_text(encoding="utf-8")
    assert "2.00×" in page
    assert page.count("<svg") >= 3  # side-by-side bandwidth (2) + ratio heatmap
    assert "matching shapes (0 only in A, 0 only in B)" in page


@needs_cpu_kernels
def test_failed_shape_is_recorded_and_the_report_goes_on(tmp_path, monkeypatch):
    real = measure.make_inputs

    def make_inputs(spec, *args, **kwargs):
        if spec.batch_size == 3:
            raise MemoryError("pretend the pool does not fit")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(measure, "make_inputs", make_inputs)
    code = R.main(["--preset", "smoke", "--filter", "_L40_", "--device", "cpu", "--out", str(tmp_path),
                   "--impls", "heuristic,torch_sdpa"])
    assert code == 1  # a tsdecode row failed
    rows = Res.read_csv(tmp_path / "results.csv")
    status = {(r["batch_size"], r["impl"]): r["status"] for r in rows}
    assert status == {(1, "heuristic"): "ok", (1, "torch_sdpa"): "ok",
                      (3, "heuristic"): "failed", (3, "torch_sdpa"): "failed"}
    assert all("MemoryError" in r["reason"] for r in rows if r["status"] == "failed")
    assert "pretend the pool does not fit" in (tmp_path / "report.html").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# CSVs from elsewhere (--from-csv / --compare)


def _report_rows() -> list[dict]:
    """Two shapes x (heuristic, torch_sdpa), as a report run writes them (values invented)."""
    rows = []
    for b, t in ((1, 100.0), (3, 150.0)):
        spec = ShapeSpec(b, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
        for impl, kind, scale in (("heuristic", "tsdecode", 1.0), ("torch_sdpa", "baseline", 2.0)):
            us = t * scale
            rows.append({
                "shape": spec.name, **spec.to_dict(), "impl": impl, "impl_kind": kind,
                "status": "ok", "timing_method": "cuda_graph", "copies": 1, "replays": 9,
                "time_us_median": us, "time_us_min": 0.9 * us, "time_us_max": 1.1 * us,
                "sm_clock_mhz": 1980.0 - b, "bytes_moved": 10**6, "bandwidth_gbs": 1e6 / us / 1e3,
                "copy_bandwidth_gbs": 40.0,
                "fraction_of_copy": 1e6 / us / 1e3 / 40.0, "rel_error": 1e-3, "tolerance": 2e-2,
                "error_ok": True, "checked_requests": b, "device": "Test GPU", "sm_count": 132,
                "compute_capability": "9.0",
            })
    return rows


def _write_report_csv(path: Path, rows: list[dict], drop=()) -> Path:
    cols = [c for c in Res.columns_for(rows) if c not in drop]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in rows:
            w.writerow([Res._csv_value(r.get(c)) for c in cols])
    return path


def _report(argv, capsys) -> tuple[int, str]:
    code = R.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize("change, code, message", [
    ({}, 0, ""),
    ({"rel_error": 0.5}, 1, "rel_error 5.00e-01 above 2e-02"),
    ({"rel_error": None}, 0, ""),  # not checked: unknown, no problem
    ({"status": "failed", "reason": None, "time_us_median": None}, 1, "failed (no reason recorded)"),
], ids=["ok", "above_tolerance", "not_checked", "failed"])
def test_report_from_csv_without_error_ok_derives_it(change, code, message, tmp_path, capsys):
    rows = _report_rows()
    rows[0].update(change)
    for drop in ((), ("error_ok",)):  # an empty cell or no column: the same answer
        if not drop:
            rows[0]["error_ok"] = None
        path = _write_report_csv(tmp_path / "results.csv", rows, drop)
        got, err = _report(["--from-csv", str(path), "--out", str(tmp_path / "out")], capsys)
        assert got == code, err
        assert (message in err) if message else "tsdecode problem" not in err
        assert err.count("tsdecode problem") == (1 if message else 0)


def test_a_derived_error_ok_accepts_an_error_equal_to_the_tolerance(tmp_path):
    """A rel_error exactly at the tolerance passes, as the benchmark's own check (<=) has it: a
    strict comparison would fail a row that the run accepted."""
    rows = _report_rows()
    for r in rows:
        r.update(rel_error=0.02, tolerance=0.02, error_ok=None)
    for drop in ((), ("error_ok",)):  # an empty cell or no column
        read = Res.read_csv(_write_report_csv(tmp_path / "results.csv", rows, drop))
        assert all(r["rel_error"] == r["tolerance"] == 0.02 for r in read)  # equal after the round trip
        assert [r["error_ok"] for r in read] == [True] * len(rows)


def test_report_csv_without_required_columns_exits_2_naming_them(tmp_path, capsys):
    good = _write_report_csv(tmp_path / "good.csv", _report_rows())
    bad = _write_report_csv(tmp_path / "bad.csv", _report_rows(),
                            drop=("kv_len", "fraction_of_copy", "time_us_min", "copy_bandwidth_gbs"))
    for argv in (["--from-csv", str(bad)], ["--compare", str(good), str(bad)]):
        code, err = _report([*argv, "--out", str(tmp_path / "out")], capsys)
        assert code == 2
        assert f"{bad}: not a report CSV (missing column(s) ['kv_len', 'time_us_min', " \
               "'copy_bandwidth_gbs', 'fraction_of_copy'])" in err
    rows = _report_rows()
    rows[1]["batch_size"] = "8.0"
    code, err = _report(["--from-csv", str(_write_report_csv(tmp_path / "int.csv", rows))], capsys)
    assert code == 2 and "int.csv, line 3: column batch_size: expected an integer, got '8.0'" in err


def _damaged(kind: str, path: Path) -> Path:
    """A report CSV damaged in one way (from ``_report_rows``)."""
    rows = _report_rows()
    if kind == "cut short":  # the last row cut inside time_us_median: 199 for 199.5
        text = _write_report_csv(path, rows).read_text()
        rows[-1]["time_us_median"] = 199.5
        line = _write_report_csv(path, rows).read_text().splitlines()[-1]
        path.write_text(text.rsplit("\n", 2)[0] + "\n" + line[:line.index(",199.5") + 4] + "\n")
        return path
    if kind == "status":
        rows[1]["status"] = "weird"
    elif kind == "impl_kind":
        rows[1]["impl_kind"] = "alien"
    elif kind == "underscore":
        rows[1]["batch_size"] = "1_0"
    elif kind == "spaces":
        rows[1]["kv_len"] = " 40 "
    elif kind == "shape name":
        rows[1]["head_dim"] = 128
    elif kind == "twice":
        rows.append(dict(rows[0]))
    elif kind == "unclosed quote":
        rows[-1]["reason"] = '"' + "x" * 140_000
    _write_report_csv(path, rows)
    if kind == "unclosed quote":
        path.write_text(path.read_text().replace('"""' + "x", '"' + "x"))
    return path


@pytest.mark.parametrize("kind, message", [
    ("cut short", "line 5: fewer cells than columns (a file cut short?)"),
    ("status", "line 3: column status: expected one of ['ok', 'skipped', 'failed'], got 'weird'"),
    ("impl_kind", "line 3: column impl_kind: expected one of ['tsdecode', 'baseline', 'peer'], got 'alien'"),
    ("underscore", "line 3: column batch_size: expected an integer, got '1_0'"),
    ("spaces", "line 3: column kv_len: expected an integer, got ' 40 '"),
    ("shape name", "line 3: the shape cell 'B1_L40_H4x2_D64_P16_bfloat16' disagrees with the row's fields"),
    ("twice", "line 6: B1_L40_H4x2_D64_P16_bfloat16 heuristic again (first on line 2)"),
    ("unclosed quote", "not a report CSV (field larger than field limit"),
])
def test_a_damaged_report_csv_exits_2_naming_the_line(kind, message, tmp_path, capsys):
    """A CSV that a report run did not write whole is refused, never drawn with wrong numbers."""
    path = _damaged(kind, tmp_path / "results.csv")
    code, err = _report(["--from-csv", str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and message in err, err
    assert not (tmp_path / "out" / "report.html").exists()


def test_a_report_csv_with_a_byte_order_mark_is_read(tmp_path, capsys):
    """Spreadsheets save UTF-8 CSVs with a BOM; the first column is still 'shape'."""
    path = _write_report_csv(tmp_path / "results.csv", _report_rows())
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert [r["shape"] for r in Res.read_csv(path)] == [r["shape"] for r in _report_rows()]
    assert _report(["--from-csv", str(path), "--out", str(tmp_path / "out")], capsys)[0] == 0


@pytest.mark.parametrize("argv, message", [
    (["--filter", "("], "argument --filter: not a regular expression"),
    (["--preset", "smoke", "--impls", ","], "--impls ',' names no implementation"),
    (["--preset", "smoke", "--impls", ""], "--impls '' names no implementation"),
    (["--preset", "smoke", "--impls", "heuristic,nope"], "unknown implementation(s) ['nope']"),
    (["--preset", "smoke", "--device", "tpu"], "--device tpu: expected cuda, cuda:N or cpu"),
    (["--from-csv", "A", "--compare", "A", "B"], "--compare and --from-csv: give one of them"),
    (["--from-csv", "A", "--preset", "smoke"], "--from-csv re-renders existing results: --preset would be ignored"),
    # past torch.manual_seed's int64: was every shape's setup failing ("Overflow when unpacking long long")
    (["--preset", "smoke", "--seed", str(2**64)], "argument --seed: expected an integer <= 9223372036854775807"),
])
def test_report_flags_that_cannot_work_exit_2_in_one_line(argv, message, tmp_path, capsys):
    code, err = _report([*argv, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_report_on_cuda_without_a_gpu_exits_2(tmp_path, capsys):
    code, err = _report(["--preset", "smoke", "--device", "cuda", "--out", str(tmp_path)], capsys)
    assert code == 2 and "--device cuda: torch finds no CUDA GPU here" in err, err


def test_report_rows_with_unusable_numbers_are_left_out_of_plots(tmp_path, capsys):
    rows = _report_rows()
    rows[0].update(time_us_median=float("nan"))
    rows[1].update(time_us_median=-5.0)
    rows[2].update(time_us_median=float("inf"), time_us_min=None)
    rows[3].update(bandwidth_gbs=None, fraction_of_copy=float("nan"), time_us_min=None)
    for r in rows:
        r["copy_bandwidth_gbs"] = None
    path = _write_report_csv(tmp_path / "results.csv", rows)
    good = _write_report_csv(tmp_path / "good.csv", _report_rows())
    code, _ = _report(["--from-csv", str(path), "--out", str(tmp_path / "a")], capsys)
    assert code == 0
    page = (tmp_path / "a" / "report.html").read_text()
    assert not re.search(r'\s[a-z0-9]+="[^"]*\b(nan|inf)\b', page)  # no SVG coordinate nan/inf
    assert "not plotted on 1 shape(s): time_us_median nan is not a positive finite number" in page
    assert "time_us_median -5.0 is not a positive finite number" in page
    code, _ = _report(["--compare", str(good), str(path), "--out", str(tmp_path / "c")], capsys)
    assert code == 0
    assert not re.search(r'\s[a-z0-9]+="[^"]*\b(nan|inf)\b',
                         (tmp_path / "c" / "compare.html").read_text())




OLD_COLUMN_NAMES = {"device": "gpu", "sm_count": "num_sms", "bandwidth_gbs": "achieved_gbs",
                    "fraction_of_copy": "frac_copy_bw", "copy_bandwidth_gbs": "copy_bw_gbs"}


def test_report_csv_with_the_old_column_names_is_read(tmp_path, capsys):
    """Reports written before the columns took the names of tsdecode.device (gpu, num_sms) and
    of the tables (achieved_gbs, frac_copy_bw, copy_bw_gbs) still re-render and compare."""
    rows = _report_rows()
    path = tmp_path / "old.csv"
    new_names = [c for c in Res.columns_for(rows) if c != "compute_capability"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([OLD_COLUMN_NAMES.get(c, c) for c in new_names])
        for r in rows:
            w.writerow([Res._csv_value(r.get(c)) for c in new_names])
    read = Res.read_csv(path)
    assert {(r["device"], r["sm_count"]) for r in read} == {("Test GPU", 132)}
    for old, new in zip(read, rows):
        for name in ("bandwidth_gbs", "fraction_of_copy", "copy_bandwidth_gbs"):
            assert old[name] == pytest.approx(new[name]), name
    code, _ = _report(["--from-csv", str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == 0 and "Test GPU" in (tmp_path / "out" / "report.html").read_text()


def test_the_committed_reports_still_read():
    """The CSVs under reports/ were written with the old column names."""
    paths = sorted((ROOT / "reports").rglob("results.csv"))
    assert paths
    for path in paths:
        rows = Res.read_csv(path)
        assert all("bandwidth_gbs" in r and "achieved_gbs" not in r for r in rows), path
        assert any(r["bandwidth_gbs"] for r in rows), path


# ---------------------------------------------------------------------------------------------
# Registry and failure handling (one shape, in-process)


@needs_cpu_kernels
def test_registry_skip_fail_and_custom_impl():
    spec = PRESETS["smoke"][0]

    def reference_impl(spec, inputs):
        from tsdecode.reference import reference_decode

        def call():
            inputs.out.copy_(reference_decode(inputs.q, inputs.cache, inputs.block_tables, inputs.seq_lens))
        return I.Prepared(call, note="float64 reference")

    def unsupported(spec, inputs):
        raise I.Unsupported("needs a unicorn")

    def broken(spec, inputs):
        return lambda: 1 / 0

    def writes_nothing(spec, inputs):
        return lambda: None

    try:
        I.register_impl("ref_peer", reference_impl, kind="peer")
        I.register_impl("unicorn", unsupported, kind="peer")
        I.register_impl("broken", broken, kind="peer")
        I.register_impl("lazy", writes_nothing, kind="peer")
        impls = [I.IMPLS[n] for n in ("heuristic", "ref_peer", "unicorn", "broken", "lazy")]
        opts = B.Options(torch.device("cpu"))
        env = B.environment(opts.device)
        rows = B.benchmark_shape(spec, impls, opts, env, copy_bw=100.0, log=lambda *a: None)
    finally:
        for n in ("ref_peer", "unicorn", "broken", "lazy"):
            I.unregister_impl(n)
    cols = Res.add_speedups(rows)
    assert cols == ["speedup_vs_heuristic", "speedup_vs_ref_peer", "speedup_vs_unicorn",
                    "speedup_vs_broken", "speedup_vs_lazy"]
    by = {r["impl"]: r for r in rows}
    assert by["ref_peer"]["status"] == "ok" and by["ref_peer"]["rel_error"] < 1e-2
    assert by["ref_peer"]["impl_note"] == "float64 reference"
    assert by["unicorn"]["status"] == "skipped" and by["unicorn"]["reason"] == "needs a unicorn"
    assert by["broken"]["status"] == "failed" and "ZeroDivisionError" in by["broken"]["reason"]
    assert by["lazy"]["status"] == "ok" and by["lazy"]["rel_error"] == math.inf
    assert not by["lazy"]["error_ok"]
    assert close(by["heuristic"]["speedup_vs_ref_peer"],
                 by["ref_peer"]["time_us_median"] / by["heuristic"]["time_us_median"])
    with pytest.raises(ValueError):
        I.register_impl("bad name", reference_impl)
    with pytest.raises(ValueError, match="unknown implementation"):
        B._parse_impls("heuristic,nope")


def test_each_shape_times_its_implementations_in_a_rotated_order(tmp_path, monkeypatch):
    """No implementation is always timed first on a shape (its first timing inherits the clock the
    previous shape left), and every shape's rows still come out in the listed order."""
    orders = []

    def fake_shape(spec, impls, opts, env, copy_bw, log):
        orders.append([impl.name for impl in impls])
        return [{"shape": spec.name, "impl": impl.name, "impl_kind": impl.kind, "status": "skipped",
                 "reason": "fake"} for impl in impls]

    monkeypatch.setattr(B, "benchmark_shape", fake_shape)
    monkeypatch.setattr(B.measure, "copy_bandwidth_gbs", lambda *a, **k: 100.0)
    monkeypatch.setattr(B, "INTERPRETER_ACTIVE", True)
    names = ["heuristic", "torch_sdpa", "flex_attention"]
    parser = argparse.ArgumentParser()
    R.add_report_arguments(parser)
    args = parser.parse_args(["--preset", "smoke", "--impls", ",".join(names), "--device", "cpu",
                              "--out", str(tmp_path)])
    rows, _ = B.run_benchmark(args, log=lambda *a: None)
    assert len(orders) == len(PRESETS["smoke"]) == 4
    assert [order[0] for order in orders] == ["heuristic", "torch_sdpa", "flex_attention", "heuristic"]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert [r["impl"] for r in rows] == names * 4


def test_a_warm_up_window_is_replayed_and_discarded(monkeypatch):
    """On a GPU, ``warm_up`` replays one window that does not count, then times the next."""
    windows = []

    def fake_graph_times(calls, replay_ms):
        windows.append(replay_ms)
        return [float(len(windows))] * 3

    monkeypatch.setattr(B.measure, "graph_times_us", fake_graph_times)
    opts = B.Options(torch.device("cuda"), replay_ms=7.0)
    times, method, note = B._time([lambda: None], opts, warm_up=True)
    assert windows == [7.0, 7.0] and times == [2.0] * 3 and method == B.CUDA_GRAPH and note == ""
    windows.clear()
    times, _, _ = B._time([lambda: None], opts)
    assert windows == [7.0] and times == [1.0] * 3


def test_only_a_shapes_first_timed_implementation_warms_up(monkeypatch):
    """The warm-up goes to the first implementation that is timed, past one that declines the
    shape, and to no other."""
    spec = ShapeSpec(2, 40, 4, 2, 64)
    flags = []

    def fake_time(calls, opts, warm_up=False):
        flags.append(warm_up)
        for call in calls:
            call()
        return [1.0], B.INTERPRETER, B.MEANINGLESS

    def declines(spec, inputs):
        raise I.Unsupported("not this one")

    def copies_reference(spec, inputs):
        from tsdecode.reference import reference_decode

        return lambda: inputs.out.copy_(reference_decode(inputs.q, inputs.cache, inputs.block_tables,
                                                         inputs.seq_lens))

    monkeypatch.setattr(B, "_time", fake_time)
    names = ("declines", "first", "second", "third")
    try:
        I.register_impl("declines", declines, kind="peer")
        for n in names[1:]:
            I.register_impl(n, copies_reference, kind="peer")
        opts = B.Options(torch.device("cpu"))
        rows = B.benchmark_shape(spec, [I.IMPLS[n] for n in names], opts, B.environment(opts.device),
                                 copy_bw=100.0, log=lambda *a: None)
    finally:
        for n in names:
            I.unregister_impl(n)
    assert flags == [True, False, False]
    assert [r["status"] for r in rows] == ["skipped", "ok", "ok", "ok"]
    assert all(r["sm_clock_mhz"] is None for r in rows[1:])  # no GPU clock on the CPU


@needs_cpu_kernels
@pytest.mark.parametrize("spec", [
    ShapeSpec(2, 70, 4, 2, 64, seq_len_q=3, mask_type="causal", window_left=20, ragged=True),
    ShapeSpec(2, 50, 4, 4, 64, seq_len_q=2, mask_type="causal"),
    ShapeSpec(3, 45, 8, 2, 64, page_size=8, ragged=True),
], ids=lambda s: s.name)
def test_baselines_match_reference(spec):
    from tsdecode.reference import reference_decode

    for inputs in measure.make_inputs(spec, "cpu", copies=2):
        ref = reference_decode(inputs.q, inputs.cache, inputs.block_tables, inputs.seq_lens,
                               seq_len_q=spec.seq_len_q, mask_type=spec.mask_type,
                               window_left=spec.window_left)
        for name in ("torch_sdpa", "flex_attention"):
            call = I.IMPLS[name].factory(spec, inputs)
            inputs.out.fill_(float("nan"))
            call()
            assert measure.relative_error(inputs.out, ref) < measure.tolerance(spec), name
    I.release()


def test_baselines_decline_packed():
    spec = ShapeSpec(2, 40, 4, 2, 64, seq_len_q=3, packed=True)
    inputs = measure.make_inputs(spec, "cpu")[0]
    for name in ("torch_sdpa", "flex_attention", "flashinfer", "flashinfer_tc"):
        with pytest.raises(I.Unsupported):
            I.IMPLS[name].factory(spec, inputs)


# ---------------------------------------------------------------------------------------------
# HTML helpers


def test_html_helpers():
    assert H.nice_ticks(0, 4270 * 1.08, 6) == [0, 1000, 2000, 3000, 4000]
    assert H.fmt_tokens(131072) == "128k" and H.fmt_tokens(40) == "40"
    assert H.diverging_color(1.0) == "#ffffff"
    assert H._log_bounds(6.39 * 0.9, 23864 * 1.15) == (5, 50000)
    assert H.esc('<a href="x">') == "&lt;a href=&quot;x&quot;&gt;"
    svg = H.line_chart([H.Series("B=1", [(1024, 10.0), (8192, 20.0)], "#000")], title="t",
                       x_label="x", y_label="y", hlines=[H.HLine(30.0, "peak")])
    assert svg.startswith("<svg") and svg.endswith("</svg>") and "peak" in svg


# ---------------------------------------------------------------------------------------------
# Headless Chromium: the page renders, plots and table are in the DOM


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium():
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("chromium is not on PATH")


def _render(browser, page, tmp_path, name):
    url = page.resolve().as_uri()
    shot = tmp_path / f"{name}.png"
    base = [browser, *CHROMIUM_FLAGS]
    subprocess.run(base + [f"--user-data-dir={tmp_path / (name + '-shot')}", f"--screenshot={shot}",
                           "--window-size=1400,2400", url],
                   check=True, capture_output=True, timeout=120)
    dom = subprocess.run(base + [f"--user-data-dir={tmp_path / (name + '-dom')}", "--dump-dom", url],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    return dom


def test_html_renders_in_chromium(smoke_run, tmp_path):
    browser = _chromium()
    _, out, _ = smoke_run
    dom = _render(browser, out / "report.html", tmp_path, "report")
    assert dom.count("<svg") >= 4
    assert dom.count("<polyline") + dom.count("<circle") >= 2  # bandwidth plot has data
    assert "<table" in dom and dom.count("<tr") >= 8
    assert "TIMINGS ARE MEANINGLESS" in dom


def test_compare_renders_in_chromium(smoke_run, tmp_path):
    browser = _chromium()
    _, out, _ = smoke_run
    assert R.main(["--compare", str(out / "results.csv"), str(out / "results.csv"),
                   "--out", str(tmp_path)]) == 0
    dom = _render(browser, tmp_path / "compare.html", tmp_path, "compare")
    assert dom.count("<svg") >= 3 and "<table" in dom
    assert "1.00×" in dom


# ---------------------------------------------------------------------------------------------
# GPU (skipped without CUDA): the real timing path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_report_one_shape(tmp_path):
    assert R.main(["--batch-sizes", "8", "--kv-lens", "1024", "--device", "cuda", "--out", str(tmp_path),
                   "--impls", "heuristic,torch_sdpa", "--replay-ms", "20", "--copy-gib", "0.5"]) == 0
    rows = Res.read_csv(tmp_path / "results.csv")
    heur = next(r for r in rows if r["impl"] == "heuristic")
    assert heur["timing_method"] == Res.CUDA_GRAPH and heur["replays"] >= 5
    assert heur["copies"] == measure.num_copies(Res.spec_of(heur))
    assert heur["error_ok"] and 0 < heur["fraction_of_copy"] < 1.5
    times = measure.graph_times_us([lambda: None], replay_ms=5)
    assert len(times) >= 5


# ---------------------------------------------------------------------------------------------
# The numbers a user reads off the page and the compare page, the CSV round trip, the budget, the row's time


def _rows_with_a_tuned_entry() -> list[dict]:
    """_report_rows plus a tuned row for B=1 (50 us, the heuristic there takes 100 us); B=3 has no
    tuned row (the runtime runs the heuristic, 150 us). torch_sdpa: 200 us and 300 us."""
    rows = _report_rows()
    tuned = dict(rows[0], impl="tuned", time_us_median=50.0, time_us_min=45.0, time_us_max=55.0,
                 bandwidth_gbs=20.0, fraction_of_copy=0.5)
    return rows[:1] + [tuned] + rows[1:]


def test_summary_speedups_take_the_runtime_row_and_other_over_this():
    t = Res.Table(_rows_with_a_tuned_entry())
    b1, b3 = list(t.specs)
    assert t.runtime(b1)["impl"] == "tuned" and t.time(b1, Res.RUNTIME) == 50.0
    assert t.runtime(b3)["impl"] == "heuristic" and t.time(b3, Res.RUNTIME) == 150.0
    s = P.summary(t)
    assert s["tuned_shapes"] == 1 and s["tuned_vs_heuristic"] == pytest.approx(2.0)  # 100 / 50
    g, n = s["vs"]["torch_sdpa"]
    assert n == 2 and g == pytest.approx(math.sqrt(200 / 50 * 300 / 150))
    assert P._tuned_cell(t, b1).text == "2.00×"
    page = P.render_html(t.rows)
    assert '<div class="v">2.00×</div><div class="l">tuned vs heuristic' in page
    assert '<div class="v">2.83×</div><div class="l">tsdecode vs torch_sdpa' in page


def test_summary_counts_a_shape_at_exactly_the_good_fraction_as_above():
    rows = _report_rows()
    rows[0]["fraction_of_copy"] = P.GOOD_FRACTION
    s = P.summary(Res.Table(rows))
    assert (s["above"], s["measured"]) == (1, 2)


def test_a_baseline_above_tolerance_is_not_a_tsdecode_failure(tmp_path, capsys):
    """A wrong torch_sdpa row is shown red in the table, but neither fails the tsdecode
    correctness card nor the exit code, nor enters tsdecode's max error."""
    rows = _report_rows()
    rows[1].update(rel_error=0.5, error_ok=False)  # torch_sdpa, B=1
    s = P.summary(Res.Table(rows))
    assert [r["impl"] for r in s["wrong"]] == ["torch_sdpa"]
    assert s["wrong_tsdecode"] == [] and s["max_err_tsdecode"] == pytest.approx(1e-3)
    path = _write_report_csv(tmp_path / "results.csv", rows)
    code, err = _report(["--from-csv", str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == 0 and "tsdecode problem" not in err
    page = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert "tsdecode correctness: max rel. error 1.0e-03" in page and ">FAIL<" not in page


def test_report_csv_round_trip_keeps_every_value_and_type(tmp_path):
    rows = _report_rows()
    rows[1]["time_us_median"] = 200.0 / 3  # needs more than a few significant digits
    read = Res.read_csv(_write_report_csv(tmp_path / "results.csv", rows))
    for got, want in zip(read, rows):
        for k, v in want.items():
            assert type(got[k]) is type(v), k
            assert got[k] == (pytest.approx(v, rel=1e-8) if isinstance(v, float) else v), k


def test_report_csv_error_ok_cells_are_read_as_booleans(tmp_path, capsys):
    """An explicit error_ok cell decides, as false/true or as 0/1 (spreadsheets write those)."""
    rows = _report_rows()
    rows[0]["error_ok"] = False  # the heuristic row, B=1
    path = _write_report_csv(tmp_path / "results.csv", rows)
    assert [r["error_ok"] for r in Res.read_csv(path)] == [False, True, True, True]
    code, err = _report(["--from-csv", str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == 1 and "tsdecode problem" in err
    text = path.read_text().replace(",false,", ",0,").replace(",true,", ",1,")
    path.write_text(text)
    assert [r["error_ok"] for r in Res.read_csv(path)] == [False, True, True, True]


class _Clock:
    """perf_counter advancing one second a call."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("budget, ran", [("0", 0), ("2", 2)])
def test_budget_stops_new_shapes_once_spent(budget, ran, tmp_path, monkeypatch):
    """--budget-s 0 runs no shape (every row skipped, reason named); --budget-s 2 with one
    second a shape starts the shapes begun at 1 s and 2 s elapsed, not the one at 3 s."""
    started = []

    def fake_shape(spec, impls, opts, env, copy_bw, log):
        started.append(spec.name)
        return [{"shape": spec.name, "impl": impl.name, "impl_kind": impl.kind, "status": "skipped",
                 "reason": "fake"} for impl in impls]

    monkeypatch.setattr(B, "benchmark_shape", fake_shape)
    monkeypatch.setattr(B.measure, "copy_bandwidth_gbs", lambda *a, **k: 100.0)
    monkeypatch.setattr(B, "INTERPRETER_ACTIVE", True)
    monkeypatch.setattr(B, "time", _Clock())
    parser = argparse.ArgumentParser()
    R.add_report_arguments(parser)
    args = parser.parse_args(["--preset", "smoke", "--impls", "heuristic", "--device", "cpu",
                              "--out", str(tmp_path), "--budget-s", budget])
    rows, _ = B.run_benchmark(args, log=lambda *a: None)
    names = [s.name for s in PRESETS["smoke"]]
    assert started == names[:ran]
    assert [r["shape"] for r in rows] == names
    for r in rows[ran:]:
        assert r["status"] == "skipped" and f"not run: time budget (--budget-s {budget})" in r["reason"]


def test_benchmark_row_takes_the_median_and_checks_error_inclusively(monkeypatch):
    """The row's time is the median of the timings, its bandwidth from that median, and an error
    equal to the tolerance passes (<=), as read_csv derives it."""
    spec = PRESETS["smoke"][0]
    tol = measure.tolerance(spec)
    monkeypatch.setattr(B, "_time", lambda calls, opts, warm_up=False: ([10.0, 20.0, 60.0], Res.INTERPRETER,
                                                                      Res.MEANINGLESS))
    monkeypatch.setattr(measure, "relative_error", lambda out, ref: tol)
    try:
        I.register_impl("noop", lambda spec, inputs: (lambda: None), kind="peer")
        (row,) = B.benchmark_shape(spec, [I.IMPLS["noop"]], B.Options(torch.device("cpu")), {},
                                   copy_bw=100.0, log=lambda *a: None)
    finally:
        I.unregister_impl("noop")
    assert row["status"] == "ok"
    assert (row["time_us_median"], row["time_us_min"], row["time_us_max"], row["replays"]) == (20.0, 10.0, 60.0, 3)
    assert close(row["bandwidth_gbs"], row["bytes_moved"] / 20e-6 / 1e9)
    assert close(row["fraction_of_copy"], row["bandwidth_gbs"] / 100.0)
    assert row["rel_error"] == tol and row["error_ok"] is True


def test_compare_cards_are_time_a_over_time_b_and_count_unmatched_shapes():
    a = _report_rows()
    extra = ShapeSpec(5, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    a.append(dict(a[0], shape=extra.name, batch_size=5, checked_requests=5))
    b = []
    for r in _report_rows():  # B: every time a quarter, no B=5 shape
        r = dict(r)
        for k in ("time_us_median", "time_us_min", "time_us_max"):
            r[k] /= 4
        b.append(r)
    page = P.render_compare(a, b, "A", "B")
    assert '<div class="v">4.00×</div><div class="l">tsdecode: B speedup over A' in page
    assert '<div class="v">4.00×</div><div class="l">torch_sdpa: B speedup over A' in page
    assert "0.25×" not in page
    assert "matching shapes (1 only in A, 0 only in B)" in page


def test_report_table_escapes_text_cells():
    rows = _report_rows()
    rows[1].update(status="skipped", reason="<img src=x onerror=alert(1)>", time_us_median=None)
    page = P.render_html(rows)
    assert "<img" not in page
    assert page.count("&lt;img src=x onerror=alert(1)&gt;") == 2  # "Not run" list and table


def test_from_csv_without_out_writes_beside_the_csv(tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    (tmp_path / "run").mkdir()
    path = _write_report_csv(tmp_path / "run" / "results.csv", _report_rows())
    assert _report(["--from-csv", str(path)], capsys)[0] == 0
    assert (tmp_path / "run" / "report.html").is_file() and list(cwd.iterdir()) == []
