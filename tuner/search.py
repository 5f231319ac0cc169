"""The search: one Optuna study per (problem class, bucket) over KernelConfig's fields, shared by
every worker of a job.

Shapes of a grid are grouped by ``tables.problem_class_key`` and ``tables.bucket_of``; each group
("bucket") gets a study whose objective is the group's time per call (geometric mean over its
shapes; usually one shape) over the space of ``tuner.space``. The study's first trials are
queued when it is created (by whichever worker creates it; the others wait for the queue): the
heuristic default, what plans take today (the table's previous winner, else another table's
entry the runtime finds), and either the whole space in a seeded order
(spaces no larger than the trial budget: a grid) or ``seed_configs`` followed by a seeded
``TPESampler`` (constant liar, so concurrent workers spread out).

Each trial's config is fitted to the shape (``fit_config``) and measured at most once per
bucket, whichever worker holds it: of the live trials with the same fitted config (queued,
running or measured), the one with the smallest number is measured and the others are recorded
as its duplicates once it has a result. Queued trials carry their fitted config from the start,
so this is exact for grids; a TPE trial gets its fitted config a moment after it is sampled,
and two workers sampling the same fitted config within that moment both measure it (the budget
counts it once). ``--trials`` counts measured configs.

The default and what plans take today are measured whatever the time budget says (the kept
configs: taken first, never dropped from the queue or the compile pool), so a bucket the budget
stops after its first trials still times both.

A bucket whose trials are all finished (the budget, the grid or its time share used up) is
finalised by the worker that finds it so, on its own GPU of the job's model: the best few (and
what plans take today, where measured) are re-timed, interleaved with the default, and a winner
is kept only if it beats the default by more than the measured noise; the result is the study's
"final" attribute, from which the table is written (``tuner.job.export``). Two workers finalising
the same bucket at once both write a valid final; the last one stays.

Crash safety: finished trials are logged (``tuner.study.ResultLog``) before they are told to the
study; a RUNNING trial whose worker died (a dead process of this host, or an RDB heartbeat older
than the grace period) is completed from the log when it has the result, else failed and queued
again (the default's before any other queued trial, and its bucket is not finalised until it is
measured); a bucket whose final record is in the log is not tuned again.

Timeouts: a config pruned for running past --trial-timeout (its result's ``timeout_s``) is queued
again by a run with a larger timeout (``timeout_retry_of``), ahead of other queued trials; while
that trial is queued, running or finished, the timed-out one counts for nothing (``retried``) and
the bucket's final, if any, is written again when it is measured.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.storages import fail_stale_trials
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.study import StudyDirection
from optuna.trial import TrialState

from tsdecode import KernelConfig
from tsdecode.config import tables
from tsdecode.config.space import ProblemShape, fit_config
from tsdecode.device import DeviceProperties

from .buckets import (
    Bucket, BucketResult, TuneSettings, bucket_space, final_of, final_problem, measured_trials, retried,
    timed_out_under,
)
from .measure import geomean
from .runner import CandidateFailed, CompilePool
from .space import (
    SPACE_FIELDS, base_programs, config_text, seed_configs, space_size,
)
from .study import (
    Heartbeat, OutputPaths, ResultLog, pop_waiting, queue_lock, retry_trial, stamp_alive, trial_params, worker_stamp,
    write_trials_csv,
)

# Bump when the space construction or the measurement changes meaning: part of the study hash.
SEARCH_VERSION = 2
# How long a worker waits for the worker that created a study to queue its first trials before
# queueing them itself (that worker died; duplicates of queued trials are never measured twice).
SEED_WAIT_S = 60.0
# How often a worker with nothing to do re-reads the studies it waits on.
POLL_S = 0.5
# The reason a study closes when --time-budget runs out: a later run searches such a bucket on.
TIME_BUDGET_USED_UP = "time budget used up"
# A worker stamps a trial right after taking it: one still unstamped after this long lost its
# worker in between (a storage without heartbeats would otherwise wait for it forever).
UNSTAMPED_GRACE_S = 30.0


def retime_noise(times: Sequence[float]) -> float:
    """Relative noise of repeated timings: the interquartile range over the median, at least 1%
    (the full range would let one slow round hide a challenger faster in every other round)."""
    if len(times) < 2:
        return 0.01
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return max(0.01, (q3 - q1) / statistics.median(times))


def pick_winner(times: dict[KernelConfig, Sequence[float]], default: KernelConfig) -> tuple[KernelConfig, bool, float]:
    """A bucket's winner from its re-timing rounds (``times``: config -> its rounds, the default's
    among them): the fastest median, only if it beats the default's median by more than the
    default's own noise, else the default (kept). Returns (winner, default kept, noise)."""
    med = {c: statistics.median(t) for c, t in times.items()}
    noise = retime_noise(times[default])
    best = min((c for c in med if c != default), key=med.get, default=None)
    if best is not None and med[best] < med[default] * (1 - noise):
        return best, False, noise
    return default, True, noise


# ---------------------------------------------------------------------------------------------
# Progress and outcomes
# ---------------------------------------------------------------------------------------------


class Progress:
    """A tqdm bar on a terminal, else a line every ``every_s`` seconds."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True, initial: int = 0,
                 every_s: float = 10.0) -> None:
        self.total, self.desc, self.n, self.enabled, self.every_s = total, desc, initial, enabled, every_s
        self.stream = sys.stderr
        self.last, self.bar = 0.0, None
        if enabled and self.stream.isatty():
            from tqdm import tqdm  # an optuna dependency

            self.bar = tqdm(total=total, initial=initial, desc=desc, file=self.stream, dynamic_ncols=True)

    def update(self, postfix: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(postfix, refresh=False)
        elif self.enabled and (time.monotonic() - self.last >= self.every_s or self.n >= self.total):
            self.last = time.monotonic()
            print(f"  {self.desc}: {self.n}/{self.total} measured; {postfix}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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


# ---------------------------------------------------------------------------------------------
# Study names and seeds
# ---------------------------------------------------------------------------------------------


def study_name(bucket: Bucket, space: dict[str, Sequence[int]], default: KernelConfig, device_name: str,
               kernel_hash: str, settings: TuneSettings) -> str:
    """class key | bucket | a hash of what the study's results depend on: the kernel, the GPU
    model, the shapes, the space, the measurement settings and the heuristic default the winner
    is timed against (a heuristic change starts new studies)."""
    ident = {
        "version": SEARCH_VERSION, "kernel": kernel_hash, "device": device_name,
        "specs": [s.to_dict() for s in bucket.specs], "space": {k: list(v) for k, v in space.items()},
        "default": default.to_dict(), **settings.study_fields(),
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    return f"{bucket.key}|{digest}"


def _study_seed(seed: int, name: str) -> int:
    return int(hashlib.sha256(f"{seed}|{name}".encode()).hexdigest()[:8], 16)


# ---------------------------------------------------------------------------------------------
# The tuner (one worker)
# ---------------------------------------------------------------------------------------------


@dataclass
class _Held:
    """A trial of this worker whose fitted config another trial (of any worker) measures."""

    trial: optuna.Trial
    params: dict[str, int]
    config: KernelConfig
    key: str
    adjustments: tuple[str, ...]


@dataclass
class _Pending(_Held):
    """A trial this worker measures (its config compiling in the pool, or ready), and this
    worker's trials of the same fitted config that wait for its result."""

    future: Future | None = None
    followers: list[_Held] = field(default_factory=list)


# What a bucket's "final" study attribute (and log record) holds; final_from_log reads it.
FINAL_FIELDS = frozenset((
    "ok", "winner", "time_us", "bandwidth_gbs", "fraction_of_copy", "default", "default_time_us",
    "default_bandwidth_gbs", "kept_default", "noise", "trials_budget", "measured", "pruned", "note",
))
# timeout_s: the --trial-timeout a pruned candidate ran past (a run with a larger one measures it again).
RESULT_FIELDS = ("bandwidth_gbs", "fraction_of_copy", "rel_error", "per_spec", "compile_s", "plan_s", "measure_s",
                 "timeout_s")


def final_from_log(jsonl: Path, name: str, bucket: Bucket | None = None, device: DeviceProperties | None = None,
                   echo: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The latest successful final of study ``name`` in the results log (a study storage lost
    since, e.g. moved aside as corrupt, no longer holds it), as the study attribute. With
    ``bucket`` and ``device``, a final whose table entry the runtime would skip (a damaged or
    edited log: e.g. a winner outside the config space) is passed over, with one warning to
    ``echo``; without a usable one the bucket is tuned again."""
    finals = [r for r in ResultLog.read(jsonl) if r.get("kind") == "final" and r.get("study") == name
              and r.get("ok") and FINAL_FIELDS <= r.keys()]
    skipped = None
    for rec in reversed(finals):
        final = {k: rec[k] for k in FINAL_FIELDS}
        why = None if bucket is None or device is None else final_problem(bucket, name, final, device)
        if why is None:
            break
        skipped = skipped or why
    else:
        final = None
    if skipped is not None and echo is not None:
        echo(f"warning: {jsonl}: a final record of bucket {bucket.bucket} ({bucket.label}) is not reused: {skipped}"
             + ("" if final is not None else "; tuning the bucket again"))
    return final


def _leader(trials: Sequence[optuna.trial.FrozenTrial], key: str) -> optuna.trial.FrozenTrial | None:
    """The trial that measures fitted config ``key``: the smallest-numbered trial with that key
    that is queued, running or measured (failed trials, recorded duplicates and timeouts queued
    again under a larger timeout do not count)."""
    best = None
    again = retried(trials)
    for t in trials:
        if t.user_attrs.get("key") != key or t.state == TrialState.FAIL or t.number in again:
            continue
        if t.state.is_finished() and not t.user_attrs.get("measured"):
            continue
        if best is None or t.number < best.number:
            best = t
    return best


def _outcome(t: optuna.trial.FrozenTrial) -> Outcome:
    ua = t.user_attrs
    return Outcome(ua["key"], KernelConfig(**ua["config"]), t.state.name, t.value, ua.get("prune_reason"), t.number,
                   ua.get("result") or {})


class _Beats:
    """Optuna heartbeats of the trials this worker holds (RDB storages), from a thread: the
    measuring and compiling happen in other processes, so a beat is never late for a long
    compile."""

    def __init__(self, storage, interval: float | None) -> None:
        """``interval`` None: no heartbeats (a journal storage, or none asked for)."""
        self.storage, self.interval = storage, interval
        self.ids: set[int] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        if interval is not None:
            threading.Thread(target=self._loop, name="tsdecode-tune-heartbeat", daemon=True).start()

    def add(self, trial_id: int) -> None:
        if self.interval is None:
            return
        with self.lock:
            self.ids.add(trial_id)
        self._beat(trial_id)

    def discard(self, trial_id: int) -> None:
        with self.lock:
            self.ids.discard(trial_id)

    def _beat(self, trial_id: int) -> None:
        try:
            self.storage.record_heartbeat(trial_id)
        except Exception:  # a storage hiccup: the next beat retries; the grace period covers it
            pass

    def _loop(self) -> None:
        while not self.stop.wait(self.interval):
            with self.lock:
                ids = list(self.ids)
            for trial_id in ids:
                self._beat(trial_id)

    def close(self) -> None:
        self.stop.set()


def _set_attrs(study: optuna.Study, trial_id: int, rec: dict[str, Any]) -> None:
    """A trial's user attributes from its results-log record."""
    attrs = {"key": rec["key"], "config": rec["config"], "measured": rec["measured"],
             "duplicate_of": rec.get("duplicate_of"), "adjustments": rec.get("adjustments") or [],
             "result": {k: rec.get(k, rec.get("rel_err")) if k == "rel_error" else rec.get(k)
                        for k in RESULT_FIELDS}}  # rel_err: the name in logs before rel_error
    if rec.get("prune_reason"):
        attrs["prune_reason"] = rec["prune_reason"]
    for k, v in attrs.items():
        study._storage.set_trial_user_attr(trial_id, k, v)


def _tell_record(study: optuna.Study, trial_id: int, number: int, rec: dict[str, Any]) -> None:
    """Set a trial's attributes from its log record, then tell its state and time."""
    _set_attrs(study, trial_id, rec)
    if rec["state"] == "COMPLETE":
        study.tell(number, rec["time_us"], skip_if_finished=True)
    else:
        study.tell(number, state=TrialState.PRUNED, skip_if_finished=True)


def recover_dead(study: optuna.Study, name: str, *, storage, storage_url: str, log_path: Path,
                 grace: float | None, echo: Callable[[str], None]) -> list[int]:
    """Finish the RUNNING trials of dead workers: Optuna's heartbeat check (RDB storages: a
    trial without a beat for the grace period is failed, and the storage's callback queues it
    again), then this host's dead processes and trials no worker stamped within
    UNSTAMPED_GRACE_S (any storage): completed from the results log at ``log_path`` when it
    holds their result (measured, but killed before telling the study), else failed and queued
    again (``study.retry_trial``). Returns the failed trials' numbers."""
    failed = []
    unstamped_grace = UNSTAMPED_GRACE_S if grace is None else min(grace, UNSTAMPED_GRACE_S)
    with queue_lock(storage_url):
        if is_heartbeat_enabled(storage):
            fail_stale_trials(study)
        dead = []
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            stamp = t.user_attrs.get("worker")
            if stamp is not None:
                if stamp_alive(stamp) is False:
                    dead.append(t)
            elif t.datetime_start is not None and time.time() - t.datetime_start.timestamp() > unstamped_grace:
                dead.append(t)  # never stamped: its worker died right after taking it
        if not dead:
            return failed
        records = ResultLog.read(log_path)
        # Trial numbers restart with a new storage: only records written since it count.
        start = max((i for i, r in enumerate(records) if r.get("kind") == "storage_reset"), default=-1) + 1
        logged = {rec["trial"]: rec for rec in records[start:]
                  if rec.get("kind") == "trial" and rec.get("study") == name
                  and all(k in rec for k in ("trial", "state", "time_us", "key", "config", "measured"))}
        for t in dead:
            rec = logged.get(t.number)
            try:
                if rec is not None:
                    _tell_record(study, t._trial_id, t.number, rec)
                    continue
                study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
                if not study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another worker got there first
            failed.append(t.number)
            again = retry_trial(study, t, "its worker died")
            stamp = t.user_attrs.get("worker")
            who = (f"{stamp.get('label') or 'a worker'} (pid {stamp.get('pid', '?')})" if stamp else
                   f"a worker that never stamped it within {unstamped_grace:.0f} s")
            echo(f"  trial {t.number} of {name.rsplit('|', 1)[0]}: {who} stopped or died while holding it; "
                 + (f"queued again as trial {again}" if again is not None else "not queued again"))
    return failed


class Tuner:
    """One worker of a job: runs the studies of the job's buckets with a measuring client,
    sharing them with the job's other workers (any number, on this and other hosts).

    storage: the study storage (``study.open_storage``); storage_url names it (for the SQLite
    queue lock). label: this worker in progress lines and trial records ("cuda:3"); it also
    varies the TPE seed, so workers spread out. previous: per bucket key, what plans take today
    (``buckets.table_winners``): among a new study's first trials, and a finalist once measured. on_study(bucket,
    name): told each study name (the job records them for ``export``). write_csv: rewrite the
    trials CSV after each bucket.
    """

    def __init__(self, settings: TuneSettings, client, *, device: DeviceProperties,
                 copy_bandwidth_gbs: float | None, paths: OutputPaths, storage, storage_url: str | None = None,
                 pool: CompilePool | None = None, progress: bool = True, echo: Callable[[str], None] | None = None,
                 label: str = "", heartbeat: Heartbeat | None = None,
                 previous: dict[str, dict[str, int]] | None = None,
                 on_study: Callable[[Bucket, str], None] | None = None, write_csv: bool = True) -> None:
        self.s = settings
        self.client = client
        self.pool = pool
        self.device = device  # the measured device: each bucket's default is the heuristic's there
        self.copy_bw = copy_bandwidth_gbs
        self.paths = paths
        self.storage = storage
        self.storage_url = storage_url or paths.storage
        self.progress = progress
        self.echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.label = label
        self.stamp = worker_stamp(label)
        self.heartbeat = heartbeat
        self.previous = previous or {}
        self.on_study = on_study
        self.write_csv = write_csv
        self.kernel_hash = tables.kernel_source_hash()
        self.log = ResultLog(paths.jsonl)
        beats = is_heartbeat_enabled(storage) and heartbeat is not None  # RDB storages opened with a heartbeat
        self.beats = _Beats(storage, heartbeat.interval if beats else None)
        self.plan_s = 0.0  # seconds the measuring process spent planning (loading or compiling)
        self.measured_now = 0  # configs measured by this worker
        self._prepared: Bucket | None = None
        self._reported: set[str] = set()  # study names told to on_study

    def close(self) -> None:
        """Stop the heartbeats and close the log."""
        self.beats.close()
        self.log.close()

    def study_name(self, bucket: Bucket, space: dict[str, Sequence[int]], default: KernelConfig) -> str:
        return study_name(bucket, space, default, self.device.name, self.kernel_hash, self.s)

    # -- the run ------------------------------------------------------------------------------

    def run(self, buckets: Sequence[Bucket], started: float | None = None) -> list[BucketResult]:
        """Tune ``buckets`` in order, then wait for (and help with) those whose last trials other
        workers hold, until every bucket is final. ``started``: the job's start (epoch seconds),
        from which --time-budget counts."""
        start = time.time() if started is None else started
        end = None if self.s.time_budget is None else start + self.s.time_budget
        results: dict[int, BucketResult] = {}
        for i, bucket in enumerate(buckets):
            deadline = None
            if end is not None:
                deadline = time.time() + max(0.0, end - time.time()) / (len(buckets) - i)
            self.echo(f"[{i + 1}/{len(buckets)}] {bucket.class_key} bucket {bucket.bucket}: {bucket.label}")
            results[i] = self.tune(bucket, deadline)
            self._csv()
        waiting = [i for i, r in results.items() if r.pending]
        if waiting:
            self.echo(f"waiting for {len(waiting)} bucket(s) whose last trials other workers hold")
        while waiting:
            time.sleep(POLL_S)
            for i in list(waiting):
                r = self.tune(buckets[i], end, quiet=True)
                if not r.pending:
                    results[i] = r
                    waiting.remove(i)
                    self._csv()
        return [results[i] for i in range(len(buckets))]

    def _csv(self) -> None:
        if not self.write_csv:
            return
        try:
            write_trials_csv(self.paths.jsonl, self.paths.csv)
        except Exception as e:  # the jsonl stays the record; the CSV is a convenience
            self.echo(f"  warning: could not write {self.paths.csv}: {e}")

    def tune(self, bucket: Bucket, deadline: float | None, quiet: bool = False) -> BucketResult:
        """Search ``bucket`` until its budget is claimed, then finalise it if every trial is
        finished (else the result is ``pending``)."""
        s = self.s
        shape = bucket.shape
        default, space = bucket_space(bucket, self.device, s.limits)
        size = space_size(space)
        name = self.study_name(bucket, space, default)
        use_grid = size <= s.trials
        study = self._open_study(bucket, name, use_grid)
        final = final_of(study.user_attrs, s.trials)
        earlier = None  # a final this run searches on from
        trials = study.get_trials(deepcopy=False)
        again = self._timed_out(trials)
        if final and (again or self._retrying(trials)):
            if again and not quiet:
                self.echo(f"  {len(again)} config(s) ran past a smaller --trial-timeout "
                          f"({', '.join(sorted({f'{timed_out_under(t):g} s' for t in again}))}) in an earlier run: "
                          f"measuring them again with {s.trial_timeout:g} s")
            earlier = final
        elif final and final.get("ok"):
            if quiet or use_grid or not self._cut_short(study, final):
                return self._resume_final(bucket, name, final, quiet)
            self.echo(f"  an earlier run's time budget stopped it at {final['measured']} of {s.trials} configs: "
                      "searching on")
            study.set_user_attr("closed", None)
            earlier = final
        elif quiet and final:  # finalised meanwhile, with no valid config
            return BucketResult.from_final(bucket, name, final)
        self._seed(study, bucket, name, space, default, use_grid)
        self._recover(study, name)
        self._queue_timed_out(study)
        default_key = config_text(default)
        kept = self._kept_keys(bucket, default)
        trials = study.get_trials(deepcopy=False)
        if _leader(trials, default_key) is None:  # e.g. its trial failed with no retries left
            fitted, changes = fit_config(default, shape)
            study.enqueue_trial(default.to_dict(), user_attrs=self._fitted_attrs(fitted, changes))
        if not quiet:
            measured = len(measured_trials(trials))
            self.echo(f"  study {name.rsplit('|', 1)[-1]}: space {size} configs ({'grid' if use_grid else 'TPE'}), "
                      f"{measured} measured before; default {config_text(default)}")
        try:
            self._search(study, bucket, name, shape, space, use_grid, kept, deadline)
        except CandidateFailed as e:  # the inputs could not be prepared
            self.echo(f"  cannot prepare inputs: {e.reason}")
            return BucketResult(bucket, name, False, default=default, note=e.reason)
        if not self._complete(study, use_grid, kept):
            return BucketResult(bucket, name, False, default=default, pending=True)
        final = final_of(study.user_attrs, s.trials)
        if final and final != earlier:  # another worker finalised it meanwhile
            return BucketResult.from_final(bucket, name, final, resumed=True)
        if self._finalising_elsewhere(study):
            return BucketResult(bucket, name, False, default=default, pending=True)
        return self._finalize(study, bucket, name, default, self._cache_from_storage(study))

    # -- studies --------------------------------------------------------------------------------

    def _open_study(self, bucket: Bucket, name: str, use_grid: bool) -> optuna.Study:
        """Create the study (one worker does; its user attribute "created_by" says which) or
        load it; a study new to this storage takes its final from the log, if the log has one
        (the storage was moved aside)."""
        # One worker keeps the run's seed; several vary it (same history, same seed: same samples).
        seed = _study_seed(self.s.seed, name + (f"|{self.label}|{self.stamp['host']}" if self.label else ""))
        if use_grid:
            sampler = optuna.samplers.RandomSampler(seed=seed)  # never asked: the grid is the queue
        else:
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(4, min(10, self.s.trials // 3)),
                                                 multivariate=True, constant_liar=True)
        created = False
        try:
            self.storage.get_study_id_from_name(name)
        except KeyError:
            try:
                self.storage.create_new_study([StudyDirection.MINIMIZE], name)
                created = True
            except optuna.exceptions.DuplicatedStudyError:  # another worker was quicker
                pass
        study = optuna.load_study(study_name=name, storage=self.storage, sampler=sampler)
        if created:
            study.set_user_attr("created_by", self.stamp)
            final = final_from_log(self.paths.jsonl, name, bucket, self.device, self.echo)
            if final is not None:
                study.set_user_attr("final", final)  # carried into the new storage
        if self.on_study is not None and name not in self._reported:
            self.on_study(bucket, name)
            self._reported.add(name)
        return study

    @staticmethod
    def _fitted_attrs(fitted: KernelConfig, changes: Sequence[str]) -> dict[str, Any]:
        return {"key": config_text(fitted), "config": fitted.to_dict(), "adjustments": list(changes)}

    def _seed(self, study: optuna.Study, bucket: Bucket, name: str, space, default: KernelConfig,
              use_grid: bool) -> None:
        """Queue a new study's first trials, once: the creator queues them; another worker
        waits for that (also while the creator has not yet stamped the study it just created),
        and queues whatever is missing itself if the creator died or SEED_WAIT_S passed."""
        ua = study.user_attrs
        if "seeded" in ua:
            return
        mine = ua.get("created_by") == self.stamp
        if not mine:
            t0 = time.monotonic()
            while time.monotonic() - t0 < SEED_WAIT_S:
                ua = study.user_attrs
                if "seeded" in ua or "final" in ua:
                    return
                creator = ua.get("created_by")
                if creator is not None and stamp_alive(creator) is False:
                    break
                time.sleep(0.2)
        shape = bucket.shape
        previous = self.previous.get(bucket.key)
        if use_grid:
            points = [dict(zip(SPACE_FIELDS, values)) for values in itertools.product(*(space[k] for k in SPACE_FIELDS))]
            random.Random(_study_seed(self.s.seed, name)).shuffle(points)
            first = [default.to_dict()] + ([previous] if previous else [])
            configs = first + [p for p in points if p not in first]
        else:
            configs = [c.to_dict() for c in seed_configs(default, space, base_programs(shape, default.block_m),
                                                         self.device.sm_count)]
            if previous is not None and previous not in configs:
                configs.insert(1, previous)  # a re-tune (e.g. after a heuristic change) keeps its gains
        for params in configs:
            fitted, changes = fit_config(KernelConfig(**params), shape)
            study.enqueue_trial(params, user_attrs=self._fitted_attrs(fitted, changes), skip_if_exists=not mine)
        study.set_user_attr("seeded", len(configs))

    def _recover(self, study: optuna.Study, name: str) -> list[int]:
        return recover_dead(study, name, storage=self.storage, storage_url=self.storage_url, log_path=self.paths.jsonl,
                            grace=self.heartbeat.grace if self.heartbeat is not None else None, echo=self.echo)

    @staticmethod
    def _cache_from_storage(study: optuna.Study) -> dict[str, Outcome]:
        cache = {}
        for t in measured_trials(study.get_trials(deepcopy=False)):
            if "key" in t.user_attrs and t.user_attrs["key"] not in cache:
                cache[t.user_attrs["key"]] = _outcome(t)
        return cache

    def _timed_out(self, trials) -> list[optuna.trial.FrozenTrial]:
        """The measured trials pruned for running past a --trial-timeout smaller than this run's
        (not queued again yet): this run measures their configs again. One pruned under the same
        or a larger timeout stays pruned."""
        return [t for t in measured_trials(trials)
                if (limit := timed_out_under(t)) is not None and limit < self.s.trial_timeout]

    @staticmethod
    def _retrying(trials) -> bool:
        """A config that timed out is queued or running again: the bucket's final is out of date."""
        return any(t.user_attrs.get("timeout_retry_of") is not None and not t.state.is_finished() for t in trials)

    def _queue_timed_out(self, study: optuna.Study) -> None:
        """Queue again, with their fitted config, the configs that timed out under a smaller
        --trial-timeout (``timeout_retry_of``: the trial whose result the new one replaces)."""
        with queue_lock(self.storage_url):
            for t in self._timed_out(study.get_trials(deepcopy=False)):
                attrs = {k: t.user_attrs[k] for k in ("key", "config", "adjustments") if k in t.user_attrs}
                study.enqueue_trial(trial_params(t), user_attrs={**attrs, "timeout_retry_of": t.number})

    def _complete(self, study: optuna.Study, use_grid: bool, kept: tuple[str, ...]) -> bool:
        """Every trial finished and nothing more to search: the grid's queue is empty, the
        budget of measured configs is reached, or a worker closed the search (time share,
        endless duplicates); and the kept configs measured (the default's trial queued again
        after an interrupt waits behind the seeds, but the winner is timed against it)."""
        trials = study.get_trials(deepcopy=False)
        # A TPE study's queue may hold seeds past the budget: they wait for a larger --trials.
        if any(t.state == TrialState.RUNNING or (use_grid and t.state == TrialState.WAITING) for t in trials):
            return False
        if not self._kept_started(trials, kept):
            return False
        ua = study.user_attrs
        if "seeded" not in ua:
            return False
        if use_grid or ua.get("closed"):
            return True
        return len({t.user_attrs.get("key") for t in measured_trials(trials)}) >= self.s.trials

    def _finalising_elsewhere(self, study: optuna.Study) -> bool:
        """Another live worker is re-timing this bucket right now (it writes the final)."""
        mark = study.user_attrs.get("finalising")
        if not mark or mark.get("worker") == self.stamp:
            return False
        alive = stamp_alive(mark.get("worker"))
        if alive is None:  # another host's: trust it for a while
            limit = 2 * self.s.trial_timeout + (self.heartbeat.grace if self.heartbeat else 0)
            return time.time() - mark.get("t", 0) < limit
        return alive

    # -- the search ---------------------------------------------------------------------------

    def _take(self, study: optuna.Study, dists, use_grid: bool, kept: tuple[str, ...]) -> optuna.Trial | None:
        """The next trial for this worker: a kept config's if it is queued (the default first; one
        queued again after an interrupt waits behind the seeds, which may use up the budget), else
        a config queued again after a timeout (likewise), else a queued one, else (TPE) a new
        sample; None when a grid's queue is empty."""
        with queue_lock(self.storage_url):
            trials = study.get_trials(deepcopy=False)
            waiting = [t for t in (_leader(trials, key) for key in kept)
                       if t is not None and t.state == TrialState.WAITING]
            first = waiting[0].number if waiting else None
            if first is None:
                first = next((t.number for t in trials if t.state == TrialState.WAITING
                              and t.user_attrs.get("timeout_retry_of") is not None), None)
            trial_id = pop_waiting(study, first) if use_grid or first is not None else None
            if trial_id is None and not use_grid:
                trial = study.ask(dists)  # takes a queued trial first
                self.beats.add(trial._trial_id)
                return trial
        if trial_id is None:
            return None
        self.beats.add(trial_id)
        trial = optuna.trial.Trial(study, trial_id)
        for name, dist in dists.items():
            trial.suggest_categorical(name, list(dist.choices))
        return trial

    def _search(self, study, bucket: Bucket, name: str, shape: ProblemShape, space, use_grid: bool,
                kept: tuple[str, ...], deadline: float | None) -> None:
        """Take, compile (in the pool) and measure trials until the budget of measured configs,
        the grid, or the time is used up (the kept configs are measured whatever it says); wait
        for other workers' trials whose results this worker's duplicates need."""
        s = self.s
        default_key = kept[0]
        dists = {k: CategoricalDistribution(list(v)) for k, v in space.items()}
        trials = study.get_trials(deepcopy=False)
        done_before = len(measured_trials(trials))
        bar = Progress(s.trials if not use_grid else max(done_before, int(study.user_attrs.get("seeded", 1))),
                       f"bucket {bucket.bucket}", enabled=self.progress,
                       initial=min(done_before, s.trials))
        pending: list[_Pending] = []
        held: list[_Held] = []
        finalists = s.top_k + (bucket.key in self.previous)  # what plans take today is one more
        stop_at = None if deadline is None else deadline - s.retime_reserve_s(finalists)
        max_told = 4 * s.trials + 20  # duplicates after fitting can make trials cheap but endless
        dup_streak = 0
        asking, out_of_time = True, False
        last_recover = time.monotonic()
        try:
            while True:
                trials = study.get_trials(deepcopy=False)
                if stop_at is not None and not out_of_time and time.time() >= stop_at \
                        and self._kept_started(trials, kept):
                    asking, out_of_time = False, True
                    self._close(study, TIME_BUDGET_USED_UP)
                    self._drop_queue(study, kept)
                while asking and len(pending) < max(1, s.lookahead):
                    # The budget: configs measured or being measured, by any worker; the kept configs
                    # are measured whatever it says (taken first, also when queued again).
                    if not use_grid and self._kept_started(trials, kept):
                        claimed = {t.user_attrs.get("key") for t in measured_trials(trials)} | {
                            t.user_attrs.get("key") for t in trials if t.state == TrialState.RUNNING}
                        claimed.discard(None)
                        told = sum(1 for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED))
                        if len(claimed) >= s.trials:
                            asking = False
                            break
                        if told >= max_told or dup_streak >= 50:
                            asking = False
                            self._close(study, "too many duplicates after fitting")
                            break
                    trial = self._take(study, dists, use_grid, kept)
                    if trial is None:
                        asking = False
                        break
                    params = dict(trial.params)
                    fitted, changes = fit_config(KernelConfig(**params), shape)
                    key = config_text(fitted)
                    attrs = {"worker": self.stamp}
                    if trial.user_attrs.get("key") != key:  # sampled (not queued with its fitted config)
                        attrs.update(self._fitted_attrs(fitted, changes))
                    for k, v in attrs.items():
                        study._storage.set_trial_user_attr(trial._trial_id, k, v)
                    trials = study.get_trials(deepcopy=False)
                    leader = _leader(trials, key)
                    mine = next((p for p in pending if p.trial.number == getattr(leader, "number", None)), None)
                    h = _Held(trial, params, fitted, key, tuple(changes))
                    leads = leader is None or leader.number == trial.number
                    dup_streak = 0 if leads else dup_streak + 1
                    if leads:
                        fut = self.pool.submit(bucket.specs, fitted) if self.pool is not None else None
                        pending.append(_Pending(trial, params, fitted, key, tuple(changes), fut))
                    elif leader.state.is_finished():
                        self._tell_duplicate(study, bucket, name, h, _outcome(leader))
                    else:
                        (mine.followers if mine is not None else held).append(h)
                if held:
                    self._resolve_held(study, bucket, name, held, pending, trials, out_of_time, kept)
                if out_of_time:  # drop candidates still compiling past the time share (told FAIL)
                    self._drop_compiling(study, pending, kept)
                if not pending:
                    if not held:
                        break
                    if time.monotonic() - last_recover > 5.0:  # the leaders' workers may have died
                        last_recover = time.monotonic()
                        self._recover(study, name)
                    time.sleep(POLL_S)
                    continue
                if self._prepared != bucket:
                    self.client.call("prepare", timeout=max(600.0, s.trial_timeout), specs=list(bucket.specs))
                    self._prepared = bucket
                wait_s = POLL_S if held else None
                if stop_at is not None and not out_of_time:
                    left = max(0.0, stop_at - time.time())
                    wait_s = left if wait_s is None else min(wait_s, left)
                p = self._next_ready(pending, wait_s)
                if p is None:  # nothing compiled in time: re-check at the top
                    continue
                pending.remove(p)
                leader = _leader(study.get_trials(deepcopy=False), p.key)
                if leader is not None and leader.number != p.trial.number:
                    # Another worker sampled the same fitted config a moment earlier (TPE).
                    held += [_Held(p.trial, p.params, p.config, p.key, p.adjustments), *p.followers]
                    continue
                outcome = self._measure(bucket, p)
                self._tell_measured(study, bucket, name, p, outcome, p.key == default_key)
                measured = [_outcome(t) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                            if t.user_attrs.get("measured") and t.value is not None]
                best = min((o.value for o in measured), default=None)
                d = next((o for o in measured if o.key == default_key), None)
                post = f"best trial {best:.2f} us" if best is not None else "no valid config yet"
                if d is not None:
                    post += f", default {d.value:.2f} us"
                bar.update(post)
        finally:
            bar.close()
            # Only on an exception: leave no trial RUNNING in this process; queue them again.
            for h in held + pending + [f for p in pending for f in p.followers]:
                self._release(study, h.trial, "interrupted")

    def _kept_keys(self, bucket: Bucket, default: KernelConfig) -> tuple[str, ...]:
        """The fitted configs a bucket always measures, even out of time: the default, and what
        plans take today (``previous``), so that a search the budget stops after one trial still
        times both and cannot write a config slower than plans already had."""
        keys = [config_text(default)]
        previous = self.previous.get(bucket.key)
        if previous is not None:
            keys.append(config_text(fit_config(KernelConfig(**previous), bucket.shape)[0]))
        return tuple(dict.fromkeys(keys))

    @staticmethod
    def _kept_started(trials, kept: tuple[str, ...]) -> bool:
        """Each kept config's measurement has been taken by a worker (or it has no live trial)."""
        return all((leader := _leader(trials, key)) is None or leader.state != TrialState.WAITING
                   for key in kept)

    def _cut_short(self, study: optuna.Study, final: dict[str, Any]) -> bool:
        """Whether ``final`` was written after the time budget stopped the search short of
        --trials measured configs (finals written before this flag existed: the study's closing
        reason says so)."""
        if "cut_short" in final:
            return final["cut_short"]
        return study.user_attrs.get("closed") == TIME_BUDGET_USED_UP and final.get("measured", 0) < self.s.trials

    def _close(self, study: optuna.Study, why: str) -> None:
        if not study.user_attrs.get("closed"):
            study.set_user_attr("closed", why)

    def _drop_queue(self, study: optuna.Study, kept: tuple[str, ...]) -> None:
        """Out of time: fail the study's queued trials (those that measure the kept configs
        excepted, not their duplicates: nobody takes those, and a grid would wait for them
        forever), so that the bucket can finish."""
        with queue_lock(self.storage_url):
            trials = study.get_trials(deepcopy=False)
            leaders = {t.number for t in (_leader(trials, key) for key in kept) if t is not None}
            for t in trials:
                if t.state != TrialState.WAITING or t.number in leaders:
                    continue
                try:
                    if study._storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                        study._storage.set_trial_user_attr(t._trial_id, "skipped", "time budget used up")
                        study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
                except optuna.exceptions.UpdateFinishedTrialError:
                    continue

    def _drop_compiling(self, study, pending: list[_Pending], kept: tuple[str, ...]) -> None:
        for q in [q for q in pending if q.future is not None and not q.future.done() and q.key not in kept]:
            q.future.cancel()
            pending.remove(q)
            for t in [q.trial] + [f.trial for f in q.followers]:
                t.set_user_attr("skipped", "time budget used up while compiling")
                study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
                self.beats.discard(t._trial_id)

    def _resolve_held(self, study, bucket: Bucket, name: str, held: list[_Held], pending: list[_Pending],
                      trials, out_of_time: bool, kept: tuple[str, ...]) -> None:
        """Record held trials whose leader has a result as its duplicates; a held trial that
        became the leader (the previous one failed) is measured here, or dropped out of time."""
        for h in list(held):
            leader = _leader(trials, h.key)
            if leader is None or leader.number == h.trial.number:
                held.remove(h)
                if out_of_time and h.key not in kept:
                    h.trial.set_user_attr("skipped", "time budget used up")
                    study.tell(h.trial, state=TrialState.FAIL, skip_if_finished=True)
                    self.beats.discard(h.trial._trial_id)
                    continue
                fut = self.pool.submit(bucket.specs, h.config) if self.pool is not None else None
                pending.append(_Pending(h.trial, h.params, h.config, h.key, h.adjustments, fut))
            elif leader.state.is_finished():
                held.remove(h)
                self._tell_duplicate(study, bucket, name, h, _outcome(leader))

    def _release(self, study: optuna.Study, trial: optuna.Trial, why: str) -> None:
        """Give back a trial this worker cannot finish: failed, and queued again."""
        self.beats.discard(trial._trial_id)
        try:
            with queue_lock(self.storage_url):
                if study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
                    retry_trial(study, study._storage.get_trial(trial._trial_id), why)
        except Exception:  # finished meanwhile, or the storage is gone: a later run recovers it
            pass

    @staticmethod
    def _next_ready(pending: list[_Pending], timeout: float | None) -> _Pending | None:
        """The first pending candidate whose compile finished (or that needs none), else wait
        up to ``timeout`` seconds for one (None: nothing finished in time)."""
        for p in pending:
            if p.future is None or p.future.done():
                return p
        wait([p.future for p in pending], timeout=timeout, return_when=FIRST_COMPLETED)
        return next((p for p in pending if p.future.done()), None)

    def _measure(self, bucket: Bucket, p: _Pending) -> Outcome:
        compile_s = None
        if p.future is not None:
            res = self.pool.result(p.future)
            compile_s = res.get("seconds")
            if res.get("ok") is False:
                return Outcome(p.key, p.config, "PRUNED", None, res["reason"], p.trial.number, {"compile_s": compile_s})
        try:
            r = self.client.call("measure", timeout=self.s.trial_timeout, specs=list(bucket.specs), config=p.config)
        except CandidateFailed as e:
            return Outcome(p.key, p.config, "PRUNED", None, e.reason, p.trial.number,
                           {"compile_s": compile_s, "timeout_s": e.timeout})
        self.plan_s += r["plan_s"]
        self.measured_now += 1
        result = {**{k: r[k] for k in ("bandwidth_gbs", "rel_error", "per_spec", "plan_s", "measure_s")},
                  "fraction_of_copy": r["bandwidth_gbs"] / self.copy_bw if self.copy_bw else None,
                  "compile_s": compile_s}
        return Outcome(p.key, p.config, "COMPLETE", r["time_us"], None, p.trial.number, result)

    def _record(self, bucket: Bucket, name: str, trial_number: int, params: dict, outcome: Outcome,
                adjustments: Sequence[str], measured: bool, is_default: bool) -> dict[str, Any]:
        reason = None
        if outcome.state == "PRUNED":
            reason = outcome.reason or "failed"
            if not measured:
                reason = f"duplicate of trial {outcome.trial}: {reason}"
        return {
            "kind": "trial", "study": name, "class_key": bucket.class_key, "bucket": list(bucket.bucket),
            "specs": [s.name for s in bucket.specs], "trial": trial_number, "state": outcome.state,
            "params": params, "config": outcome.config.to_dict(), "key": outcome.key, "measured": measured,
            "duplicate_of": None if measured else outcome.trial, "adjustments": list(adjustments),
            "is_default": is_default, "time_us": outcome.value,
            **{k: outcome.result.get(k) for k in RESULT_FIELDS}, "prune_reason": reason,
            "worker": self.label or None,
        }

    def _tell(self, study: optuna.Study, trial: optuna.Trial, rec: dict[str, Any]) -> None:
        self.log.write(rec)  # first the log (durable), then the study
        self.beats.discard(trial._trial_id)
        try:
            _tell_record(study, trial._trial_id, trial.number, rec)
        except optuna.exceptions.UpdateFinishedTrialError:
            self.echo(f"  trial {trial.number}: failed as stale by another worker before its result arrived; "
                      "its result stays in the log only")

    def _tell_duplicate(self, study, bucket: Bucket, name: str, h: _Held, leader: Outcome) -> None:
        self._tell(study, h.trial, self._record(bucket, name, h.trial.number, h.params, leader, h.adjustments,
                                                False, False))

    def _tell_measured(self, study, bucket, name, p: _Pending, outcome: Outcome, is_default: bool) -> None:
        self._tell(study, p.trial, self._record(bucket, name, p.trial.number, p.params, outcome, p.adjustments,
                                                True, is_default))
        if outcome.state == "PRUNED":
            self.echo(f"  pruned {config_text(p.config)}: {outcome.reason}")
        for f in p.followers:
            self._tell_duplicate(study, bucket, name, f, outcome)

    # -- the end of a bucket --------------------------------------------------------------------

    def _retime(self, bucket: Bucket, configs: list[KernelConfig], fallback: list[Outcome]):
        """(times per config, bytes moved, note, rounds): the interleaved re-timing, or the
        search's own timings (0 rounds) if it fails."""
        try:
            rt = self.client.call("retime", timeout=self.s.trial_timeout * 2, specs=list(bucket.specs),
                                  configs=configs, rounds=self.s.retime_rounds)
        except CandidateFailed as e:
            first = fallback[0].result.get("per_spec") or [] if fallback else []
            return ({o.config: [o.value] for o in fallback}, geomean(p["bytes"] for p in first),
                    f"re-timing failed ({e.reason}); search timings used; ", 0)
        note = "".join(f"re-timing failed for {config_text(configs[i])}: {reason}; "
                       for i, reason in rt["failed"].items())
        return {configs[i]: t for i, t in rt["times_us"].items() if t}, rt["bytes"], note, self.s.retime_rounds

    def _finalize(self, study: optuna.Study, bucket: Bucket, name: str, default: KernelConfig,
                  cache: dict[str, Outcome]) -> BucketResult:
        """Re-time the best few against the default on this GPU and write the study's final."""
        study.set_user_attr("finalising", {"worker": self.stamp, "t": time.time()})
        self._prepared = None  # re-timing prepares the bucket's inputs itself
        measured = len(cache)
        pruned = sum(o.state == "PRUNED" for o in cache.values())
        cut_short = study.user_attrs.get("closed") == TIME_BUDGET_USED_UP and measured < self.s.trials
        default_key = config_text(default)
        complete = sorted((o for o in cache.values() if o.state == "COMPLETE"), key=lambda o: o.value)
        base = dict(bucket=bucket, study_name=name, default=default, measured=measured, pruned=pruned)
        d_out = cache.get(default_key)
        if not complete:
            note = "every candidate failed" + (
                f" (default: {d_out.reason})" if d_out is not None and d_out.reason else "")
            self.echo(f"  no valid config for this bucket: {note}")
            failed = {"ok": False, "note": note, "measured": measured, "pruned": pruned, "trials_budget": self.s.trials}
            study.set_user_attr("failed", failed)
            study.set_user_attr("finalising", None)
            self.log.write({"kind": "final", "study": name, **failed})
            return BucketResult(**base, ok=False, note=note)
        default_ok = d_out is not None and d_out.state == "COMPLETE"
        top = [o for o in complete if o.key != default_key][: self.s.top_k]
        # What plans take today (``previous``), where the search measured it, is a finalist too:
        # a winner then beats it in the same interleaved rounds, not only in one short timing.
        previous = self.previous.get(bucket.key)
        if previous is not None:
            p_out = cache.get(config_text(fit_config(KernelConfig(**previous), bucket.shape)[0]))
            if p_out is not None and p_out.state == "COMPLETE" and p_out.key not in {default_key,
                                                                                     *(o.key for o in top)}:
                top.append(p_out)
        configs = ([default] if default_ok else []) + [o.config for o in top]
        times, nbytes, note, rounds = self._retime(bucket, configs, ([d_out] if default_ok else []) + top)
        for config, t in times.items():
            self.log.write({"kind": "retime", "study": name, "class_key": bucket.class_key,
                            "bucket": list(bucket.bucket), "specs": [s.name for s in bucket.specs],
                            "config": config.to_dict(), "is_default": config == default, "times_us": t,
                            "median_us": statistics.median(t)})
        med = {c: statistics.median(t) for c, t in times.items()}
        if default_ok and default in med:
            winner, kept, noise = pick_winner(times, default)
            t_win, d_med = med[winner], med[default]
        else:
            # The default failed (or could not be re-timed): the best valid config wins and the
            # entry's default time is set to the winner's (speedup unknown).
            noise = None
            winner = min(med, key=med.get) if med else complete[0].config
            t_win = med.get(winner, complete[0].value)
            d_med, kept = t_win, False
            note += (f"default failed ({d_out.reason if d_out is not None else 'not measured'}); its time is "
                     "recorded as the winner's; ")
        bw = nbytes / (t_win * 1e-6) / 1e9 if nbytes else 0.0
        d_bw = nbytes / (d_med * 1e-6) / 1e9 if nbytes else 0.0
        frac = bw / self.copy_bw if self.copy_bw else None
        final = {
            "ok": True, "winner": winner.to_dict(), "time_us": t_win, "bandwidth_gbs": bw, "fraction_of_copy": frac,
            "default": default.to_dict(), "default_time_us": d_med, "default_bandwidth_gbs": d_bw,
            "kept_default": kept, "noise": noise, "trials_budget": self.s.trials, "measured": measured,
            "pruned": pruned, "note": note, "worker": self.label or None, "cut_short": cut_short,
        }
        study.set_user_attr("final", final)
        study.set_user_attr("finalising", None)
        self.log.write({"kind": "final", "study": name, "class_key": bucket.class_key, "bucket": list(bucket.bucket),
                        **final})
        # The search timed each config once (a short timing); the winner is the re-timing's median.
        finalists = len(times) - (default in times)
        timed = (f"{finalists} finalist{'s' if finalists != 1 else ''}" if finalists else "") + (
            (" and the default" if finalists else "the default alone") if default in times else "")
        how = (f"median of {rounds} interleaved round{'s' if rounds != 1 else ''} of {timed}" if rounds
               else "search timing, not re-timed")
        verdict = ("default kept" if kept else f"{med.get(default, d_med) / t_win:.2f}x over the default") + (
            f", noise {100 * noise:.1f}%" if noise is not None else "")
        self.echo(f"  best trial {complete[0].value:.2f} us (one short timing each); re-timed winner "
                  f"{config_text(winner)}: {t_win:.2f} us ({how}; {verdict})")
        return BucketResult(**base, ok=True, winner=winner, time_us=t_win, bandwidth_gbs=bw, fraction_of_copy=frac,
                            default_time_us=d_med, default_bandwidth_gbs=d_bw, kept_default=kept, noise=noise,
                            note=note, cut_short=cut_short)

    def _resume_final(self, bucket: Bucket, name: str, final: dict[str, Any], quiet: bool = False) -> BucketResult:
        """A bucket already finished (by an earlier run or another worker)."""
        if not quiet:
            winner = config_text(KernelConfig(**final["winner"]))
            self.echo(f"  already tuned ({final['measured']} configs measured): {winner} {final['time_us']:.2f} us "
                      "(re-timed)")
        return BucketResult.from_final(bucket, name, final, resumed=True)
