"""Distributed tuning on CPU (Triton's interpreter): several worker processes on one job's studies.

Two and four workers sharing a journal file, SQLite or a real PostgreSQL server finish the smoke
grid with every grid point recorded once, every fitted config measured once, and the winners of
one worker; a worker that dies (SIGKILL, mid-trial) is reported and its trial queued again, on
one host (the supervisor notices) and across "hosts" (Optuna's heartbeats notice); a supervisor
killed outright leaves no worker or measuring process behind; a worker of another GPU model, or
without a GPU on a job for GPUs, is refused; ``worker`` / ``export`` errors are one line with exit
code 2.

Timings in the interpreter mean nothing, so the runs that compare winners take a deterministic
time from the measurement hook (``fake_time``): the search is then a function of the grid alone.
Each grid here is the smoke preset narrowed to 4 configs per bucket (a GridSampler-sized space),
so every worker count measures the same set of configs.

PostgreSQL: ``.ci/run`` starts a server and sets $TSDECODE_TEST_POSTGRES_URL; without it the
fixture starts one from the installed binaries (``initdb``/``pg_ctl``), and skips only where
there are none (never in CI).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import optuna
import pytest
import torch

from tsdecode import KernelConfig
from tsdecode.config import tables
from tsdecode.device import CPU_NAME, device_properties
from tuner import job as J
from tuner import buckets, search, study
from tuner.cli import main
from tuner.devices import compile_workers_per_device

REPO = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()
# The smoke preset (4 buckets), block_n 16/64 x num_kv_splits 1/2 x num_stages 2/3 a bucket; the
# space also takes in the heuristic default's value of each field, so a default outside it adds
# grid points (a default's split count, or four warps with the 64-token tile that holds a whole
# request: at most 16 points, all of them trials).
GRID = ["--preset", "smoke", "--block-n", "16,64", "--block-m", "16", "--num-kv-splits", "1,2", "--num-warps", "1",
        "--num-stages", "2,3", "--trials", "16"]
GRID_POINTS = {tuple(sorted(dict(block_n=n, block_m=16, num_kv_splits=s, num_warps=1, num_stages=st).items()))
               for n in (16, 64) for s in (1, 2) for st in (2, 3)}
FAST = ["--no-progress", "--retime-rounds", "1", "--top-k", "1", "--isolation", "inline"]
HOOK = f"{THIS}:fake_time"
MARKER_ENV, MODE_ENV = "TSDECODE_TEST_MARKER", "TSDECODE_TEST_HOOK_MODE"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode (interpreter) tuner test")


# ---- hooks (loaded by file path in the worker processes) --------------------------------------


def fake_time(stage, spec, config, out=None):
    """A deterministic time (us) per config and shape. With $TSDECODE_TEST_HOOK_MODE set, the
    first config a worker plans is its last: "die" kills the worker (SIGKILL), "hang" sleeps
    until it is killed; $TSDECODE_TEST_MARKER records its PID, and only one worker does it."""
    if stage == "plan" and os.environ.get(MODE_ENV):
        marker = Path(os.environ[MARKER_ENV])
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return None
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        if os.environ[MODE_ENV] == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    if stage == "time":
        # distinct for every config of the grid, so that which run measured a config first cannot
        # change the winner
        return (100.0 + 7.0 * config.block_n / 16 + 3.0 * config.num_kv_splits + 0.5 * config.num_stages
                + 0.25 * config.num_warps + spec.batch_size)
    return None


# ---- helpers --------------------------------------------------------------------------------


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TRITON_INTERPRET": "1"}
    env.pop(MODE_ENV, None)
    env.update({k: v for k, v in extra.items() if v is not None})
    return env


def _tune(args, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner", *args], cwd=REPO, env=_env(**env), capture_output=True,
                          text=True, timeout=600)


def _captured(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _winners(table: Path) -> dict:
    data = json.loads(table.read_text())
    return {(key, e["batch_size"], e["kv_len"]): e["kernel_config"] for key, es in data["entries"].items() for e in es}


def _bucket_studies(storage) -> list[optuna.Study]:
    return [optuna.load_study(study_name=s.study_name, storage=storage) for s in storage.get_all_studies()
            if not s.study_name.startswith("tsdecode-")]


def _check_trials(storage, killed: bool = False) -> dict:
    """No trial lost or duplicated: each study holds every grid point once among its finished
    trials, each fitted config measured once, nothing left running or queued. Returns
    {study: {params: (state, fitted config's key)}} to compare runs (where two grid points fit to
    one config, which of them measured it depends on the trials' order)."""
    found = {}
    for s in _bucket_studies(storage):
        trials = s.get_trials(deepcopy=False)
        assert not [t for t in trials if t.state.name in ("RUNNING", "WAITING")], s.study_name
        failed = [t for t in trials if t.state.name == "FAIL"]
        assert bool(failed) <= killed, [t.user_attrs for t in failed]
        finished = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
        params = [tuple(sorted(t.params.items())) for t in finished]
        # the whole grid once (GRID_POINTS, and any points the default's values add)
        assert len(params) == len(set(params)) and GRID_POINTS <= set(params), s.study_name
        keys = [t.user_attrs["key"] for t in finished if t.user_attrs["measured"]]
        assert len(keys) == len(set(keys)), "a fitted config was measured twice"
        for t in finished:
            if not t.user_attrs["measured"]:
                assert t.user_attrs["key"] in keys and t.user_attrs["duplicate_of"] is not None
        assert s.user_attrs["final"]["ok"]
        found[s.study_name] = {p: (t.state.name, t.user_attrs["key"]) for p, t in zip(params, finished)}
    assert len(found) == 4
    return found


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(tables.CONFIG_DIR_ENV, raising=False)
    monkeypatch.delenv(study.HOST_ENV, raising=False)
    tables.clear_cache()
    yield
    tables.clear_cache()


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    """The reference: the grid tuned by one worker (this process) into a journal."""
    out = tmp_path_factory.mktemp("one")
    r = _tune([*GRID, *FAST, "--out", str(out), "--inject-hook", HOOK])
    assert r.returncode == 0, r.stderr[-3000:]
    (journal,) = out.glob("*_study.journal")
    storage = study.open_storage(str(journal))
    return {"out": out, "winners": _winners(out / "cpu_Triton_interpreter.json"), "trials": _check_trials(storage),
            "storage": str(journal), "job": J.list_jobs(storage)[0], "stderr": r.stderr}


# ---- one host: journal file and SQLite ----------------------------------------------------------


@pytest.mark.parametrize("storage, workers", [("journal", 2), ("journal", 4), ("sqlite", 2), ("sqlite", 4)])
def test_workers_on_one_host_find_what_one_worker_finds(one_worker, tmp_path, storage, workers):
    out = tmp_path / "out"
    url = [] if storage == "journal" else ["--storage", f"sqlite:///{tmp_path / 'study.db'}"]
    r = _tune([*GRID, *FAST, "--out", str(out), "--inject-hook", HOOK, "--devices", f"cpu:{workers}", *url])
    assert r.returncode == 0, r.stderr[-4000:]
    labels = [f"cpu:{i}" for i in range(workers)]
    assert f"devices: {workers} x 'cpu (Triton interpreter)'" in r.stderr and all(f"[{x}]" in r.stderr for x in labels)
    assert "4/4 buckets tuned" in r.stderr
    opened = study.open_storage(url[1] if url else str(next(out.glob("*_study.journal"))))
    assert _check_trials(opened) == one_worker["trials"]
    assert _winners(out / "cpu_Triton_interpreter.json") == one_worker["winners"]
    # the table's provenance is the one-process run's
    data = json.loads((out / "cpu_Triton_interpreter.json").read_text())
    ref = json.loads((one_worker["out"] / "cpu_Triton_interpreter.json").read_text())
    assert data.keys() == ref.keys() and data["tuner_settings"].keys() == ref["tuner_settings"].keys()
    assert data["kernel_hash"] == tables.kernel_source_hash()
    # every worker measured, each trial is in the shared log once
    recs = [r for r in study.ResultLog.read(next(out.glob("*_trials.jsonl"))) if r.get("kind") == "trial"]
    assert len({(r["study"], r["trial"]) for r in recs}) == len(recs) == sum(map(len, one_worker["trials"].values()))
    assert 2 <= len({r["worker"] for r in recs if r["measured"]}) and {r["worker"] for r in recs} <= set(labels)


def test_a_worker_that_dies_is_reported_its_trial_retried_and_the_run_goes_on(one_worker, tmp_path):
    out, marker = tmp_path / "out", tmp_path / "marker"
    r = _tune([*GRID, *FAST, "--out", str(out), "--inject-hook", HOOK, "--devices", "cpu:2"],
              **{MODE_ENV: "die", MARKER_ENV: str(marker)})
    assert r.returncode == 0, r.stderr[-4000:]
    pid = int(marker.read_text())
    assert f"(pid {pid}) died (killed by SIGKILL); its trials are queued again" in r.stderr
    assert "restarting it (1/3)" in r.stderr
    storage = study.open_storage(str(next(out.glob("*_study.journal"))))
    assert _check_trials(storage, killed=True) == one_worker["trials"]
    assert _winners(out / "cpu_Triton_interpreter.json") == one_worker["winners"]
    # the dead worker's trials: the one it planned when it died, and any others it held by then
    # (it takes the next trials while the first compiles): each failed, each queued again and done
    for s in _bucket_studies(storage):
        for failed in [t for t in s.trials if t.state.name == "FAIL"]:
            assert failed.user_attrs["worker"]["pid"] == pid and failed.user_attrs["interrupted"]
            (retry,) = [t for t in s.trials if t.user_attrs.get("retry_of") == failed.number
                        and t.user_attrs["key"] == failed.user_attrs["key"]]
            assert retry.state.name == "COMPLETE" and retry.params == failed.params
    assert any(t.state.name == "FAIL" for s in _bucket_studies(storage) for t in s.trials)


def _children() -> dict[int, list[int]]:
    """Each process's children, from /proc."""
    found: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:  # gone meanwhile
            continue
        found.setdefault(int(text[text.rindex(")") + 2:].split()[1]), []).append(int(text[:text.index(" ")]))
    return found


def _descendants(pid: int) -> set[int]:
    children, found, todo = _children(), set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pids) -> set[int]:
    """Those of ``pids`` still running (a zombie has ended)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            alive.add(pid)
    return alive


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the process tree from /proc")
def test_workers_and_their_measuring_processes_end_when_the_supervisor_is_killed(tmp_path):
    """kill -9 of a --devices run's process: its workers (and their measuring processes) end too,
    instead of timing on beside the workers of the next run."""
    marker = tmp_path / "marker"
    log = open(tmp_path / "run.log", "w")
    run = subprocess.Popen([sys.executable, "-m", "tuner", *GRID, "--no-progress", "--retime-rounds", "1", "--out",
                            str(tmp_path / "out"), "--inject-hook", HOOK, "--devices", "cpu:2"], cwd=REPO,
                           env=_env(**{MODE_ENV: "hang", MARKER_ENV: str(marker)}), stdout=subprocess.DEVNULL,
                           stderr=log)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():  # a worker's measuring process hangs in its first candidate
            assert time.monotonic() < deadline and run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.2)
        started = _descendants(run.pid)
        hanging = int(marker.read_text())
        workers = {pid for pid in started if b"\0worker\0" in _cmdline(pid)}
        assert len(workers) == 2 and hanging in started, (started, workers, hanging)
        run.kill()
        run.wait()
        deadline = time.monotonic() + 30
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(started), f"outlived the killed run: {sorted(_alive(started))} of {sorted(started)}"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        for pid in _alive(started | _descendants(run.pid)):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        log.close()


# ---- PostgreSQL ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin(name: str) -> str | None:
    return shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)


@pytest.fixture(scope="module")
def pg_server():
    """A PostgreSQL server's base URL: $TSDECODE_TEST_POSTGRES_URL (CI starts one), else one
    started here on loopback with a throwaway data folder."""
    in_ci = bool(os.environ.get("CI"))
    try:
        import psycopg  # noqa: F401
    except ImportError:
        if in_ci:
            pytest.fail("psycopg is not installed (the test extra brings it)")
        pytest.skip("psycopg is not installed: pip install -e '.[test]'")
    url = os.environ.get("TSDECODE_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        if in_ci:
            pytest.fail("CI must run the PostgreSQL tests: .ci/run starts a server and sets TSDECODE_TEST_POSTGRES_URL")
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql")
    data = tempfile.mkdtemp(prefix="tsdecode-pg-")
    as_user: list[str] = []
    if os.geteuid() == 0:  # the server refuses to run as root
        shutil.chown(data, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    subprocess.run([*as_user, initdb, "-D", f"{data}/db", "-U", "tsdecode", "--auth=trust"], check=True,
                   capture_output=True)
    subprocess.run([*as_user, pg_ctl, "-D", f"{data}/db", "-l", f"{data}/log", "-w", "-o",
                    f"-c listen_addresses=127.0.0.1 -p {port} -k {data}", "start"], check=True, capture_output=True)
    try:
        yield f"postgresql://tsdecode@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", f"{data}/db", "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server):
    """A fresh database of the server, over a real connection."""
    import psycopg

    name = f"tsdecode_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server, autocommit=True) as con:
        con.execute(f"CREATE DATABASE {name}")
    yield pg_server.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(pg_server, autocommit=True) as con:
        con.execute(f"DROP DATABASE {name} WITH (FORCE)")


def test_postgres_four_workers_find_what_one_worker_finds(one_worker, tmp_path, pg_url):
    out = tmp_path / "out"
    r = _tune([*GRID, *FAST, "--out", str(out), "--inject-hook", HOOK, "--devices", "cpu:4", "--storage", pg_url])
    assert r.returncode == 0, r.stderr[-4000:]
    assert _check_trials(study.open_storage(pg_url)) == one_worker["trials"]
    assert _winners(out / "cpu_Triton_interpreter.json") == one_worker["winners"]


def test_postgres_two_hosts_a_killed_worker_and_export(one_worker, tmp_path, pg_url):
    """Two workers as two hosts on one job (created with ``create``); host B's worker is killed
    (SIGKILL) mid-trial: host A's worker fails the trial after the heartbeat grace period and
    measures it again, B restarted joins again, and ``export`` writes the one-worker table."""
    args = [*GRID, "--retime-rounds", "1", "--top-k", "1", "--heartbeat-grace", "3"]
    r = _tune(["create", "--storage", pg_url, "--job", "two-hosts", "--for", "cpu", *args])
    assert r.returncode == 0 and r.stdout.strip() == "two-hosts", r.stderr
    marker = tmp_path / "marker"

    def worker(host: str, **env) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "tuner", "worker", "--storage", pg_url, "--job", "two-hosts", "--device", "cpu",
               "--label", host, "--isolation", "inline", "--no-progress", "--out", str(tmp_path / host),
               "--inject-hook", HOOK]
        return subprocess.Popen(cmd, cwd=REPO, env=_env(**{study.HOST_ENV: host, MARKER_ENV: str(marker), **env}),
                                stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{host}.log", "a"))

    b = worker("host-b", **{MODE_ENV: "hang"})
    a = worker("host-a")
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert time.monotonic() < deadline and b.poll() is None, (tmp_path / "host-b.log").read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(0.5)
        b.kill()  # SIGKILL mid-trial: its heartbeats stop
        b.wait()
        while "no heartbeat for 3 s" not in (tmp_path / "host-a.log").read_text():
            assert time.monotonic() < deadline and a.poll() is None, (tmp_path / "host-a.log").read_text()[-3000:]
            time.sleep(0.2)
        b = worker("host-b")  # the restarted worker joins again
        assert a.wait(timeout=300) == 0, (tmp_path / "host-a.log").read_text()[-3000:]
        assert b.wait(timeout=300) == 0, (tmp_path / "host-b.log").read_text()[-3000:]
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
    logs = (tmp_path / "host-a.log").read_text() + (tmp_path / "host-b.log").read_text()
    assert "no heartbeat for 3 s (its worker died or lost the storage); queued again as trial" in logs
    storage = study.open_storage(pg_url)
    assert _check_trials(storage, killed=True) == one_worker["trials"]
    # the killed worker's trials (the one it ran, and any others it held by then): each failed,
    # each queued again within its study and done
    for s in _bucket_studies(storage):
        for failed in [t for t in s.trials if t.state.name == "FAIL"]:
            assert failed.user_attrs["worker"]["label"] == "host-b"
            (retry,) = [t for t in s.trials if t.user_attrs.get("retry_of") == failed.number]
            assert retry.state.name == "COMPLETE" and retry.params == failed.params
    assert any(t.state.name == "FAIL" for s in _bucket_studies(storage) for t in s.trials)
    rc, text, err = _captured(["export", "--storage", pg_url, "--job", "two-hosts", "--out", str(tmp_path / "table")])
    assert rc == 0, err
    assert "job two-hosts: 4 of 4 buckets tuned" in err
    assert _winners(tmp_path / "table" / "cpu_Triton_interpreter.json") == one_worker["winners"]


# ---- refusals and errors --------------------------------------------------------------------------


def test_a_worker_of_another_gpu_model_is_refused(one_worker, tmp_path):
    hook = tmp_path / "other_gpu.py"
    hook.write_text("from tsdecode.device import DeviceProperties, set_override\n"
                    "set_override(DeviceProperties('NVIDIA Other GPU', 100, (8, 0)))\n"
                    "def noop(stage, spec, config, out=None):\n    return None\n")
    r = _tune(["worker", "--storage", one_worker["storage"], "--job", one_worker["job"], "--isolation", "inline",
               "--out", str(tmp_path), "--inject-hook", f"{hook}:noop"])
    assert r.returncode == 2, r.stderr
    kernel = tables.kernel_source_hash()
    line = r.stderr.strip().splitlines()[-1]
    assert line == (f"tsdecode-tune: error: job '{one_worker['job']}' is tuned on '{CPU_NAME}' with kernel {kernel}; "
                    f"this worker's device is 'NVIDIA Other GPU' with kernel {kernel}: refusing to join (another GPU "
                    "model would mix its trials into the job's table; start another job for it)")
    assert "Traceback" not in r.stderr


def test_a_worker_with_another_kernel_is_refused(tmp_path):
    storage = study.open_storage(str(tmp_path / "s.journal"))
    cpu = device_properties("cpu")
    mine = J.Identity(cpu, "aaaa", "3.x", "2.x", None)
    assert J.pin(storage, "j", mine) == mine and J.pin(storage, "j", mine) == mine
    with pytest.raises(J.JobError, match=r"job 'j' is tuned on '.*' with kernel aaaa; this worker's device is "
                                         r"'.*' with kernel bbbb: refusing to join \(another kernel would mix"):
        J.pin(storage, "j", J.Identity(cpu, "bbbb", "3.x", "2.x", None))
    assert J.pinned(storage, "j") == mine  # the refused worker left no pin behind
    assert len([s for s in storage.get_all_studies() if s.study_name.startswith(J.PIN_PREFIX)]) == 1


@pytest.mark.parametrize("devices", [[], ["--devices", "cpu:2"]], ids=["one", "devices"])
def test_a_job_for_gpus_refuses_a_cpu_worker_and_stays_unpinned(tmp_path, devices):
    """``create`` without --for makes a GPU job: a worker without a GPU (Triton's interpreter) is
    refused with one line, measures nothing and leaves the job unpinned for the GPU workers."""
    url = str(tmp_path / "s.journal")
    r = _tune(["create", "--storage", url, "--job", "gpu-job", *GRID, "--trials", "1"])
    assert r.returncode == 0, r.stderr
    r = _tune(["worker", "--storage", url, "--job", "gpu-job", *devices, "--isolation", "inline", "--no-progress",
               "--out", str(tmp_path / "w"), "--inject-hook", HOOK])
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr == ("tsdecode-tune: error: job 'gpu-job' is for GPU workers (--for gpu); this worker has no GPU "
                        "(Triton's interpreter): refusing to join (its timings would pin the job to the CPU; run it "
                        "on a GPU host, or create a job with --for cpu)\n")
    storage = study.open_storage(url)
    assert J.pinned(storage, "gpu-job") is None and not _bucket_studies(storage)
    job = J.load_job(storage, "gpu-job")
    J.check_kind(job, interpreter=False)  # a GPU worker joins it
    with pytest.raises(J.JobError, match=r"job 'gpu-job' is for CPU workers \(--for cpu\); this worker runs on a "
                                         r"GPU: refusing to join"):  # and a GPU worker a CPU job: not
        J.check_kind(dataclasses.replace(job, interpreter=True), interpreter=False)


@pytest.mark.parametrize("command", ["worker", "export"])
@pytest.mark.parametrize("storage, message", [
    ("foo://nowhere/db", "not a usable URL"),
    ("postgresql://tsdecode@127.0.0.1:{port}/db", "cannot connect"),
    ("{tmp}/missing.journal", "no such file"),
    ("just-a-name", "not a storage URL"),
    ("{journal}", "unknown job 'nope' in this storage (jobs there: "),
], ids=["bad_url", "unreachable", "missing_file", "not_a_url", "unknown_job"])
def test_worker_and_export_errors_are_one_line_exit_2(one_worker, tmp_path, command, storage, message, capsys):
    storage = storage.format(port=_free_port(), tmp=tmp_path, journal=one_worker["storage"])
    job = "nope" if "journal" in storage else one_worker["job"]
    t0 = time.monotonic()
    assert main([command, "--storage", storage, "--job", job, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tsdecode-tune: error: ") and message in err, err
    assert "Traceback" not in err and time.monotonic() - t0 < 30
    assert not (tmp_path / "missing.journal").exists()


def test_a_bad_job_name_and_a_job_defined_otherwise_exit_2(one_worker, tmp_path, capsys):
    assert main(["export", "--storage", one_worker["storage"], "--job", "no/slash"]) == 2
    assert "bad job name 'no/slash'" in capsys.readouterr().err
    url = str(tmp_path / "s.journal")
    assert main(["create", "--storage", url, "--job", "j", "--for", "cpu", *GRID]) == 0
    assert main(["create", "--storage", url, "--job", "j", "--for", "cpu", *GRID, "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert "job 'j' already exists in this storage with another grid or search settings" in err


# ---- pieces ---------------------------------------------------------------------------------------


class _FakeClient:
    """Re-times configs with fake_time (what a worker's measuring process would return)."""

    def call(self, op, timeout=None, **kw):
        assert op == "retime"
        times = {i: [fake_time("time", kw["specs"][0], c)] * kw["rounds"] for i, c in enumerate(kw["configs"])}
        return {"times_us": times, "failed": {}, "bytes": 1000}


def test_two_workers_finalising_one_bucket_is_harmless(one_worker, tmp_path):
    """The worker that finishes a bucket's last trial re-times it; two doing so at once both
    write a valid final (the last stays) and the export is the same."""
    shutil.copy(one_worker["storage"], tmp_path / "s.journal")
    storage = study.open_storage(str(tmp_path / "s.journal"))
    job = J.load_job(storage, one_worker["job"])
    cpu = device_properties("cpu")
    bucket = job.buckets[1]
    name = J.study_names(storage, job)[bucket.key]
    s = optuna.load_study(study_name=name, storage=storage)
    before = s.user_attrs["final"]
    default, _ = buckets.bucket_space(bucket, cpu, job.settings.limits)
    results = []
    for label in ("a", "b"):  # one after the other here; at once, each writes a whole final
        paths = study.OutputPaths.for_device(cpu.name, tmp_path / label)
        tuner = search.Tuner(job.settings, _FakeClient(), device=cpu, copy_bandwidth_gbs=None, paths=paths,
                             storage=storage, storage_url=str(tmp_path / "s.journal"), label=label, progress=False)
        results.append(tuner._finalize(s, bucket, name, default, tuner._cache_from_storage(s)))
        tuner.close()
    assert results[0].winner == results[1].winner == KernelConfig(**before["winner"])
    assert s.user_attrs["final"]["worker"] == "b" and s.user_attrs["final"]["winner"] == before["winner"]
    ex = J.export(storage, job, tmp_path / "table")
    assert _winners(ex.table) == one_worker["winners"]


def test_the_job_record_holds_what_a_worker_needs(one_worker):
    storage = study.open_storage(one_worker["storage"])
    job = J.load_job(storage, one_worker["job"])
    assert len(job.specs) == 4 and len(job.buckets) == 4
    assert job.settings.trials == 16 and job.settings.limits.block_n == (16, 64) and job.interpreter
    assert job.heartbeat.grace == 2 * job.settings.trial_timeout
    assert set(J.study_names(storage, job)) == {b.key for b in job.buckets}
    assert J.pinned(storage, job.name).device.name == CPU_NAME


def test_compile_processes_share_the_host():
    assert compile_workers_per_device(1, cpus=16) == 8  # one GPU: min(8, CPUs - 4)
    assert compile_workers_per_device(1, cpus=6) == 2
    assert compile_workers_per_device(8, cpus=16) == 1  # never none
    assert compile_workers_per_device(8, cpus=128) == 8
    assert compile_workers_per_device(4, cpus=32) == 5
    assert compile_workers_per_device(4, cpus=32, cpu_mode=True) == 0


def test_devices_flag_errors(capsys):
    assert main(["--devices", "cpu:0"]) == 2
    assert "cpu:N needs a worker count N >= 1" in capsys.readouterr().err
    assert main(["--devices", "all"]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err
    assert main(["--device", "cpu", "--devices", "cpu:2"]) == 2
    assert "--device and --devices: give one of them" in capsys.readouterr().err
