"""The search: one Optuna study per (problem class, bucket) over KernelConfig's fields.

Shapes of a grid are grouped by ``tables.problem_class_key`` and ``tables.bucket_of``; each group
("bucket") gets a study whose objective is the group's time per call (geometric mean over its
shapes; usually one shape). The space is KernelConfig's fields, narrowed to values that can be
valid for the shape, with num_kv_splits from powers of two, 3 x powers of two, SM-wave multiples
and the heuristic's own value. Small spaces (no larger than the trial budget) are searched with
``GridSampler``, larger ones with a seeded ``TPESampler``; the heuristic default is always the
first trial.

Each sampled config is fitted to the shape (``configs.fit_config``) and measured at most once per
bucket: a trial whose fitted config was already measured (or is being measured) gets that result
without a new measurement ("duplicate"). ``--trials`` counts measured configs; duplicates are
recorded but do not count. At the end the best few are re-timed, interleaved with the default,
and a winner is kept only if it beats the default by more than the measured noise.

Crash safety: every finished trial is appended (flushed, fsynced) to ``<gpu>_trials.jsonl``
before it is told to the study storage; on resume, trials left RUNNING are completed from that
log when it has them, else marked FAIL and re-sampled. A run holds an exclusive lock on
``<study storage>.tuner.lock`` from start to end, so a RUNNING trial found at the start was left
by a dead process, never by a live one. A study DB that is not a database any more is moved
aside and the studies start afresh; buckets whose final record is in the log are not re-tuned.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from tsdecode import tables
from tsdecode.configs import (
    BLOCK_M_CHOICES, BLOCK_N_CHOICES, DOT_MIN_BLOCK_M, MAX_NUM_KV_SPLITS, NUM_STAGES_CHOICES,
    NUM_WARPS_CHOICES, SHARED_MEMORY_PER_SM, KernelConfig, ProblemShape, fit_config, heuristic_config,
    next_power_of_2, num_kv_tiles,
)

from .grids import ShapeSpec
from .runner import CandidateFailed, CompilePool, config_key

try:  # POSIX; without it two runs on one study storage are not kept apart
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


def retime_noise(times: Sequence[float]) -> float:
    """Relative noise of repeated timings: the interquartile range over the median, at least 1%.

    The full range would let one slow outlier round (seen on the H200: 1029-1035 us and one
    1145 us) hide a challenger that was 6% faster in every round.
    """
    if len(times) < 2:
        return 0.01
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return max(0.01, (q3 - q1) / statistics.median(times))


SPACE_FIELDS = ("block_n", "block_m", "num_kv_splits", "num_warps", "num_stages")
# Bump when the space construction or the measurement changes meaning: part of the study hash.
SEARCH_VERSION = 1
# Programs (split-pass grid size) per SM above which more KV splits are not searched.
MAX_PROGRAMS_PER_SM = 64
# Programs per SM whose split counts are always candidates (whole waves).
WAVES = (1, 2, 3, 4, 6, 8)


# ---------------------------------------------------------------------------------------------
# The space
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpaceLimits:
    """Restrictions of the config space from the command line (None: automatic)."""

    block_n: tuple[int, ...] = BLOCK_N_CHOICES
    block_m: tuple[int, ...] | None = None  # None: BLOCK_M_CHOICES, FMA ones up to FMA_MAX_ROWS
    num_kv_splits: tuple[int, ...] | None = None
    num_warps: tuple[int, ...] = NUM_WARPS_CHOICES
    num_stages: tuple[int, ...] = NUM_STAGES_CHOICES

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if v is not None else None) for k, v in asdict(self).items()}


# block_m below DOT_MIN_BLOCK_M (FMA reductions) is searched by default only for shapes with at
# most this many query rows a KV head. In every committed H200 trial log (157 buckets, 37% of
# their trials on FMA configs) an FMA config never won: within 1-9% of the best at 1 row (MHA),
# 2.0-9.4x slower at 3 rows (llama3.2-3b, 12 buckets), at least 1.3x slower at 4 rows and more
# (median 3.3x). --block-m still searches them anywhere.
FMA_MAX_ROWS = 2


def split_choices(shape: ProblemShape, num_sms: int, block_n_choices: Sequence[int],
                  block_m_choices: Sequence[int]) -> list[int]:
    """Candidate num_kv_splits for a shape: 1, powers of two and 3 x powers of two, and the split
    counts that fill whole waves of 1..8 programs per SM, up to the K/V tile count (at the
    smallest block_n) and MAX_PROGRAMS_PER_SM programs per SM."""
    tiles = num_kv_tiles(shape.max_kv_len, min(block_n_choices))
    rows = shape.rows_per_kv_head
    min_m_blocks = min(-(-rows // bm) for bm in block_m_choices)
    base = shape.batch_size * shape.num_kv_heads * min_m_blocks  # programs at one split
    cap = max(1, min(MAX_NUM_KV_SPLITS, tiles, (MAX_PROGRAMS_PER_SM * num_sms) // base))
    values = {1}
    p = 1
    while p <= cap:
        values.add(p)
        if 3 * p <= cap:
            values.add(3 * p)
        p *= 2
    for w in WAVES:
        s = (w * num_sms) // base
        if 1 <= s <= cap:
            values.add(s)
    return sorted(values)


def build_space(shape: ProblemShape, num_sms: int, limits: SpaceLimits,
                default: KernelConfig) -> dict[str, tuple[int, ...]]:
    """The categorical choices of each KernelConfig field for this shape (always containing the
    heuristic default's values, so the default is a point of the space)."""
    rows = shape.rows_per_kv_head
    # block_m above the padded row count is always fitted down: leave it out.
    m_cap = max(DOT_MIN_BLOCK_M, next_power_of_2(rows))
    if limits.block_m is None:
        block_m = [m for m in BLOCK_M_CHOICES if m <= m_cap
                   and (m >= DOT_MIN_BLOCK_M or rows <= FMA_MAX_ROWS)]
    else:
        block_m = [m for m in limits.block_m if m <= m_cap] or [min(limits.block_m)]
    block_n = list(limits.block_n)
    if limits.num_kv_splits is not None:
        tiles = num_kv_tiles(shape.max_kv_len, min(block_n))
        splits = sorted({min(s, tiles) for s in limits.num_kv_splits})
    else:
        splits = split_choices(shape, num_sms, block_n, block_m)
    space = {
        "block_n": block_n, "block_m": block_m, "num_kv_splits": splits,
        "num_warps": list(limits.num_warps), "num_stages": list(limits.num_stages),
    }
    for name in SPACE_FIELDS:
        value = getattr(default, name)
        if value not in space[name]:
            space[name].append(value)
        space[name] = tuple(sorted(space[name]))
    return space


def space_size(space: dict[str, Sequence[int]]) -> int:
    return math.prod(len(v) for v in space.values())


def seed_configs(default: KernelConfig, space: dict[str, Sequence[int]],
                 base_programs: int | None = None, num_sms: int | None = None) -> list[KernelConfig]:
    """The first trials of a new study: the default, then the default with a few other split
    counts (the knob that matters most for decode) from the space, then the "lean program"
    family at 1x, 2x and 4x the default's splits: the smallest block_n, 1 warp, 3 stages (about
    12 resident programs per H200 SM against 5 for block_n=64 at 4 warps). On the H200 that
    family was the best config of 6 of 10 held-out ragged shapes and of two tuned buckets, and
    TPE with 40-64 trials rarely reached it on its own (docs/perf-notes.md). Then the same
    family with the deepest pipeline of the space (5 stages: two K/V tiles in flight) at 1x and
    1/2x the default's splits (the best at fp8 caches and at B=1 with long K/V on the H200).
    Last, given base_programs (programs at one split) and num_sms, both lean families at the
    split counts for about 8 and 46 programs per SM, the heuristic's two calibrated targets
    (16-bit and fp8 lean rules), whatever the default's own regime: at fp8 with B <= 32 the
    default is a 64-token 4-warp config whose splits keep these seeds out of reach otherwise
    (docs/perf-notes.md, "Ninth lease")."""
    out = [default]
    splits = space["num_kv_splits"]
    s = default.num_kv_splits

    def near(values, target):
        return min(values, key=lambda v: abs(v - target))

    candidates = [{"num_kv_splits": near(splits, c)} for c in (2 * s, max(1, s // 2), 4 * s)]
    lean = {"block_n": min(space["block_n"]), "num_warps": near(space["num_warps"], 1),
            "num_stages": near(space["num_stages"], 3)}
    candidates += [{**lean, "num_kv_splits": near(splits, c)} for c in (s, 2 * s, 4 * s)]
    deep = {**lean, "num_stages": max(space["num_stages"])}
    candidates += [{**deep, "num_kv_splits": near(splits, c)} for c in (s, max(1, s // 2))]
    if base_programs and num_sms:
        for per_sm in (8, 46):
            target = near(splits, max(1, round(per_sm * num_sms / base_programs)))
            candidates += [{**lean, "num_kv_splits": target}, {**deep, "num_kv_splits": target}]
    for change in candidates:
        config = KernelConfig(**{**default.to_dict(), **change})
        if config not in out:
            out.append(config)
    return out


# ---------------------------------------------------------------------------------------------
# Buckets
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bucket:
    """The shapes of one (problem class, bucket) study."""

    class_key: str
    bucket: tuple[int, int]
    specs: tuple[ShapeSpec, ...]

    @property
    def representative(self) -> ShapeSpec:
        """The shape the space and the default are built for: the largest of the bucket."""
        return max(self.specs, key=lambda s: (s.kv_len, s.batch_size))

    @property
    def shape(self) -> ProblemShape:
        return self.representative.to_problem_shape()

    @property
    def label(self) -> str:
        names = ",".join(s.name for s in self.specs)
        return names if len(names) <= 60 else f"{self.specs[0].name} (+{len(self.specs) - 1})"


def group_buckets(specs: Iterable[ShapeSpec]) -> list[Bucket]:
    groups: dict[tuple[str, tuple[int, int]], list[ShapeSpec]] = {}
    for spec in specs:
        shape = spec.to_problem_shape()
        key = (tables.problem_class_key(shape), tables.bucket_of(spec.batch_size, spec.kv_len))
        groups.setdefault(key, []).append(spec)
    return [Bucket(k, b, tuple(v)) for (k, b), v in groups.items()]


# ---------------------------------------------------------------------------------------------
# Settings, outputs, progress
# ---------------------------------------------------------------------------------------------


@dataclass
class TuneSettings:
    trials: int = 48
    time_budget: float | None = None  # seconds for the whole run (None: no limit)
    seed: int = 0
    top_k: int = 3
    retime_rounds: int = 5
    trial_timeout: float = 300.0
    lookahead: int = 1  # trials asked ahead (precompiled while another is measured)
    limits: SpaceLimits = field(default_factory=SpaceLimits)
    timing: str = "cuda-graph"  # or "wall" (interpreter)
    replay_ms: float = 80.0
    check_requests: int = 2

    def study_fields(self) -> dict[str, Any]:
        """What a study's measurements depend on (budgets excluded: a rerun with a larger
        --trials continues the same studies)."""
        return {"seed": self.seed, "limits": self.limits.to_dict(), "timing": self.timing,
                "replay_ms": self.replay_ms, "check_requests": self.check_requests}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["limits"] = self.limits.to_dict()
        return d


@dataclass(frozen=True)
class OutputPaths:
    out_dir: Path
    table: Path
    jsonl: Path
    csv: Path
    storage: str

    @classmethod
    def for_device(cls, out_dir: Path, device_name: str, storage: str | None) -> "OutputPaths":
        table = out_dir / tables.table_filename(device_name)
        stem = table.stem
        if storage is None:
            storage = f"sqlite:///{(out_dir / f'{stem}_study.db').resolve()}"
        return cls(out_dir, table, out_dir / f"{stem}_trials.jsonl", out_dir / f"{stem}_trials.csv",
                   storage)

    @property
    def storage_file(self) -> Path | None:
        """The file of a SQLite or journal storage (None: a database server)."""
        if self.storage.startswith("sqlite:///"):
            return Path(self.storage[len("sqlite:///"):])
        if _is_journal(self.storage):
            return Path(self.storage)
        return None

    @property
    def lock(self) -> Path:
        """The run lock of the study storage: ``<file>.tuner.lock`` (not ``.lock``, which an
        Optuna journal file uses itself); for a database server, one per --out and GPU."""
        base = self.storage_file or self.out_dir / f"{self.table.stem}_study"
        return Path(f"{os.path.abspath(base)}.tuner.lock")


class StudyBusy(RuntimeError):
    """Another tuner process holds the run lock of the same study storage."""


def lock_study(paths: OutputPaths):
    """Take the run lock of ``paths``' study storage (an exclusive, non-blocking ``flock``);
    returns the open lock file, whose closing (or the process's end, a kill included) releases
    it. The file is never deleted: a leftover one blocks nothing. Raises StudyBusy."""
    path = paths.lock
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+b")
    if fcntl is None:  # pragma: no cover - no flock: runs are not serialised
        return f
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        what = paths.storage_file or paths.storage
        raise StudyBusy(f"another tuner is using {what}; wait for it to finish or pass a "
                        "different --out") from None
    return f


def _sqlite_problem(path: Path) -> str | None:
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


def _move_aside_storage(path: Path) -> Path:
    """Move a damaged SQLite file aside with its journal files (a journal left beside a new,
    empty DB would be rolled back into it)."""
    moved = tables._move_aside(path, "corrupt")
    for suffix in ("-journal", "-wal", "-shm"):
        side = Path(f"{path}{suffix}")
        if side.exists():
            os.replace(side, f"{moved}{suffix}")
    return moved


def _is_journal(url: str) -> bool:
    return url.endswith((".log", ".journal")) and "://" not in url


def open_storage(url: str):
    """An Optuna storage: an RDB URL (sqlite:///file.db, the default), or a path ending in .log
    / .journal for a journal file (no SQLAlchemy needed)."""
    if _is_journal(url):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        return JournalStorage(JournalFileBackend(url))
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}}
                                          if url.startswith("sqlite") else None)
    except ImportError as e:  # no SQLAlchemy: fall back to a journal file beside the DB
        if url.startswith("sqlite:///"):
            path = url[len("sqlite:///"):].rsplit(".", 1)[0] + ".journal"
            print(f"note: {e}; using the Optuna journal file {path} instead of SQLite",
                  file=sys.stderr)
            return open_storage(path)
        raise


class ResultLog:
    """Append-only JSON-lines log of every finished trial, re-timing and bucket result."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        record = {"t": round(time.time(), 3), **record}
        self._f.write(json.dumps(record, default=_json_default) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        """All complete records (a line cut short by a crash, or otherwise damaged, is
        skipped)."""
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


def _json_default(o: Any) -> Any:
    if isinstance(o, KernelConfig):
        return o.to_dict()
    if isinstance(o, tuple):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


class Progress:
    """A tqdm bar with ETA on a terminal, else a line every ``every_s`` seconds."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True, initial: int = 0,
                 deadline: float | None = None, every_s: float = 10.0, stream=None) -> None:
        self.total, self.desc, self.n = total, desc, initial
        self.deadline, self.every_s = deadline, every_s
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.start_n = initial
        self.last = 0.0
        self.postfix = ""
        self.bar = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, desc=desc, file=self.stream,
                                dynamic_ncols=True, leave=True)
            except ImportError:
                self.bar = None

    def eta_s(self) -> float | None:
        done = self.n - self.start_n
        if done <= 0:
            return None
        rate = (time.monotonic() - self.t0) / done
        eta = rate * max(0, self.total - self.n)
        if self.deadline is not None:
            eta = min(eta, max(0.0, self.deadline - time.monotonic()))
        return eta

    def update(self, n: int = 1, postfix: str = "") -> None:
        self.n += n
        self.postfix = postfix or self.postfix
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix_str(postfix, refresh=False)
            return
        now = time.monotonic()
        if now - self.last >= self.every_s or self.n >= self.total:
            self.last = now
            eta = self.eta_s()
            eta_s = f", eta {eta:.0f} s" if eta is not None else ""
            print(f"  {self.desc}: {self.n}/{self.total} measured{eta_s}"
                  + (f"; {self.postfix}" if self.postfix else ""), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """A measured (or failed) fitted config of one bucket."""

    key: str
    config: KernelConfig
    state: str  # "COMPLETE" or "PRUNED"
    value: float | None
    reason: str | None
    trial: int
    result: dict[str, Any]


@dataclass
class BucketResult:
    bucket: Bucket
    study_name: str
    ok: bool
    winner: KernelConfig | None = None
    time_us: float | None = None
    bandwidth_gbs: float | None = None
    fraction_of_copy: float | None = None
    default: KernelConfig | None = None
    default_time_us: float | None = None
    kept_default: bool = False
    noise: float | None = None
    measured: int = 0
    pruned: int = 0
    note: str = ""
    resumed: bool = False

    @property
    def speedup(self) -> float | None:
        if self.time_us and self.default_time_us:
            return self.default_time_us / self.time_us
        return None


def _short(config: KernelConfig | None) -> str:
    if config is None:
        return "-"
    return (f"n{config.block_n} m{config.block_m} s{config.num_kv_splits} "
            f"w{config.num_warps} st{config.num_stages}")


def summary_table(results: Sequence[BucketResult]) -> str:
    """Best config per bucket, speedup over the heuristic default, fraction of copy bandwidth."""
    head = ("bucket (B,L)", "shape(s)", "best config", "us", "default us", "speedup", "% copy",
            "trials")
    rows = []
    for r in results:
        frac = f"{100 * r.fraction_of_copy:.0f}%" if r.fraction_of_copy is not None else "-"
        if r.ok:
            best = _short(r.winner) + (" (default)" if r.kept_default else "")
            rows.append((str(r.bucket.bucket), r.bucket.label, best, f"{r.time_us:.2f}",
                         f"{r.default_time_us:.2f}", f"{r.speedup:.2f}x", frac,
                         f"{r.measured} ({r.pruned} pruned)"))
        else:
            rows.append((str(r.bucket.bucket), r.bucket.label, f"FAILED: {r.note}"[:60], "-", "-",
                         "-", "-", f"{r.measured} ({r.pruned} pruned)"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in rows]
    return "\n".join(lines)


def write_trials_csv(jsonl: Path, csv: Path) -> int:
    """The raw results of the log as one long CSV (pandas): a row per trial and per re-timing
    round. Returns the number of rows."""
    import pandas as pd

    rows = []
    for rec in ResultLog.read(jsonl):
        kind = rec.get("kind")
        base = {"kind": kind, "study": rec.get("study"), "class_key": rec.get("class_key"),
                "bucket_batch_size": (rec.get("bucket") or [None, None])[0],
                "bucket_kv_len": (rec.get("bucket") or [None, None])[1]}
        if kind == "trial":
            cfg = rec.get("config") or {}
            rows.append({
                **base, "trial": rec.get("trial"), "state": rec.get("state"),
                **{k: cfg.get(k) for k in SPACE_FIELDS},
                "time_us": rec.get("time_us"), "bandwidth_gbs": rec.get("bandwidth_gbs"),
                "fraction_of_copy": rec.get("fraction_of_copy"), "rel_err": rec.get("rel_err"),
                "measured": rec.get("measured"), "duplicate_of": rec.get("duplicate_of"),
                "prune_reason": rec.get("prune_reason"), "compile_s": rec.get("compile_s"),
                "plan_s": rec.get("plan_s"), "measure_s": rec.get("measure_s"),
                "is_default": rec.get("is_default"),
                "specs": ";".join(rec.get("specs") or []), "sampled": json.dumps(rec.get("params")),
            })
        elif kind == "retime":
            cfg = rec.get("config") or {}
            for i, t in enumerate(rec.get("times_us") or []):
                rows.append({**base, "state": "RETIME", "round": i,
                             **{k: cfg.get(k) for k in SPACE_FIELDS}, "time_us": t,
                             "is_default": rec.get("is_default"),
                             "specs": ";".join(rec.get("specs") or [])})
    frame = pd.DataFrame(rows)
    for col in ("trial", "round", "bucket_batch_size", "bucket_kv_len"):
        if col in frame:
            frame[col] = frame[col].astype("Int64")
    tmp = csv.with_name(f".{csv.name}.tmp")
    frame.to_csv(tmp, index=False)
    os.replace(tmp, csv)
    return len(frame)


# ---------------------------------------------------------------------------------------------
# The tuner
# ---------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    trial: optuna.Trial
    params: dict[str, int]
    config: KernelConfig
    key: str
    adjustments: tuple[str, ...]
    future: Future | None
    followers: list[tuple[optuna.Trial, dict[str, int], tuple[str, ...]]] = field(default_factory=list)


class _NoStopGridSampler(optuna.samplers.GridSampler):
    """GridSampler that does not call ``study.stop()`` (which only works inside optimize());
    the tuner checks exhaustion itself."""

    def after_trial(self, study, trial, state, values) -> None:  # noqa: D102
        return None


# What a bucket's "final" study attribute (and log record) holds; _resume_final reads it.
FINAL_FIELDS = frozenset((
    "ok", "winner", "time_us", "bandwidth_gbs", "fraction_of_copy", "default", "default_time_us",
    "default_bandwidth_gbs", "kept_default", "noise", "trials_budget", "measured", "pruned", "note",
))


def _study_seed(seed: int, name: str) -> int:
    return int(hashlib.sha256(f"{seed}|{name}".encode()).hexdigest()[:8], 16)


class Tuner:
    """Runs the studies of a grid with a measuring client and writes the table."""

    def __init__(self, settings: TuneSettings, client, *, device_info, copy_bandwidth_gbs: float | None,
                 paths: OutputPaths, pool: CompilePool | None = None, progress: bool = True,
                 echo: Callable[[str], None] | None = None, run_info: dict[str, Any] | None = None,
                 shared_memory_per_sm: int = SHARED_MEMORY_PER_SM) -> None:
        self.s = settings
        self.client = client
        self.pool = pool
        self.device_info = device_info
        # the measured GPU's, so that each bucket's default is the heuristic the runtime uses there
        self.shared_memory_per_sm = shared_memory_per_sm
        self.copy_bw = copy_bandwidth_gbs
        self.paths = paths
        self.progress = progress
        self.echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.run_info = run_info or {}
        self._lock = lock_study(paths)  # first: nothing below may touch another run's study
        try:
            moved = self._check_storage()
            self.storage = open_storage(paths.storage)
            self.log = ResultLog(paths.jsonl)
        except BaseException:
            self._lock.close()
            raise
        if moved is not None:  # trial numbers start again: older trial records are not theirs
            self.log.write({"kind": "storage_reset", "storage": paths.storage, "moved_to": moved})
        self.jsonl_records: list[dict[str, Any]] | None = None
        self.plan_s = 0.0  # seconds the measuring worker spent planning (loading or compiling)
        self.measured_now = 0  # configs measured by this run

    def close(self) -> None:
        """Close the log and release the run lock."""
        self.log.close()
        self._lock.close()

    def _check_storage(self) -> Path | None:
        """Move a SQLite study DB that is not a database aside (one warning); returns where to.
        The table and the log keep what was tuned: finished buckets are not tuned again."""
        db = self.paths.storage_file
        if db is None or _is_journal(self.paths.storage):
            return None
        problem = _sqlite_problem(db)
        if problem is None:
            return None
        moved = _move_aside_storage(db)
        self.echo(f"warning: study storage {db} is unusable ({problem}); moved aside to {moved} "
                  "and started afresh (tuned entries are kept in the table, finished buckets "
                  "are not tuned again)")
        return moved

    # -- names --------------------------------------------------------------------------------

    def study_name(self, bucket: Bucket, space: dict[str, Sequence[int]],
                   default: KernelConfig) -> str:
        """class key | bucket | a hash of what the study's results depend on: the kernel, the
        device, the shapes, the space, the measurement settings and the heuristic default the
        winner is timed against (a heuristic change starts new studies)."""
        ident = {
            "version": SEARCH_VERSION, "kernel": tables.kernel_source_hash(),
            "device": self.device_info.name, "specs": [s.to_dict() for s in bucket.specs],
            "space": {k: list(v) for k, v in space.items()}, "default": default.to_dict(),
            **self.s.study_fields(),
        }
        digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
        b, n = bucket.bucket
        return f"{bucket.class_key}|B{b}_L{n}|{digest}"

    def tuner_settings(self) -> dict[str, Any]:
        return {"tool": "tsdecode-tune", **self.s.to_dict(), **self.run_info,
                "copy_bandwidth_gbs": self.copy_bw}

    # -- the run ------------------------------------------------------------------------------

    def run(self, buckets: Sequence[Bucket]) -> list[BucketResult]:
        results = []
        start = time.monotonic()
        for i, bucket in enumerate(buckets):
            deadline = None
            if self.s.time_budget is not None:
                remaining = self.s.time_budget - (time.monotonic() - start)
                deadline = time.monotonic() + max(0.0, remaining) / (len(buckets) - i)
            self.echo(f"[{i + 1}/{len(buckets)}] {bucket.class_key} bucket {bucket.bucket}: "
                      f"{bucket.label}")
            result = self.tune(bucket, deadline)
            results.append(result)
            try:
                write_trials_csv(self.paths.jsonl, self.paths.csv)
            except Exception as e:  # the jsonl stays the record; the CSV is a convenience
                self.echo(f"  warning: could not write {self.paths.csv}: {e}")
        return results

    def _recover(self, study: optuna.Study, name: str) -> None:
        """Finish trials a crashed run left RUNNING: from the results log if it has them (the
        measurement finished), else FAIL (they are sampled again)."""
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if not running:
            return
        records = self._log_records()
        # Trial numbers restart with a new storage: only records written since it count.
        start = max((i for i, r in enumerate(records) if r.get("kind") == "storage_reset"),
                    default=-1) + 1
        logged = {rec["trial"]: rec for rec in records[start:]
                  if rec.get("kind") == "trial" and rec.get("study") == name
                  and all(k in rec for k in ("trial", "state", "time_us", "key", "config",
                                              "measured"))}
        for t in running:
            rec = logged.get(t.number)
            if rec is None:
                study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
                study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
                continue
            self._set_attrs(study, t._trial_id, rec)
            if rec["state"] == "COMPLETE":
                study.tell(t.number, rec["time_us"], skip_if_finished=True)
            else:
                study.tell(t.number, state=TrialState.PRUNED, skip_if_finished=True)

    def _log_records(self) -> list[dict[str, Any]]:
        """The results log as it was when first needed (read once per run)."""
        if self.jsonl_records is None:
            self.jsonl_records = ResultLog.read(self.paths.jsonl)
        return self.jsonl_records

    def _final_from_log(self, name: str) -> dict[str, Any] | None:
        """The latest successful final of study ``name`` in the log (a study storage lost
        since, e.g. moved aside as corrupt, no longer holds it), as the study attribute."""
        finals = [r for r in self._log_records() if r.get("kind") == "final"
                  and r.get("study") == name and r.get("ok") and FINAL_FIELDS <= r.keys()]
        return {k: finals[-1][k] for k in FINAL_FIELDS} if finals else None

    @staticmethod
    def _set_attrs(study: optuna.Study, trial_id: int, rec: dict[str, Any]) -> None:
        attrs = {
            "key": rec["key"], "config": rec["config"], "measured": rec["measured"],
            "duplicate_of": rec.get("duplicate_of"), "adjustments": rec.get("adjustments") or [],
            "result": {k: rec.get(k) for k in ("bandwidth_gbs", "fraction_of_copy", "rel_err",
                                                "per_spec", "compile_s", "plan_s", "measure_s")},
        }
        if rec.get("prune_reason"):
            attrs["prune_reason"] = rec["prune_reason"]
        for k, v in attrs.items():
            study._storage.set_trial_user_attr(trial_id, k, v)

    def _cache_from_storage(self, study: optuna.Study) -> dict[str, Outcome]:
        cache = {}
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            ua = t.user_attrs
            if not ua.get("measured") or "key" not in ua:
                continue
            cache[ua["key"]] = Outcome(
                ua["key"], KernelConfig(**ua["config"]), t.state.name, t.value,
                ua.get("prune_reason"), t.number, ua.get("result") or {},
            )
        return cache

    def tune(self, bucket: Bucket, deadline: float | None) -> BucketResult:
        s = self.s
        shape = bucket.shape
        num_sms = self.device_info.sm_count
        default = heuristic_config(shape, num_sms, self.shared_memory_per_sm)
        space = build_space(shape, num_sms, s.limits, default)
        size = space_size(space)
        name = self.study_name(bucket, space, default)
        use_grid = size <= s.trials
        seed = _study_seed(s.seed, name)
        if use_grid:
            sampler = _NoStopGridSampler({k: list(v) for k, v in space.items()}, seed=seed)
        else:
            sampler = optuna.samplers.TPESampler(
                seed=seed, n_startup_trials=max(4, min(10, s.trials // 3)), multivariate=True,
                constant_liar=True,
            )
        study = optuna.create_study(storage=self.storage, sampler=sampler, study_name=name,
                                    direction="minimize", load_if_exists=True)
        self._recover(study, name)
        final = study.user_attrs.get("final")
        if final is None and not study.get_trials(deepcopy=False):
            final = self._final_from_log(name)
            if final is not None:
                study.set_user_attr("final", final)  # carried into the new storage
        if final and final.get("trials_budget", 0) >= s.trials and final.get("ok"):
            return self._resume_final(bucket, name, final)
        if not study.get_trials(deepcopy=False):  # a new study: the default first
            base_programs = (shape.batch_size * shape.num_kv_heads
                             * -(-shape.rows_per_kv_head // default.block_m))
            seeds = [default] if use_grid else seed_configs(default, space, base_programs, num_sms)
            previous = self._table_winner(bucket, space)
            if previous is not None and previous not in seeds:
                seeds.insert(1, previous)  # a re-tune (e.g. after a heuristic change) keeps its gains
            for config in seeds:
                study.enqueue_trial(config.to_dict())
        cache = self._cache_from_storage(study)
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        if config_key(default) not in cache and not any(
                t.system_attrs.get("fixed_params") == default.to_dict() for t in waiting):
            study.enqueue_trial(default.to_dict())  # e.g. its first attempt was interrupted
        self.echo(f"  study {name.rsplit('|', 1)[-1]}: space {size} configs "
                  f"({'grid' if use_grid else 'TPE'}), {len(cache)} measured before, "
                  f"default {_short(default)}")
        try:
            self.client.call("prepare", timeout=max(600.0, s.trial_timeout), specs=list(bucket.specs))
        except CandidateFailed as e:
            self.echo(f"  cannot prepare inputs: {e.reason}")
            return BucketResult(bucket, name, False, default=default, note=e.reason)

        dists = {k: CategoricalDistribution(list(v)) for k, v in space.items()}
        bar = Progress(s.trials, f"B{bucket.bucket[0]} L{bucket.bucket[1]}", enabled=self.progress,
                       initial=min(len(cache), s.trials), deadline=deadline)
        pending: list[_Pending] = []
        inflight: dict[str, _Pending] = {}
        retime_reserve = self._retime_reserve()
        max_total = 4 * s.trials + 20
        dup_streak = 0
        asking = True
        default_key = config_key(default)

        def told() -> int:
            return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))

        try:
            while True:
                stop_at = None if deadline is None else deadline - retime_reserve
                out_of_time = bool(cache) and stop_at is not None and time.monotonic() >= stop_at
                if out_of_time:  # (the first config, the default, is always measured)
                    asking = False
                while asking and len(pending) < max(1, s.lookahead):
                    if len(cache) + len(inflight) >= s.trials:
                        asking = False
                    elif told() + len(pending) >= max_total or dup_streak >= 50:
                        asking = False
                    elif use_grid and self._grid_exhausted(study, space):
                        asking = False
                    if not asking:
                        break
                    trial = study.ask(dists)
                    params = dict(trial.params)
                    fitted, changes = fit_config(KernelConfig(**params), shape)
                    key = config_key(fitted)
                    if key in cache:
                        dup_streak += 1
                        self._tell_duplicate(study, bucket, name, trial, params, changes, cache[key])
                    elif key in inflight:
                        dup_streak += 1
                        inflight[key].followers.append((trial, params, changes))
                    else:
                        dup_streak = 0
                        fut = self.pool.submit(bucket.specs, fitted) if self.pool is not None else None
                        p = _Pending(trial, params, fitted, key, changes, fut)
                        pending.append(p)
                        inflight[key] = p
                if out_of_time:
                    # Drop candidates still compiling (told FAIL, never measured).
                    for q in [q for q in pending if q.future is not None and not q.future.done()
                              and q.key != default_key]:
                        q.future.cancel()
                        pending.remove(q)
                        del inflight[q.key]
                        for t in [q.trial] + [f[0] for f in q.followers]:
                            t.set_user_attr("skipped", "time budget used up while compiling")
                            study.tell(t, state=TrialState.FAIL)
                if not pending:
                    break
                wait_s = None
                if cache and stop_at is not None and default_key not in inflight:
                    wait_s = max(0.0, stop_at - time.monotonic())
                p = self._next_ready(pending, wait_s)
                if p is None:  # nothing compiled before the deadline: re-check at the top
                    continue
                pending.remove(p)
                outcome = self._measure(bucket, p)
                del inflight[p.key]
                cache[p.key] = outcome
                self._tell_measured(study, bucket, name, p, outcome, p.key == default_key)
                best = min((o.value for o in cache.values() if o.value is not None), default=None)
                d = cache.get(default_key)
                post = f"best {best:.2f} us" if best is not None else "no valid config yet"
                if d is not None and d.value is not None:
                    post += f", default {d.value:.2f} us"
                bar.update(1, post)
        finally:
            bar.close()
            for p in pending:  # only on an exception: leave no trial RUNNING in this process
                for t in [p.trial] + [f[0] for f in p.followers]:
                    study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
        return self._finalize(study, bucket, name, default, cache)

    def stale_buckets(self, buckets: Sequence[Bucket]) -> list[Bucket]:
        """The buckets whose entry the output table lacks, or holds timed against another default
        than the heuristic gives today (a tsdecode upgrade that changed the heuristic), or with
        another kernel or triton major version (``Table.stale``); a re-tune of just these keeps
        "tuned never slower than the heuristic" true for the whole table."""
        table = tables.load_table(self.paths.table) if self.paths.table.exists() else None
        if table is None or table.stale:
            return list(buckets)
        num_sms = self.device_info.sm_count
        stale = []
        for bucket in buckets:
            entry = table.entries.get(bucket.class_key, {}).get(bucket.bucket)
            default = heuristic_config(bucket.shape, num_sms, self.shared_memory_per_sm)
            if entry is None or entry.default_config != default:
                stale.append(bucket)
        return stale

    def _table_winner(self, bucket: Bucket, space: dict[str, Sequence[int]]) -> KernelConfig | None:
        """The winner the output table already holds for ``bucket`` (None if absent, unreadable
        or outside today's search space): a new study measures it among its first trials."""
        table = tables.load_table(self.paths.table) if self.paths.table.exists() else None
        entry = table.entries.get(bucket.class_key, {}).get(bucket.bucket) if table else None
        if entry is None:
            return None
        config = entry.kernel_config
        if any(getattr(config, k) not in v for k, v in space.items()):
            return None
        return config

    def _retime_reserve(self) -> float:
        per = self.s.replay_ms / 1000.0 + 0.1 if self.s.timing == "cuda-graph" else 0.5
        return (self.s.top_k + 1) * (self.s.retime_rounds * per + 0.5)

    @staticmethod
    def _grid_exhausted(study: optuna.Study, space: dict[str, Sequence[int]]) -> bool:
        seen = {
            tuple(t.params.get(k) for k in SPACE_FIELDS)
            for t in study.get_trials(deepcopy=False)
            if t.state != TrialState.FAIL and len(t.params) == len(SPACE_FIELDS)
        }
        return len(seen) >= space_size(space)

    @staticmethod
    def _next_ready(pending: list[_Pending], timeout: float | None) -> _Pending | None:
        """The first pending candidate whose compile finished (or that needs none), else wait
        up to ``timeout`` seconds for one (None: nothing finished in time)."""
        for p in pending:
            if p.future is None or p.future.done():
                return p
        wait([p.future for p in pending], timeout=timeout, return_when=FIRST_COMPLETED)
        for p in pending:
            if p.future.done():
                return p
        return None

    def _measure(self, bucket: Bucket, p: _Pending) -> Outcome:
        compile_s = None
        if p.future is not None:
            res = self.pool.result(p.future)
            compile_s = res.get("seconds")
            if res.get("ok") is False:
                return Outcome(p.key, p.config, "PRUNED", None, res["reason"], p.trial.number,
                               {"compile_s": compile_s})
        try:
            r = self.client.call("measure", timeout=self.s.trial_timeout, specs=list(bucket.specs),
                                 config=p.config)
        except CandidateFailed as e:
            return Outcome(p.key, p.config, "PRUNED", None, e.reason, p.trial.number,
                           {"compile_s": compile_s})
        result = {
            "bandwidth_gbs": r["bandwidth_gbs"],
            "fraction_of_copy": r["bandwidth_gbs"] / self.copy_bw if self.copy_bw else None,
            "rel_err": r["rel_err"], "per_spec": r["per_spec"],
            "compile_s": compile_s, "plan_s": r["plan_s"], "measure_s": r["measure_s"],
        }
        self.plan_s += r["plan_s"]
        self.measured_now += 1
        return Outcome(p.key, p.config, "COMPLETE", r["time_us"], None, p.trial.number, result)

    def _record(self, bucket: Bucket, name: str, trial_number: int, params: dict, outcome: Outcome,
                adjustments: Sequence[str], measured: bool, is_default: bool) -> dict[str, Any]:
        rec = {
            "kind": "trial", "study": name, "class_key": bucket.class_key,
            "bucket": list(bucket.bucket), "specs": [s.name for s in bucket.specs],
            "trial": trial_number, "state": outcome.state, "params": params,
            "config": outcome.config.to_dict(), "key": outcome.key, "measured": measured,
            "duplicate_of": None if measured else outcome.trial,
            "adjustments": list(adjustments), "is_default": is_default,
            "time_us": outcome.value, **{k: outcome.result.get(k) for k in (
                "bandwidth_gbs", "fraction_of_copy", "rel_err", "per_spec", "compile_s", "plan_s",
                "measure_s")},
            "prune_reason": None,
        }
        if outcome.state == "PRUNED":
            reason = outcome.reason or "failed"
            if not measured:
                reason = f"duplicate of trial {outcome.trial}: {reason}"
            rec["prune_reason"] = reason
        return rec

    def _tell(self, study: optuna.Study, trial: optuna.Trial, rec: dict[str, Any]) -> None:
        self.log.write(rec)  # first the log (durable), then the study
        self._set_attrs(study, trial._trial_id, rec)
        if rec["state"] == "COMPLETE":
            study.tell(trial, rec["time_us"])
        else:
            study.tell(trial, state=TrialState.PRUNED)

    def _tell_measured(self, study, bucket, name, p: _Pending, outcome: Outcome, is_default: bool) -> None:
        rec = self._record(bucket, name, p.trial.number, p.params, outcome, p.adjustments, True, is_default)
        self._tell(study, p.trial, rec)
        if outcome.state == "PRUNED":
            self.echo(f"  pruned {_short(p.config)}: {outcome.reason}")
        for trial, params, changes in p.followers:
            self._tell_duplicate(study, bucket, name, trial, params, changes, outcome)

    def _tell_duplicate(self, study, bucket, name, trial, params, changes, outcome: Outcome) -> None:
        rec = self._record(bucket, name, trial.number, params, outcome, changes, False, False)
        self._tell(study, trial, rec)

    # -- the end of a bucket --------------------------------------------------------------------

    def _finalize(self, study: optuna.Study, bucket: Bucket, name: str, default: KernelConfig,
                  cache: dict[str, Outcome]) -> BucketResult:
        measured = len(cache)
        pruned = sum(o.state == "PRUNED" for o in cache.values())
        default_key = config_key(default)
        complete = sorted((o for o in cache.values() if o.state == "COMPLETE"), key=lambda o: o.value)
        base = dict(bucket=bucket, study_name=name, default=default, measured=measured, pruned=pruned)
        if not complete:
            note = "every candidate failed"
            d = cache.get(default_key)
            if d is not None and d.reason:
                note += f" (default: {d.reason})"
            self.echo(f"  no valid config for this bucket: {note}")
            self.log.write({"kind": "final", "study": name, "ok": False, "note": note})
            return BucketResult(**base, ok=False, note=note)
        d_out = cache.get(default_key)
        default_ok = d_out is not None and d_out.state == "COMPLETE"
        top = [o for o in complete if o.key != default_key][: self.s.top_k]
        configs = ([default] if default_ok else []) + [o.config for o in top]
        note = ""
        try:
            rt = self.client.call("retime", timeout=self.s.trial_timeout * 2, specs=list(bucket.specs),
                                  configs=configs, rounds=self.s.retime_rounds)
            times = {configs[i]: t for i, t in rt["times_us"].items() if t}
            nbytes = rt["bytes"]
            for i, reason in rt["failed"].items():
                note += f"re-timing failed for {_short(configs[i])}: {reason}; "
        except CandidateFailed as e:  # fall back to the search's own timings
            note += f"re-timing failed ({e.reason}); search timings used; "
            times = {o.config: [o.value] for o in ([d_out] if default_ok else []) + top}
            first = complete[0].result.get("per_spec") or []
            nbytes = _geo([p["bytes"] for p in first]) if first else None
        for config, t in times.items():
            self.log.write({"kind": "retime", "study": name, "class_key": bucket.class_key,
                            "bucket": list(bucket.bucket), "specs": [s.name for s in bucket.specs],
                            "config": config.to_dict(), "is_default": config == default,
                            "times_us": t, "median_us": statistics.median(t)})
        med = {c: statistics.median(t) for c, t in times.items()}
        if default_ok and default in med:
            d_times = times[default]
            d_med = med[default]
            noise = retime_noise(d_times)
            challengers = [c for c in med if c != default]
            best = min(challengers, key=med.get) if challengers else None
            if best is not None and med[best] < d_med * (1 - noise):
                winner, t_win, kept = best, med[best], False
            else:
                winner, t_win, kept = default, d_med, True
        else:
            # The default failed (or could not be re-timed): the best valid config wins and the
            # entry's default time is set to the winner's (speedup unknown).
            noise = None
            winner = min(med, key=med.get) if med else complete[0].config
            t_win = med.get(winner, complete[0].value)
            d_med, kept = t_win, False
            reason = d_out.reason if d_out is not None else "not measured"
            note += f"default failed ({reason}); its time is recorded as the winner's; "
        bw = nbytes / (t_win * 1e-6) / 1e9 if nbytes else 0.0
        d_bw = nbytes / (d_med * 1e-6) / 1e9 if nbytes else 0.0
        frac = bw / self.copy_bw if self.copy_bw else None
        entry = tables.TableEntry(winner, float(t_win), float(bw), frac, default, float(d_med), float(d_bw),
                                  tuned_batch_size=bucket.representative.batch_size)
        tables.merge_entries(self.paths.table, self.device_info,
                             {bucket.class_key: {bucket.bucket: entry}}, self.tuner_settings())
        final = {
            "ok": True, "winner": winner.to_dict(), "time_us": t_win, "bandwidth_gbs": bw,
            "fraction_of_copy": frac, "default": default.to_dict(), "default_time_us": d_med,
            "default_bandwidth_gbs": d_bw, "kept_default": kept, "noise": noise,
            "trials_budget": self.s.trials, "measured": measured, "pruned": pruned, "note": note,
        }
        study.set_user_attr("final", final)
        self.log.write({"kind": "final", "study": name, "class_key": bucket.class_key,
                        "bucket": list(bucket.bucket), **final})
        verdict = "default kept" if kept else f"{med.get(default, d_med) / t_win:.2f}x over default"
        self.echo(f"  winner {_short(winner)}: {t_win:.2f} us ({verdict}"
                  + (f", noise {100 * noise:.1f}%" if noise is not None else "") + ")")
        return BucketResult(**base, ok=True, winner=winner, time_us=t_win, bandwidth_gbs=bw,
                            fraction_of_copy=frac, default_time_us=d_med, kept_default=kept,
                            noise=noise, note=note)

    def _resume_final(self, bucket: Bucket, name: str, final: dict[str, Any]) -> BucketResult:
        """A bucket a previous run finished: re-merge its entry (idempotent) and report it."""
        winner, default = KernelConfig(**final["winner"]), KernelConfig(**final["default"])
        entry = tables.TableEntry(winner, float(final["time_us"]), float(final["bandwidth_gbs"]),
                                  final["fraction_of_copy"], default, float(final["default_time_us"]),
                                  float(final["default_bandwidth_gbs"]),
                                  tuned_batch_size=bucket.representative.batch_size)
        tables.merge_entries(self.paths.table, self.device_info,
                             {bucket.class_key: {bucket.bucket: entry}}, self.tuner_settings())
        self.echo(f"  already tuned ({final['measured']} configs measured): {_short(winner)} "
                  f"{final['time_us']:.2f} us")
        return BucketResult(bucket, name, True, winner, final["time_us"], final["bandwidth_gbs"],
                            final["fraction_of_copy"], default, final["default_time_us"],
                            final["kept_default"], final["noise"], final["measured"],
                            final["pruned"], final.get("note", ""), resumed=True)


def _geo(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))
