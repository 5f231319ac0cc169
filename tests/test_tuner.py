"""tsdecode-tune end to end on CPU (Triton interpreter): the table written to the user cache and
used by plans, what the run prints, resume after a kill, pruning of broken candidates, duplicates
after fitting, CLI errors, the search space.

Timings in the interpreter mean nothing; these tests check the pipeline, not the winners.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import torch

import tsdecode
from tsdecode.config import tables
from tsdecode.config.heuristic import heuristic_config
from tsdecode.config.space import KernelConfig, ProblemShape, fit_config
from tsdecode.config.tables import TableEntry
from tsdecode.device import CPU_NAME, DeviceProperties, device_properties
from tsdecode.reference import reference_decode
from tuner import buckets as tuner_buckets
from tuner import measure, search, space, study
from tuner.arguments import PROG
from tuner.cli import console_main, main
from tuner.grids import DTYPES, PRESETS, ShapeSpec
from tuner.table_writer import merge_entries

REPO = Path(__file__).resolve().parent.parent
HOOKS = f"{Path(__file__).resolve()}"
CPU = device_properties("cpu")
H200 = DeviceProperties("NVIDIA H200", 132, (9, 0))  # for the search space's arithmetic only
# One tiny class: B in {1, 3}, L = 40, Hq=4, Hkv=2, D=64 (fast in the interpreter).
TINY = ["--batch-sizes", "1", "--kv-lens", "40", "--heads", "4:2", "--head-dim", "64"]
FAST = ["--no-progress", "--retime-rounds", "1", "--top-k", "1"]

# The interpreter tests need TRITON_INTERPRET=1 from conftest, i.e. no GPU; on a GPU machine
# test_gpu_smoke_tuning_end_to_end runs the real thing instead.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode (interpreter) tuner test")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """A user cache of the test's own, no $TSDECODE_CONFIG_DIR, and TRITON_INTERPRET restored
    after the test (tuner.cli.select_device sets it for CPU runs)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(tables.CONFIG_DIR_ENV, raising=False)
    if "TRITON_INTERPRET" in os.environ:
        monkeypatch.setenv("TRITON_INTERPRET", os.environ["TRITON_INTERPRET"])
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.delenv("TRITON_INTERPRET")  # recorded as absent: undo deletes it again
    tables.clear_cache()
    yield
    tables.clear_cache()


# ---- fault-injection hooks (loaded by file path in the worker and compile processes) --------


def batch_3_fails_hook(stage, spec, config, out=None):
    """Every config of the batch-size-3 shapes fails to plan."""
    if stage == "plan" and spec.batch_size == 3:
        raise RuntimeError("injected plan error")


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
    if stage == "compile" and config != _fitted_default(spec):
        time.sleep(60)


def _fitted_default(spec):
    shape = spec.to_problem_shape()
    return fit_config(heuristic_config(shape, device_properties("cpu")), shape)[0]


def interrupt_the_default_hook(stage, spec, config, out=None):
    """Ctrl-C while the heuristic default is measured (inline: in the run's own process)."""
    if stage == "plan" and config == _fitted_default(spec):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)


def slower_default_hook(stage, spec, config, out=None):
    """Every config times 200 us, the heuristic default 300 us."""
    if stage == "time":
        return 300.0 if config == _fitted_default(spec) else 200.0


PLANNED = KernelConfig(block_n=32, block_m=16, num_kv_splits=2, num_warps=2, num_stages=2)


def planned_in_the_middle_hook(stage, spec, config, out=None):
    """The heuristic default times 300 us, PLANNED 250 us, every other config 200 us."""
    if stage == "time":
        return 300.0 if config == _fitted_default(spec) else 250.0 if config == PLANNED else 200.0


def planned_faster_the_rest_slow_to_compile_hook(stage, spec, config, out=None):
    """The heuristic default times 300 us, PLANNED 250 us; every other config compiles for 60 s."""
    if stage == "compile" and config not in (_fitted_default(spec), PLANNED):
        time.sleep(60)
    return planned_in_the_middle_hook(stage, spec, config, out)


# ---- helpers --------------------------------------------------------------------------------


def _records(work: Path, kind: str = "trial") -> list[dict]:
    (jsonl,) = work.glob("*_trials.jsonl")
    return [r for r in study.ResultLog.read(jsonl) if r.get("kind") == kind]


def _studies(work: Path) -> list[optuna.Study]:
    """The bucket studies of the default storage (a journal file) in ``work``."""
    (journal,) = work.glob("*_study.journal")
    storage = study.open_storage(str(journal))
    return [optuna.load_study(study_name=s.study_name, storage=storage)
            for s in optuna.get_all_study_summaries(storage) if not s.study_name.startswith("tsdecode-")]


def _finished(s: optuna.Study):
    return s.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED))


def _check_log_matches_storage(work: Path) -> None:
    """Every finished trial is in the log once, and no fitted config was measured twice (but for a
    timeout measured again under a larger --trial-timeout)."""
    recs = _records(work)
    pairs = [(r["study"], r["trial"]) for r in recs]
    assert len(pairs) == len(set(pairs)), "a trial was logged twice"
    for s in _studies(work):
        finished = _finished(s)
        logged = {r["trial"]: r for r in recs if r["study"] == s.study_name}
        assert sorted(logged) == sorted(t.number for t in finished), s.study_name
        for t in finished:
            assert logged[t.number]["state"] == t.state.name
            if t.state.name == "COMPLETE":
                assert logged[t.number]["time_us"] == pytest.approx(t.value)
        again = tuner_buckets.retried(s.trials)
        keys = [r["key"] for r in logged.values() if r["measured"] and r["trial"] not in again]
        assert len(keys) == len(set(keys)), "a fitted config was measured twice"


def _plan_and_run(spec: ShapeSpec, device: str = "cpu"):
    """A wrapper planned for ``spec`` the way a serving engine calls the public API (no config:
    what the runtime picks), its output's error against the reference."""
    inp = measure.make_inputs(spec, device, copies=1, seed=3)[0]
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(device, spec.batch_size, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size,
           spec.kv_len, q_data_type=DTYPES[spec.q_dtype], seq_lens=inp.seq_lens.tolist())
    out = w.run(inp.q, inp.cache, None, inp.block_tables)
    ref = reference_decode(inp.q, inp.cache, inp.block_tables, inp.seq_lens)
    return w, measure.relative_error(out, ref)


def _bare_tuner(out: Path) -> search.Tuner:
    """A Tuner on ``out`` without a measuring client (storage and log only)."""
    paths = study.OutputPaths.for_device(CPU.name, out)
    return search.Tuner(tuner_buckets.TuneSettings(), client=None, device=CPU, copy_bandwidth_gbs=None, paths=paths,
                        storage=study.open_storage(paths.storage), progress=False, heartbeat=study.Heartbeat(1, 60))


def _dead_stamp() -> dict:
    """The worker stamp of a process of this host that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return {"host": study.host_key(), "pid": proc.pid, "start": "0", "label": "gone"}


@cpu_only
def test_a_zombie_worker_counts_as_dead():
    """A killed run's worker can stay a zombie (its parent is gone and PID 1 need not reap it):
    a zombie's trials must be recovered, not waited on. Here the parent lives on and never
    reaps its exited child."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "c = subprocess.Popen([sys.executable, '-c', 'pass']); "
                               "print(c.pid, flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    child = int(parent.stdout.readline())
    stamp = {"host": study.host_key(), "pid": child, "start": None}
    try:
        deadline = time.monotonic() + 30
        while study.stamp_alive(stamp) is not False and time.monotonic() < deadline:
            time.sleep(0.05)  # the child exits at once; until then it is alive
        assert study.stamp_alive(stamp) is False
        assert study.stamp_alive({**stamp, "pid": os.getpid(), "start": None}) is True
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def _main_captured(argv) -> tuple[int, str, str]:
    """main(argv) with its stdout and stderr (also usable from module-scoped fixtures)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


# ---- the quick start: tsdecode-tune --preset smoke, defaults --------------------------------


SMOKE = ["--preset", "smoke", "--trials", "3", "--isolation", "inline", *FAST]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """``tsdecode-tune --preset smoke`` with the default output, from an empty working folder,
    with a user cache folder of its own."""
    home, cwd = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("cwd")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(home))
    mp.delenv(tables.CONFIG_DIR_ENV, raising=False)
    mp.chdir(cwd)
    try:
        rc, out, err = _main_captured(SMOKE)
    finally:
        mp.undo()
    user_dir = home / "tsdecode" / "tuned_configs"
    return SimpleNamespace(rc=rc, out=out, err=err, home=home, cwd=cwd, user_dir=user_dir,
                           table=user_dir / tables.table_filename(CPU_NAME), work=home / "tsdecode" / "tuning")


@pytest.fixture
def in_smoke_cache(smoke, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(smoke.home))
    monkeypatch.chdir(smoke.cwd)
    return smoke


@cpu_only
def test_smoke_tune_writes_the_user_cache_table_that_plans_then_use(in_smoke_cache):
    """Finding 1: the default output is the user cache folder, which plans on this device (the
    CPU included) search without being told; the run's last lines say so."""
    smoke = in_smoke_cache
    assert smoke.rc == 0, smoke.err
    assert smoke.table == tables.user_tables_dir() / "cpu_Triton_interpreter.json"
    table = tables.load_table(smoke.table)
    assert table is not None and not table.skipped and not table.stale
    specs = PRESETS["smoke"]
    assert sum(len(b) for b in table.entries.values()) == len(specs)
    for entry in (e for b in table.entries.values() for e in b.values()):
        assert entry.time_us > 0 and entry.default_time_us > 0
    last = smoke.err.strip().splitlines()[-3:]
    assert last[0] == f"table: {smoke.table}"
    assert last[1].startswith("plans on this device use it from now on: search order: $TSDECODE_CONFIG_DIR, "
                              f"the user cache ({smoke.user_dir.resolve()}), the shipped tables")
    assert "check with `tsdecode-tune explain --batch-size" in last[1]
    assert last[2].startswith("the smoke preset is 4 small test shapes; on a GPU, tune a model's shapes with "
                              "`tsdecode-tune --preset NAME` (one of llama3-8b, ")
    for spec in specs:
        w, err = _plan_and_run(spec)
        assert w.config.source == "table", str(w.config)
        assert w.config.table_path == str(smoke.table)
        assert w.config.bucket == tables.bucket_of(spec.batch_size, spec.kv_len)
        entry = table.entries[tables.problem_class_key(spec.to_problem_shape())][w.config.bucket]
        assert w.config.kernel_config == entry.kernel_config, (str(w.config), spec)
        assert err < measure.tolerance(spec)


@cpu_only
def test_smoke_tune_writes_nothing_into_the_working_folder(smoke):
    """Finding 4: the quick start leaves the working folder (e.g. a checkout) alone; logs and the
    study go under the user cache too."""
    assert smoke.rc == 0 and list(smoke.cwd.iterdir()) == []
    assert (smoke.work / "cpu_Triton_interpreter_trials.csv").stat().st_size > 0
    assert f"trial log: {smoke.work / 'cpu_Triton_interpreter_trials.jsonl'}" in smoke.err
    _check_log_matches_storage(smoke.work)
    buckets = {f"{b.class_key}|B{b.bucket[0]}_L{b.bucket[1]}": b for b in tuner_buckets.group_buckets(PRESETS["smoke"])}
    studies = _studies(smoke.work)
    assert sorted(s.study_name.rsplit("|", 1)[0] for s in studies) == sorted(buckets)
    for s in studies:
        assert s.user_attrs["final"]["ok"] and s.user_attrs["final"]["measured"] == 3
        first = s.trials[0]  # the heuristic default is always measured first
        assert first.user_attrs["measured"] and first.state.name == "COMPLETE"
        bucket = buckets[s.study_name.rsplit("|", 1)[0]]
        assert first.user_attrs["config"] == heuristic_config(bucket.shape, CPU).to_dict()


@cpu_only
def test_cpu_run_describes_the_cpu_not_an_h200(smoke):
    """Finding 2: output, table JSON and log describe this machine's CPU (name, cores)."""
    cores = os.cpu_count()
    assert f"device: 'cpu (Triton interpreter)' ({cores} CPU cores)" in smoke.err
    assert "SMs" not in smoke.err and "SMs" not in smoke.out  # (timings may hold any digits)
    data = json.loads(smoke.table.read_text())
    assert data["device"] == {"name": "cpu (Triton interpreter)", "sm_count": cores,
                              "compute_capability": [0, 0], "total_memory": 0}
    (run,) = _records(smoke.work, "run")
    assert run["device"] == data["device"] and run["device_name"] == "cpu (Triton interpreter)"


@cpu_only
def test_search_says_the_winner_was_retimed(smoke):
    """Finding 3: the best trial's time and the winner's are told apart."""
    lines = [ln for ln in smoke.err.splitlines() if "re-timed winner" in ln]
    assert len(lines) == len(PRESETS["smoke"])
    for line in lines:
        assert re.fullmatch(r"  best trial [\d.]+ us \(one short timing each\); re-timed winner "
                            r"block_n=\d+ block_m=\d+ num_kv_splits=\d+ num_warps=\d+ num_stages=\d+: [\d.]+ us "
                            r"\(median of 1 interleaved round of (the default alone|1 finalist and the default); .*\)",
                            line), line


@cpu_only
def test_configs_are_printed_by_their_field_names(smoke):
    """Finding 8: no unexplained codes (n16 m16 s4 w1 st5): KernelConfig's field names in the
    output, the summary table and the trials CSV."""
    for text in (smoke.err, smoke.out):
        assert "num_kv_splits=" in text
        assert not re.search(r"\bn\d+[ _]m\d+[ _]s\d+", text) and not re.search(r"\bst\d+\b", text)
    assert "block_n=" in smoke.out and "num_stages=" in smoke.out  # the summary table
    header = (smoke.work / "cpu_Triton_interpreter_trials.csv").read_text().splitlines()[0].split(",")
    assert {"block_n", "block_m", "num_kv_splits", "num_warps", "num_stages"} <= set(header)
    for rec in _records(smoke.work):
        assert rec["key"] == " ".join(f"{k}={v}" for k, v in rec["config"].items())


@cpu_only
def test_rerun_of_a_finished_run_measures_nothing(in_smoke_cache):
    before = len(_records(in_smoke_cache.work))
    rc, _, err = _main_captured(SMOKE)
    assert rc == 0
    assert len(_records(in_smoke_cache.work)) == before
    assert err.count("already tuned") == len(PRESETS["smoke"])


@cpu_only
def test_explain_subcommand_reads_the_user_cache_table(in_smoke_cache, capsys):
    rc = main(["explain", "--batch-size", "3", "--kv-len", "130", "--heads", "4:2", "--head-dim", "64"])
    text = capsys.readouterr().out
    assert rc == 0
    assert f"source: table {in_smoke_cache.table}" in text and "bucket (4, 256)" in text
    assert f"({os.cpu_count()} CPU cores)" in text


@cpu_only
def test_out_folder_says_how_to_point_the_runtime_at_it(tmp_path, monkeypatch):
    out = tmp_path / "elsewhere"
    rc, _, err = _main_captured([*TINY, "--trials", "1", "--out", str(out), "--isolation", "inline", *FAST])
    assert rc == 0
    table = out / "cpu_Triton_interpreter.json"
    last = err.strip().splitlines()[-1]
    assert err.strip().splitlines()[-2] == f"table: {table}"
    assert f"set TSDECODE_CONFIG_DIR={out.resolve()}" in last and "plans do not search" in last
    assert not tables.user_tables_dir().exists()  # nothing in the user cache
    w, _ = _plan_and_run(ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64))
    assert w.config.source == "heuristic"
    explain = ["explain", "--batch-size", "1", "--kv-len", "40", "--heads", "4:2", "--head-dim", "64"]
    rc, text, _ = _main_captured([*explain, "--config-dir", str(out)])
    assert rc == 0 and f"source: table {table}" in text
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(out.resolve()))
    w, _ = _plan_and_run(ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64))
    assert w.config.source == "table" and w.config.table_path == str(out.resolve() / table.name)


def test_without_the_tune_extra_one_line_and_exit_2(tmp_path):
    """Finding 5: optuna missing (an ``optuna`` module that fails to import, first on the path):
    one line naming the install command, exit code 2, no traceback."""
    fake = tmp_path / "no_optuna"
    fake.mkdir()
    (fake / "optuna.py").write_text("raise ImportError(\"No module named 'optuna'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(REPO)]),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "tuner", "--preset", "smoke"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert 'pip install "tsdecode[tune]"' in r.stderr and "optuna" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "cache").exists()


# ---- resume ---------------------------------------------------------------------------------


def _tune_in_a_process(out: Path, trials: int) -> tuple[list[str], dict, subprocess.Popen]:
    """(args, env, process) of a two-bucket CPU tune into ``out``, started as a child process."""
    args = [*TINY, "--batch-sizes", "1,3", "--trials", str(trials), "--block-m", "2,16", "--num-kv-splits", "1,2",
            "--num-warps", "4", "--num-stages", "2", "--out", str(out), *FAST]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tuner", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return args, env, proc


def _wait_for(logged, out: Path, proc: subprocess.Popen, seconds: float, what: str) -> None:
    """Poll until ``logged(out)`` holds while the run is alive; fail naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if out.exists() and list(out.glob("*_trials.jsonl")) and logged(out):
            return
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    pytest.fail(f"{what} in time")


@cpu_only
def test_resume_after_kill_loses_and_repeats_nothing(tmp_path):
    out = tmp_path / "resume"
    args, env, proc = _tune_in_a_process(out, trials=6)
    try:
        _wait_for(lambda out: len(_records(out)) >= 4, out, proc, 120, "no trials logged")
    finally:
        proc.kill()  # SIGKILL: no cleanup, like a crash
        proc.wait()
    worker = {"host": study.host_key(), "pid": _records(out, "run")[0]["worker_pid"], "start": None}
    for _ in range(100):  # the worker exits when its pipe closes (it may stay a zombie: gone too)
        if study.stamp_alive(worker) is False:
            break
        time.sleep(0.1)
    else:
        os.kill(worker["pid"], signal.SIGKILL)
    err = proc.stderr.read().decode()  # the measuring process shares it: it left quietly
    proc.stderr.close()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    before = _records(out)
    assert 4 <= len(before) and not _records(out, "final")

    # the resume runs in its own process under a deadline: a wait on the dead run fails, not hangs
    resumed = subprocess.run([sys.executable, "-m", "tuner", *args, "--isolation", "inline"], cwd=REPO,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    assert resumed.returncode == 0, resumed.stderr.decode()
    after = _records(out)
    assert after[: len(before)] == before  # nothing lost or rewritten
    _check_log_matches_storage(out)
    finals = _records(out, "final")
    assert len(finals) == 2 and all(f["ok"] for f in finals)
    for s in _studies(out):
        assert len([t for t in _finished(s) if t.user_attrs["measured"]]) == 6
        # the interrupted run's trials are kept (with their results), none is measured again
        for n, rec in {r["trial"]: r for r in before if r["study"] == s.study_name}.items():
            t = s.trials[n]
            assert t.state.name == rec["state"] and t.user_attrs["key"] == rec["key"]


@cpu_only
def test_recover_completes_a_running_trial_from_the_log(tmp_path):
    """A crash between logging a result and telling the study: the log completes the trial; a
    trial whose worker died without a result is failed and queued again; a live worker's trial
    is left alone."""
    tuner = _bare_tuner(tmp_path)
    try:
        s = optuna.create_study(storage=tuner.storage, study_name="s")
        dists = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in KernelConfig().to_dict().items()}
        done, lost, live = s.ask(dists), s.ask(dists), s.ask(dists)
        for t in (done, lost):
            t.set_user_attr("worker", _dead_stamp())
        live.set_user_attr("worker", study.worker_stamp())
        tuner.log.write({"kind": "trial", "study": "s", "trial": done.number, "state": "COMPLETE",
                         "time_us": 12.5, "key": "k", "config": KernelConfig().to_dict(), "measured": True})
        assert tuner._recover(s, "s") == [lost.number]
        trials = s.get_trials(deepcopy=False)
        assert trials[done.number].state.name == "COMPLETE" and trials[done.number].value == 12.5
        assert trials[done.number].user_attrs["key"] == "k"
        assert trials[lost.number].state.name == "FAIL" and trials[lost.number].user_attrs["interrupted"]
        assert trials[live.number].state.name == "RUNNING"
        (again,) = [t for t in trials if t.state.name == "WAITING"]
        assert again.user_attrs["retry_of"] == lost.number and again.system_attrs["fixed_params"] == lost.params
    finally:
        tuner.close()


@cpu_only
def test_recover_fails_a_trial_its_worker_never_stamped(tmp_path, monkeypatch):
    """A worker killed between taking a trial and stamping it leaves a RUNNING trial with no
    owner: once UNSTAMPED_GRACE_S has passed it is failed and queued again (a journal file has
    no heartbeats to tell), not waited on for the whole heartbeat grace; a fresh one is left."""
    tuner = _bare_tuner(tmp_path)
    try:
        s = optuna.create_study(storage=tuner.storage, study_name="s")
        dists = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in KernelConfig().to_dict().items()}
        orphan = s.ask(dists)
        assert tuner.heartbeat.grace > search.UNSTAMPED_GRACE_S
        assert tuner._recover(s, "s") == []  # just taken: its worker may be about to stamp it
        now = time.time()
        monkeypatch.setattr(search.time, "time", lambda: now + search.UNSTAMPED_GRACE_S + 1)
        assert tuner._recover(s, "s") == [orphan.number]
        trials = s.get_trials(deepcopy=False)
        assert trials[orphan.number].state.name == "FAIL"
        (again,) = [t for t in trials if t.state.name == "WAITING"]
        assert again.user_attrs["retry_of"] == orphan.number
    finally:
        tuner.close()


@cpu_only
def test_seeding_waits_while_the_creator_has_not_stamped_its_new_study(tmp_path):
    """Creating a study and stamping it "created_by" are two writes: a worker that loads the
    study in between must wait for the creator's seeds, not queue its own beside them (four
    workers on SQLite finished a grid point twice that way)."""
    tuner = _bare_tuner(tmp_path)
    try:
        s = optuna.create_study(storage=tuner.storage, study_name="s")  # created, not yet stamped

        def creator():
            time.sleep(0.5)
            s.set_user_attr("created_by", study.worker_stamp("creator"))
            time.sleep(0.5)
            s.set_user_attr("seeded", 0)

        thread = threading.Thread(target=creator)
        thread.start()
        t0 = time.monotonic()
        tuner._seed(s, None, "s", {}, KernelConfig(), use_grid=True)  # returns once seeded
        thread.join()
        assert 0.9 < time.monotonic() - t0 < search.SEED_WAIT_S
        assert s.get_trials(deepcopy=False) == []
    finally:
        tuner.close()


@cpu_only
def test_recover_ignores_trial_records_from_before_a_storage_reset(tmp_path):
    """Trial numbers restart in a new study DB: an old record of trial 0 must not complete the
    new trial 0 that a crash left RUNNING."""
    tuner = _bare_tuner(tmp_path)
    try:
        tuner.log.write({"kind": "trial", "study": "s", "trial": 0, "state": "COMPLETE",
                         "time_us": 12.5, "key": "k", "config": KernelConfig().to_dict(), "measured": True})
        tuner.log.write({"kind": "storage_reset", "storage": "x", "moved_to": "y"})
        s = optuna.create_study(storage=tuner.storage, study_name="s")
        trial = s.ask({"block_n": optuna.distributions.CategoricalDistribution([64])})
        trial.set_user_attr("worker", _dead_stamp())
        tuner._recover(s, "s")
        assert s.get_trials(deepcopy=False)[trial.number].state.name == "FAIL"
    finally:
        tuner.close()


def test_result_log_skips_damaged_lines(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"kind": "run"}\n\xff\xfe junk\n5\n[1]\n{"kind": "trial", "tri\n{"kind": "final"}\n')
    assert study.ResultLog.read(path) == [{"kind": "run"}, {"kind": "final"}]


@cpu_only
def test_sigterm_stops_a_run_as_ctrl_c_does(tmp_path):
    """timeout, Slurm, docker stop and systemd send SIGTERM: the run says so at once, writes the
    buckets it finished, exits 130 without a traceback, and a second signal breaks nothing."""
    out = tmp_path / "term"
    _, _, proc = _tune_in_a_process(out, trials=4)
    try:
        _wait_for(lambda out: _records(out, "final") and len(_records(out)) > len(_records(out, "final")) + 4,
                  out, proc, 240, "the first bucket did not finish")  # and the second has begun
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # impatient: must not break the writing
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err = stderr.decode()
    assert proc.returncode == 130, err
    assert "interrupted: stopping the measuring process and writing the finished buckets" in err
    assert "finished trials are saved" in err and "Traceback" not in err, err
    finals = {r["study"] for r in _records(out, "final")}
    table = tables.load_table(study.OutputPaths.for_device(CPU.name, out).table)
    assert table is not None and sum(len(b) for b in table.entries.values()) == len(finals) >= 1


@cpu_only
@pytest.mark.parametrize("command", ["tune", "worker"])
def test_an_error_a_library_raises_in_place_of_the_interrupt_still_ends_the_run_as_one(command, tmp_path,
                                                                                      monkeypatch, capsys):
    """A SIGTERM can land inside a library's cleanup, which then raises something else (Optuna's
    journal lock, interrupted in ``release``, raises FileNotFoundError): the run still ends as
    interrupted (exit 130, no traceback), not as a crash."""

    def interrupted_inside_a_lock(self, buckets, started=None):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt:
            raise FileNotFoundError("[Errno 2] No such file or directory: 'study.journal.lock'") from None
        raise AssertionError("no signal arrived")

    monkeypatch.setattr(search.Tuner, "run", interrupted_inside_a_lock)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    storage = str(tmp_path / "s.journal")
    try:
        if command == "worker":
            assert main(["create", "--storage", storage, "--job", "j", "--for", "cpu", *TINY]) == 0
            argv = ["worker", "--storage", storage, "--job", "j", "--out", str(tmp_path)]
        else:
            argv = [*TINY, "--out", str(tmp_path), "--no-progress"]
        assert main(argv) == 130
    finally:
        for sig, handler in handlers.items():  # the run ignores signals once one came
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert "interrupted" in err and "FileNotFoundError" not in err and "Traceback" not in err, err


@cpu_only
def test_an_interrupt_while_the_closing_files_are_written_exits_130(tmp_path, monkeypatch, capsys):
    """Ctrl-C / SIGTERM once the buckets are done, while the run writes the CSV: the usual line and
    exit code 130 (the table is written already), not a KeyboardInterrupt traceback."""

    def interrupted_writing(jsonl, csv):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        raise AssertionError("no signal arrived")

    monkeypatch.setattr(study, "write_trials_csv", interrupted_writing)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            rc = main([*TINY, "--trials", "2", "--out", str(tmp_path), "--isolation", "inline", *FAST])
        except KeyboardInterrupt:  # (before the fix: would end pytest's session)
            rc = "KeyboardInterrupt"
    finally:
        for sig, handler in handlers.items():  # the run ignores signals once one came
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert rc == 130, err
    assert err.endswith(f"{PROG}: interrupted; finished trials are saved, rerun the same command to resume\n"), err
    assert "Traceback" not in err and list(tmp_path.glob("*.json"))


@cpu_only
@pytest.mark.parametrize("where", ["closing the measuring process", "writing the table"])
def test_an_interrupt_after_the_search_still_writes_the_finished_buckets(where, tmp_path, monkeypatch, capsys):
    """Ctrl-C / SIGTERM once every bucket is final, while the run closes its measuring process or
    while it writes the table: the finished buckets still land in the table, with the usual line
    and exit code 130."""
    from tuner import job as tuner_job

    def interrupt_once(original):
        fired = []

        def patched(*args, **kwargs):
            if not fired:
                fired.append(1)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
                raise AssertionError("no signal arrived")
            return original(*args, **kwargs)
        return patched

    if where == "writing the table":
        monkeypatch.setattr(tuner_job, "export", interrupt_once(tuner_job.export))
    else:
        monkeypatch.setattr(search.Tuner, "close", interrupt_once(search.Tuner.close))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            rc = main([*TINY, "--trials", "2", "--out", str(tmp_path), "--isolation", "inline", *FAST])
        except KeyboardInterrupt:  # (before the fix: would end pytest's session)
            rc = "KeyboardInterrupt"
    finally:
        for sig, handler in handlers.items():  # the run ignores signals once one came
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert rc == 130, err
    assert err.endswith(f"{PROG}: interrupted; finished trials are saved, rerun the same command to resume\n"), err
    assert "Traceback" not in err, err
    table = tables.load_table(study.OutputPaths.for_device(CPU.name, tmp_path).table)
    assert table is not None and sum(len(b) for b in table.entries.values()) == 1, err


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the signal mask from /proc")
def test_the_command_ignores_a_late_interrupt_while_the_process_exits(monkeypatch, capsys):
    """``tsdecode-tune`` (``console_main``): once main returns, Ctrl-C and SIGTERM are ignored, so a
    late signal cannot cut torch's exit-time cleanup short with a traceback (the work is written)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(sys, "argv", [PROG, "explain", "--batch-size", "1", "--kv-len", "40", "--heads", "4:2",
                                      "--head-dim", "64"])
    try:
        assert console_main() == 0
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in handlers)
        os.kill(os.getpid(), signal.SIGINT)  # ignored: no KeyboardInterrupt here
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert "config: KernelConfig(" in capsys.readouterr().out


def test_advised_commands_quote_paths_for_a_shell(tmp_path):
    """The run's closing advice and the join command are pasted into a shell: a path with a space
    stays one word."""
    import shlex

    from tuner.run import join_command, where_the_table_is_used

    folder = tmp_path / "with space"
    lines = where_the_table_is_used(folder / "cpu_Triton_interpreter.json", PRESETS["smoke"][0])
    command = lines[-1].split("check with `")[1].rstrip("`")
    env, *argv = shlex.split(command)
    assert env == f"{tables.CONFIG_DIR_ENV}={folder.resolve()}" and argv[:2] == [PROG, "explain"]
    assert shlex.split(join_command(folder / "s.journal", "j 1"))[2:] == [
        "--storage", str(folder / "s.journal"), "--job", "j 1"]


def test_an_interrupt_while_torch_imports_exits_130_without_a_traceback(tmp_path):
    """SIGINT in the first second (``select_device`` importing torch): one line, exit code 130."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "tuner", *TINY, "--out", str(tmp_path / "out")], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # main's handlers are in: SIGTERM is caught (bit 15 of SigCgt)
            caught = next(line for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                          if line.startswith("SigCgt:"))
            if int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # 130, or (now and then, when the interrupt lands inside torch's import) CPython ending the
    # process by SIGINT after main returned: a shell reports both as status 130.
    assert proc.returncode in (130, -signal.SIGINT), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "interrupted" in err, err


@cpu_only
def test_a_second_tuner_on_the_same_study_exits_2(tmp_path, capsys):
    """One run (``tune``) per study storage: the second neither touches the first's RUNNING
    trials nor races it creating the storage. The lock dies with its holder: a leftover lock
    file is harmless. (Workers joining the run's job take no such lock.)"""
    paths = study.OutputPaths.for_device(CPU.name, tmp_path)
    first = study.lock_study(paths)
    try:
        s = optuna.create_study(storage=study.open_storage(paths.storage), study_name="s")
        live = s.ask({"block_n": optuna.distributions.CategoricalDistribution([64])})
        with pytest.raises(study.StudyBusy, match="another tuner is using .*_study.journal"):
            study.lock_study(paths)
        assert main([*TINY, "--trials", "2", "--out", str(tmp_path), "--isolation", "inline", *FAST]) == 2
        err = capsys.readouterr().err
        assert "tsdecode-tune: error: another tuner is using" in err
        # the advice keeps the table where it is: a storage of its own, not another --out
        assert f"--storage FILE.journal): its buckets are still merged into {paths.table}" in err
        assert "Traceback" not in err and not list(tmp_path.glob("*_trials.jsonl"))
        assert "grid:" not in err and "table:" not in err  # refused before the run's header lines
        assert s.get_trials(deepcopy=False)[live.number].state.name == "RUNNING"
    finally:
        first.release()
    assert paths.lock.exists()
    study.lock_study(paths).release()  # released; the file left behind blocks nothing
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; f = open(sys.argv[1], 'a+b'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); os.kill(os.getpid(), 9)", str(paths.lock)])
    assert holder.wait(timeout=60) == -signal.SIGKILL
    study.lock_study(paths).release()  # a killed holder's lock is gone with it


@cpu_only
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (no files can be created there)")
@pytest.mark.parametrize("storage, lock, why", [
    ("/proc/x.journal", "/proc/x.journal.tuner.lock", "No such file or directory"),
    ("sqlite:////proc/x.db", "/proc/x.db.tuner.lock", "No such file or directory"),
    ("FILE/sub/x.journal", "FILE/sub/x.journal.tuner.lock", "FILE is not a folder"),
])
def test_a_run_lock_that_cannot_be_created_is_named_not_taken_for_another_tuner(storage, lock, why, tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("")
    storage, lock, why = (x.replace("FILE", str(file)) for x in (storage, lock, why))
    assert main([*TINY, "--trials", "2", "--out", str(tmp_path / "out"), "--storage", storage, "--isolation", "inline",
                 *FAST]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"tsdecode-tune: error: study storage {storage}: cannot create its run lock {lock} ({why})\n"), err
    assert "another tuner" not in err and "Traceback" not in err


@cpu_only
@pytest.mark.parametrize("name, content, message", [
    ("build.log", b"make: *** [all] Error 1\n", "study storage '{path}': not a storage URL (sqlite:///FILE.db, "
     "postgresql://USER@HOST:PORT/DB) nor a journal file (a path ending in .journal)"),
    ("notes.journal", b"my notes\n", "study storage {path}: not an Optuna journal (line 1 is not JSON); a file the "
     "tuner does not recognise as its own is left alone: pass another --storage or move it away"),
    ("folder.journal", None, "study storage {path}: not an Optuna journal (not a regular file); a file the tuner "
     "does not recognise as its own is left alone"),
    ("notes.db", b"my notes\n" * 100, "study storage sqlite:///{path}: not an SQLite database (file is not a "
     "database); a file the tuner does not recognise as its own is left alone"),
], ids=["log", "text-journal", "folder-journal", "text-db"])
def test_a_file_the_tuner_does_not_recognise_is_refused_not_moved_aside(name, content, message, tmp_path, capsys):
    """Only paths ending in .journal are journal storages, and only a file that starts as a journal
    (or an SQLite database) or is the journal the tuner names itself is moved aside when damaged:
    a user's file given as --storage, or a folder, is refused in one line and left as it was."""
    path = tmp_path / name
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    storage = f"sqlite:///{path}" if name.endswith(".db") else str(path)
    assert main([*TINY, "--trials", "2", "--out", str(tmp_path / "out"), "--storage", storage, "--isolation", "inline",
                 *FAST]) == 2
    err = capsys.readouterr().err
    assert f"tsdecode-tune: error: {message.format(path=path)}" in err and err.count("tsdecode-tune: error") == 1, err
    assert "Traceback" not in err and "moved aside" not in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(name)) in ([name], [name, f"{name}.tuner.lock"])
    assert path.is_dir() if content is None else path.read_bytes() == content


@cpu_only
def test_a_damaged_journal_that_starts_as_one_is_moved_aside_under_any_name(tmp_path, capsys):
    storage = tmp_path / "mine.journal"
    argv = [*TINY, "--trials", "2", "--out", str(tmp_path / "out"), "--storage", str(storage), "--isolation", "inline",
            *FAST]
    assert main(argv) == 0
    with open(storage, "ab") as f:
        f.write(os.urandom(64) + b"\n")
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    (aside,) = tmp_path.glob("mine.journal.corrupt-*")
    assert err.count("warning: study storage") == 1 and str(aside) in err and "already tuned" in err, err


@cpu_only
def test_corrupt_study_db_is_moved_aside_and_finished_buckets_are_kept(smoke, tmp_path, capsys):
    out = tmp_path / "copy"
    shutil.copytree(smoke.work, out)
    shutil.copy(smoke.table, out)
    (db,) = out.glob("*_study.journal")
    db.write_bytes(os.urandom(4096))
    before = _records(out)
    argv = [*SMOKE, "--out", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    (aside,) = out.glob("*_study.journal.corrupt-*")
    assert err.count("warning: study storage") == 1 and str(aside) in err and "Traceback" not in err
    assert err.count("already tuned") == len(PRESETS["smoke"])  # from the log: nothing re-tuned
    assert _records(out) == before  # nothing measured again
    (table_path,) = out.glob("*.json")
    assert sum(len(b) for b in tables.load_table(table_path).entries.values()) == len(PRESETS["smoke"])
    assert all(s.user_attrs["final"]["ok"] for s in _studies(out))  # carried into the new DB
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and err.count("already tuned") == len(PRESETS["smoke"])


@cpu_only
@pytest.mark.parametrize("record, why", [('{"op_code": 99}', "AssertionError"),
                                         ('{"op_code": 5, "worker_id": "x"}', "KeyError: 'trial_id'")])
def test_a_journal_record_optuna_cannot_replay_is_damage_too(record, why, smoke, tmp_path, capsys):
    """Valid JSON that Optuna's replay fails on (an unknown operation, a trial that does not exist):
    ``worker`` and ``export`` say so in one line (exit 2); ``tune`` moves the journal aside with one
    warning, as any damaged study file, and continues from the log."""
    out = tmp_path / "copy"
    shutil.copytree(smoke.work, out)
    shutil.copy(smoke.table, out)
    (journal,) = out.glob("*_study.journal")
    lines = journal.read_text().count("\n")
    with open(journal, "a") as f:
        f.write(record + "\n")
    job = _records(out, "run")[0]["job"]
    for argv in (["export", "--storage", str(journal), "--job", job, "--out", str(tmp_path / "export")],
                 ["worker", "--storage", str(journal), "--job", job, "--out", str(tmp_path / "worker")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == (f"tsdecode-tune: error: study storage {journal}: cannot read the journal (line {lines + 1} is a "
                       f"record Optuna cannot replay: {why}" + err.split(why, 1)[-1]), err
        assert err.count("\n") == 1
    before = _records(out)
    assert main([*SMOKE, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    (aside,) = out.glob("*_study.journal.corrupt-*")
    assert err.count("warning: study storage") == 1 and f"line {lines + 1} is a record Optuna cannot replay" in err
    assert str(aside) in err and "Traceback" not in err
    assert err.count("already tuned") == len(PRESETS["smoke"]) and _records(out) == before  # nothing measured again


@cpu_only
def test_a_final_record_whose_entry_the_runtime_would_skip_is_not_reused(tmp_path, capsys):
    """A ``final`` in the log with a winner outside the space (an edited or damaged log), reused after
    the study storage is gone: passed over with one warning and its bucket tuned again; the table
    holds every bucket. A bad final in the storage itself (a winner outside the space, a field
    missing): export leaves that bucket out with one warning and writes the others."""
    out = tmp_path / "out"
    argv = [*TINY, "--batch-sizes", "1,3", "--trials", "2", "--out", str(out), "--isolation", "inline", *FAST]
    assert main(argv) == 0
    capsys.readouterr()
    (log,) = out.glob("*_trials.jsonl")
    (journal,) = out.glob("*_study.journal")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    bad = next(r for r in records if r["kind"] == "final")
    bad["winner"]["block_n"] = 7
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    journal.unlink()
    next(out.glob("*.json")).unlink()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "Traceback" not in err, err
    assert (f"a final record of bucket {tuple(bad['bucket'])}" in err and "is not reused: KernelConfig.block_n must be "
            "one of (16, 32, 64, 128, 256), got 7; tuning the bucket again" in err), err
    assert err.count("already tuned") == 1
    (table_path,) = out.glob("*.json")
    entries = tables.load_table(table_path).entries
    assert sum(len(b) for b in entries.values()) == 2
    assert all(e.kernel_config.block_n != 7 for b in entries.values() for e in b.values())
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and err.count("already tuned") == 2

    storage = study.open_storage(str(journal))
    s = optuna.load_study(study_name=bad["study"], storage=storage)
    s.set_user_attr("final", {**s.user_attrs["final"], "winner": bad["winner"]})
    job = _records(out, "run")[-1]["job"]
    assert main(["export", "--storage", str(journal), "--job", job, "--out", str(tmp_path / "export")]) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "its final in the study storage is not written to the table" in err, err
    assert "got 7" in err and "Traceback" not in err
    (exported,) = (tmp_path / "export").glob("*.json")
    assert sum(len(b) for b in tables.load_table(exported).entries.values()) == 1
    # a final missing a field: left out the same way, no KeyError
    s.set_user_attr("final", {k: v for k, v in s.user_attrs["final"].items() if k != "time_us"})
    assert main(["export", "--storage", str(journal), "--job", job, "--out", str(tmp_path / "export2")]) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "not a final record (KeyError: 'time_us')" in err, err
    (exported,) = (tmp_path / "export2").glob("*.json")
    assert sum(len(b) for b in tables.load_table(exported).entries.values()) == 1


# ---- failing candidates ---------------------------------------------------------------------


def _grid_trials(spec: ShapeSpec, **limits) -> int:
    """The size of the tuner's space for ``spec`` with these limits (the default included)."""
    shape = spec.to_problem_shape()
    default = heuristic_config(shape, CPU)
    return space.space_size(space.build_space(shape, CPU.sm_count, space.SpaceLimits(**limits), default))


@cpu_only
def test_broken_candidates_are_pruned_with_reasons(tmp_path, monkeypatch):
    # A default inside the grid's limits (the heuristic's own choice for this shape lies outside
    # them and would widen the grid), so the grid is exactly block_n x block_m.
    fixed_default = KernelConfig(block_n=64, block_m=16, num_kv_splits=1, num_warps=4, num_stages=2)
    fixed = lambda shape, *_: fit_config(fixed_default, shape)[0]  # noqa: E731
    for module in (tuner_buckets, sys.modules[__name__]):  # search.py uses buckets.bucket_space
        monkeypatch.setattr(module, "heuristic_config", fixed)
    out = tmp_path / "broken"
    trials = _grid_trials(ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64),
                          block_m=(2, 16), num_kv_splits=(1,), num_warps=(4,), num_stages=(2,))
    rc = main([*TINY, "--trials", str(trials), "--block-m", "2,16", "--num-kv-splits", "1", "--num-warps", "4",
               "--num-stages", "2", "--out", str(out), "--compile-workers", "1", "--isolation", "process",
               "--inject-hook", f"{HOOKS}:broken_configs_hook", *FAST])
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
    (s,) = _studies(out)
    pruned = [t for t in s.trials if t.state.name == "PRUNED"]
    assert len([t for t in pruned if t.user_attrs["measured"]]) == 6
    assert all(t.user_attrs["prune_reason"] for t in pruned)
    (table_path,) = out.glob("*.json")
    (entries,) = tables.load_table(table_path).entries.values()
    (entry,) = entries.values()
    c = entry.kernel_config
    assert (c.block_n, c.block_m) in ok or (c.block_n, c.block_m) not in recs


@cpu_only
def test_a_run_with_a_bucket_that_found_no_valid_config_exits_1(tmp_path, capsys):
    """The tuned buckets are written; the exit code says that not every bucket was."""
    out = tmp_path / "partial"
    rc = main(["--batch-sizes", "1,3", "--kv-lens", "40", "--heads", "4:2", "--head-dim", "64", "--trials", "2",
               "--out", str(out), "--isolation", "inline", "--inject-hook", f"{HOOKS}:batch_3_fails_hook", *FAST])
    assert rc == 1, capsys.readouterr().err
    assert "1/2 buckets tuned" in capsys.readouterr().err
    (table_path,) = out.glob("*.json")
    (entries,) = tables.load_table(table_path).entries.values()
    assert list(entries) == [tables.bucket_of(1, 40)]


@cpu_only
def test_fitted_duplicates_are_not_measured_twice(tmp_path):
    # L=40 is 3 tiles of 16 but 1 tile of 64: splits 2 and 3 are fitted down at block_n 64.
    spec = ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    d = heuristic_config(spec.to_problem_shape(), CPU)
    limits = dict(block_n=(16, 64), block_m=(d.block_m,), num_kv_splits=(2, 3), num_warps=(d.num_warps,),
                  num_stages=(d.num_stages,))
    trials = _grid_trials(spec, **limits)
    out = tmp_path / "dup"
    rc = main([*TINY, "--trials", str(trials), "--block-n", "16,64", "--block-m", str(d.block_m),
               "--num-kv-splits", "2,3", "--num-warps", str(d.num_warps), "--num-stages", str(d.num_stages),
               "--out", str(out), "--isolation", "inline", *FAST])
    assert rc == 0
    recs = _records(out)
    shape = spec.to_problem_shape()
    fitted = {}
    for r in recs:
        config, changes = fit_config(KernelConfig(**r["params"]), shape)
        assert r["config"] == config.to_dict() and bool(r["adjustments"]) == bool(changes)
        fitted.setdefault(r["key"], []).append(r)
    assert len({tuple(r["params"].values()) for r in recs}) == trials  # the whole grid
    for group in fitted.values():
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
    rc = main([*TINY, "--trials", "20", "--time-budget", "6", "--compile-workers", "2", "--out", str(out),
               "--isolation", "inline", "--inject-hook", f"{HOOKS}:slow_compile_hook", *FAST])
    assert rc == 0
    assert time.monotonic() - t0 < 40  # not waiting for the 60 s compiles
    recs = _records(out)
    assert [r["is_default"] for r in recs if r["measured"]] == [True]  # only the default
    (s,) = _studies(out)
    skipped = [t for t in s.trials if t.user_attrs.get("skipped")]
    assert skipped and all(t.state.name == "FAIL" for t in skipped)
    (final,) = _records(out, "final")
    assert final["ok"] and final["kept_default"]


@cpu_only
def test_a_time_budget_used_up_on_a_grid_with_duplicates_of_the_default_still_finishes(tmp_path):
    """At L=40 the grid's splits 2 and 3 at block_n 64 fit down to the default's 1: out of time,
    those queued duplicates are dropped with the rest of the queue (keeping them for the default's
    measurement left the grid's queue never empty: the run and every rerun waited forever)."""
    out = tmp_path / "grid"
    args = [*TINY, "--block-n", "16,64", "--block-m", "16", "--num-warps", "4", "--num-stages", "2", "--trials", "6",
            "--time-budget", "1", "--out", str(out), "--isolation", "inline", *FAST]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TRITON_INTERPRET": "1"}
    for run in ("run", "rerun"):  # in a process of its own under a deadline: a hang fails, not hangs
        try:
            r = subprocess.run([sys.executable, "-m", "tuner", *args], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=120)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"the {run} did not finish: {(e.stderr or b'')[-2000:]!r}")
        assert r.returncode == 0, r.stderr[-4000:]
    assert "already tuned" in r.stderr
    (s,) = _studies(out)
    default_key = space.config_text(_fitted_default(ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)))
    dropped = [t for t in s.trials if t.user_attrs["key"] == default_key and not t.user_attrs.get("measured")]
    assert dropped and all(t.state.name == "FAIL" and t.user_attrs["skipped"] for t in dropped)
    assert not s.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    (final,) = _records(out, "final")
    assert final["ok"] and final["measured"] == 1 and final["kept_default"]


@cpu_only
def test_a_default_interrupted_mid_measurement_is_measured_first_by_the_rerun(tmp_path):
    """Ctrl-C while a bucket's default is measured queues it again behind the seeds: the rerun
    measures it first all the same (not after --trials seeds, i.e. never), and the winner is
    re-timed against it, as in a run never interrupted."""
    out = tmp_path / "again"
    # --num-kv-splits 1: no seed but the default fits to the default (L=40 is one tile of 64).
    args = [*TINY, "--trials", "2", "--num-kv-splits", "1", "--out", str(out), "--isolation", "inline", *FAST]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "tuner", *args, "--inject-hook", f"{HOOKS}:interrupt_the_default_hook"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 130 and "interrupted" in r.stderr, r.stderr[-4000:]
    (s,) = _studies(out)
    assert s.trials[0].state.name == "RUNNING" and not _records(out)  # its worker is gone: the rerun retries it
    assert main([*args, "--inject-hook", f"{HOOKS}:slower_default_hook"]) == 0
    measured = [r for r in _records(out) if r["measured"]]
    assert [r["is_default"] for r in measured] == [True, False]
    (final,) = _records(out, "final")
    assert (final["default_time_us"], final["time_us"]) == pytest.approx((300.0, 200.0)) and not final["kept_default"]
    assert "not measured" not in final["note"]
    (entries,) = tables.load_table(study.OutputPaths.for_device(CPU.name, out).table).entries.values()
    (entry,) = entries.values()
    assert entry.default_time_us / entry.time_us == pytest.approx(1.5)
    _check_log_matches_storage(out)


@cpu_only
def test_a_config_that_ran_past_the_trial_timeout_is_measured_again_under_a_larger_one(tmp_path):
    """A prune for running past --trial-timeout is a verdict on the timeout, not on the config: a
    rerun with a larger timeout measures it again (here every config, the default included: the
    bucket found no valid config, and the rerun tunes it); one with the same or a smaller timeout
    leaves it pruned (no endless retries)."""
    out = tmp_path / "slow"
    spec = ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    limits = dict(block_n=(16, 64), block_m=(16,), num_kv_splits=(1,), num_warps=(4,), num_stages=(2,))
    assert _grid_trials(spec, **limits) == 2  # the default and one other config
    args = [*TINY, "--block-n", "16,64", "--block-m", "16", "--num-kv-splits", "1", "--num-warps", "4",
            "--num-stages", "2", "--trials", "2", "--out", str(out), "--isolation", "process", "--compile-workers",
            "0", *FAST]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TRITON_INTERPRET": "1"}

    def tune(*extra):  # in a process of its own under a deadline: a hang fails, not hangs
        try:
            return subprocess.run([sys.executable, "-m", "tuner", *args, *extra], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"the run did not finish: {(e.stderr or b'')[-2000:]!r}")

    measured = lambda: [r for r in _records(out) if r["measured"]]  # noqa: E731
    r = tune("--trial-timeout", "1e-9")  # every config times out, the default included
    assert r.returncode == 1 and "0/1 buckets tuned" in r.stderr, r.stderr[-4000:]
    assert [r["state"] for r in measured()] == ["PRUNED", "PRUNED"]
    r = tune("--trial-timeout", "1e-9")  # the same timeout: nothing is measured again
    assert r.returncode == 1 and "0/1 buckets tuned" in r.stderr, r.stderr[-4000:]
    assert len(measured()) == 2
    r = tune()  # the default timeout: the same command measures both configs again and tunes the bucket
    assert r.returncode == 0 and "1/1 buckets tuned" in r.stderr, r.stderr[-4000:]
    first, again = measured()[:2], measured()[2:]
    assert all(r["prune_reason"].startswith("timeout") and r["timeout_s"] == 1e-9 for r in first)
    assert sorted(r["key"] for r in again) == sorted(r["key"] for r in first)
    assert all(r["state"] == "COMPLETE" and r["timeout_s"] is None for r in again)
    assert [r["is_default"] for r in again].count(True) == 1
    final = _records(out, "final")[-1]
    assert final["ok"] and final["measured"] == 2 and final["pruned"] == 0 and "not measured" not in final["note"]
    (entries,) = tables.load_table(study.OutputPaths.for_device(CPU.name, out).table).entries.values()
    assert list(entries) == [tables.bucket_of(1, 40)]
    r = tune("--trial-timeout", "1e-9")  # a smaller timeout again: the bucket is done
    assert r.returncode == 0 and "already tuned (2 configs measured)" in r.stderr, r.stderr[-4000:]
    assert len(measured()) == 4
    _check_log_matches_storage(out)


def test_a_bucket_is_not_complete_while_its_default_waits_in_the_queue(tmp_path):
    """Another worker can fill the budget before a dead worker's default (or the config plans
    take today: both are kept) is queued again: the bucket then waits for its measurement
    instead of being finalised without it."""
    tuner = _bare_tuner(tmp_path)
    tuner.s = tuner_buckets.TuneSettings(trials=1)
    try:
        s = optuna.create_study(storage=tuner.storage, study_name="s")
        s.set_user_attr("seeded", 2)
        dists = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in KernelConfig().to_dict().items()}
        other = s.ask(dists)
        for k, v in {"key": "other", "measured": True}.items():
            other.set_user_attr(k, v)
        s.tell(other, 10.0)  # the budget of 1 measured config is used up
        s.enqueue_trial(KernelConfig().to_dict(), user_attrs={"key": "default", "retry_of": 0})
        assert not tuner._complete(s, False, ("default",))
        assert not tuner._complete(s, False, ("other", "default"))  # what plans take today waits
        assert tuner._complete(s, False, ("other",))  # its default measured: complete
    finally:
        tuner.close()


# ---- command line ---------------------------------------------------------------------------


@cpu_only
@pytest.mark.parametrize("argv, message", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--batch-sizes", "1,x", "--kv-lens", "64"], "comma-separated list of integers"),
    (["--batch-sizes", "0", "--kv-lens", "64"], "expected positive integers"),
    (["--batch-sizes", "4"], "--kv-lens missing: a custom grid needs both batch sizes and K/V lengths"),
    (["--kv-lens", "64"], "--batch-sizes missing: a custom grid needs both batch sizes and K/V lengths"),
    (["--batch-sizes", "abc"], "--batch-sizes: expected a comma-separated list of integers, got 'abc'"),
    (["--batch-sizes", "1,,2", "--kv-lens", "64"], "--batch-sizes: expected a comma-separated list of integers, "
                                                   "got '1,,2' (an empty item)"),
    (["--batch-sizes", "1", "--kv-lens", "64,"], "got '64,' (an empty item)"),
    # a causal query longer than its K/V cannot run: refused before any work, not pruned trial by trial
    (["--batch-sizes", "1", "--kv-lens", "2,64", "--seq-len-q", "4", "--mask", "causal"],
     "--seq-len-q 4 exceeds the shortest of --kv-lens, 2: a causal mask needs every request's query length <= "
     "its K/V length"),
    # a custom grid's flag beside a preset shaped nothing: refused, not ignored
    (["--preset", "smoke", "--page-sizes", "32"], "--page-sizes shapes a custom grid only: give it with --batch-sizes"),
    (["--preset", "smoke", "--heads", "4:3"], "--heads shapes a custom grid only"),
    (["--trials", "0"], "--trials: expected an integer >= 1"),
    (["--top-k", "0"], "--top-k: expected an integer >= 1"),  # no finalist: the search's winner thrown away
    (["--block-n", "48"], "--block-n [48] not in"),
    (["--num-kv-splits", "2000"], "--num-kv-splits [2000] not in [1, 1024]"),
    (["--num-warps", "1,x"], "--num-warps: expected a comma-separated list of integers"),
    (["--time-budget", "-3"], "expected a number > 0"),
    (["frobnicate"], "unrecognized arguments"),
    (["--trial-timeout", "nan"], "--trial-timeout: expected a finite number, got 'nan'"),
    (["--trial-timeout", "inf"], "--trial-timeout: expected a finite number, got 'inf'"),
    (["--time-budget", "nan"], "--time-budget: expected a finite number, got 'nan'"),
    ([*TINY, "--head-dim", "100"], "--head-dim: [100] not supported; one of [64, 96, 128"),
    ([*TINY, "--kv-dtypes", "fp8"], "--kv-dtypes: unknown dtype(s) ['fp8']"),
    ([*TINY, "--heads", "4:3"], "--heads: 4:3: HQ must be a multiple of HKV"),
    ([*TINY, "--config-dir", "x"], "--config-dir is a flag of explain, not of tune"),
    # finite but too large for the run's waits and arithmetic (NaN heartbeats, a poll's overflow)
    (["--trial-timeout", "1e308"], "--trial-timeout: expected a number <= 604800 (a week), got '1e308'"),
    (["--trial-timeout", "1e200"], "--trial-timeout: expected a number <= 604800 (a week), got '1e200'"),
    (["--heartbeat-grace", "1e300"], "--heartbeat-grace: expected a number <= 604800 (a week), got '1e300'"),
    (["--time-budget", "1e300"], "--time-budget: expected a number <= 31536000 (a year), got '1e300'"),
    (["--replay-ms", "1e308"], "--replay-ms: expected a number <= 60000 (a minute), got '1e308'"),
    (["--trials", "9" * 400], "--trials: expected an integer <= 9223372036854775807, got '999"),
    (["--top-k", "9" * 400], "--top-k: expected an integer <= 9223372036854775807, got '999"),
    (["--seed", "9" * 400], "--seed: expected an integer <= 9223372036854775807, got '999"),
    (["--compile-workers", "100000"], "--compile-workers: expected an integer <= 256, got '100000'"),
    ([*TINY, "--batch-sizes", "9" * 400], "--batch-sizes, --seq-len-q, --heads and --head-dim: B*SQ*Hq*D = 999"),
    ([*TINY, "--kv-lens", "100000000000"], "--kv-lens must be <= 2147483392, got 100000000000"),
    ([*TINY, "--seq-len-q", "9" * 400], "--batch-sizes, --seq-len-q, --heads and --head-dim: B*SQ*Hq*D = 1*999"),
    ([*TINY, "--mask", "causal", "--window-left", "9" * 400], "--window-left: expected -1 (no window) or at most"),
])
def test_cli_errors_exit_2_with_a_message(argv, message, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists() and not tables.user_tables_dir().exists()  # nothing written


MEMORY = "names no database file (an in-memory database keeps nothing to resume or share with other workers)"


@pytest.mark.parametrize("argv, message", [
    ([*TINY, "--storage", "sqlite:///", "--out", "OUT"], f"tsdecode-tune: error: study storage 'sqlite:///': {MEMORY}"),
    ([*TINY, "--storage", "sqlite://", "--out", "OUT"], f"tsdecode-tune: error: study storage 'sqlite://': {MEMORY}"),
    ([*TINY, "--storage", "sqlite:///:memory:", "--out", "OUT"], "study storage 'sqlite:///:memory:': names no"),
    (["create", "--storage", "sqlite:///", *TINY], f"tsdecode-tune: error: study storage 'sqlite:///': {MEMORY}"),
    (["worker", "--storage", "sqlite:///", "--job", "j"], f"tsdecode-tune: error: study storage 'sqlite:///': {MEMORY}"),
    ([*TINY, "--out", ""], "tsdecode-tune tune: error: --out: expected a value, got '' (leave the flag out for its "
     "default)"),
    ([*TINY, "--devices", "", "--out", "OUT"], "tsdecode-tune tune: error: --devices: expected a value, got ''"),
    ([*TINY, "--grid-file", " ", "--out", "OUT"], "tsdecode-tune tune: error: --grid-file: expected a value, got ' '"),
    (["worker", "--storage", "S", "--job", "j", "--out", ""], "tsdecode-tune worker: error: --out: expected a value"),
    (["export", "--storage", "", "--job", "j"], "tsdecode-tune export: error: --storage: expected a value, got ''\n"),
])
def test_empty_values_and_in_memory_storages_are_refused(argv, message, tmp_path, monkeypatch, capsys):
    """An in-memory SQLite storage keeps nothing (no resume, no other worker) and used to leave a
    lock file in the parent folder; an empty --out meant the user cache, an empty --devices one
    process: one line each, exit code 2, nothing written."""
    cwd = tmp_path / "cwd" / "sub"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    argv = [{"OUT": str(tmp_path / "out"), "S": str(tmp_path / "s.journal")}.get(a, a) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not tables.user_tables_dir().exists()
    assert sorted(p.name for p in (tmp_path / "cwd").rglob("*")) == ["sub"]


@pytest.mark.parametrize("argv, owners", [
    (["--out", "OUT"], "tune, worker and export"),
    (["--out=OUT"], "tune, worker and export"),
    (["--device", "cuda:3"], "tune and explain"),
    (["--devices", "all"], "tune and worker"),
    (["--compile-workers", "2"], "tune and worker"),
    (["--isolation", "inline"], "tune and worker"),
    (["--inject-hook", "x:y"], "tune and worker"),
    (["--no-progress"], "tune and worker"),
    (["--stale-only"], "tune"),
])
def test_create_has_no_device_or_output_flags(argv, owners, tmp_path, capsys):
    """``create`` only defines the job: the flags of a run are not in its help and are refused
    (exit code 2, one line naming the flag and who takes it), before anything is written."""
    out, storage = tmp_path / "out", tmp_path / "s.journal"
    argv = [a.replace("OUT", str(out)) for a in argv]
    assert main(["create", "--storage", str(storage), "--preset", "smoke", "--for", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert f"{PROG} create: error: {argv[0].split('=')[0]} is a flag of {owners}, not of create" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists() and not storage.exists()
    assert main(["create", "--help"]) == 0
    assert f"{argv[0].split('=')[0]} " not in capsys.readouterr().out


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
    ("seq_len_q = true", "[[grid]] 1: seq_len_q: expected an integer >= 1, got True"),
    ("window_left = -5\nmask = \"causal\"", "[[grid]] 1: window_left: expected an integer >= -1, got -5"),
    ("seq_len_q = 41\nmask = \"causal\"", "[[grid]] 1: seq_len_q 41 exceeds the shortest of kv_lens, 40"),
], ids=["unknown_key", "packed_str", "ragged_int", "seq_len_float", "head_dim_100", "fp8", "heads_str",
        "heads_flat", "seq_len_bool", "window_below_minus_one", "causal_query_longer_than_kv"])
def test_cli_bad_grid_file_names_the_key(body, message, tmp_path, capsys):
    grid = tmp_path / "grid.toml"
    out = tmp_path / "out"
    grid.write_text(f"[[grid]]\nbatch_sizes = [1]\nkv_lens = [40]\n{body}\n")
    assert main(["--grid-file", str(grid), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--grid-file {grid}: {message}" in err and "Traceback" not in err
    assert err.count("[[grid]] 1:") == 1, err
    assert not out.exists()


@cpu_only
@pytest.mark.parametrize("lists, message", [
    ("batch_sizes = [1.5]\nkv_lens = [40]", "batch_sizes: expected a list of integers"),
    ("batch_sizes = 5\nkv_lens = [40]", "batch_sizes: expected a list of integers"),
    ("batch_sizes = [1]\nkv_lens = [0]", "kv_lens: expected positive integers"),
    ("batch_sizes = [1]", "[[grid]] 1: kv_lens missing: a custom grid needs both batch sizes and K/V lengths"),
    ("batch_sizes = [true]\nkv_lens = [40]", "batch_sizes: expected a list of integers"),
    ("batch_sizes = [1]\nkv_lens = [40]\n[settings]\ntrials = 4", "expected one or more [[grid]] tables (unknown "
                                                                   "top-level key(s) ['settings'])"),
], ids=["float", "scalar", "zero", "missing", "bool", "unknown_top_level_key"])
def test_cli_grid_file_lists_must_be_positive_integers(lists, message, tmp_path, capsys):
    grid = tmp_path / "grid.toml"
    grid.write_text(f"[[grid]]\n{lists}\n")
    assert main(["--grid-file", str(grid), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--grid-file {grid}: " in err and message in err and "Traceback" not in err
    assert err.count(str(grid)) == 1, err


@cpu_only
@pytest.mark.parametrize("command", ["tune", "create"])
@pytest.mark.parametrize("dtypes, message", [
    (["--q-dtype", "float32"], "--kv-dtypes bfloat16 with --q-dtype float32: q_data_type torch.float32 is not "
                               "supported"),
    (["--q-dtype", "float16"], "--kv-dtypes bfloat16 with --q-dtype float16: kv_data_type torch.bfloat16 (a "
                               "16-bit K/V cache) needs a query of the same dtype"),
    (["--kv-dtypes", "float32"], "--kv-dtypes: ['float32'] cannot be a K/V cache dtype"),
], ids=["q_float32", "q_other_half", "kv_float32"])
def test_an_unsupported_dtype_pair_is_a_usage_error(command, dtypes, message, tmp_path, capsys):
    extra = ["--storage", str(tmp_path / "s.journal"), "--for", "cpu"] if command == "create" else ["--out",
                                                                                                   str(tmp_path)]
    assert main([command, "--batch-sizes", "1", "--kv-lens", "40", "--heads", "4:2", "--head-dim", "64", *dtypes,
                 *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "s.journal").exists()


@cpu_only
def test_cli_grid_file_accepts_toml_types(tmp_path):
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
def test_cli_out_that_cannot_be_written_exits_2_before_anything_starts(tmp_path, capsys, monkeypatch):
    """A folder that exists but refuses new files (read-only, or another user's): one line."""
    locked = tmp_path / "locked"
    locked.mkdir()

    def refuse(*args, dir=None, **kwargs):
        if Path(dir) == locked:
            raise PermissionError(13, "Permission denied")
        return real_mkstemp(*args, dir=dir, **kwargs)

    real_mkstemp = tempfile.mkstemp
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    assert main([*TINY, "--out", str(locked), "--isolation", "inline"]) == 2
    err = capsys.readouterr().err
    assert f"--out {locked}: cannot write in the folder (Permission denied)" in err
    assert "Traceback" not in err and "device:" not in err
    assert list(locked.iterdir()) == []


@cpu_only
def test_cli_out_holding_another_devices_table_exits_2_before_tuning(tmp_path, capsys):
    """The merge at the end would refuse the file: say so before any candidate is measured."""
    out = tmp_path / "out"
    target = study.OutputPaths.for_device(CPU.name, out).table
    other = DeviceProperties("Other CPU", CPU.sm_count, CPU.compute_capability)
    merge_entries(target, other, {}, {})
    before = target.read_bytes()
    assert main([*TINY, "--trials", "1", "--out", str(out), "--isolation", "inline", *FAST]) == 2
    err = capsys.readouterr().err
    assert f"{target} holds the table of 'Other CPU', not of '{CPU.name}'" in err
    assert "Traceback" not in err and "measured" not in err
    assert target.read_bytes() == before


def test_a_time_budget_too_small_to_search_is_named():
    """A bucket stops searching its share's re-timing reserve before the share ends: a share no
    longer than that measures the default only, and a rerun would not get further either."""
    settings = tuner_buckets.TuneSettings(time_budget=10, timing="wall", top_k=3, retime_rounds=2)
    assert settings.retime_reserve_s() == 4 * (2 * 0.5 + 0.5)
    warning = settings.budget_warning(4)
    assert "leaves each of the 4 buckets about 2.5 s, of which re-timing its finalists takes 6.0 s: 0.0 s" in warning
    assert "--time-budget 48 or more" in warning
    almost = tuner_buckets.TuneSettings(time_budget=40, timing="wall", top_k=3, retime_rounds=2).budget_warning(4)
    assert "about 10.0 s, of which re-timing its finalists takes 6.0 s: 4.0 s to search" in almost
    assert tuner_buckets.TuneSettings(time_budget=48, timing="wall", top_k=3, retime_rounds=2).budget_warning(4) is None
    assert tuner_buckets.TuneSettings().budget_warning(4) is None


@cpu_only
def test_a_corrupt_table_in_out_is_reported_once(tmp_path, capsys, caplog):
    """The tuner moves an unusable table aside and says so; the runtime's own warning about the
    same file (with its advice to re-tune) must not come on top."""
    out = tmp_path / "out"
    target = study.OutputPaths.for_device(CPU.name, out).table
    target.parent.mkdir(parents=True)
    target.write_text('{"format_version": 1, "entr')
    tables.clear_cache()
    assert main([*TINY, "--trials", "1", "--out", str(out), "--isolation", "inline", *FAST]) == 0
    said = capsys.readouterr().err + "\n".join(r.getMessage() for r in caplog.records)
    assert said.count(f"tuned config table {target}") == 1, said
    assert "moved aside" in said
    assert tables.load_table(target) is not None  # written afresh


@pytest.mark.parametrize("flags, message", [
    (["--head-dim", "65"], "--head-dim must be one of"),
    (["--page-size", "5000"], "--page-size must be in [1, 1024], got 5000"),
    (["--kv-len", "3000000000"], "--kv-len must be <= 2147483392"),
    (["--heads", "4:3"], "--heads 4:3: HQ and HKV must be positive, HQ a multiple of HKV"),
    (["--window-left", "5"], "--window-left 5 needs --mask causal"),
    (["--q-dtype", "float32"], "--q-dtype torch.float32 is not supported"),
    (["--kv-dtype", "fp8"], "--kv-dtype: unknown dtype 'fp8'; one of ['float16', 'bfloat16', 'float8_e4m3fn']"),
    (["--o-dtype", "half"], "--o-dtype: unknown dtype 'half'; one of ['float16', 'bfloat16', 'float8_e4m3fn', 'float32']"),
    (["--device", "tpu"], "--device tpu: expected cuda, cuda:N or cpu"),
    (["--device", "cpu:3"], "--device cpu:3: expected cuda, cuda:N or cpu"),
    (["--seq-len-q", "9" * 400], "--seq-len-q: expected an integer <= 9223372036854775807"),  # not a float overflow
])
def test_explain_errors_name_the_flags_typed(flags, message, capsys):
    args = ["explain", "--batch-size", "1", "--kv-len", "10", *flags]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert err.startswith("tsdecode-tune"), err


@cpu_only
def test_a_missing_grid_file_is_named(tmp_path, capsys):
    missing = tmp_path / "nope.toml"
    assert main(["--grid-file", str(missing)]) == 2
    assert f"--grid-file {missing}: cannot be read (No such file or directory)" in capsys.readouterr().err


def test_an_empty_job_name_is_refused(tmp_path, capsys):
    assert main(["create", "--storage", str(tmp_path / "s.journal"), "--job", "", *TINY]) == 2
    assert "bad job name ''" in capsys.readouterr().err


def test_only_a_run_of_the_smoke_preset_alone_gets_the_smoke_note():
    from tuner.run import smoke_note

    smoke = PRESETS["smoke"]
    assert smoke_note(smoke, cpu=False)[0].startswith("the smoke preset is 4 small test shapes; your model's shapes")
    assert smoke_note(list(reversed(smoke)), cpu=True)[0].startswith("the smoke preset is 4 small test shapes; on a GPU")
    assert smoke_note(smoke[:2], cpu=True) == []
    assert smoke_note(smoke + PRESETS["llama3-8b"], cpu=False) == []


def test_the_closing_lines_say_when_the_config_dir_shadows_the_new_table(tmp_path, monkeypatch):
    from tuner.run import where_the_table_is_used

    table = tables.user_tables_dir() / "cpu_Triton_interpreter.json"
    spec = ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    monkeypatch.delenv(tables.CONFIG_DIR_ENV, raising=False)
    assert where_the_table_is_used(table, spec)[1].startswith("plans on this device use it from now on")
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path))
    line = where_the_table_is_used(table, spec)[1]
    assert line.startswith(f"plans on this device use it except for buckets that $TSDECODE_CONFIG_DIR={tmp_path} "
                           "(searched first) also holds")


@cpu_only
def test_cli_empty_grid_file(tmp_path, capsys):
    grid = tmp_path / "grid.toml"
    grid.write_text("# no [[grid]] tables\n")
    assert main(["--grid-file", str(grid)]) == 2
    err = capsys.readouterr().err
    assert "expected one or more [[grid]] tables" in err and "Traceback" not in err


@cpu_only
def test_cli_error_in_a_subprocess_has_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "tuner", "--preset", "nope"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr == "tsdecode-tune: error: unknown preset 'nope'; choose one of " + str(sorted(PRESETS)) + "\n"


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


# ---- the search space -----------------------------------------------------------------------


def test_split_choices_cover_powers_waves_and_default():
    shape = ShapeSpec(1, 32768).to_problem_shape()  # Hq 32, Hkv 8, D 128
    default = heuristic_config(shape, H200)
    sp = space.build_space(shape, 132, space.SpaceLimits(), default)
    splits = sp["num_kv_splits"]
    assert {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 512} <= set(splits)
    assert {132 // 8, 2 * 132 // 8, 4 * 132 // 8} <= set(splits)  # whole waves of programs
    assert default.num_kv_splits in splits and max(splits) <= space.SEARCH_MAX_PROGRAMS_PER_SM * 132 // 8
    # G*SQ = 4 rows: larger block_m is fitted away, FMA block_m (< 16) only when asked for
    assert sp["block_m"] == (16,)
    asked = space.SpaceLimits(block_m=(1, 2, 4, 8, 16, 32))
    assert space.build_space(shape, 132, asked, default)["block_m"] == (1, 2, 4, 8, 16)
    mha = ShapeSpec(1, 32768, num_qo_heads=8, num_kv_heads=8).to_problem_shape()  # 1 row
    assert space.build_space(mha, 132, space.SpaceLimits(), heuristic_config(mha, H200))["block_m"] == (1, 2, 4, 8, 16)
    for hq, fma in ((16, (1, 2, 4, 8)), (24, ())):  # 2 rows: FMA searched; 3 rows: not
        rows = ShapeSpec(1, 32768, num_qo_heads=hq, num_kv_heads=8).to_problem_shape()
        assert space.build_space(rows, 132, space.SpaceLimits(), heuristic_config(rows, H200))[
            "block_m"] == fma + (16,)
    wide = ShapeSpec(1, 32768, num_qo_heads=64, num_kv_heads=2).to_problem_shape()  # 32 rows
    assert space.build_space(wide, 132, space.SpaceLimits(), heuristic_config(wide, H200))["block_m"] == (16, 32)
    big = ShapeSpec(128, 32768).to_problem_shape()
    assert space.build_space(big, 132, space.SpaceLimits(), heuristic_config(big, H200))[
        "num_kv_splits"] == (1, 2, 3, 4, 6, 8)
    short = ProblemShape(1, 4, 2, 64, 16, max_kv_len=40)
    assert max(space.split_choices(short, 132, (16, 32), (2,))) == 3  # 3 tiles of 16


def test_retime_noise_ignores_one_outlier_round():
    # A default's re-timings on an H200 (us): one slow round must not set the noise.
    default = [1033.9, 1035.1, 1144.6, 1059.5, 1028.6]
    noise = search.retime_noise(default)
    assert 0.02 < noise < 0.03
    challenger_median = 975.2  # 6% faster in every round
    assert challenger_median < statistics.median(default) * (1 - noise)
    assert search.retime_noise([100.0]) == 0.01
    assert search.retime_noise([100.0, 100.1, 100.0]) == 0.01


def test_a_challenger_wins_only_beyond_the_defaults_noise():
    default = KernelConfig(block_n=64, block_m=16, num_kv_splits=4, num_warps=4, num_stages=2)
    near, far = (KernelConfig(block_n=n, block_m=16, num_kv_splits=4, num_warps=4, num_stages=2) for n in (32, 16))
    rounds = [100.0, 103.0, 97.0, 101.0, 99.0]  # noise: interquartile range 2 over median 100
    times = {default: rounds, near: [t * 0.985 for t in rounds]}  # 1.5% faster: within the noise
    assert search.pick_winner(times, default) == (default, True, pytest.approx(0.02))
    times[far] = [t * 0.97 for t in rounds]  # 3% faster: beyond it
    assert search.pick_winner(times, default) == (far, False, pytest.approx(0.02))
    assert search.pick_winner({default: rounds}, default)[:2] == (default, True)


def test_a_study_new_to_its_storage_takes_the_latest_final_of_the_log(tmp_path):
    """A rerun with a larger --trials writes a second final for the same study: the later one,
    not the first, is what a new storage takes (nor a failed or another study's final)."""
    fields = {k: 0 for k in search.FINAL_FIELDS}
    log = study.ResultLog(tmp_path / "log.jsonl")
    for rec in ({**fields, "ok": True, "time_us": 12.0, "trials_budget": 8},
                {**fields, "ok": True, "time_us": 10.0, "trials_budget": 16},
                {**fields, "ok": False, "time_us": 9.0, "trials_budget": 32}):
        log.write({"kind": "final", "study": "a", **rec})
    log.write({"kind": "final", "study": "b", **fields, "ok": True, "time_us": 1.0})
    log.close()
    final = search.final_from_log(tmp_path / "log.jsonl", "a")
    assert (final["time_us"], final["trials_budget"]) == (10.0, 16) and set(final) == search.FINAL_FIELDS
    assert search.final_from_log(tmp_path / "log.jsonl", "c") is None


def test_seed_configs_cover_splits_and_the_lean_family():
    default = KernelConfig(block_n=64, block_m=16, num_kv_splits=4, num_warps=4, num_stages=2)
    sp = {"block_n": [16, 32, 64], "block_m": [16], "num_kv_splits": [1, 2, 3, 4, 6, 8, 12, 16],
          "num_warps": [1, 2, 4], "num_stages": [1, 2, 3, 5]}
    seeds = space.seed_configs(default, sp)
    assert seeds[0] == default and len(set(seeds)) == len(seeds)
    assert {c.num_kv_splits for c in seeds if c.block_n == 64} == {2, 4, 8, 16}
    lean = [c for c in seeds if c.block_n == 16 and c.num_stages == 3]
    assert {c.num_warps for c in lean} == {1}
    assert sorted(c.num_kv_splits for c in lean) == [4, 8, 16]
    deep = [c for c in seeds if c.block_n == 16 and c.num_stages != 3]
    assert {(c.num_warps, c.num_stages) for c in deep} == {(1, 5)}  # the space's deepest pipeline
    assert sorted(c.num_kv_splits for c in deep) == [2, 4]
    for c in seeds:  # every seed lies in the space
        assert all(getattr(c, k) in v for k, v in sp.items())


def test_seed_configs_reach_the_lean_programs_per_sm_targets():
    """With the shape's programs at one split, both lean families are seeded at the split counts
    for ~8 and ~46 programs per SM, even when the default's own splits are far from them."""
    default = KernelConfig(block_n=64, block_m=16, num_kv_splits=8, num_warps=4, num_stages=2)
    sp = {"block_n": [16, 64], "block_m": [16], "num_kv_splits": [1, 2, 4, 8, 16, 32, 64, 95, 96, 128],
          "num_warps": [1, 4], "num_stages": [2, 3, 5]}
    plain = space.seed_configs(default, sp)
    seeds = space.seed_configs(default, sp, base=64, sm_count=132)  # B=8, Hkv=8
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
        bucket = tuner_buckets.group_buckets(PRESETS["smoke"])[0]
        sp = {"block_n": [16, 32]}
        a = tuner.study_name(bucket, sp, KernelConfig(block_n=16, num_stages=3))
        assert a == tuner.study_name(bucket, sp, KernelConfig(block_n=16, num_stages=3))
        assert a != tuner.study_name(bucket, sp, KernelConfig(block_n=16, num_stages=5))
        assert a.startswith(bucket.class_key + "|")
    finally:
        tuner.close()


@cpu_only
def test_a_new_study_measures_the_tables_current_winner_second(tmp_path):
    """Re-tuning into a table that already holds a winner for the bucket (e.g. after a heuristic
    change started new studies): that winner is measured right after the default, so a re-tune
    cannot lose what the last one found for lack of trials."""
    spec = ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    shape = spec.to_problem_shape()
    default = heuristic_config(shape, CPU)
    previous = KernelConfig(block_n=32, block_m=16, num_kv_splits=2, num_warps=2, num_stages=2)
    assert previous != default and fit_config(previous, shape)[0] == previous
    out = tmp_path / "warm"
    entry = TableEntry(previous, 10.0, 1.0, None, default, 11.0, 0.9, tuned_batch_size=1)
    key, bucket = tables.problem_class_key(shape), tables.bucket_of(1, 40)
    merge_entries(study.OutputPaths.for_device(CPU.name, out).table, CPU, {key: {bucket: entry}}, {})
    args = [*TINY, "--trials", "2", "--block-n", "16,32,64", "--block-m", "16", "--num-kv-splits", "1,2,3",
            "--num-warps", "1,2,4", "--num-stages", "2,3", "--out", str(out), "--isolation", "inline", *FAST]
    assert main(args) == 0
    measured = [KernelConfig(**r["config"]) for r in _records(out) if r["measured"]]
    assert measured[:2] == [default, previous]


@cpu_only
def test_a_first_tune_measures_the_entry_plans_take_today_second(tmp_path, monkeypatch):
    """Tuning into a table that lacks the bucket (a GPU's first tune, say an H100 whose plans take
    the H200's entries): the entry the runtime's table search finds today, here in a table of a
    device of the same compute capability and SM count in $TSDECODE_CONFIG_DIR, is measured right
    after the default, so the new table cannot lose what plans got before it for lack of trials."""
    spec = ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    shape = spec.to_problem_shape()
    default = heuristic_config(shape, CPU)
    planned = KernelConfig(block_n=32, block_m=16, num_kv_splits=2, num_warps=2, num_stages=2)
    assert planned != default and fit_config(planned, shape)[0] == planned
    twin = DeviceProperties("another cpu", CPU.sm_count, CPU.compute_capability)
    elsewhere = tmp_path / "elsewhere"
    entry = TableEntry(planned, 10.0, 1.0, None, default, 11.0, 0.9, tuned_batch_size=1)
    key, bucket = tables.problem_class_key(shape), tables.bucket_of(1, 40)
    merge_entries(study.OutputPaths.for_device(twin.name, elsewhere).table, twin, {key: {bucket: entry}}, {})
    out = tmp_path / "first"
    (group,) = tuner_buckets.group_buckets([spec])
    inside = space.SpaceLimits(num_warps=(1, 2, 4), num_stages=(2, 3))
    table = study.OutputPaths.for_device(CPU.name, out).table
    assert tuner_buckets.table_winners(table, [group], CPU, inside) == {}  # nothing found: the default alone
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(elsewhere))
    tables.clear_cache()
    assert tables.lookup(shape, CPU).kernel_config == planned
    assert tuner_buckets.table_winners(table, [group], CPU, inside) == {group.key: planned.to_dict()}
    args = [*TINY, "--trials", "2", "--block-n", "16,32,64", "--block-m", "16", "--num-kv-splits", "1,2,3",
            "--num-warps", "1,2,4", "--num-stages", "2,3", "--out", str(out), "--isolation", "inline", *FAST]
    assert main(args) == 0
    measured = [KernelConfig(**r["config"]) for r in _records(out) if r["measured"]]
    assert measured[:2] == [default, planned]


@cpu_only
def test_what_plans_take_today_is_a_finalist_where_the_search_measured_it(tmp_path):
    """The table's current winner, measured in the search but slower there than the --top-k best,
    is re-timed with them and the default: a new winner beats it in the same interleaved rounds,
    not only in one short timing."""
    spec = ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    shape = spec.to_problem_shape()
    default = heuristic_config(shape, CPU)
    assert PLANNED != default and fit_config(PLANNED, shape)[0] == PLANNED
    out = tmp_path / "warm"
    entry = TableEntry(PLANNED, 10.0, 1.0, None, default, 11.0, 0.9, tuned_batch_size=1)
    merge_entries(study.OutputPaths.for_device(CPU.name, out).table, CPU,
                  {tables.problem_class_key(shape): {tables.bucket_of(1, 40): entry}}, {})
    args = [*TINY, "--trials", "3", "--block-n", "16,32,64", "--block-m", "16", "--num-kv-splits", "1,2,3",
            "--num-warps", "1,2,4", "--num-stages", "2,3", "--out", str(out), "--isolation", "inline", *FAST,
            "--inject-hook", f"{HOOKS}:planned_in_the_middle_hook"]
    assert main(args) == 0
    measured = [KernelConfig(**r["config"]) for r in _records(out) if r["measured"]]
    assert measured[:2] == [default, PLANNED] and len(measured) == 3
    retimed = {KernelConfig(**r["config"]) for r in _records(out, "retime")}
    assert retimed == set(measured)  # the default, the best (--top-k 1) and the table's winner
    (final,) = _records(out, "final")
    assert KernelConfig(**final["winner"]) == measured[2] and final["time_us"] == pytest.approx(200.0)


@cpu_only
def test_a_budget_that_stops_the_search_still_measures_what_plans_take_today(tmp_path):
    """A time budget used up before the search starts (every config but the default and the
    table's winner compiles for 60 s): the default and what plans take today are both measured
    whatever the budget says, and the faster one is written, so the tune cannot replace today's
    entry with a slower default for lack of trials."""
    spec = ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    shape = spec.to_problem_shape()
    default = _fitted_default(spec)
    assert PLANNED != default and fit_config(PLANNED, shape)[0] == PLANNED
    out = tmp_path / "short"
    entry = TableEntry(PLANNED, 10.0, 1.0, None, default, 11.0, 0.9, tuned_batch_size=1)
    merge_entries(study.OutputPaths.for_device(CPU.name, out).table, CPU,
                  {tables.problem_class_key(shape): {tables.bucket_of(1, 40): entry}}, {})
    t0 = time.monotonic()
    args = [*TINY, "--trials", "6", "--time-budget", "1", "--compile-workers", "2", "--block-n", "16,32,64",
            "--block-m", "16", "--num-kv-splits", "1,2,3", "--num-warps", "1,2,4", "--num-stages", "2,3",
            "--out", str(out), "--isolation", "inline", *FAST,
            "--inject-hook", f"{HOOKS}:planned_faster_the_rest_slow_to_compile_hook"]
    assert main(args) == 0
    assert time.monotonic() - t0 < 50  # not waiting for the 60 s compiles
    measured = [KernelConfig(**r["config"]) for r in _records(out) if r["measured"]]
    assert sorted(measured, key=str) == sorted([default, PLANNED], key=str)
    (final,) = _records(out, "final")
    assert final["cut_short"] and KernelConfig(**final["winner"]) == PLANNED
    assert final["time_us"] == pytest.approx(250.0) and final["default_time_us"] == pytest.approx(300.0)


def test_the_tables_winner_is_seeded_only_when_every_field_lies_in_todays_space(tmp_path):
    spec = ShapeSpec(1, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    shape = spec.to_problem_shape()
    previous = KernelConfig(block_n=32, block_m=16, num_kv_splits=2, num_warps=2, num_stages=2)
    entry = TableEntry(previous, 10.0, 1.0, None, heuristic_config(shape, CPU), 11.0, 0.9, tuned_batch_size=1)
    table = study.OutputPaths.for_device(CPU.name, tmp_path).table
    merge_entries(table, CPU, {tables.problem_class_key(shape): {tables.bucket_of(1, 40): entry}}, {})
    (bucket,) = tuner_buckets.group_buckets([spec])
    inside = space.SpaceLimits(num_warps=(1, 2, 4), num_stages=(2, 3))
    assert tuner_buckets.table_winners(table, [bucket], CPU, inside) == {bucket.key: previous.to_dict()}
    outside = space.SpaceLimits(num_warps=(1, 4), num_stages=(2, 3))  # its num_warps 2 is not searched
    assert tuner_buckets.table_winners(table, [bucket], CPU, outside) == {}


@cpu_only
def test_stale_only_tunes_just_the_buckets_timed_against_another_default(tmp_path, capsys):
    """--stale-only: of the grid's buckets, only those the table lacks or holds timed against
    another default than today's heuristic are tuned; the others keep their entries."""
    specs = [ShapeSpec(b, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64) for b in (1, 3)]
    out = tmp_path / "t"
    paths = study.OutputPaths.for_device(CPU.name, out)
    other = KernelConfig(block_n=32, block_m=16, num_kv_splits=2, num_warps=2, num_stages=2)
    key = tables.problem_class_key(specs[0].to_problem_shape())
    buckets = [tables.bucket_of(s.batch_size, s.kv_len) for s in specs]
    assert buckets[0] != buckets[1]
    entries = {}
    for spec, bucket, up_to_date in zip(specs, buckets, (True, False)):
        default = heuristic_config(spec.to_problem_shape(), CPU)
        assert other != default
        entries[bucket] = TableEntry(default, 10.0, 1.0, None, default if up_to_date else other, 11.0, 0.9,
                                     tuned_batch_size=spec.batch_size)
    merge_entries(paths.table, CPU, {key: entries}, {})
    grid = ["--batch-sizes", "1,3", "--kv-lens", "40", "--heads", "4:2", "--head-dim", "64"]
    args = [*grid, "--trials", "1", "--stale-only", "--out", str(out), "--isolation", "inline", *FAST]
    assert main(args) == 0
    assert "--stale-only: 1 of 2 buckets up to date" in capsys.readouterr().err
    tables.clear_cache()
    after = tables.load_table(paths.table).entries[key]
    assert after[buckets[0]] == entries[buckets[0]]  # kept as it was
    assert after[buckets[1]].time_us != 10.0  # re-tuned, against today's default
    assert after[buckets[1]].default_config == heuristic_config(specs[1].to_problem_shape(), CPU)
    # Everything up to date now: a second run tunes nothing and leaves the table alone.
    before = paths.table.read_bytes()
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "--stale-only: 2 of 2 buckets up to date" in captured.err
    assert f"nothing to tune: every bucket of the grid is up to date in {paths.table}" in captured.err
    assert f"table: {paths.table}" in captured.err and "plans do not search" in captured.err
    assert "buckets tuned" not in captured.err and "best config" not in captured.out
    assert paths.table.read_bytes() == before


# ---- on a GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_smoke_tuning_end_to_end(tmp_path, monkeypatch):
    """The real pipeline (worker process, compile pool, CUDA graphs) on the smoke preset, into
    the user cache folder, which plans then use."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)  # the GPU pipeline, whatever this process runs in
    r = subprocess.run([sys.executable, "-m", "tuner", "--preset", "smoke", "--trials", "6",
                        "--compile-workers", "2", "--no-progress"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    props = device_properties("cuda")
    table_path = tables.user_tables_dir() / tables.table_filename(props.name)
    table = tables.load_table(table_path)
    assert table is not None and table.device.name == props.name
    assert f"{props.sm_count} SMs" in r.stderr and "plans on this device use it from now on" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "the smoke preset is 4 small test shapes; your model's shapes still get the heuristic's configs: tune")
    entries = [e for b in table.entries.values() for e in b.values()]
    assert len(entries) == len(PRESETS["smoke"])
    assert all(e.fraction_of_copy is not None and e.fraction_of_copy > 0 for e in entries)
    _check_log_matches_storage(tables.user_tables_dir().parent / "tuning")
    for spec in PRESETS["smoke"]:
        w, err = _plan_and_run(spec, "cuda")
        assert w.config.source == "table", str(w.config)
        assert err < measure.tolerance(spec)


@cpu_only
def test_a_rerun_searches_on_where_the_time_budget_cut_a_bucket_short(tmp_path, capsys):
    out = tmp_path / "cut"
    rc = main([*TINY, "--trials", "4", "--time-budget", "6", "--compile-workers", "2", "--out", str(out),
               "--isolation", "inline", "--inject-hook", f"{HOOKS}:slow_compile_hook", *FAST])
    assert rc == 0
    first = capsys.readouterr()
    assert "1 (0 pruned), time ran out" in first.out
    assert "1 bucket(s) stopped short of --trials when the time budget ran out" in first.err + first.out
    (final,) = _records(out, "final")
    assert final["cut_short"] and final["measured"] == 1
    # The same command without the slow compiles: the bucket is searched on, not resumed as done.
    rc = main([*TINY, "--trials", "4", "--out", str(out), "--isolation", "inline", *FAST])
    assert rc == 0
    second = capsys.readouterr()
    assert "searching on" in second.err + second.out and "already tuned" not in second.err + second.out
    finals = _records(out, "final")
    assert len(finals) == 2 and not finals[-1]["cut_short"] and finals[-1]["measured"] == 4
    assert "time ran out" not in second.out
    # A third run finds it done.
    assert main([*TINY, "--trials", "4", "--out", str(out), "--isolation", "inline", *FAST]) == 0
    assert "already tuned (4 configs measured)" in "".join(capsys.readouterr())
    _check_log_matches_storage(out)


def test_shape_spec_refuses_zero_sizes_and_a_window_without_causal():
    for bad in ({"batch_size": 0}, {"kv_len": 0}, {"page_size": 0}, {"seq_len_q": 0}, {"num_kv_heads": 0}):
        with pytest.raises(ValueError, match="must be a positive int"):
            ShapeSpec(**{"batch_size": 1, "kv_len": 64, **bad})
    with pytest.raises(ValueError, match="needs mask_type='causal'"):
        ShapeSpec(1, 64, window_left=8)
    with pytest.raises(ValueError, match="a causal mask needs seq_len_q <= kv_len, got seq_len_q=8 and kv_len=4"):
        ShapeSpec(1, 4, seq_len_q=8, mask_type="causal")
    assert ShapeSpec(1, 8, seq_len_q=8, mask_type="causal").seq_len_q == 8  # as long as its K/V: it runs


def test_problem_shape_spread_is_longest_over_mean_length():
    spec = ShapeSpec(4, 100, ragged=True)
    assert spec.to_problem_shape().kv_len_spread == 1.0
    assert spec.to_problem_shape([100, 50, 50, 100]).kv_len_spread == pytest.approx(100 * 4 / 300)


def test_llama3_70b_presets_split_the_heads_by_the_tensor_parallel_degree():
    for tp in (1, 2, 4, 8):
        specs = PRESETS[f"llama3-70b-tp{tp}"]
        assert {(s.num_qo_heads, s.num_kv_heads) for s in specs} == {(64 // tp, 8 // tp)}
    assert {(s.num_qo_heads, s.num_kv_heads) for s in PRESETS["qwen2.5-7b"]} == {(28, 4)}


def test_a_grid_named_twice_holds_each_shape_once():
    from tuner.grids import specs_from_args

    args = SimpleNamespace(preset=["smoke", "smoke"], grid_file=None, batch_sizes="1", kv_lens="40",
                           heads="4:2", head_dim="64", page_sizes="16", kv_dtypes="bfloat16", q_dtype=None,
                           seq_len_q=1, packed=False, mask="dense", window_left=-1, ragged=False)
    specs = specs_from_args(args)
    assert specs == PRESETS["smoke"]  # B1 L40 H4x2 D64 is a smoke shape already


def test_a_causal_query_as_long_as_the_shortest_kv_is_a_grid():
    from tuner.grids import specs_from_args

    args = SimpleNamespace(preset=None, grid_file=None, batch_sizes="1", kv_lens="4,64", heads="4:2",
                           head_dim="64", page_sizes="16", kv_dtypes="bfloat16", q_dtype=None, seq_len_q=4,
                           packed=False, mask="causal", window_left=-1, ragged=False)
    assert sorted(s.kv_len for s in specs_from_args(args)) == [4, 64]


def test_a_buckets_space_is_built_for_its_longest_shape_and_speedup_is_default_over_winner():
    """The representative has the bucket's longest K/V (its split space reaches that shape's tile
    count), whichever shape has the larger batch; speedup is default time / winner time."""
    short_wide, long_narrow = ShapeSpec(6, 900), ShapeSpec(5, 1000)
    bucket = tuner_buckets.Bucket("k", (8, 1024), (short_wide, long_narrow))
    assert bucket.representative == long_narrow and bucket.shape.max_kv_len == 1000
    result = tuner_buckets.BucketResult(bucket, "s", True, KernelConfig(), 5.0, None, None, KernelConfig(), 10.0)
    assert result.speedup == pytest.approx(2.0)
    assert "2.00x" in tuner_buckets.summary_table([result])


def test_asked_split_counts_are_capped_at_the_shapes_tile_count():
    """--num-kv-splits values past the K/V tiles at the smallest block_n fold onto that count
    (a larger split count only fits down to it): the space holds each distinct config once."""
    shape = ShapeSpec(1, 48, num_qo_heads=4, num_kv_heads=2, head_dim=64).to_problem_shape()
    default = heuristic_config(shape, H200)
    asked = space.SpaceLimits(block_n=(16, 32), num_kv_splits=(1, 2, 8, 64))
    assert set(space.build_space(shape, 132, asked, default)["num_kv_splits"]) - {default.num_kv_splits} <= {1, 2, 3}
    assert 3 in space.build_space(shape, 132, asked, default)["num_kv_splits"]  # 48 / 16 tiles


def test_trials_csv_names_the_error_rel_error_for_old_logs_too(tmp_path):
    """The trials CSV calls a trial's error against the reference rel_error, as the reports do; a
    log written before the rename (rel_err) still fills that column."""
    from tuner import study as S

    log = tmp_path / "t_trials.jsonl"
    base = {"kind": "trial", "study": "s", "class_key": "k", "bucket": [1, 128], "state": "COMPLETE",
            "config": {"block_n": 16, "block_m": 16, "num_kv_splits": 1, "num_warps": 1, "num_stages": 3},
            "time_us": 5.0, "bandwidth_gbs": 1.0, "fraction_of_copy": 0.5, "specs": ["a"]}
    log.write_text(json.dumps({**base, "trial": 0, "rel_err": 0.002}) + "\n"
                   + json.dumps({**base, "trial": 1, "rel_error": 0.003}) + "\n")
    out = tmp_path / "t_trials.csv"
    assert S.write_trials_csv(log, out) == 2
    import pandas as pd

    frame = pd.read_csv(out)
    assert "rel_err" not in frame.columns
    assert frame["rel_error"].tolist() == [0.002, 0.003]
    assert list(frame.columns).index("rel_error") == list(frame.columns).index("fraction_of_copy") + 1


def test_a_run_without_a_grid_says_it_tunes_the_smoke_preset(capsys):
    """On the CPU a bare ``tsdecode-tune`` tunes the smoke preset: the help and the run say so."""
    from tuner.parsers import build_parser
    from tuner.run import _specs

    parser = build_parser(cpu=True)
    args = parser.parse_args(["tune"])
    assert set(_specs(args, cpu=True)) == set(PRESETS["smoke"])
    assert "no grid given: tuning the smoke preset" in capsys.readouterr().out
    assert _specs(parser.parse_args(["tune", "--preset", "smoke"]), cpu=True) and not capsys.readouterr().out
    help_text = " ".join(parser._subparsers._group_actions[0].choices["tune"].format_help().split())
    assert "a run on the CPU tunes the smoke preset" in help_text
