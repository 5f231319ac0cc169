"""A tuning job in the study storage: its definition, the GPU model it is pinned to, its progress
and the table written from it.

A job is a grid and the search settings, stored as the user attributes of a study named
``tsdecode-job:<name>`` (no trials), so a worker needs only the storage URL and the job name.
The job's buckets are ordinary studies of ``tuner.search`` (their names hash the GPU model and
the kernel hash, so studies of two models never mix); the job records which study is which
bucket (``study|<bucket key>`` attributes, written by the workers) for ``export``.

The first worker to join pins the job to its GPU model and kernel hash: it creates a study named
``tsdecode-pin:<job>|<model>|<kernel hash>``; of such studies the oldest (smallest study id) is
the pin, so two workers joining at once agree without a lock. A worker whose model or kernel
hash differs is refused (``JobError`` naming both), and so, before it pins anything, is a worker
of the other kind (``check_kind``: a GPU job's worker in Triton's interpreter, or the reverse).

``export`` writes the table from the buckets' final results, with the provenance of the worker
that pinned the job (device, triton, torch, kernel hash, copy bandwidth); run it any time for a
partial table.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import optuna
from optuna.study import StudyDirection
from optuna.trial import TrialState

from tsdecode.config.tables import TableEntry, table_filename
from tsdecode.device import DeviceProperties

from .arguments import ToolError
from .buckets import (Bucket, BucketResult, TuneSettings, bucket_space, entry_problem, final_of, group_buckets,
                      measured_trials)
from .grids import ShapeSpec
from .space import space_size
from .study import Heartbeat
from .table_writer import merge_entries

JOB_PREFIX = "tsdecode-job:"
PIN_PREFIX = "tsdecode-pin:"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
# Bump when the job record changes meaning.
JOB_FORMAT = 1


class JobError(ToolError):
    """An unknown job, a bad job name, a job defined otherwise, a refused worker: one line
    (exit code 2)."""


@dataclass
class Job:
    """What every worker of a job tunes, and how."""

    name: str
    specs: tuple[ShapeSpec, ...]
    settings: TuneSettings
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    previous: dict[str, dict[str, int]] = field(default_factory=dict)  # bucket key -> table winner
    interpreter: bool = False
    started: float | None = None  # epoch seconds: --time-budget counts from here
    created: str = ""

    @property
    def buckets(self) -> list[Bucket]:
        return group_buckets(self.specs)

    def identity(self) -> dict[str, Any]:
        """What the job's results depend on (a job of the same name must match it)."""
        return {"specs": [s.to_dict() for s in self.specs], "study": self.settings.study_fields()}

    def to_dict(self) -> dict[str, Any]:
        return {"format": JOB_FORMAT, "name": self.name, "specs": [s.to_dict() for s in self.specs],
                "settings": self.settings.to_dict(), "heartbeat": dataclasses.asdict(self.heartbeat),
                "previous": self.previous, "interpreter": self.interpreter, "started": self.started,
                "created": self.created}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Job":
        if data.get("format") != JOB_FORMAT:
            raise JobError(f"job {data.get('name')!r}: record format {data.get('format')} is not {JOB_FORMAT} "
                           "(written by another tsdecode version)")
        return cls(data["name"], tuple(ShapeSpec(**s) for s in data["specs"]),
                   TuneSettings.from_dict(data["settings"]), Heartbeat(**data["heartbeat"]),
                   dict(data.get("previous") or {}), bool(data.get("interpreter")), data.get("started"),
                   data.get("created", ""))


def default_job_name(specs: Sequence[ShapeSpec], settings: TuneSettings, device_name: str) -> str:
    """The job a ``tune`` without --job runs: the same grid and study settings on the same GPU
    model resume it (budgets are not part of it)."""
    ident = {"specs": [s.to_dict() for s in specs], "study": settings.study_fields(), "device": device_name}
    return "run-" + hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise JobError(f"bad job name {name!r}: letters, digits, '.', '_' and '-' (at most 80, starting with a "
                       "letter or digit)")
    return name


def list_jobs(storage) -> list[str]:
    return sorted(s.study_name[len(JOB_PREFIX):] for s in storage.get_all_studies()
                  if s.study_name.startswith(JOB_PREFIX))


def _job_study_id(storage, name: str) -> int:
    try:
        return storage.get_study_id_from_name(JOB_PREFIX + name)
    except KeyError:
        known = list_jobs(storage)
        there = f"jobs there: {', '.join(known)}" if known else "it holds no job"
        raise JobError(f"unknown job {name!r} in this storage ({there})") from None


def load_job(storage, name: str) -> Job:
    """The job ``name`` (JobError if the storage has none of that name)."""
    attrs = storage.get_study_user_attrs(_job_study_id(storage, check_name(name)))
    if "job" not in attrs:
        raise JobError(f"job {name!r}: its record is missing (the process creating it died?); create it again")
    return Job.from_dict(attrs["job"])


def save_job(storage, job: Job) -> Job:
    """Create the job, or update an existing one of the same name and definition (budgets,
    start time, heartbeat settings and previous winners are the caller's); JobError if the
    existing one has another grid or study settings."""
    check_name(job.name)
    try:
        study_id = storage.create_new_study([StudyDirection.MINIMIZE], JOB_PREFIX + job.name)
    except optuna.exceptions.DuplicatedStudyError:
        study_id = storage.get_study_id_from_name(JOB_PREFIX + job.name)
        old = storage.get_study_user_attrs(study_id).get("job")
        if old is not None:
            try:
                mismatch = Job.from_dict(old).identity() != job.identity()
            except (JobError, KeyError, TypeError, ValueError):
                mismatch = True
            if mismatch:
                raise JobError(f"job {job.name!r} already exists in this storage with another grid or search "
                               "settings; pick another --job name (or leave --job out)") from None
            job = dataclasses.replace(job, created=old.get("created") or job.created)
    if not job.created:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        job = dataclasses.replace(job, created=now)
    storage.set_study_user_attr(study_id, "job", job.to_dict())
    return job


def mark_started(storage, job: Job) -> Job:
    """Set the job's start (the time budget counts from it) if no run has."""
    if job.started is not None:
        return job
    job = dataclasses.replace(job, started=time.time())
    study_id = _job_study_id(storage, job.name)
    current = storage.get_study_user_attrs(study_id).get("job") or {}
    if current.get("started") is None:
        storage.set_study_user_attr(study_id, "job", job.to_dict())
        return job
    return dataclasses.replace(job, started=current["started"])


# ---------------------------------------------------------------------------------------------
# The GPU model a job is pinned to
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """Where a job's trials are measured: the device (all its properties, for the heuristic and
    the table), the kernel hash, and the versions and copy bandwidth the table records."""

    device: DeviceProperties
    kernel_hash: str
    triton: str
    torch: str
    copy_bandwidth_gbs: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"device": dataclasses.asdict(self.device), "kernel_hash": self.kernel_hash, "triton": self.triton,
                "torch": self.torch, "copy_bandwidth_gbs": self.copy_bandwidth_gbs}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Identity":
        return cls(DeviceProperties.from_dict(data["device"]), data["kernel_hash"], data["triton"], data["torch"],
                   data.get("copy_bandwidth_gbs"))


def _pins(storage, job: str) -> list[tuple[int, str, str]]:
    """(study id, model, kernel hash) of the job's pin studies, oldest first."""
    prefix = f"{PIN_PREFIX}{job}|"
    pins = []
    for s in storage.get_all_studies():
        if s.study_name.startswith(prefix):
            model, _, kernel = s.study_name[len(prefix):].rpartition("|")
            pins.append((s._study_id, model, kernel))
    return sorted(pins)


def check_kind(job: Job, interpreter: bool) -> None:
    """JobError unless a worker in Triton's interpreter (``interpreter``) or on a GPU is of the
    kind the job is for (``create --for``; a ``tune`` run's device): a worker of the other kind
    would pin the job to its device and refuse every worker of the job's kind."""
    if interpreter == job.interpreter:
        return
    if job.interpreter:
        raise JobError(f"job {job.name!r} is for CPU workers (--for cpu); this worker runs on a GPU: refusing to "
                       "join (GPU timings would pin the job to the GPU; join with --devices cpu:N, or create a "
                       "job for GPUs)")
    raise JobError(f"job {job.name!r} is for GPU workers (--for gpu); this worker has no GPU (Triton's "
                   "interpreter): refusing to join (its timings would pin the job to the CPU; run it on a GPU "
                   "host, or create a job with --for cpu)")


def pin(storage, job: str, identity: Identity) -> Identity:
    """Pin ``job`` to ``identity``'s GPU model and kernel hash, or check it against the pin;
    returns the pinned identity. JobError names both when they differ."""
    model, kernel = identity.device.name, identity.kernel_hash
    pins = _pins(storage, job)
    if not any(p[1:] == (model, kernel) for p in pins):
        try:
            sid = storage.create_new_study([StudyDirection.MINIMIZE], f"{PIN_PREFIX}{job}|{model}|{kernel}")
            storage.set_study_user_attr(sid, "identity", identity.to_dict())
        except optuna.exceptions.DuplicatedStudyError:  # the same model, pinned a moment ago
            pass
        pins = _pins(storage, job)
    first_id, first_model, first_kernel = pins[0]
    if (first_model, first_kernel) != (model, kernel):
        ours = next((p[0] for p in pins if p[1:] == (model, kernel)), None)
        if ours is not None:  # leave no pin of a refused model behind
            storage.delete_study(ours)
        what = "GPU model" if first_model != model else "kernel"
        raise JobError(f"job {job!r} is tuned on '{first_model}' with kernel {first_kernel}; this worker's device is "
                       f"'{model}' with kernel {kernel}: refusing to join (another {what} would mix its "
                       "trials into the job's table; start another job for it)")
    return pinned(storage, job) or identity


def pinned(storage, job: str) -> Identity | None:
    """The identity the job is pinned to (None: no worker has joined yet)."""
    pins = _pins(storage, job)
    for sid, _, _ in pins[:1]:
        data = storage.get_study_user_attrs(sid).get("identity")
        for _ in range(50):  # the pinning worker writes it right after creating the pin
            if data is not None:
                return Identity.from_dict(data)
            time.sleep(0.1)
            data = storage.get_study_user_attrs(sid).get("identity")
    return None


def record_study(storage, job: str, bucket: Bucket, study_name: str) -> None:
    """Note which study holds ``bucket`` (for export and progress)."""
    study_id = _job_study_id(storage, job)
    attr = f"study|{bucket.key}"
    if storage.get_study_user_attrs(study_id).get(attr) != study_name:
        storage.set_study_user_attr(study_id, attr, study_name)


def study_names(storage, job: Job) -> dict[str, str]:
    """Bucket key -> study name, for the buckets a worker has opened."""
    attrs = storage.get_study_user_attrs(_job_study_id(storage, job.name))
    return {k[len("study|"):]: v for k, v in attrs.items() if k.startswith("study|")}


def _study(storage, name: str) -> optuna.Study | None:
    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return None


# ---------------------------------------------------------------------------------------------
# The table and progress
# ---------------------------------------------------------------------------------------------


@dataclass
class Export:
    results: list[BucketResult]  # one per bucket: final, failed, or pending (not finished)
    table: Path | None  # written, or None (nothing final yet)


def _results(storage, job: Job, warn: Callable[[str], None]) -> list[BucketResult]:
    names = study_names(storage, job)
    results = []
    for bucket in job.buckets:
        name = names.get(bucket.key)
        study = _study(storage, name) if name else None
        final = final_of(study.user_attrs, job.settings.trials) if study is not None else None
        if final:
            try:
                results.append(BucketResult.from_final(bucket, name, final))
            except (KeyError, TypeError, ValueError) as e:  # a damaged storage
                why = f"not a final record ({type(e).__name__}: {e})"
                warn(f"warning: bucket {bucket.bucket} of {bucket.class_key}: its final in the study storage is not "
                     f"written to the table ({why})")
                results.append(BucketResult(bucket, name, False, note=f"final not usable: {why}"))
        else:
            measured = 0 if study is None else len(measured_trials(study.get_trials(deepcopy=False)))
            results.append(BucketResult(bucket, name or "", False, measured=measured, pending=True))
    return results


def tuner_settings(job: Job, identity: Identity) -> dict[str, Any]:
    """The table's ``tuner_settings``: the same fields a single-process run always wrote."""
    run_info = {"device_name": identity.device.name, "interpreter": job.interpreter, "triton": identity.triton,
                "torch": identity.torch, "grid": [s.name for s in job.specs]}
    return {"tool": "tsdecode-tune", **job.settings.to_dict(), **run_info,
            "copy_bandwidth_gbs": identity.copy_bandwidth_gbs}


def export(storage, job: Job, table_dir: Path, warn: Callable[[str], None] | None = None) -> Export:
    """Merge the job's finished buckets into ``table_dir``/<GPU>.json (other entries of the
    table are kept); buckets not finished yet are left out, and so is a final the runtime would
    skip (a damaged storage; ``warn`` is told which)."""
    identity = pinned(storage, job.name)
    if identity is None:
        return Export([BucketResult(b, "", False, pending=True) for b in job.buckets], None)
    warn = warn or (lambda msg: None)
    results = _results(storage, job, warn)
    entries: dict[str, dict[tuple[int, int], TableEntry]] = {}
    for i, r in enumerate(results):
        if r.ok:
            why = entry_problem(r, identity.device)
            if why is not None:
                warn(f"warning: bucket {r.bucket.bucket} of {r.bucket.class_key}: its final in "
                                             f"the study storage is not written to the table ({why})")
                results[i] = BucketResult(r.bucket, r.study_name, False, measured=r.measured, pruned=r.pruned,
                                          note=f"final not usable: {why}")
                continue
            entries.setdefault(r.bucket.class_key, {})[r.bucket.bucket] = r.table_entry()
    if not entries:
        return Export(results, None)
    path = Path(table_dir) / table_filename(identity.device.name)
    merge_entries(path, identity.device, entries, tuner_settings(job, identity),
                  provenance={"kernel_hash": identity.kernel_hash, "triton_version": identity.triton,
                              "torch_version": identity.torch})
    return Export(results, path)


class JobProgress:
    """One line for the whole job: buckets finished, configs measured of the budget, the rate,
    an ETA, and per worker the bucket it is on."""

    def __init__(self, storage, job: Job, device: DeviceProperties) -> None:
        self.storage, self.job = storage, job
        self.budget = {}
        for b in job.buckets:
            _, space = bucket_space(b, device, job.settings.limits)
            self.budget[b.key] = min(space_size(space), job.settings.trials)
        self.t0 = time.monotonic()
        self.first: int | None = None
        self.line()  # the baseline of the rate: what earlier runs measured
        self.t0 = time.monotonic()

    def line(self) -> str:
        names = study_names(self.storage, self.job)
        done = measured = 0
        where: dict[str, str] = {}
        for bucket in self.job.buckets:
            name = names.get(bucket.key)
            study = _study(self.storage, name) if name else None
            if study is None:
                continue
            if final_of(study.user_attrs, self.job.settings.trials):
                done += 1
                measured += self.budget[bucket.key]
                continue
            for t in study.get_trials(deepcopy=False):
                if t.state.is_finished() and t.user_attrs.get("measured"):
                    measured += 1
                elif t.state == TrialState.RUNNING and (t.user_attrs.get("worker") or {}).get("label"):
                    where[t.user_attrs["worker"]["label"]] = f"bucket {bucket.bucket}"
        total = sum(self.budget.values())
        measured = min(measured, total)
        if self.first is None:
            self.first = measured
        elapsed = time.monotonic() - self.t0
        rate = (measured - self.first) / elapsed if elapsed > 0 else 0.0
        eta = f"ETA {_duration((total - measured) / rate)}" if rate > 0 and done < len(self.job.buckets) else "ETA -"
        per = ", ".join(f"{label}: {b}" for label, b in sorted(where.items()))
        return (f"job {self.job.name}: {done}/{len(self.job.buckets)} buckets, {measured}/{total} configs measured "
                f"({rate:.2f}/s), {eta}" + (f" | {per}" if per else ""))


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def each_study(storage, job: Job, fn: Callable[[optuna.Study, str], Any]) -> None:
    """``fn(study, name)`` for each of the job's studies that exists."""
    for name in study_names(storage, job).values():
        study = _study(storage, name)
        if study is not None:
            fn(study, name)
