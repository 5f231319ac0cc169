"""Where a tuning run keeps its state: the output paths, the Optuna study storage (and its run lock
and queue lock), and the append-only results log (with its CSV view).

Storages: an Optuna journal file (the default, ``<work folder>/<GPU>_study.journal``: no server,
and its trial queue is safe with several writers, see docs/tuning.md for the measurement), an
RDB URL (``sqlite:///file.db``; ``postgresql://...`` for several hosts). Errors opening one (a bad
URL, a missing driver, an unreachable server) raise ``StorageError`` with a one-line message.

The results log is the durable record: every finished trial is appended (one ``write`` of a
whole line, fsynced, so workers of one host can share the file) before it is told to the study
storage, so a crash between the two loses nothing. The process that starts a run (``tune``)
holds an exclusive lock on ``<study storage>.tuner.lock`` from start to end: one run per storage.
A study file that is not a database / journal any more is moved aside (the table and the log
keep what was tuned), if the tuner recognises it as its own (``set_aside_if_damaged``); a journal
storage is a path ending in ``.journal``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import filelock
import optuna

from tsdecode import KernelConfig
from tsdecode.config import tables

from .arguments import ToolError
from .files import atomic_write_text, move_aside
from .space import SPACE_FIELDS


@dataclass(frozen=True)
class OutputPaths:
    """The device's table, and the folder of the trial log, its CSV and the default study DB."""

    table: Path
    work_dir: Path
    jsonl: Path
    csv: Path
    storage: str

    @classmethod
    def for_device(cls, device_name: str, table_dir: Path, work_dir: Path | None = None,
                   storage: str | None = None) -> "OutputPaths":
        work_dir = work_dir or table_dir
        table = table_dir / tables.table_filename(device_name)
        stem = table.stem
        if storage is None:
            storage = str((work_dir / f"{stem}_study.journal").resolve())
        return cls(table, work_dir, work_dir / f"{stem}_trials.jsonl", work_dir / f"{stem}_trials.csv", storage)

    @property
    def storage_file(self) -> Path | None:
        """The file of a SQLite or journal storage (None: a database server)."""
        if self.storage.startswith("sqlite:///"):
            return Path(self.storage[len("sqlite:///"):])
        if is_journal(self.storage):
            return Path(self.storage)
        return None

    @property
    def default_storage(self) -> bool:
        """The storage is the journal file the tuner names itself (no --storage, or the same path)."""
        return self.storage == str((self.work_dir / f"{self.table.stem}_study.journal").resolve())

    @property
    def lock(self) -> Path:
        """The run lock of the study storage: ``<file>.tuner.lock`` (not ``.lock``, which an
        Optuna journal file uses itself); for a database server, one per work folder and device."""
        base = self.storage_file or self.work_dir / f"{self.table.stem}_study"
        return Path(f"{os.path.abspath(base)}.tuner.lock")


class StorageError(ToolError):
    """A study storage that cannot be opened or used (bad URL, missing driver, unreachable
    server, missing file): a one-line message for the command line (exit code 2)."""


class StudyBusy(ToolError):
    """Another tuner process holds the run lock of the same study storage."""


def lock_study(paths: OutputPaths) -> filelock.FileLock:
    """Take the run lock of ``paths``' study storage without waiting; released by ``release()`` or
    when the process ends, a kill included (the file left behind blocks nothing). Raises
    StudyBusy, or StorageError where the lock file cannot be created (filelock would take that
    for a lock held by another process)."""
    try:
        paths.lock.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o644))
    except OSError as e:
        above = next((d for d in paths.lock.parents if d.exists()), None)
        why = f"{above} is not a folder" if above is not None and not above.is_dir() else e.strerror
        raise StorageError(f"study storage {display_url(paths.storage)}: cannot create its run lock {paths.lock} "
                           f"({why or e})") from None
    lock = filelock.FileLock(paths.lock)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise StudyBusy(f"another tuner is using {paths.storage_file or paths.storage}; wait for it to "
                        "finish, or give this run a study storage of its own (--storage FILE.journal): "
                        f"its buckets are still merged into {paths.table}") from None
    return lock


def sqlite_problem(path: Path) -> str | None:
    """Why the SQLite file at ``path`` is not a database (None: it is one, or it is missing,
    empty or busy, which are no evidence of damage)."""
    import sqlite3

    try:
        if path.stat().st_size == 0:
            return None
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=60)
        try:
            row = con.execute("PRAGMA quick_check").fetchone()
        finally:
            con.close()
    except (OSError, sqlite3.OperationalError):  # missing, unreadable, locked
        return None
    except sqlite3.DatabaseError as e:  # "file is not a database", "disk image is malformed"
        return str(e)
    return None if row and row[0] == "ok" else f"integrity check: {row[0] if row else 'no answer'}"


def move_storage_aside(path: Path) -> Path:
    """Move a damaged SQLite file aside with its journal files (a journal left beside a new,
    empty DB would be rolled back into it)."""
    moved = move_aside(path, "corrupt")
    for suffix in ("-journal", "-wal", "-shm"):
        side = Path(f"{path}{suffix}")
        if side.exists():
            os.replace(side, f"{moved}{suffix}")
    return moved


def set_aside_if_damaged(paths: OutputPaths) -> tuple[Path, str] | None:
    """Move the study file of ``paths`` aside if it is no longer a database / journal (random
    bytes, a torn record): (where it went, why), or None if it is fine, missing or a server.
    Only a regular file the tuner recognises as its own is moved: the journal it names itself, or
    a file that starts as its kind does (a journal record, SQLite's header); anything else (a
    user's file given as --storage, a folder) raises StorageError and is left alone."""
    path = paths.storage_file
    if path is None or not path.exists():
        return None
    journal = is_journal(paths.storage)
    problem = journal_problem(path) if journal else sqlite_problem(path)
    if problem is None:
        return None
    if not (path.is_file() and (paths.default_storage or _starts_as_storage(path, journal))):
        kind = "an Optuna journal" if journal else "an SQLite database"
        raise StorageError(f"study storage {display_url(paths.storage)}: not {kind} ({problem}); a file the tuner "
                           "does not recognise as its own is left alone: pass another --storage or move it away")
    return move_storage_aside(path), problem


def _starts_as_storage(path: Path, journal: bool) -> bool:
    """Whether the file at ``path`` starts as an Optuna journal (a first line that is a JSON
    object with an "op_code") or an SQLite database (its 16-byte header) does."""
    try:
        with open(path, "rb") as f:
            if not journal:
                return f.read(16) == b"SQLite format 3\0"
            record = json.loads(f.readline(1 << 20))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(record, dict) and "op_code" in record


def is_journal(url: str) -> bool:
    """A journal storage is a path ending in .journal (any other path is no storage)."""
    return url.endswith(".journal") and "://" not in url


def journal_problem(path: Path) -> str | None:
    """Why the journal file at ``path`` cannot be replayed (None: it can, or it is missing):
    every line must be a JSON object ending in a newline (Optuna would append after a torn last
    line and damage the next record too), and Optuna must be able to replay every record (valid
    JSON of an unknown operation, or naming a trial that does not exist, fails the replay)."""
    if path.exists() and not path.is_file():  # reading a FIFO would hang
        return "not a regular file"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    for number, line in enumerate(data.splitlines(keepends=True), 1):
        if not line.endswith(b"\n"):
            return f"line {number} is cut short"
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            return f"line {number} is not JSON"
        if not isinstance(record, dict) or "op_code" not in record:
            return f"line {number} is not an Optuna journal record"
    return _replay_problem(path)


def _replay_problem(path: Path) -> str | None:
    """Why Optuna cannot replay the journal at ``path`` (whose lines are complete JSON objects),
    naming the line of the first record it fails on; None if it can."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    class Counted:  # the backend, counting the records it hands to the replay
        def __init__(self) -> None:
            self.backend, self.read = JournalFileBackend(str(path)), 0

        def read_logs(self, log_number_from: int):
            for record in self.backend.read_logs(log_number_from):
                self.read += 1
                yield record

    counted = Counted()
    try:
        JournalStorage(counted)
    except OSError:
        return None
    except Exception as e:  # AssertionError "Should not reach.", KeyError 'trial_id', ...
        return f"line {counted.read} is a record Optuna cannot replay: {type(e).__name__}: {e}"
    return None


def check_url(url: str) -> None:
    """StorageError unless ``url`` names a storage that keeps what is stored: a journal file, an
    SQLite file or a database server (an in-memory SQLite database is gone with the process: no
    resume, no other worker)."""
    if is_journal(url):
        return
    if "://" not in url:
        raise StorageError(f"study storage {url!r}: not a storage URL (sqlite:///FILE.db, "
                           "postgresql://USER@HOST:PORT/DB) nor a journal file (a path ending in .journal)")
    scheme, rest = url.split("://", 1)
    if scheme.split("+", 1)[0] == "sqlite":  # sqlite:///FILE, sqlite+DRIVER:///FILE
        path = rest.split("?", 1)[0]
        if path in ("", "/", "/:memory:") or path.endswith("/"):
            raise StorageError(f"study storage {url!r}: names no database file (an in-memory database "
                               "keeps nothing to resume or share with other workers): give sqlite:///FILE.db")


def display_url(url: str) -> str:
    """``url`` for messages: a database URL without its password."""
    if "://" not in url:
        return url
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("://", 1)[0] + "://..."


def _rdb_url(url: str) -> str:
    """``postgresql://`` means SQLAlchemy's default driver, psycopg2; with only psycopg (3)
    installed (what the "tune" extra brings) the URL names that driver instead."""
    scheme, sep, rest = url.partition("://")
    if scheme in ("postgresql", "postgres") and sep:
        import importlib.util

        if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
            return f"postgresql+psycopg://{rest}"
        if scheme == "postgres":  # SQLAlchemy 2 knows only "postgresql"
            return f"postgresql://{rest}"
    return url


@dataclass(frozen=True)
class Heartbeat:
    """Optuna's trial heartbeats (RDB storages): a worker records one per held trial every
    ``interval`` seconds; a RUNNING trial without one for ``grace`` seconds is stale (its worker
    died or lost the storage) and is failed and retried by any other worker."""

    interval: int = 30
    grace: int = 600


def open_storage(url: str, heartbeat: Heartbeat | None = None, stale_callback=None, must_exist: bool = False):
    """An Optuna storage: a path ending in .journal (journal file, no SQLAlchemy needed)
    or an RDB URL (sqlite:///file.db, postgresql://user@host:port/db). ``heartbeat`` enables
    Optuna's heartbeats on RDB storages, with ``stale_callback(study, trial)`` called for each
    trial failed as stale. ``must_exist``: a storage file that does not exist is an error (a
    worker joins an existing job) instead of being created. Raises StorageError."""
    check_url(url)
    if is_journal(url):
        path = Path(url)
        if must_exist and not path.is_file():
            raise StorageError(f"study storage {url}: no such file")
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return JournalStorage(JournalFileBackend(str(path)))
        except OSError as e:
            raise StorageError(f"study storage {url}: cannot read the journal ({e})") from None
        except Exception as e:  # not JSON, or a record Optuna cannot replay (AssertionError, KeyError, ...)
            why = journal_problem(path) or f"{type(e).__name__}: {e}"
            raise StorageError(f"study storage {url}: cannot read the journal ({why})") from None
    shown = display_url(url)
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        if must_exist and not path.is_file():
            raise StorageError(f"study storage {shown}: no such file")
        path.parent.mkdir(parents=True, exist_ok=True)
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        engine_kwargs = {"connect_args": {"timeout": 60}}
    elif url.startswith(("postgresql", "postgres")):
        # A dropped connection is replaced before use (trials can take minutes); an unreachable
        # server fails in seconds instead of hanging.
        engine_kwargs = {"pool_pre_ping": True, "connect_args": {"connect_timeout": 10}}
    hb = {} if heartbeat is None else {"heartbeat_interval": heartbeat.interval, "grace_period": heartbeat.grace,
                                       "heartbeat_stale_trial_callback": stale_callback}
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # heartbeats are "experimental"
            return optuna.storages.RDBStorage(_rdb_url(url), engine_kwargs=engine_kwargs, **hb)
    except ImportError as e:
        name = getattr(e, "name", None) or str(e)
        hint = ' (pip install "tsdecode[tune]" brings psycopg for PostgreSQL)' if "psycopg" in str(name) else ""
        raise StorageError(f"study storage {shown}: the driver is not installed: {e}{hint}") from None
    except Exception as e:  # sqlalchemy's ArgumentError, NoSuchModuleError, OperationalError, ...
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        what = type(e).__name__
        first = lines[0] if lines else what
        if what in ("ArgumentError", "NoSuchModuleError"):
            raise StorageError(f"study storage {shown}: not a usable URL ({first})") from None
        if what in ("OperationalError", "InterfaceError", "DatabaseError"):
            first = first.split("] ", 1)[-1]  # "(psycopg.OperationalError) connection failed: ..."
            raise StorageError(f"study storage {shown}: cannot connect ({first[:300]})") from None
        raise StorageError(f"study storage {shown}: {what}: {first[:300]}") from None


@contextlib.contextmanager
def queue_lock(url: str) -> Iterator[None]:
    """Held around taking a queued trial (and failing a stale one). SQLite's transactions do not
    lock the row read before the update, so two processes can take the same WAITING trial (the
    benchmark in docs/tuning.md counts them); a file lock beside the DB serialises that on its
    one host. Journal files (ordered log) and PostgreSQL (``SELECT ... FOR UPDATE``) need none."""
    if not url.startswith("sqlite:///"):
        yield
        return
    with filelock.FileLock(f"{url[len('sqlite:///'):]}.tuner-queue.lock"):
        yield


# ---------------------------------------------------------------------------------------------
# Workers and their trials
# ---------------------------------------------------------------------------------------------

# A trial whose worker died is queued again at most this many times (a config that kills the
# worker process itself, not just the isolated measuring process, stops there).
MAX_RETRIES = 2
HOST_ENV = "TSDECODE_TUNE_HOST"


def host_key() -> str:
    """This machine as workers tell each other apart: hostname, boot id and PID namespace (two
    containers on one machine are two hosts: their PIDs mean nothing to each other), or
    $TSDECODE_TUNE_HOST if set."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    import socket

    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8])
    with contextlib.suppress(OSError):
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    return "/".join(parts)


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (None: no such process, a
    zombie, or no /proc); with the PID it names one process, even after the PID is reused. A
    zombie counts as gone: a killed run's orphaned worker stays one where PID 1 does not reap."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def worker_stamp(label: str = "") -> dict[str, Any]:
    """What a trial records of the worker holding it (its user attribute "worker")."""
    pid = os.getpid()
    return {"host": host_key(), "pid": pid, "start": _process_start(pid), "label": label}


def stamp_alive(stamp: dict[str, Any]) -> bool | None:
    """Whether the worker of ``stamp`` is alive: True/False for a worker of this host, None for
    another host's (its heartbeats tell)."""
    if not isinstance(stamp, dict) or stamp.get("host") != host_key():
        return None
    pid = stamp.get("pid")
    if not isinstance(pid, int):
        return None
    start = _process_start(pid)
    if start is not None or Path("/proc/self/stat").exists():
        return start is not None and (stamp.get("start") is None or start == stamp.get("start"))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def pop_waiting(study: optuna.Study, first: int | None = None) -> int | None:
    """Atomically take a WAITING (queued) trial of ``study`` for this process: its id, now
    RUNNING, or None when none is waiting; trial number ``first`` before the others, if it is
    waiting. Unlike ``study.ask()`` it never creates a trial. (On SQLite, hold ``queue_lock``
    around it.)"""
    from optuna.trial import TrialState

    storage = study._storage
    waiting = storage.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.WAITING,))
    for t in sorted(waiting, key=lambda t: t.number != first):  # stable: queue order otherwise
        try:
            if storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                return t._trial_id
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
    return None


def trial_params(trial) -> dict[str, Any]:
    """A trial's parameters, also for a queued one whose parameters were never suggested."""
    return dict(trial.system_attrs.get("fixed_params") or trial.params)


def retry_trial(study: optuna.Study, trial, why: str) -> int | None:
    """Queue ``trial`` (just failed because its worker died) again, with its fitted config: the
    number of the new WAITING trial, or None (retried MAX_RETRIES times already, or a sampled
    trial that died before its parameters were set: the sampler samples afresh)."""
    params = trial_params(trial)
    if set(params) != set(SPACE_FIELDS):
        return None
    retries = int(trial.user_attrs.get("retries", 0))
    if retries >= MAX_RETRIES:
        return None
    attrs = {k: trial.user_attrs[k] for k in ("key", "config", "adjustments", "timeout_retry_of")
             if k in trial.user_attrs}
    attrs.update(retry_of=trial.number, retries=retries + 1, retry_reason=why)
    study.enqueue_trial(params, user_attrs=attrs)
    return next((t.number for t in reversed(study.get_trials(deepcopy=False))
                 if t.user_attrs.get("retry_of") == trial.number), None)


def _json_default(o: Any) -> Any:
    if isinstance(o, KernelConfig):
        return o.to_dict()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


class ResultLog:
    """Append-only JSON-lines log of every finished trial, re-timing and bucket result (of every
    worker of this host that writes to the same folder)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND and one write() per record: the workers of a host share the file and each
        # record lands whole, after the others'.
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps({"t": round(time.time(), 3), **record}, default=_json_default) + "\n").encode()
        os.write(self._fd, line)
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        """All complete records (a line cut short by a crash, or otherwise damaged, is skipped)."""
        records = []
        try:
            with open(path, "rb") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except (ValueError, RecursionError):  # not JSON, not UTF-8
                        continue
                    if isinstance(record, dict):
                        records.append(record)
        except FileNotFoundError:
            pass
        return records


def write_trials_csv(jsonl: Path, csv: Path) -> int:
    """The log as one long CSV (pandas): a row per trial and per re-timing round, the config in
    KernelConfig's field names. Returns the number of rows."""
    import pandas as pd

    rows = []
    for rec in ResultLog.read(jsonl):
        kind = rec.get("kind")
        bucket = rec.get("bucket") or [None, None]
        base = {"kind": kind, "study": rec.get("study"), "class_key": rec.get("class_key"),
                "bucket_batch_size": bucket[0], "bucket_kv_len": bucket[1]}
        cfg = rec.get("config") or {}
        fields = {k: cfg.get(k) for k in SPACE_FIELDS}
        specs = ";".join(rec.get("specs") or [])
        if kind == "trial":
            rows.append({
                **base, "trial": rec.get("trial"), "state": rec.get("state"), **fields,
                **{k: rec.get(k) for k in ("time_us", "bandwidth_gbs", "fraction_of_copy")},
                "rel_error": rec.get("rel_error", rec.get("rel_err")),  # rel_err: logs before the rename
                **{k: rec.get(k) for k in ("measured", "duplicate_of", "prune_reason", "timeout_s", "compile_s",
                                           "plan_s", "measure_s", "is_default")},
                "specs": specs, "sampled": json.dumps(rec.get("params")),
            })
        elif kind == "retime":
            rows += [{**base, "state": "RETIME", "round": i, **fields, "time_us": t,
                      "is_default": rec.get("is_default"), "specs": specs}
                     for i, t in enumerate(rec.get("times_us") or [])]
    frame = pd.DataFrame(rows)
    for col in ("trial", "round", "bucket_batch_size", "bucket_kv_len"):
        if col in frame:
            frame[col] = frame[col].astype("Int64")
    atomic_write_text(csv, frame.to_csv(index=False))
    return len(frame)
