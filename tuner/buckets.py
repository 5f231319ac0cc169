"""What the search works on and hands back: buckets (the shapes of one study), the settings of a
run, a bucket's result and its summary table, and the config plans take for a bucket today. How a
bucket is searched is ``tuner.search``."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Sequence

from tsdecode import KernelConfig
from tsdecode.config import tables
from tsdecode.config.heuristic import heuristic_config
from tsdecode.config.space import ProblemShape, fit_config
from tsdecode.device import DeviceProperties

from .grids import ShapeSpec
from .space import SpaceLimits, build_space, config_text
from .table_writer import readable_table


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

    @property
    def key(self) -> str:
        """The bucket in job records and progress lines: ``<class key>|B<b>_L<l>``."""
        return f"{self.class_key}|B{self.bucket[0]}_L{self.bucket[1]}"


def group_buckets(specs: Iterable[ShapeSpec]) -> list[Bucket]:
    groups: dict[tuple[str, tuple[int, int]], list[ShapeSpec]] = {}
    for spec in specs:
        key = (tables.problem_class_key(spec.to_problem_shape()), tables.bucket_of(spec.batch_size, spec.kv_len))
        groups.setdefault(key, []).append(spec)
    return [Bucket(k, b, tuple(v)) for (k, b), v in groups.items()]


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
        return {**asdict(self), "limits": self.limits.to_dict()}

    def retime_reserve_s(self, finalists: int | None = None) -> float:
        """Seconds a bucket keeps back from its --time-budget share to re-time its finalists
        (``finalists``, else --top-k) against the default: the search stops this long before the
        share ends."""
        per = self.replay_ms / 1000.0 + 0.1 if self.timing == "cuda-graph" else 0.5
        return ((self.top_k if finalists is None else finalists) + 1) * (self.retime_rounds * per + 0.5)

    def budget_warning(self, num_buckets: int) -> str | None:
        """A warning when --time-budget leaves a bucket less time to search than to re-time its
        finalists: such a bucket measures the default and few configs besides, if any."""
        if self.time_budget is None or num_buckets < 1:
            return None
        share, reserve = self.time_budget / num_buckets, self.retime_reserve_s()
        if share >= 2 * reserve:
            return None
        return (f"warning: --time-budget {self.time_budget:g} leaves each of the {num_buckets} buckets about "
                f"{share:.1f} s, of which re-timing its finalists takes {reserve:.1f} s: {max(0.0, share - reserve):.1f} "
                f"s to search, the heuristic default and few configs besides; --time-budget "
                f"{2 * reserve * num_buckets:.0f} or more leaves each as long to search as to re-time (fewer "
                "--top-k or --retime-rounds shorten the re-timing)")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TuneSettings":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        limits = {k: (tuple(v) if v is not None else None) for k, v in (data.get("limits") or {}).items()}
        values["limits"] = SpaceLimits(**limits)
        return cls(**values)


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
    default_bandwidth_gbs: float | None = None
    kept_default: bool = False
    noise: float | None = None
    measured: int = 0
    pruned: int = 0
    note: str = ""
    resumed: bool = False
    pending: bool = False  # other workers still hold trials of the bucket
    cut_short: bool = False  # the time budget ended the search before --trials configs

    @property
    def speedup(self) -> float | None:
        return self.default_time_us / self.time_us if self.time_us and self.default_time_us else None

    @classmethod
    def from_final(cls, bucket: Bucket, name: str, final: dict[str, Any], resumed: bool = False) -> "BucketResult":
        """The result a study's "final" attribute records."""
        if not final.get("ok"):
            return cls(bucket, name, False, measured=final.get("measured", 0), pruned=final.get("pruned", 0),
                       note=final.get("note", ""), resumed=resumed)
        return cls(bucket, name, True, KernelConfig(**final["winner"]), final["time_us"], final["bandwidth_gbs"],
                   final["fraction_of_copy"], KernelConfig(**final["default"]), final["default_time_us"],
                   final["default_bandwidth_gbs"], final["kept_default"], final["noise"], final["measured"],
                   final["pruned"], final.get("note", ""), resumed=resumed, cut_short=final.get("cut_short", False))

    def table_entry(self) -> tables.TableEntry:
        """The table entry of a tuned bucket (``ok``)."""
        return tables.TableEntry(self.winner, float(self.time_us), float(self.bandwidth_gbs), self.fraction_of_copy,
                                 self.default, float(self.default_time_us), float(self.default_bandwidth_gbs),
                                 tuned_batch_size=self.bucket.representative.batch_size)


# The start of table_writer.table_data's refusal, left out where the caller says what it refuses.
_REFUSED = "refusing to write an entry the runtime would skip: "


def entry_problem(result: BucketResult, device: DeviceProperties) -> str | None:
    """Why the table entry of a tuned bucket's ``result`` (read back from the results log or a
    study storage, not measured now: e.g. a winner outside today's config space) cannot be
    written, as the runtime would skip it; None if it can."""
    from .table_writer import table_data

    try:
        table_data(device, {result.bucket.class_key: {result.bucket.bucket: result.table_entry()}}, {})
    except (TypeError, ValueError, ArithmeticError) as e:
        where = f"{_REFUSED}{result.bucket.class_key} bucket {result.bucket.bucket}: "
        return str(e).removeprefix(where)
    return None


def final_problem(bucket: Bucket, name: str, final: dict[str, Any], device: DeviceProperties) -> str | None:
    """``entry_problem`` of a successful "final" record."""
    try:
        result = BucketResult.from_final(bucket, name, final)
    except (KeyError, TypeError, ValueError) as e:
        return f"not a final record ({type(e).__name__}: {e})"
    return entry_problem(result, device)


def final_of(study_attrs: dict[str, Any], trials: int) -> dict[str, Any] | None:
    """A study's result for a budget of ``trials`` measured configs: its "final" (a winner) or
    "failed" (no valid config) attribute, if written for at least that budget (else None: a larger
    --trials searches on)."""
    for key in ("final", "failed"):
        rec = study_attrs.get(key)
        if rec and rec.get("trials_budget", 0) >= trials:
            return rec
    return None


def measured_trials(trials: Iterable) -> list:
    """The finished trials that measured their fitted config (not duplicates of another, nor
    timed out and measured again: ``retried``)."""
    trials = list(trials)
    again = retried(trials)
    return [t for t in trials if t.state.is_finished() and t.user_attrs.get("measured") and t.number not in again]


def timed_out_under(trial) -> float | None:
    """The --trial-timeout (seconds) a measured trial was pruned for running past; None if it
    was not (measured, or pruned for another reason)."""
    if trial.state.name != "PRUNED" or not trial.user_attrs.get("measured"):
        return None
    return (trial.user_attrs.get("result") or {}).get("timeout_s")


def retried(trials: Iterable) -> set[int]:
    """The numbers of the trials pruned for running past --trial-timeout whose config a run with a
    larger timeout queued again (its trial's ``timeout_retry_of``): while that trial is queued,
    running or finished (not failed), its result stands for theirs."""
    return {t.user_attrs["timeout_retry_of"] for t in trials
            if t.user_attrs.get("timeout_retry_of") is not None and t.state.name != "FAIL"}


def summary_table(results: Sequence[BucketResult]) -> str:
    """Best config per bucket, its speedup over the heuristic default, fraction of copy bandwidth."""
    head = ("bucket (B,L)", "shape(s)", "best config", "us", "default us", "speedup", "% copy", "trials")
    rows = []
    for r in results:
        trials = f"{r.measured} ({r.pruned} pruned)" + (", time ran out" if r.cut_short else "")
        if r.ok:
            frac = f"{100 * r.fraction_of_copy:.0f}%" if r.fraction_of_copy is not None else "-"
            best = config_text(r.winner) + (" (default)" if r.kept_default else "")
            rows.append((str(r.bucket.bucket), r.bucket.label, best, f"{r.time_us:.2f}",
                         f"{r.default_time_us:.2f}", f"{r.speedup:.2f}x", frac, trials))
        else:
            what = "not finished" if r.pending else f"FAILED: {r.note}"
            rows.append((str(r.bucket.bucket), r.bucket.label, what[:60], "-", "-", "-", "-", trials))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


def model_default(shape: ProblemShape, device: DeviceProperties) -> KernelConfig:
    """What a plan of ``shape`` (equal lengths) runs where no table has an entry: the heuristic's
    config, fitted."""
    return fit_config(heuristic_config(shape, device), shape)[0]


def bucket_space(bucket: Bucket, device: DeviceProperties, limits: SpaceLimits):
    """(heuristic default, search space) of ``bucket`` on ``device``."""
    default = model_default(bucket.shape, device)
    return default, build_space(bucket.shape, device.sm_count, limits, default)


def stale_buckets(table_path: Path, buckets: Sequence[Bucket], device: DeviceProperties) -> list[Bucket]:
    """The buckets whose entry the table lacks, or holds timed against another default than the
    heuristic gives today (a tsdecode upgrade that changed the heuristic), or with another kernel
    or triton major version; re-tuning just these keeps "tuned never slower than the heuristic"
    true for the whole table."""
    table = readable_table(table_path)
    if table is None or table.stale:
        return list(buckets)
    return [b for b in buckets if (entry := table.entries.get(b.class_key, {}).get(b.bucket)) is None
            or entry.default_config != model_default(b.shape, device)]


def table_winners(table_path: Path, buckets: Sequence[Bucket], device: DeviceProperties,
                  limits: SpaceLimits) -> dict[str, dict[str, int]]:
    """Per bucket key, the config plans take for the bucket today, where it lies in today's space:
    the winner the table being written holds, else the entry the runtime's own table search finds
    (another folder's table, or one of a GPU of the same compute capability and SM count). A new
    study queues it among its first trials (right after the default, unless its seeds hold it), so
    tuning does not lose what plans already get for lack of trials."""
    table = readable_table(table_path)
    out = {}
    for b in buckets:
        entry = table.entries.get(b.class_key, {}).get(b.bucket) if table else None
        config = entry.kernel_config if entry is not None else _planned_entry(b, device)
        if config is None:
            continue
        _, space = bucket_space(b, device, limits)
        if all(getattr(config, k) in v for k, v in space.items()):
            out[b.key] = config.to_dict()
    return out


def _planned_entry(bucket: Bucket, device: DeviceProperties) -> KernelConfig | None:
    """The table entry a plan of the bucket's shape takes on ``device`` today, if any. The search's
    warnings (a missing table, another GPU's) are for plans, not for the tuner, and are not given."""
    log = logging.getLogger(tables.__name__)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        hit = tables.lookup(bucket.shape, device)
    finally:
        log.setLevel(level)
    return hit.kernel_config if hit is not None else None
