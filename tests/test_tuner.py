"""tsdecode-tune end to end on CPU (Triton interpreter): tables written and used, resume after a
kill, pruning of broken candidates, duplicates after fitting, CLI errors, the search space.

Timings in the interpreter mean nothing; these tests check the pipeline, not the winners.
"""

from __future__ import annotations

import os
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
])
def test_cli_errors_exit_2_with_a_message(argv, message, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing written


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
    assert space["block_m"] == (1, 2, 4, 8, 16)  # G*SQ = 4 rows: larger block_m is fitted away
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
