"""Reports (tuner/report.py): CSV schema and arithmetic, end-to-end CPU (interpreter) run,
re-rendering, comparison mode, the implementation registry and the HTML in headless Chromium."""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
import subprocess

import pytest
import torch

import tsdecode.api
from tsdecode.configs import KernelConfig, SelectedConfig, device_num_sms, fit_config, heuristic_config
from tsdecode.kernels.decode import interpreter_active
from tuner import html as H
from tuner import impls as I
from tuner import measure
from tuner import report as R
from tuner.grids import PRESETS, ShapeSpec

# Two of the smoke preset's shapes: the table below has an entry for the B=3 one only.
FILTER = "^B1_L40_|^B3_L130_"
TABLE_BATCH = 3
TABLE_CONFIG = KernelConfig(block_n=16, block_m=2, num_kv_splits=2, num_warps=2, num_stages=1)

needs_cpu_kernels = pytest.mark.skipif(
    not interpreter_active(), reason="CPU runs need TRITON_INTERPRET=1 set before triton is imported"
)


def fake_table(real_select):
    """select_config with a 'tuned table' holding an entry for batch size TABLE_BATCH only (and
    no other table, whatever this machine has)."""

    def select(shape, device, explicit=None):
        if explicit is None and shape.batch_size == TABLE_BATCH:
            fitted, changes = fit_config(TABLE_CONFIG, shape)
            return SelectedConfig(fitted, "table", table_path="fake.json",
                                  bucket=(shape.batch_size, shape.max_kv_len), adjustments=changes)
        if explicit is None:  # whatever tables exist on this machine: none here
            return SelectedConfig(heuristic_config(shape, device_num_sms(device)), "heuristic")
        return real_select(shape, device, explicit)

    return select


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One end-to-end report over two tiny smoke shapes, on the CPU through the interpreter."""
    if not interpreter_active():
        pytest.skip("CPU runs need TRITON_INTERPRET=1 set before triton is imported")
    out = tmp_path_factory.mktemp("report")
    mp = pytest.MonkeyPatch()
    mp.setattr(tsdecode.api, "select_config", fake_table(tsdecode.api.select_config))
    try:
        code = R.main(["--preset", "smoke", "--filter", FILTER, "--device", "cpu", "--out", str(out),
                       "--check-requests", "8"])
    finally:
        mp.undo()
    return code, out


def load(out):
    with open(out / "results.csv", newline="") as f:
        header = next(csv.reader(f))
    return header, R.read_csv(out / "results.csv")


def close(a, b, rel=1e-6):
    return math.isclose(a, b, rel_tol=rel)


# ---------------------------------------------------------------------------------------------
# End to end on CPU


def test_report_runs_and_writes_outputs(smoke_run):
    code, out = smoke_run
    assert code == 0
    assert (out / "results.csv").stat().st_size > 0
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "TIMINGS ARE MEANINGLESS" in page
    assert page.count("<svg") >= 4  # bandwidth, % copy, tuned heatmap, latency (one family)
    assert '<table class="data sortable">' in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # no network needed
    assert "https://" not in page


def test_csv_schema(smoke_run):
    _, out = smoke_run
    header, rows = load(out)
    for col in ("shape", *R.SPEC_FIELDS, "impl", "status", "time_us_median", "time_us_min",
                "time_us_max", "bytes_moved", "achieved_gbs", "frac_copy_bw", "copy_bw_gbs",
                "speedup_vs_heuristic", "speedup_vs_torch_sdpa", "speedup_vs_flex_attention",
                "speedup_vs_flashinfer", "rel_error", "config", "config_source", "timing_method",
                "gpu", "torch_version", "triton_version", "date"):
        assert col in header, col
    assert len(header) == len(set(header))
    shapes = {r["shape"] for r in rows}
    assert shapes == {s.name for s in PRESETS["smoke"] if re.search(FILTER, s.name)}
    assert len(shapes) == 2
    for r in rows:
        assert r["timing_method"] == R.INTERPRETER
        assert "MEANINGLESS" in r["timing_note"]
        assert r["status"] in ("ok", "skipped", "failed")
        assert r["status"] != "failed", (r["impl"], r["reason"])
        assert R.spec_of(r).name == r["shape"]


def test_csv_numbers_consistent(smoke_run):
    _, out = smoke_run
    _, rows = load(out)
    by = {(r["shape"], r["impl"]): r for r in rows}
    for r in rows:
        spec = R.spec_of(r)
        assert r["bytes_moved"] == measure.bytes_moved(spec)  # fixed lengths, SQ=1
        if r["status"] != "ok":
            assert r["time_us_median"] is None and r["reason"]
            continue
        t = r["time_us_median"]
        assert r["time_us_min"] <= t <= r["time_us_max"]
        assert close(r["achieved_gbs"], r["bytes_moved"] / (t * 1e-6) / 1e9)
        assert close(r["frac_copy_bw"], r["achieved_gbs"] / r["copy_bw_gbs"])
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
    assert len({r["copy_bw_gbs"] for r in rows}) == 1  # measured once per run


def test_tuned_rows_only_where_a_table_entry_exists(smoke_run):
    _, out = smoke_run
    _, rows = load(out)
    for shape in {r["shape"] for r in rows}:
        spec = ShapeSpec(**{f: next(r for r in rows if r["shape"] == shape)[f] for f in R.SPEC_FIELDS})
        impls = {r["impl"]: r for r in rows if r["shape"] == shape}
        heur = impls["heuristic"]
        assert heur["config_source"] == "heuristic"
        assert KernelConfig.from_dict(json.loads(heur["config"])).validate() is None
        if spec.batch_size == TABLE_BATCH:
            tuned = impls["tuned"]
            assert tuned["status"] == "ok" and tuned["config_source"] == "table"
            assert json.loads(tuned["config"]) == fit_config(TABLE_CONFIG, spec.to_problem_shape())[0].to_dict()
            assert "fake.json" in tuned["config_note"]
            assert close(tuned["speedup_vs_heuristic"], heur["time_us_median"] / tuned["time_us_median"])
        else:
            assert "tuned" not in impls  # no separate row: it would be the heuristic again
            assert "no tuned table entry" in heur["config_note"]


def test_peers_skip_with_reason(smoke_run):
    _, out = smoke_run
    _, rows = load(out)
    fi = [r for r in rows if r["impl"] == "flashinfer"]
    assert len(fi) == 2
    for r in fi:
        assert r["status"] == "skipped" and r["reason"]
        assert r["impl_kind"] == "peer"
    flex = [r for r in rows if r["impl"] == "flex_attention"]
    assert all(r["status"] == "ok" and r["error_ok"] for r in flex), [r["reason"] for r in flex]


def test_from_csv_roundtrip_and_rerender(smoke_run, tmp_path):
    _, out = smoke_run
    rows = R.read_csv(out / "results.csv")
    R.write_csv(rows, tmp_path / "again.csv")
    assert R.read_csv(tmp_path / "again.csv") == rows
    assert R.main(["--from-csv", str(out / "results.csv"), "--out", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    for shape in {r["shape"] for r in rows}:
        assert shape in page
    assert "TIMINGS ARE MEANINGLESS" in page


def test_compare_mode(smoke_run, tmp_path):
    _, out = smoke_run
    rows = R.read_csv(out / "results.csv")
    faster = []
    for r in rows:  # "B": every time halved, bandwidth doubled
        r = dict(r)
        if r["status"] == "ok":
            for k in ("time_us_median", "time_us_min", "time_us_max"):
                r[k] /= 2
            r["achieved_gbs"] *= 2
            r["frac_copy_bw"] *= 2
        faster.append(r)
    b = tmp_path / "b" / "results.csv"
    b.parent.mkdir()
    R.write_csv(faster, b)
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
    rows = R.read_csv(tmp_path / "results.csv")
    status = {(r["batch_size"], r["impl"]): r["status"] for r in rows}
    assert status == {(1, "heuristic"): "ok", (1, "torch_sdpa"): "ok",
                      (3, "heuristic"): "failed", (3, "torch_sdpa"): "failed"}
    assert all("MemoryError" in r["reason"] for r in rows if r["status"] == "failed")
    assert "pretend the pool does not fit" in (tmp_path / "report.html").read_text(encoding="utf-8")


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
        opts = R.Options(torch.device("cpu"))
        env = R.environment(opts.device)
        rows = R.benchmark_shape(spec, impls, opts, env, copy_bw=100.0, log=lambda *a: None)
    finally:
        for n in ("ref_peer", "unicorn", "broken", "lazy"):
            I.unregister_impl(n)
    cols = R.add_speedups(rows)
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
        R._parse_impls("heuristic,nope")


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
    for name in ("torch_sdpa", "flex_attention", "flashinfer"):
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
    _, out = smoke_run
    dom = _render(browser, out / "report.html", tmp_path, "report")
    assert dom.count("<svg") >= 4
    assert dom.count("<polyline") + dom.count("<circle") >= 2  # bandwidth plot has data
    assert "<table" in dom and dom.count("<tr") >= 8
    assert "TIMINGS ARE MEANINGLESS" in dom


def test_compare_renders_in_chromium(smoke_run, tmp_path):
    browser = _chromium()
    _, out = smoke_run
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
    rows = R.read_csv(tmp_path / "results.csv")
    heur = next(r for r in rows if r["impl"] == "heuristic")
    assert heur["timing_method"] == R.CUDA_GRAPH and heur["replays"] >= 5
    assert heur["copies"] == measure.num_copies(R.spec_of(heur))
    assert heur["error_ok"] and 0 < heur["frac_copy_bw"] < 1.5
    times = measure.graph_times_us([lambda: None], replay_ms=5)
    assert len(times) >= 5
