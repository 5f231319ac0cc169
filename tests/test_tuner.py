"""tsdecode-tune end to end on CPU (Triton interpreter): tables written and used, resume after a
kill, pruning of broken candidates, duplicates after fitting, CLI errors, the search space.

Timings in the interpreter mean nothing; these tests check the pipeline, not the winners.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch

from tsdecode import BatchDecodePagedTSWrapper, tables
from tsdecode.configs import KernelConfig, ProblemShape, fit_config, heuristic_config
from tsdecode.reference import reference_decode
from tuner import measure, search
from tuner.cli import main
from tuner.grids import PRESETS, ShapeSpec
from tuner.runner import plan_kwargs


@pytest.fixture(autouse=True)
def _restore_triton_interpret(monkeypatch):
    """tuner.cli.select_device sets TRITON_INTERPRET in os.environ for CPU runs; restore the
    variable after each test so later tests and their subprocesses see this process's mode."""
    if "TRITON_INTERPRET" in os.environ:
        monkeypatch.setenv("TRITON_INTERPRET", os.environ["TRITON_INTERPRET"])
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.delenv("TRITON_INTERPRET")  # recorded as absent: undo deletes it again

REPO = Path(__file__).resolve().parent.parent
HOOKS = f"{Path(__file__).resolve()}"
# One tiny class: B in {1, 3}, L = 40, Hq=4, Hkv=2, D=64 (fast in the interpreter).
TINY = ["--batch-sizes", "1", "--kv-lens", "40", "--heads", "4:2", "--head-dim", "64"]
FAST = ["--no-progress", "--retime-rounds", "1", "--top-k", "1"]

# The interpreter tests need TRITON_INTERPRET=1 from conftest, i.e. no GPU; on a GPU machine
# test_gpu_smoke_tuning_end_to_end runs the real thing instead.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode (interpreter) tuner test")


# ---- fault-injection hooks (loaded by file path in the worker and compile processes) --------


def broken_configs_hook(stage, spec, config, out=None):
    """block_n 16: compile error; 64: NaN (block_m 2) or wrong values (block_m 16); 128 with
    block_m 2: the worker process dies; 256 with block_m 16: plan raises."""
    if stage == "compile" and config.block_n == 16:
        raise RuntimeError("injected compile error")
    if stage == "plan" and config.block_n == 128 and config.block_m == 2:
        os._exit(7)  # like a crash that takes the CUDA context with it
    if stage == "plan" and config.block_n == 256 and config.block_m == 16:
        raise RuntimeError("injected plan error")
    if stage == "output" and config.block_n == 64:
        if config.block_m == 2:
            out.fill_(float("nan"))
        else:
            out.mul_(1.5)


def slow_compile_hook(stage, spec, config, out=None):
    """Every config but the heuristic default compiles for 60 s."""
    if stage == "compile" and config != heuristic_config(spec.to_problem_shape(), 132):
        time.sleep(60)


# ---- helpers --------------------------------------------------------------------------------


def _records(out: Path, kind: str = "trial") -> list[dict]:
    (jsonl,) = out.glob("*_trials.jsonl")
    return [r for r in search.ResultLog.read(jsonl) if r.get("kind") == kind]


def _studies(out: Path) -> list[optuna.Study]:
    (db,) = out.glob("*_study.db")
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}")
    return [optuna.load_study(study_name=s.study_name, storage=storage)
            for s in optuna.get_all_study_summaries(storage)]


def _finished(study: optuna.Study):
    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,
                                                    optuna.trial.TrialState.PRUNED))


def _check_log_matches_storage(out: Path) -> None:
    """Every finished trial is in the log once, and no fitted config was measured twice."""
    recs = _records(out)
    pairs = [(r["study"], r["trial"]) for r in recs]
    assert len(pairs) == len(set(pairs)), "a trial was logged twice"
    for study in _studies(out):
        finished = _finished(study)
        logged = {r["trial"]: r for r in recs if r["study"] == study.study_name}
        assert sorted(logged) == sorted(t.number for t in finished), study.study_name
        for t in finished:
            assert logged[t.number]["state"] == t.state.name
            if t.state.name == "COMPLETE":
                assert logged[t.number]["time_us"] == pytest.approx(t.value)
        keys = [r["key"] for r in logged.values() if r["measured"]]
        assert len(keys) == len(set(keys)), "a fitted config was measured twice"


def _run(spec: ShapeSpec, device: str = "cpu"):
    inp = measure.make_inputs(spec, device, copies=1, seed=3)[0]
    w = BatchDecodePagedTSWrapper()
    w.plan(inp.block_tables, inp.seq_lens, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
           spec.page_size, qo_indptr=inp.qo_indptr, **plan_kwargs(spec))
    out = w.run(inp.q, inp.cache)
    ref = reference_decode(inp.q, inp.cache, inp.block_tables, inp.seq_lens)
    return w, measure.relative_error(out, ref)


# ---- end to end -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    rc = main(["--preset", "smoke", "--trials", "3", "--out", str(out), "--isolation", "inline", *FAST])
    assert rc == 0
    return out


@cpu_only
def test_smoke_tuning_writes_a_table_the_runtime_uses(smoke_out, monkeypatch):
    (table_path,) = smoke_out.glob("*.json")
    table = tables.load_table(table_path)
    assert table is not None and not table.skipped
    specs = PRESETS["smoke"]
    assert sum(len(b) for b in table.entries.values()) == len(specs)
    for entry in (e for b in table.entries.values() for e in b.values()):
        assert entry.time_us > 0 and entry.default_time_us > 0
    assert (smoke_out / f"{table_path.stem}_trials.csv").stat().st_size > 0
    _check_log_matches_storage(smoke_out)
    for study in _studies(smoke_out):
        assert study.user_attrs["final"]["ok"]
        assert study.user_attrs["final"]["measured"] == 3
        # the heuristic default is always measured first
        first = study.trials[0]
        spec_shape = [s for s in specs if study.study_name.startswith(
            tables.problem_class_key(s.to_problem_shape()))]
        assert first.user_attrs["measured"] and first.state.name == "COMPLETE"
        assert spec_shape

    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(smoke_out))
    tables.clear_cache()
    try:
        for spec in specs:
            w, err = _run(spec)
            assert w.config.source == "table", str(w.config)
            assert w.config.bucket == tables.bucket_of(spec.batch_size, spec.kv_len)
            entry = table.entries[tables.problem_class_key(spec.to_problem_shape())][w.config.bucket]
            assert w.config.kernel_config == entry.kernel_config, (str(w.config), spec)
            assert err < measure.tolerance(spec)
    finally:
        tables.clear_cache()


@cpu_only
def test_rerun_of_a_finished_run_measures_nothing(smoke_out, capsys):
    before = len(_records(smoke_out))
    assert main(["--preset", "smoke", "--trials", "3", "--out", str(smoke_out), "--isolation", "inline", *FAST]) == 0
    assert len(_records(smoke_out)) == before
    assert "already tuned" in capsys.readouterr().err


@cpu_only
def test_explain_subcommand_reads_the_table(smoke_out, capsys):
    rc = main(["explain", "--batch-size", "3", "--kv-len", "130", "--heads", "4:2", "--head-dim", "64",
               "--config-dir", str(smoke_out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "source: table" in text and "bucket (4, 256)" in text


# ---- resume ---------------------------------------------------------------------------------


@cpu_only
def test_resume_after_kill_loses_and_repeats_nothing(tmp_path):
    out = tmp_path / "resume"
    args = [*TINY, "--batch-sizes", "1,3", "--trials", "6", "--block-m", "2,16",
            "--num-kv-splits", "1,2", "--num-warps", "4", "--num-stages", "2", "--out", str(out), *FAST]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tuner", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if out.exists() and list(out.glob("*_trials.jsonl")) and len(_records(out)) >= 4:
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        else:
            pytest.fail("no trials logged in time")
    finally:
        proc.kill()  # SIGKILL: no cleanup, like a crash
        proc.wait()
        proc.stderr.close()
    worker = _records(out, "run")[0]["worker_pid"]
    for _ in range(100):  # the worker exits when its pipe closes
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(worker, signal.SIGKILL)
    before = _records(out)
    assert 4 <= len(before) and not _records(out, "final")

    assert main(args + ["--isolation", "inline"]) == 0
    after = _records(out)
    assert after[: len(before)] == before  # nothing lost or rewritten
    _check_log_matches_storage(out)
    finals = _records(out, "final")
    assert len(finals) == 2 and all(f["ok"] for f in finals)
    for study in _studies(out):
        measured = [t for t in _finished(study) if t.user_attrs["measured"]]
        assert len(measured) == 6
        # the interrupted run's trials are kept (with their results), none is measured again
        old = {r["trial"]: r for r in before if r["study"] == study.study_name}
        for n, rec in old.items():
            t = study.trials[n]
            assert t.state.name == rec["state"] and t.user_attrs["key"] == rec["key"]


@cpu_only
def test_recover_completes_a_running_trial_from_the_log(tmp_path):
    """A crash between logging a result and telling the study: the log completes the trial."""
    info = tables.DeviceInfo("CPU Triton interpreter", 132, (0, 0), 0)
    paths = search.OutputPaths.for_device(tmp_path, info.name, None)
    tuner = search.Tuner(search.TuneSettings(), client=None, device_info=info,
                         copy_bandwidth_gbs=None, paths=paths, progress=False)
    try:
        study = optuna.create_study(storage=tuner.storage, study_name="s")
        dist = {"block_n": optuna.distributions.CategoricalDistribution([64])}
        done, lost = study.ask(dist), study.ask(dist)
        cfg = KernelConfig().to_dict()
        tuner.log.write({"kind": "trial", "study": "s", "trial": done.number, "state": "COMPLETE",
                         "time_us": 12.5, "key": "k", "config": cfg, "measured": True})
        tuner._recover(study, "s")
        trials = study.get_trials(deepcopy=False)
        assert trials[done.number].state.name == "COMPLETE" and trials[done.number].value == 12.5
        assert trials[done.number].user_attrs["key"] == "k"
        assert trials[lost.number].state.name == "FAIL"
    finally:
        tuner.close()


def _bare_tuner(out: Path) -> search.Tuner:
    """A Tuner on ``out`` without a measuring client (storage, log and run lock only)."""
    info = tables.DeviceInfo("CPU Triton interpreter", 132, (0, 0), 0)
    paths = search.OutputPaths.for_device(out, info.name, None)
    return search.Tuner(search.TuneSettings(), client=None, device_info=info,
                        copy_bandwidth_gbs=None, paths=paths, progress=False)


@cpu_only
def test_recover_ignores_trial_records_from_before_a_storage_reset(tmp_path):
    """Trial numbers restart in a new study DB: an old record of trial 0 must not complete the
    new trial 0 that a crash left RUNNING."""
    tuner = _bare_tuner(tmp_path)
    try:
        cfg = KernelConfig().to_dict()
        tuner.log.write({"kind": "trial", "study": "s", "trial": 0, "state": "COMPLETE",
                         "time_us": 12.5, "key": "k", "config": cfg, "measured": True})
        tuner.log.write({"kind": "storage_reset", "storage": "x", "moved_to": "y"})
        study = optuna.create_study(storage=tuner.storage, study_name="s")
        trial = study.ask({"block_n": optuna.distributions.CategoricalDistribution([64])})
        tuner._recover(study, "s")
        assert study.get_trials(deepcopy=False)[trial.number].state.name == "FAIL"
    finally:
        tuner.close()


def test_result_log_skips_damaged_lines(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"kind": "run"}\n\xff\xfe junk\n5\n[1]\n{"kind": "trial", "tri\n'
                     b'{"kind": "final"}\n')
    assert search.ResultLog.read(path) == [{"kind": "run"}, {"kind": "final"}]


@cpu_only
def test_a_second_tuner_on_the_same_study_exits_2(tmp_path, capsys):
    """One run per study storage: the second neither touches the first's RUNNING trials nor
    races it creating the DB. The lock dies with its holder: a leftover lock file is harmless."""
    first = _bare_tuner(tmp_path)
    try:
        study = optuna.create_study(storage=first.storage, study_name="s")
        live = study.ask({"block_n": optuna.distributions.CategoricalDistribution([64])})
        with pytest.raises(search.StudyBusy, match="another tuner is using .*_study.db"):
            _bare_tuner(tmp_path)
        assert main([*TINY, "--trials", "2", "--out", str(tmp_path), "--isolation", "inline",
                     *FAST]) == 2
        err = capsys.readouterr().err
        assert "tsdecode-tune: error: another tuner is using" in err and "different --out" in err
        assert "Traceback" not in err and not _records(tmp_path)
        assert study.get_trials(deepcopy=False)[live.number].state.name == "RUNNING"
    finally:
        first.close()
    assert first.paths.lock.exists()
    _bare_tuner(tmp_path).close()  # released on close; the file left behind blocks nothing
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; "
                               "f = open(sys.argv[1], 'a+b'); fcntl.flock(f, fcntl.LOCK_EX); "
                               "os.kill(os.getpid(), 9)", str(first.paths.lock)])
    assert holder.wait(timeout=60) == -signal.SIGKILL
    _bare_tuner(tmp_path).close()  # a killed holder's lock is gone with it


@cpu_only
def test_corrupt_study_db_is_moved_aside_and_finished_buckets_are_kept(smoke_out, tmp_path,
                                                                        capsys):
    out = tmp_path / "copy"
    shutil.copytree(smoke_out, out)
    (db,) = out.glob("*_study.db")
    db.write_bytes(os.urandom(4096))
    before = _records(out)
    argv = ["--preset", "smoke", "--trials", "3", "--out", str(out), "--isolation", "inline", *FAST]
    assert main(argv) == 0
    err = capsys.readouterr().err
    (aside,) = out.glob("*_study.db.corrupt-*")
    assert err.count("warning: study storage") == 1 and str(aside) in err and "Traceback" not in err
    assert err.count("already tuned") == len(PRESETS["smoke"])  # from the log: nothing re-tuned
    assert _records(out) == before  # nothing measured again
    (table_path,) = out.glob("*.json")
    assert sum(len(b) for b in tables.load_table(table_path).entries.values()) == len(PRESETS["smoke"])
    assert all(s.user_attrs["final"]["ok"] for s in _studies(out))  # carried into the new DB
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and err.count("already tuned") == len(PRESETS["smoke"])


# ---- failing candidates ---------------------------------------------------------------------


def _grid_trials(spec: ShapeSpec, **limits) -> int:
    """The size of the tuner's space for ``spec`` with these limits (the default included)."""
    shape = spec.to_problem_shape()
    default = heuristic_config(shape, 132)  # CPU runs use the runtime's nominal 132 SMs
    return search.space_size(search.build_space(shape, 132, search.SpaceLimits(**limits), default))


@cpu_only
def test_broken_candidates_are_pruned_with_reasons(tmp_path, monkeypatch):
    # A default inside the grid's limits (the heuristic's own choice for this shape lies outside
    # them and would widen the grid), so the grid is exactly block_n x block_m.
    fixed_default = KernelConfig(block_n=64, block_m=16, num_kv_splits=1, num_warps=4, num_stages=2)
    monkeypatch.setattr(search, "heuristic_config", lambda shape, *_: fit_config(fixed_default, shape)[0])
    monkeypatch.setattr(sys.modules[__name__], "heuristic_config", search.heuristic_config)
    out = tmp_path / "broken"
    trials = _grid_trials(ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64),
                          block_m=(2, 16), num_kv_splits=(1,), num_warps=(4,), num_stages=(2,))
    rc = main([*TINY, "--trials", str(trials), "--block-m", "2,16", "--num-kv-splits", "1",
               "--num-warps", "4", "--num-stages", "2", "--out", str(out), "--compile-workers", "1",
               "--isolation", "process", "--inject-hook", f"{HOOKS}:broken_configs_hook", *FAST])
    assert rc == 0
    measured = [r for r in _records(out) if r["measured"]]
    assert len(measured) == trials  # a grid: every config once
    recs = {(r["config"]["block_n"], r["config"]["block_m"]): r for r in measured
            if (r["config"]["num_kv_splits"], r["config"]["num_warps"], r["config"]["num_stages"]) == (1, 4, 2)}
    assert len(recs) == 10
    reason = {k: r["prune_reason"] for k, r in recs.items()}
    assert "compile failed: RuntimeError: injected compile error" in reason[16, 2]
    assert "compile failed" in reason[16, 16]
    assert "non-finite" in reason[64, 2]
    assert "relative error" in reason[64, 16]
    assert "worker process died (exit code 7)" in reason[128, 2]
    assert "plan/compile failed: RuntimeError: injected plan error" in reason[256, 16]
    ok = {k for k, r in recs.items() if r["state"] == "COMPLETE"}
    assert ok == {(32, 2), (32, 16), (128, 16), (256, 2)}
    (study,) = _studies(out)
    pruned = [t for t in study.trials if t.state.name == "PRUNED"]
    assert len([t for t in pruned if t.user_attrs["measured"]]) == 6
    assert all(t.user_attrs["prune_reason"] for t in pruned)
    (table_path,) = out.glob("*.json")
    (entries,) = tables.load_table(table_path).entries.values()
    (entry,) = entries.values()
    c = entry.kernel_config
    assert (c.block_n, c.block_m) in ok or (c.block_n, c.block_m) not in recs


@cpu_only
def test_fitted_duplicates_are_not_measured_twice(tmp_path):
    # L=40 is 3 tiles of 16 but 1 tile of 64: splits 2 and 3 are fitted down at block_n 64.
    spec = ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    d = heuristic_config(spec.to_problem_shape(), 132)
    limits = dict(block_n=(16, 64), block_m=(d.block_m,), num_kv_splits=(2, 3),
                  num_warps=(d.num_warps,), num_stages=(d.num_stages,))
    trials = _grid_trials(spec, **limits)
    out = tmp_path / "dup"
    rc = main([*TINY, "--trials", str(trials), "--block-n", "16,64", "--block-m", str(d.block_m),
               "--num-kv-splits", "2,3", "--num-warps", str(d.num_warps), "--num-stages",
               str(d.num_stages), "--out", str(out), "--isolation", "inline", *FAST])
    assert rc == 0
    recs = _records(out)
    shape = spec.to_problem_shape()
    fitted = {}
    for r in recs:
        config, changes = fit_config(KernelConfig(**r["params"]), shape)
        assert r["config"] == config.to_dict() and bool(r["adjustments"]) == bool(changes)
        fitted.setdefault(r["key"], []).append(r)
    assert len({tuple(r["params"].values()) for r in recs}) == trials  # the whole grid
    for key, group in fitted.items():
        (leader,) = [r for r in group if r["measured"]]  # each fitted config measured once
        for r in group:
            if r is not leader:
                assert r["duplicate_of"] == leader["trial"] and r["time_us"] == leader["time_us"]
    assert any(r["adjustments"] and not r["measured"] for r in recs)  # a fitted duplicate
    _check_log_matches_storage(out)


@cpu_only
def test_time_budget_stops_the_search_and_drops_slow_compiles(tmp_path):
    out = tmp_path / "budget"
    t0 = time.monotonic()
    rc = main([*TINY, "--trials", "20", "--time-budget", "6", "--compile-workers", "2",
               "--out", str(out), "--isolation", "inline",
               "--inject-hook", f"{HOOKS}:slow_compile_hook", *FAST])
    assert rc == 0
    assert time.monotonic() - t0 < 40  # not waiting for the 60 s compiles
    recs = _records(out)
    assert [r["is_default"] for r in recs if r["measured"]] == [True]  # only the default
    (study,) = _studies(out)
    skipped = [t for t in study.trials if t.user_attrs.get("skipped")]
    assert skipped and all(t.state.name == "FAIL" for t in skipped)
    (final,) = _records(out, "final")
    assert final["ok"] and final["kept_default"]


# ---- command line ---------------------------------------------------------------------------


@cpu_only
@pytest.mark.parametrize("argv, message", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--batch-sizes", "1,x", "--kv-lens", "64"], "comma-separated list of integers"),
    (["--batch-sizes", "0", "--kv-lens", "64"], "expected positive integers"),
    (["--batch-sizes", "4"], "needs both batch sizes and K/V lengths"),
    (["--trials", "0"], "--trials: expected an integer >= 1"),
    (["--block-n", "48"], "--block-n [48] not in"),
    (["--time-budget", "-3"], "expected a number > 0"),
    (["frobnicate"], "unrecognized arguments"),
    (["--trial-timeout", "nan"], "--trial-timeout: expected a finite number, got 'nan'"),
    (["--trial-timeout", "inf"], "--trial-timeout: expected a finite number, got 'inf'"),
    (["--time-budget", "nan"], "--time-budget: expected a finite number, got 'nan'"),
    ([*TINY, "--head-dim", "100"], "--head-dim: [100] not supported; one of [64, 96, 128"),
    ([*TINY, "--kv-dtypes", "fp8"], "--kv-dtypes: unknown dtype(s) ['fp8']"),
    ([*TINY, "--heads", "4:3"], "--heads: 4:3: HQ must be a multiple of HKV"),
])
def test_cli_errors_exit_2_with_a_message(argv, message, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing written


@cpu_only
@pytest.mark.parametrize("body, message", [
    ("head_dims = [64]", "[[grid]] 1: unknown key(s) ['head_dims']; the keys are"),
    ('packed = "no"', "[[grid]] 1: packed: expected true or false, got 'no'"),
    ("ragged = 1", "[[grid]] 1: ragged: expected true or false, got 1"),
    ("seq_len_q = 1.5", "[[grid]] 1: seq_len_q: expected an integer >= 1, got 1.5"),
    ("head_dim = 100", "[[grid]] 1: head_dim: [100] not supported"),
    ('kv_dtypes = ["fp8"]', "[[grid]] 1: kv_dtypes: unknown dtype(s) ['fp8']"),
    ('heads = "4-2"', "[[grid]] 1: heads: expected HQ:HKV pairs like 32:8, got '4-2'"),
    ("heads = [4, 2]", "[[grid]] 1: heads: expected HQ:HKV pairs"),
], ids=["unknown_key", "packed_str", "ragged_int", "seq_len_float", "head_dim_100", "fp8",
        "heads_str", "heads_flat"])
def test_cli_bad_grid_file_names_the_key(body, message, tmp_path, capsys):
    grid = tmp_path / "grid.toml"
    out = tmp_path / "out"
    grid.write_text(f"[[grid]]\nbatch_sizes = [1]\nkv_lens = [40]\n{body}\n")
    assert main(["--grid-file", str(grid), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{grid}: {message}" in err and "Traceback" not in err
    assert not out.exists()


@cpu_only
@pytest.mark.parametrize("lists, message", [
    ("batch_sizes = [1.5]\nkv_lens = [40]", "batch_sizes: expected a list of integers"),
    ("batch_sizes = 5\nkv_lens = [40]", "batch_sizes: expected a list of integers"),
    ("batch_sizes = [1]\nkv_lens = [0]", "kv_lens: expected positive integers"),
    ("batch_sizes = [1]", "needs both batch sizes and K/V lengths"),
], ids=["float", "scalar", "zero", "missing"])
def test_cli_grid_file_lists_must_be_positive_integers(lists, message, tmp_path, capsys):
    grid = tmp_path / "grid.toml"
    grid.write_text(f"[[grid]]\n{lists}\n")
    assert main(["--grid-file", str(grid), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@cpu_only
def test_cli_grid_file_accepts_toml_types(tmp_path):
    from types import SimpleNamespace

    from tuner.grids import specs_from_args

    grid = tmp_path / "grid.toml"
    grid.write_text('[[grid]]\nbatch_sizes = [1, 3]\nkv_lens = "40"\nheads = [[4, 2]]\n'
                    'head_dim = 64\nkv_dtypes = ["bfloat16", "float8_e4m3fn"]\npacked = false\n')
    args = SimpleNamespace(preset=None, grid_file=str(grid), batch_sizes=None, kv_lens=None)
    specs = specs_from_args(args)
    assert [(s.batch_size, s.kv_dtype, s.q_dtype) for s in specs] == [
        (1, "bfloat16", "bfloat16"), (3, "bfloat16", "bfloat16"),
        (1, "float8_e4m3fn", "bfloat16"), (3, "float8_e4m3fn", "bfloat16")]
    assert {(s.num_qo_heads, s.num_kv_heads, s.head_dim, s.kv_len) for s in specs} == {(4, 2, 64, 40)}


@cpu_only
def test_cli_out_that_is_a_file_exits_2_before_anything_starts(tmp_path, capsys):
    target = tmp_path / "afile"
    target.write_text("mine\n")
    assert main([*TINY, "--out", str(target), "--isolation", "inline"]) == 2
    assert main([*TINY, "--out", str(target / "sub"), "--isolation", "inline"]) == 2
    err = capsys.readouterr().err
    assert f"--out {target}: exists and is not a folder" in err
    assert f"--out {target / 'sub'}: cannot create the folder" in err
    assert "Traceback" not in err and "device:" not in err  # no worker was started
    assert target.read_text() == "mine\n"


@cpu_only
def test_cli_empty_grid_file(tmp_path, capsys):
    grid = tmp_path / "grid.toml"
    grid.write_text("# no [[grid]] tables\n")
    assert main(["--grid-file", str(grid)]) == 2
    err = capsys.readouterr().err
    assert "expected one or more [[grid]] tables" in err and "Traceback" not in err


@cpu_only
def test_cli_error_in_a_subprocess_has_no_traceback():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "tuner", "--preset", "nope"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "tsdecode-tune: error: unknown preset 'nope'" in r.stderr
    assert "Traceback" not in r.stderr


# ---- report CSVs from elsewhere (tuner/report.py --from-csv / --compare) -----------------------


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
                "bytes_moved": 10**6, "achieved_gbs": 1e6 / us / 1e3, "copy_bw_gbs": 40.0,
                "frac_copy_bw": 1e6 / us / 1e3 / 40.0, "rel_error": 1e-3, "tolerance": 2e-2,
                "error_ok": True, "checked_requests": b, "gpu": "Test GPU", "num_sms": 132,
            })
    return rows


def _write_report_csv(path: Path, rows: list[dict], drop=()) -> Path:
    from tuner import report as R

    cols = [c for c in R.columns_for(rows) if c not in drop]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in rows:
            w.writerow([R._csv_value(r.get(c)) for c in cols])
    return path


def _report(argv, capsys) -> tuple[int, str]:
    from tuner import report as R

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


def test_report_csv_without_required_columns_exits_2_naming_them(tmp_path, capsys):
    good = _write_report_csv(tmp_path / "good.csv", _report_rows())
    bad = _write_report_csv(tmp_path / "bad.csv", _report_rows(),
                            drop=("kv_len", "frac_copy_bw", "time_us_min", "copy_bw_gbs"))
    for argv in (["--from-csv", str(bad)], ["--compare", str(good), str(bad)]):
        code, err = _report([*argv, "--out", str(tmp_path / "out")], capsys)
        assert code == 2
        assert f"{bad}: not a report CSV (missing column(s) ['kv_len', 'time_us_min', " \
               "'copy_bw_gbs', 'frac_copy_bw'])" in err
    rows = _report_rows()
    rows[1]["batch_size"] = "8.0"
    code, err = _report(["--from-csv", str(_write_report_csv(tmp_path / "int.csv", rows))], capsys)
    assert code == 2 and "int.csv, line 3: column batch_size: expected an integer, got '8.0'" in err


def test_report_rows_with_unusable_numbers_are_left_out_of_plots(tmp_path, capsys):
    rows = _report_rows()
    rows[0].update(time_us_median=float("nan"))
    rows[1].update(time_us_median=-5.0)
    rows[2].update(time_us_median=float("inf"), time_us_min=None)
    rows[3].update(achieved_gbs=None, frac_copy_bw=float("nan"), time_us_min=None)
    for r in rows:
        r["copy_bw_gbs"] = None
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


# ---- the search space -----------------------------------------------------------------------


@cpu_only
def test_split_choices_cover_powers_waves_and_default():
    shape = ShapeSpec(1, 32768).to_problem_shape()  # Hq 32, Hkv 8, D 128
    default = heuristic_config(shape, 132)
    space = search.build_space(shape, 132, search.SpaceLimits(), default)
    splits = space["num_kv_splits"]
    assert {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 512} <= set(splits)
    assert {132 // 8, 2 * 132 // 8, 4 * 132 // 8} <= set(splits)  # whole waves of programs
    assert default.num_kv_splits in splits and max(splits) <= 64 * 132 // 8
    # G*SQ = 4 rows: larger block_m is fitted away, FMA block_m (< 16) only when asked for
    assert space["block_m"] == (16,)
    asked = search.SpaceLimits(block_m=(1, 2, 4, 8, 16, 32))
    assert search.build_space(shape, 132, asked, default)["block_m"] == (1, 2, 4, 8, 16)
    mha = ShapeSpec(1, 32768, num_qo_heads=8, num_kv_heads=8).to_problem_shape()  # 1 row
    assert search.build_space(mha, 132, search.SpaceLimits(), heuristic_config(mha, 132))[
        "block_m"] == (1, 2, 4, 8, 16)
    for hq, fma in ((16, (1, 2, 4, 8)), (24, ())):  # 2 rows: FMA searched; 3 rows: not
        rows = ShapeSpec(1, 32768, num_qo_heads=hq, num_kv_heads=8).to_problem_shape()
        assert search.build_space(rows, 132, search.SpaceLimits(), heuristic_config(rows, 132))[
            "block_m"] == fma + (16,)
    wide = ShapeSpec(1, 32768, num_qo_heads=64, num_kv_heads=2).to_problem_shape()  # 32 rows
    assert search.build_space(wide, 132, search.SpaceLimits(), heuristic_config(wide, 132))[
        "block_m"] == (16, 32)
    big = ShapeSpec(128, 32768).to_problem_shape()
    assert search.build_space(big, 132, search.SpaceLimits(), heuristic_config(big, 132))[
        "num_kv_splits"] == (1, 2, 3, 4, 6, 8)
    short = ProblemShape(1, 4, 2, 64, 16, max_kv_len=40)
    assert max(search.split_choices(short, 132, (16, 32), (2,))) == 3  # 3 tiles of 16


# ---- on a GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_smoke_tuning_end_to_end(tmp_path, monkeypatch):
    """The real pipeline (worker process, compile pool, CUDA graphs) on the smoke preset."""
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)  # the GPU pipeline, whatever this process runs in
    r = subprocess.run([sys.executable, "-m", "tuner", "--preset", "smoke", "--trials", "6",
                        "--compile-workers", "2", "--out", str(out), "--no-progress"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    (table_path,) = out.glob("*.json")
    table = tables.load_table(table_path)
    assert table is not None and table.device.name == torch.cuda.get_device_name()
    entries = [e for b in table.entries.values() for e in b.values()]
    assert len(entries) == len(PRESETS["smoke"])
    assert all(e.fraction_of_copy is not None and e.fraction_of_copy > 0 for e in entries)
    _check_log_matches_storage(out)
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(out))
    tables.clear_cache()
    try:
        for spec in PRESETS["smoke"]:
            w, err = _run(spec, "cuda")
            assert w.config.source == "table", str(w.config)
            assert err < measure.tolerance(spec)
    finally:
        tables.clear_cache()


def test_retime_noise_ignores_one_outlier_round():
    from tuner.search import retime_noise

    # The H200 default's re-timings for B=256 L=4k (us): one slow round must not set the noise.
    default = [1033.9, 1035.1, 1144.6, 1059.5, 1028.6]
    noise = retime_noise(default)
    assert 0.02 < noise < 0.03
    challenger_median = 975.2  # 6% faster in every round
    assert challenger_median < statistics.median(default) * (1 - noise)
    assert retime_noise([100.0]) == 0.01
    assert retime_noise([100.0, 100.1, 100.0]) == 0.01


def test_seed_configs_cover_splits_and_the_lean_family():
    from tuner.search import seed_configs

    default = KernelConfig(block_n=64, block_m=16, num_kv_splits=4, num_warps=4, num_stages=2)
    space = {"block_n": [16, 32, 64], "block_m": [16], "num_kv_splits": [1, 2, 3, 4, 6, 8, 12, 16],
             "num_warps": [1, 2, 4], "num_stages": [1, 2, 3, 5]}
    seeds = seed_configs(default, space)
    assert seeds[0] == default and len(set(seeds)) == len(seeds)
    assert {c.num_kv_splits for c in seeds if c.block_n == 64} == {2, 4, 8, 16}
    lean = [c for c in seeds if c.block_n == 16 and c.num_stages == 3]
    assert {c.num_warps for c in lean} == {1}
    assert sorted(c.num_kv_splits for c in lean) == [4, 8, 16]
    deep = [c for c in seeds if c.block_n == 16 and c.num_stages != 3]
    assert {(c.num_warps, c.num_stages) for c in deep} == {(1, 5)}  # the space's deepest pipeline
    assert sorted(c.num_kv_splits for c in deep) == [2, 4]
    for c in seeds:  # every seed lies in the space
        assert all(getattr(c, k) in v for k, v in space.items())


def test_seed_configs_reach_the_lean_programs_per_sm_targets():
    """With the shape's programs at one split, both lean families are seeded at the split counts
    for ~8 and ~46 programs per SM, even when the default's own splits are far from them."""
    from tuner.search import seed_configs

    default = KernelConfig(block_n=64, block_m=16, num_kv_splits=8, num_warps=4, num_stages=2)
    space = {"block_n": [16, 64], "block_m": [16], "num_kv_splits": [1, 2, 4, 8, 16, 32, 64, 95, 96, 128],
             "num_warps": [1, 4], "num_stages": [2, 3, 5]}
    plain = seed_configs(default, space)
    seeds = seed_configs(default, space, base_programs=64, num_sms=132)  # B=8, Hkv=8
    assert seeds[:len(plain)] == plain and len(set(seeds)) == len(seeds)
    # ~8 per SM: 8 * 132 / 64 -> 16 splits (the 3-stage lean seed at 16 = 2x the default's
    # splits is there already); ~46 per SM: 46 * 132 / 64 -> 95 splits.
    added = {(c.num_kv_splits, c.num_stages) for c in seeds[len(plain):]}
    assert added == {(16, 5), (95, 3), (95, 5)}
    assert all(c.block_n == 16 and c.num_warps == 1 for c in seeds[len(plain):])


def test_study_name_changes_with_the_heuristic_default(tmp_path):
    """A study is timed against the heuristic's default: a heuristic change must start a new
    study, not resume the old one (whose final records the old default)."""
    tuner = _bare_tuner(tmp_path)
    try:
        bucket = search.group_buckets(PRESETS["smoke"])[0]
        space = {"block_n": [16, 32]}
        a = tuner.study_name(bucket, space, KernelConfig(block_n=16, num_stages=3))
        assert a == tuner.study_name(bucket, space, KernelConfig(block_n=16, num_stages=3))
        assert a != tuner.study_name(bucket, space, KernelConfig(block_n=16, num_stages=5))
        assert a.startswith(bucket.class_key + "|")
    finally:
        tuner.close()


def test_grid_file_without_a_toml_reader_is_a_usage_error(tmp_path, monkeypatch, capsys):
    """Python 3.10 has no tomllib: --grid-file exits 2 with a message, not a traceback."""
    import builtins

    grid_file = tmp_path / "g.toml"
    grid_file.write_text("[[grid]]\nbatch_sizes = [1]\nkv_lens = [40]\n")
    real_import = builtins.__import__

    def no_tomllib(name, *a, **kw):
        if name == "tomllib":
            raise ImportError("No module named 'tomllib'")
        return real_import(name, *a, **kw)

    monkeypatch.delitem(sys.modules, "tomllib", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_tomllib)
    assert main(["--grid-file", str(grid_file), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Python >= 3.11" in err and "Traceback" not in err


@cpu_only
def test_a_new_study_measures_the_tables_current_winner_second(tmp_path):
    """Re-tuning into a table that already holds a winner for the bucket (e.g. after a heuristic
    change started new studies): that winner is measured right after the default, so a
    re-tune cannot lose what the last one found for lack of trials."""
    spec = ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    shape = spec.to_problem_shape()
    default = heuristic_config(shape, 132)
    previous = KernelConfig(block_n=32, block_m=16, num_kv_splits=2, num_warps=2, num_stages=2)
    assert previous != default and fit_config(previous, shape)[0] == previous
    out = tmp_path / "warm"
    info = tables.DeviceInfo("CPU Triton interpreter", 132, (0, 0), 0)
    paths = search.OutputPaths.for_device(out, info.name, None)
    out.mkdir()
    entry = tables.TableEntry(previous, 10.0, 1.0, None, default, 11.0, 0.9, tuned_batch_size=1)
    key, bucket = tables.problem_class_key(shape), tables.bucket_of(1, 40)
    tables.merge_entries(paths.table, info, {key: {bucket: entry}}, {})
    args = [*TINY, "--trials", "2", "--block-n", "16,32,64", "--block-m", "16",
            "--num-kv-splits", "1,2,3", "--num-warps", "1,2,4", "--num-stages", "2,3",
            "--out", str(out), "--isolation", "inline", *FAST]
    assert main(args) == 0
    measured = [KernelConfig(**r["config"]) for r in _records(out) if r["measured"]]
    assert measured[:2] == [default, previous]


@cpu_only
def test_stale_only_tunes_just_the_buckets_timed_against_another_default(tmp_path, capsys):
    """--stale-only: of the grid's buckets, only those the output table lacks or holds timed
    against another default than today's heuristic are tuned; the others keep their entries."""
    specs = [ShapeSpec(b, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64) for b in (1, 3)]
    info = tables.DeviceInfo("CPU Triton interpreter", 132, (0, 0), 0)
    out = tmp_path / "t"
    out.mkdir()
    paths = search.OutputPaths.for_device(out, info.name, None)
    other = KernelConfig(block_n=32, block_m=16, num_kv_splits=2, num_warps=2, num_stages=2)
    key = tables.problem_class_key(specs[0].to_problem_shape())
    buckets = [tables.bucket_of(s.batch_size, s.kv_len) for s in specs]
    assert buckets[0] != buckets[1]
    entries = {}
    for spec, bucket, up_to_date in zip(specs, buckets, (True, False)):
        default = heuristic_config(spec.to_problem_shape(), 132)
        assert other != default
        entries[bucket] = tables.TableEntry(default, 10.0, 1.0, None, default if up_to_date else other,
                                            11.0, 0.9, tuned_batch_size=spec.batch_size)
    tables.merge_entries(paths.table, info, {key: entries}, {})
    grid = ["--batch-sizes", "1,3", "--kv-lens", "40", "--heads", "4:2", "--head-dim", "64"]
    args = [*grid, "--trials", "1", "--stale-only", "--out", str(out), "--isolation", "inline", *FAST]
    assert main(args) == 0
    assert "--stale-only: 1 of 2 buckets up to date" in capsys.readouterr().err
    tables.clear_cache()
    after = tables.load_table(paths.table).entries[key]
    assert after[buckets[0]] == entries[buckets[0]]  # kept as it was
    assert after[buckets[1]].time_us != 10.0  # re-tuned, against today's default
    assert after[buckets[1]].default_config == heuristic_config(specs[1].to_problem_shape(), 132)
    # Everything up to date now: a second run tunes nothing and leaves the table alone.
    before = paths.table.read_bytes()
    assert main(args) == 0
    assert "--stale-only: 2 of 2 buckets up to date" in capsys.readouterr().err
    assert paths.table.read_bytes() == before
