"""The subcommands that run or define a job: ``tune``, ``worker``, ``create`` and ``export``.

A tune run: the device's identity (from the measuring process), the run lock, the job defined
(or found again) in the study storage, the buckets tuned in this process or by one ``worker``
process per device (``--devices``), then the table written from the storage and the closing
lines. Ctrl-C and SIGTERM end a run the same way: the finished buckets are written, exit 130.
Imports of the tuner's heavy parts (optuna, torch, tsdecode) happen inside the functions: ``cli``
imports this module before it decides whether triton runs in its interpreter.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

from .arguments import PROG, UsageError

CPU_NOTE = ("NOTE: no CUDA GPU in use: kernels run in Triton's interpreter on the CPU. Timings are "
            "wall-clock and MEANINGLESS; the table written only exercises the pipeline.")


def _limits(args):
    from tsdecode.config import space as C

    from .space import SpaceLimits

    fields = {}
    for name, allowed in (("block_n", C.BLOCK_N_CHOICES), ("block_m", C.BLOCK_M_CHOICES),
                          ("num_kv_splits", range(1, C.MAX_NUM_KV_SPLITS + 1)),
                          ("num_warps", C.NUM_WARPS_CHOICES), ("num_stages", C.NUM_STAGES_CHOICES)):
        values = getattr(args, name)
        if values is None:
            continue
        bad = [v for v in values if v not in allowed]
        if bad:
            what = f"[1, {C.MAX_NUM_KV_SPLITS}]" if name == "num_kv_splits" else list(allowed)
            raise UsageError(f"{PROG}: error: --{name.replace('_', '-')} {bad} not in {what}")
        fields[name] = tuple(sorted(set(values)))
    return SpaceLimits(**fields)


def _folder(path: Path, flag: str) -> Path:
    """``path`` as an existing folder this process can write in (created and tried now, before
    any worker starts, so that a path that cannot be one is a usage error)."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{PROG}: error: {flag} {path}: exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{PROG}: error: {flag} {path}: cannot create the folder ({e.strerror or e})") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".tsdecode-write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{PROG}: error: {flag} {path}: cannot write in the folder ({e.strerror or e})") from None
    return path


def explain_command(spec) -> str:
    """The ``tsdecode-tune explain`` command line of one grid shape."""
    parts = [f"{PROG} explain --batch-size {spec.batch_size} --kv-len {spec.kv_len} --heads "
             f"{spec.num_qo_heads}:{spec.num_kv_heads} --head-dim {spec.head_dim} --page-size {spec.page_size}"]
    if spec.seq_len_q != 1:
        parts.append(f"--seq-len-q {spec.seq_len_q}")
    if spec.packed:
        parts.append("--packed")
    if spec.mask_type != "dense":
        parts.append(f"--mask {spec.mask_type}")
    if spec.window_left >= 0:
        parts.append(f"--window-left {spec.window_left}")
    if spec.q_dtype != "bfloat16":
        parts.append(f"--q-dtype {spec.q_dtype}")
    for flag, name in (("--kv-dtype", spec.kv_dtype), ("--o-dtype", spec.o_dtype)):
        if name != spec.q_dtype:
            parts.append(f"{flag} {name}")
    return " ".join(parts)


def where_the_table_is_used(table: Path, spec) -> list[str]:
    """The run's last lines: where the table is and how plans find it."""
    from tsdecode.config.tables import CONFIG_DIR_ENV, user_tables_dir

    explain = explain_command(spec)
    folder = table.parent.resolve()
    lines = [f"table: {table}"]
    if folder == user_tables_dir().resolve():
        first = os.environ.get(CONFIG_DIR_ENV)
        when = (f"except for buckets that ${CONFIG_DIR_ENV}={first} (searched first) also holds"
                if first else "from now on")
        lines.append(f"plans on this device use it {when}: search order: ${CONFIG_DIR_ENV}, the user cache "
                     f"({folder}), the shipped tables; check with `{explain}`")
    else:
        quoted = shlex.quote(str(folder))  # the advice is pasted into a shell
        lines.append(f"plans do not search {folder} by default: set {CONFIG_DIR_ENV}={quoted} (or call "
                     f"tsdecode.config.tables.set_config_path) to use it; check with "
                     f"`{CONFIG_DIR_ENV}={quoted} {explain}`")
    return lines


def join_command(storage, job_name: str) -> str:
    """The command other hosts join a job with (its storage path quoted for a shell)."""
    return f"{PROG} worker --storage {shlex.quote(str(storage))} --job {shlex.quote(job_name)}"


def smoke_note(specs, cpu: bool) -> list[str]:
    """A closing line for a run of the smoke preset alone: its shapes are tiny test shapes, so a
    model's shapes are still untuned (a GPU then has a table, and plans no longer hint at tuning)."""
    from .grids import PRESETS

    if set(specs) != set(PRESETS["smoke"]):
        return []
    models = ", ".join(name for name in PRESETS if name not in ("smoke", "mha", "g16", "g32", "fp8"))
    where = "on a GPU, tune" if cpu else "your model's shapes still get the heuristic's configs: tune"
    return [f"the smoke preset is {len(PRESETS['smoke'])} small test shapes; {where} a model's shapes with "
            f"`{PROG} --preset NAME` (one of {models}, ...) or --grid-file FILE"]


def _specs(args, cpu: bool):
    from .grids import PRESETS, specs_from_args

    if cpu and not (args.preset or args.grid_file or args.batch_sizes or args.kv_lens):
        args.preset = ["smoke"]
        print(f"{PROG}: no grid given: tuning the smoke preset ({len(PRESETS['smoke'])} small test shapes; "
              f"--preset, --grid-file or --batch-sizes with --kv-lens choose others)")
    try:
        specs = specs_from_args(args)
    except (ValueError, OSError) as e:  # bad preset, list, TOML file or empty grid
        raise UsageError(f"{PROG}: error: {e}") from None
    if cpu and any(s.batch_size * s.kv_len > 1 << 16 for s in specs):
        print(f"{PROG}: warning: shapes this large take very long in the interpreter (and their timings mean "
              "nothing); the smoke preset is meant for CPU runs", file=sys.stderr)
    return specs


def _check_hook(hook: str | None) -> None:
    if hook:
        from .runner import load_hook

        try:
            load_hook(hook)
        except Exception as e:
            raise UsageError(f"{PROG}: error: --inject-hook: {e}") from None


def _compile_workers(args, workers: int, cpu: bool) -> int:
    """--compile-workers, else the host's CPUs shared by ``workers`` workers (devices.py)."""
    from .devices import compile_workers_per_device

    given = args.compile_workers
    return given if given is not None else compile_workers_per_device(workers, cpu_mode=cpu)


def _settings(args, cpu: bool, lookahead: int):
    from .buckets import TuneSettings
    from .study import Heartbeat

    settings = TuneSettings(
        trials=args.trials, time_budget=args.time_budget, seed=args.seed, top_k=args.top_k,
        retime_rounds=args.retime_rounds, trial_timeout=args.trial_timeout, lookahead=lookahead,
        limits=_limits(args), timing="wall" if cpu else "cuda-graph", replay_ms=args.replay_ms,
        check_requests=args.check_requests)
    grace = args.heartbeat_grace if args.heartbeat_grace is not None else 2 * args.trial_timeout
    heartbeat = Heartbeat(interval=max(1, min(30, int(grace // 4))), grace=max(1, int(round(grace))))
    return settings, heartbeat


def _quiet_optuna() -> None:
    import warnings

    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def echo(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _labelled(label: str):
    if not label:
        return echo
    return lambda msg: echo("\n".join(f"[{label}] {line}" for line in msg.splitlines()))


def _open(url: str, heartbeat=None, must_exist: bool = False, say=echo):
    """The storage, with Optuna heartbeats whose stale trials are queued again."""
    from .study import open_storage, retry_trial

    def stale(study, trial) -> None:
        again = retry_trial(study, trial, "no heartbeat for the grace period")
        say(f"  trial {trial.number} of {study.study_name.rsplit('|', 1)[0]}: no heartbeat for "
            f"{heartbeat.grace} s (its worker died or lost the storage); "
            + (f"queued again as trial {again}" if again is not None else "not queued again"))

    return open_storage(url, heartbeat, stale if heartbeat is not None else None, must_exist=must_exist)


def _start_client(args, device: str, check_requests: int, replay_ms: float):
    from . import runner

    options = runner.WorkerOptions(device=device, hook=args.inject_hook, check_requests=check_requests,
                                   replay_ms=replay_ms)
    client = runner.WorkerClient(options) if args.isolation == "process" else runner.InlineClient(options)
    try:
        hello = client.start()
    except BaseException:
        client.close()
        raise
    return client, hello


def _identity(hello):
    from tsdecode.config.tables import kernel_source_hash
    from tsdecode.device import DeviceProperties

    from .job import Identity

    return Identity(DeviceProperties.from_dict(hello["device"]), kernel_source_hash(), hello["triton"], hello["torch"],
                    hello["copy_bandwidth_gbs"])


def _open_run_storage(paths, heartbeat, log_path):
    """Take the run lock, move a damaged study file aside (logged), open the storage."""
    from .study import ResultLog, lock_study, set_aside_if_damaged

    lock = lock_study(paths)
    try:
        moved = set_aside_if_damaged(paths)
        if moved is not None:
            echo(f"warning: study storage {paths.storage_file} is unusable ({moved[1]}); moved aside to {moved[0]} "
                 "and started afresh (tuned entries are kept in the table, finished buckets are not tuned again)")
            log = ResultLog(log_path)  # trial numbers start again: older trial records are not theirs
            log.write({"kind": "storage_reset", "storage": paths.storage, "moved_to": moved[0]})
            log.close()
        storage = _open(paths.storage, heartbeat)
    except BaseException:
        lock.release()
        raise
    return lock, storage


def _say_where(args, specs, paths) -> None:
    """A run's opening lines after the device: the grid and where its files go."""
    from .buckets import group_buckets

    echo(f"grid: {len(specs)} shapes in {len(group_buckets(specs))} buckets; {args.trials} configs per bucket"
         + (f", time budget {args.time_budget:.0f} s" if args.time_budget else ""))
    echo(f"table: {paths.table}\ntrial log: {paths.jsonl}\ntrials CSV: {paths.csv}\nstudy storage: {paths.storage}")


def _define_job(args, storage, specs, settings, heartbeat, device_props, table: Path, cpu: bool):
    """The run's job (created, or updated for a resume); None if --stale-only leaves nothing."""
    from . import job as J
    from .buckets import group_buckets, stale_buckets, table_winners
    from .table_writer import check_target

    try:
        check_target(table, device_props)  # now, not after the tuning, when the table is written
    except ValueError as e:
        raise UsageError(f"{PROG}: error: {e}") from None
    buckets = group_buckets(specs)
    if getattr(args, "stale_only", False):
        stale = stale_buckets(table, buckets, device_props)
        echo(f"--stale-only: {len(buckets) - len(stale)} of {len(buckets)} buckets up to date in {table}; "
             f"tuning {len(stale)}")
        buckets = stale
        specs = [spec for b in buckets for spec in b.specs]
    if not buckets:
        return None
    warning = settings.budget_warning(len(buckets))
    if warning:
        echo(warning)
    name = args.job if args.job is not None else J.default_job_name(specs, settings, device_props.name)
    previous = table_winners(table, buckets, device_props, settings.limits)
    return J.save_job(storage, J.Job(name, tuple(specs), settings, heartbeat, previous, cpu, started=time.time()))


def _finish(storage, job, paths, results, t_start: float, cpu: bool, extra: Sequence[str] = (),
            grid: Sequence = ()) -> int:
    """Write the table from the storage, the CSV, the summary and the closing lines; ``grid``: the
    run's shapes (the closing lines name one of them where --stale-only left no job, and say
    when they were only the smoke preset's). Interrupted meanwhile: the finished buckets are
    written all the same (unless they were already), the usual line, exit 130."""
    written: list = []
    try:
        return _write_and_report(storage, job, paths, results, t_start, cpu, extra, grid, written)
    except BaseException as e:
        if not is_interrupt(e):
            raise
        return _interrupted_after_search(storage, job, paths, table_written=bool(written))


def _interrupted_after_search(storage, job, paths, table_written: bool = False) -> int:
    """Ctrl-C / SIGTERM once the search is over (signals are ignored from then on): the finished
    buckets still go into the table, then the usual line, exit 130."""
    if not table_written:
        echo(f"{PROG}: interrupted: writing the finished buckets")
        _export_interrupted(storage, job, paths)
    echo(f"{PROG}: interrupted; finished trials are saved, rerun the same command to resume")
    return 130


def _write_and_report(storage, job, paths, results, t_start: float, cpu: bool, extra: Sequence[str],
                      grid: Sequence, written: list) -> int:
    from . import job as J
    from .buckets import summary_table
    from .study import write_trials_csv

    ex = J.export(storage, job, paths.table.parent, warn=echo) if job is not None else None
    written.append(True)
    if results is None:
        results = ex.results if ex is not None else []
    try:
        write_trials_csv(paths.jsonl, paths.csv)
    except Exception as e:  # the jsonl stays the record; the CSV is a convenience
        echo(f"warning: could not write {paths.csv}: {e}")
    if job is None:
        echo(f"nothing to tune: every bucket of the grid is up to date in {paths.table}")
    else:
        print(summary_table(results))
    for line in extra:
        echo(line)
    cut = sum(r.cut_short for r in results)
    if cut:
        echo(f"{cut} bucket(s) stopped short of --trials when the time budget ran out (\"time ran out\" above): "
             "the same command again, with a larger --time-budget or none, searches them on from what they "
             "measured")
    ok = sum(r.ok for r in results)
    if job is not None:
        echo(f"{ok}/{len(results)} buckets tuned in {time.monotonic() - t_start:.0f} s")
    if cpu:
        echo(CPU_NOTE)
    if not paths.table.exists():
        echo(f"no table written: no bucket of the grid was tuned ({paths.table} does not exist)")
        return 1
    specs = job.specs if job is not None else tuple(grid)
    tuned = next((r.bucket.representative for r in results if r.ok), specs[0] if specs else None)
    if tuned is not None:
        for line in where_the_table_is_used(paths.table, tuned) + smoke_note(specs, cpu):
            echo(line)
    return 0 if ok == len(results) else 1


def _stopping(say=None, what: str = "the measuring process and writing the finished buckets") -> None:
    """The first thing after Ctrl-C or SIGTERM: say so at once."""
    (say or echo)(f"{PROG}: interrupted: stopping {what}")


def _ignore_interrupts() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


_signalled = False  # set by _interrupt, reset by interrupts_stop_the_run


def _interrupt(signum, frame) -> None:
    """Ctrl-C or SIGTERM: KeyboardInterrupt, once; a second one must not break the few seconds
    of writing what is finished, so both are ignored from now on, to the end of the process."""
    global _signalled
    _signalled = True
    _ignore_interrupts()
    raise KeyboardInterrupt


def is_interrupt(e: BaseException) -> bool:
    """``e`` ends the run as an interrupt: a KeyboardInterrupt, or whatever a library's cleanup
    raised in its place (Optuna's journal lock, interrupted in ``release``, raises
    FileNotFoundError) once a signal came."""
    return isinstance(e, KeyboardInterrupt) or _signalled


@contextlib.contextmanager
def interrupts_stop_the_run():
    """SIGTERM (timeout, Slurm, docker stop, systemd) ends a run as Ctrl-C does: the finished
    buckets are written. The handlers are restored afterwards unless one came (the process is
    then ending; a late signal must not cut it short)."""
    global _signalled
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _signalled = False
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in saved:
        signal.signal(sig, _interrupt)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is _interrupt:  # no interrupt came
            for sig, handler in saved.items():
                signal.signal(sig, handler)


def _export_interrupted(storage, job, paths) -> None:
    """An interrupted run still writes the buckets it finished into the table."""
    if storage is None or job is None:
        return
    from . import job as J

    try:
        ex = J.export(storage, job, paths.table.parent, warn=echo)
    except Exception as e:
        echo(f"{PROG}: could not write the finished buckets: {e}")
        return
    if ex.table is not None:
        echo(f"{sum(r.ok for r in ex.results)} finished bucket(s) written to {ex.table}")


def _supervise(args, slots, storage, storage_url: str, job, work_dir: Path, compile_workers: int,
               progress=None) -> dict[int, int]:
    """One ``worker`` process per slot on ``job``; the trials of one that dies are completed from
    the log or queued again at once. Returns each slot's exit code."""
    from . import job as J
    from . import search
    from .devices import Supervisor, worker_command
    from .study import OutputPaths

    commands = [worker_command(s, storage=storage_url, job=job.name, work_dir=work_dir,
                               compile_workers=compile_workers, isolation=args.isolation, hook=args.inject_hook)
                for s in slots]

    def recover() -> None:
        pinned = J.pinned(storage, job.name)  # None: no worker joined, so none held a trial
        if pinned is not None:
            log = OutputPaths.for_device(pinned.device.name, work_dir).jsonl  # the workers' shared log
            J.each_study(storage, job, lambda study, name: search.recover_dead(
                study, name, storage=storage, storage_url=storage_url, log_path=log, grace=job.heartbeat.grace,
                echo=echo))

    return Supervisor(slots, commands, echo=echo, recover=recover, progress=progress).run()


def _one_slot(slot, isolation: str) -> str:
    """The device of a run with one --devices slot, in this process: its subprocesses (measuring,
    compiling) see only the slot's GPU; measured inline, this process (whose CUDA is already
    initialised) opens that GPU by index."""
    if slot.device == "cuda" and isolation == "inline":
        return slot.label
    os.environ.update(slot.env)
    return slot.device


def run_tune(args, device: str) -> int:
    from .devices import parse_devices

    if args.devices and args.device:
        raise UsageError(f"{PROG}: error: --device and --devices: give one of them")
    slots = parse_devices(args.devices) if args.devices else None
    cpu = device == "cpu"
    specs = _specs(args, cpu)
    _limits(args)  # usage errors first, before anything is printed or started
    _check_hook(args.inject_hook)
    if args.storage is not None:
        from .study import check_url

        check_url(args.storage)
    from tsdecode.config.tables import user_tables_dir

    if args.out:
        table_dir = work_dir = _folder(Path(args.out), "--out")
    else:
        table_dir = _folder(user_tables_dir(), "the user cache folder")
        work_dir = _folder(user_tables_dir().parent / "tuning", "the user cache folder")
    _quiet_optuna()
    if cpu:
        echo("=" * 78 + "\n" + CPU_NOTE + "\n" + "=" * 78)
    if slots is not None and len(slots) > 1:
        return _tune_supervised(args, slots, specs, table_dir, work_dir, cpu)
    if slots is not None:  # one device: this process is its worker, as without --devices
        device = _one_slot(slots[0], args.isolation)
    return _tune_here(args, device, specs, table_dir, work_dir, cpu)


def _tune_here(args, device: str, specs, table_dir: Path, work_dir: Path, cpu: bool) -> int:
    """The run in this process: one worker (a measuring subprocess and a compile pool)."""
    from . import job as J
    from . import runner, search
    from .study import OutputPaths

    compile_workers = _compile_workers(args, 1, cpu)
    settings, heartbeat = _settings(args, cpu, max(1, compile_workers))
    t_start = time.monotonic()
    client = pool = tuner = lock = storage = job = paths = None
    results: list = []
    try:
        client, hello = _start_client(args, device, args.check_requests, args.replay_ms)
        identity = _identity(hello)
        props, copy_bw = identity.device, identity.copy_bandwidth_gbs
        paths = OutputPaths.for_device(props.name, table_dir, work_dir, args.storage)
        lock, storage = _open_run_storage(paths, heartbeat, paths.jsonl)  # first: a refused run says only why
        echo(f"device: {props.describe()}; copy bandwidth {copy_bw:.0f} GB/s"
             + (" (host memory, wall-clock)" if cpu else ""))
        _say_where(args, specs, paths)
        job = _define_job(args, storage, specs, settings, heartbeat, props, paths.table, cpu)
        if job is not None:
            J.pin(storage, job.name, identity)
            echo(f"job: {job.name} (other hosts join with: {join_command(paths.storage, job.name)})")
            if compile_workers > 0:
                pool = runner.CompilePool(compile_workers, device, args.inject_hook)
            tuner = search.Tuner(settings, client, device=props, copy_bandwidth_gbs=copy_bw, paths=paths,
                                 storage=storage, pool=pool, progress=not args.no_progress, echo=echo,
                                 heartbeat=heartbeat, previous=job.previous,
                                 on_study=lambda b, n: J.record_study(storage, job.name, b, n))
            tuner.log.write({"kind": "run", "device": props.to_dict(), "copy_bandwidth_gbs": copy_bw,
                             "settings": settings.to_dict(), "worker_pid": hello["pid"], "job": job.name,
                             **J.tuner_settings(job, identity)})
            results = tuner.run(job.buckets, started=job.started)
    except runner.WorkerUnavailable as e:
        echo(f"{PROG}: error: {e}")
        if lock is not None:
            lock.release()
        return 1
    except BaseException as e:
        interrupted = is_interrupt(e)
        if interrupted:
            _stopping()
            if client is not None:
                client.close(wait=False)
            _export_interrupted(storage, job, paths)
        if lock is not None:
            lock.release()
        if interrupted:
            echo(f"{PROG}: interrupted; finished trials are saved, rerun the same command to resume")
            return 130
        raise
    finally:
        late = None  # an interrupt while closing: the search is over, its buckets are still written
        try:
            if pool is not None:
                pool.close(wait=False)
            if client is not None:
                client.close()
            if tuner is not None:
                tuner.close()
        except BaseException as e:
            if not is_interrupt(e):
                raise
            late = e
    try:
        if late is not None:
            return _interrupted_after_search(storage, job, paths)
        extra = []
        if pool is not None and pool.compiled:
            extra.append(f"precompiled {pool.compiled} candidates in {compile_workers} processes ({pool.busy_s:.0f} s "
                         "of compile work)")
        if tuner is not None and tuner.measured_now:
            extra.append(f"the measuring process checked and timed {tuner.measured_now} valid candidates; preparing "
                         f"their kernels (compiling those not precompiled) took {tuner.plan_s:.0f} s")
        return _finish(storage, job, paths, results, t_start, cpu, extra, grid=specs)
    except BaseException as e:
        if not is_interrupt(e):
            raise
        return _interrupted_after_search(storage, job, paths)
    finally:
        lock.release()


def _tune_supervised(args, slots, specs, table_dir: Path, work_dir: Path, cpu: bool) -> int:
    """The run as one worker process per slot, all on the job's studies; this process defines
    the job, reports progress and writes the table at the end."""
    from . import job as J
    from .devices import probe
    from .study import OutputPaths, ResultLog

    props_list = probe(slots)
    models = sorted({p.name for p in props_list})
    if len(models) > 1:
        raise UsageError(f"{PROG}: error: --devices {args.devices}: GPUs of several models ({', '.join(models)}); a "
                         "job tunes one model: pass the indices of one model's GPUs")
    props = props_list[0]
    compile_workers = _compile_workers(args, len(slots), cpu)
    settings, heartbeat = _settings(args, cpu, max(1, compile_workers))
    t_start = time.monotonic()
    paths = OutputPaths.for_device(props.name, table_dir, work_dir, args.storage)
    lock, storage = _open_run_storage(paths, heartbeat, paths.jsonl)  # first: a refused run says only why
    try:
        echo(f"devices: {len(slots)} x {props.describe()}: {', '.join(s.label for s in slots)}; {compile_workers} "
             f"compile process{'es' if compile_workers != 1 else ''} per worker")
        _say_where(args, specs, paths)
        job = _define_job(args, storage, specs, settings, heartbeat, props, paths.table, cpu)
        if job is None:
            return _finish(storage, None, paths, [], t_start, cpu, grid=specs)
        echo(f"job: {job.name} (other hosts join with: {join_command(paths.storage, job.name)})")
        log = ResultLog(paths.jsonl)
        log.write({"kind": "run", "device": props.to_dict(), "settings": settings.to_dict(), "job": job.name,
                   "workers": [s.label for s in slots]})
        log.close()
        progress = None if args.no_progress else J.JobProgress(storage, job, props).line
        try:
            codes = _supervise(args, slots, storage, paths.storage, job, work_dir, compile_workers, progress)
        except KeyboardInterrupt:  # the supervisor stopped the workers and said so
            _export_interrupted(storage, job, paths)
            echo(f"{PROG}: interrupted; finished trials are saved, rerun the same command to resume")
            return 130
        try:
            if progress is not None:
                echo(progress())
        except BaseException as e:
            if not is_interrupt(e):
                raise
            return _interrupted_after_search(storage, job, paths)
        refused = [slots[i].label for i, rc in codes.items() if rc == 2]
        rc = _finish(storage, job, paths, None, t_start, cpu, grid=specs)
        return 2 if len(refused) == len(slots) else rc
    finally:
        lock.release()


def run_worker(args, device: str) -> int:
    """``tsdecode-tune worker``: join a job and tune its studies until every bucket is final."""
    import socket

    from . import job as J
    from . import runner, search
    from .buckets import TuneSettings
    from .devices import parse_devices, stop_with_supervisor
    from .study import OutputPaths

    if args.supervisor is not None:  # a --devices run's worker: it ends with that run
        stop_with_supervisor(args.supervisor)
    if args.devices and args.device:
        raise UsageError(f"{PROG}: error: --device and --devices: give one of them")
    _quiet_optuna()
    storage = _open(args.storage, must_exist=True)
    job = J.load_job(storage, args.job)
    _check_hook(args.inject_hook)
    from tsdecode.config.tables import user_tables_dir

    work_dir = _folder(Path(args.out) if args.out else user_tables_dir().parent / "tuning",
                       "--out" if args.out else "the user cache folder")
    slots = parse_devices(args.devices) if args.devices else None
    cpu = device == "cpu"
    J.check_kind(job, cpu)  # before anything is measured or pinned
    if slots is not None and len(slots) > 1:
        codes = _supervise(args, slots, _open(args.storage, job.heartbeat), args.storage, job, work_dir,
                           _compile_workers(args, len(slots), cpu))
        return max(codes.values(), default=0)
    if slots is not None:
        device = _one_slot(slots[0], args.isolation)
    label = args.label or f"{socket.gethostname()}/{device}"
    say = _labelled(label)
    storage = _open(args.storage, job.heartbeat, say=say)
    compile_workers = _compile_workers(args, 1, cpu)
    settings = TuneSettings.from_dict({**job.settings.to_dict(), "lookahead": max(1, compile_workers)})
    client = pool = tuner = None
    try:
        client, hello = _start_client(args, device, settings.check_requests, settings.replay_ms)
        identity = _identity(hello)
        J.pin(storage, job.name, identity)
        job = J.mark_started(storage, job)
        props = identity.device
        paths = OutputPaths.for_device(props.name, work_dir, work_dir, args.storage)
        say(f"worker {label} (pid {os.getpid()}): {props.describe()}; job {job.name}, {len(job.buckets)} buckets; "
            f"trial log {paths.jsonl}")
        if compile_workers > 0:
            pool = runner.CompilePool(compile_workers, device, args.inject_hook)
        tuner = search.Tuner(settings, client, device=props, copy_bandwidth_gbs=identity.copy_bandwidth_gbs,
                             paths=paths, storage=storage, storage_url=args.storage, pool=pool,
                             progress=not args.no_progress, echo=say, label=label, heartbeat=job.heartbeat,
                             previous=job.previous, on_study=lambda b, n: J.record_study(storage, job.name, b, n),
                             write_csv=False)
        tuner.log.write({"kind": "worker", "label": label, "pid": os.getpid(), "worker_pid": hello["pid"],
                         "job": job.name, "device": props.to_dict(), "copy_bandwidth_gbs": identity.copy_bandwidth_gbs})
        results = tuner.run(job.buckets, started=job.started)
    except runner.WorkerUnavailable as e:
        say(f"{PROG}: error: {e}")
        return 1
    except BaseException as e:
        if not is_interrupt(e):
            raise
        _stopping(say=say, what="the measuring process")
        if client is not None:
            client.close(wait=False)
        say(f"{PROG} worker: interrupted; the next run or worker of the job queues its unfinished trials again")
        return 130
    finally:
        if pool is not None:
            pool.close(wait=False)
        if client is not None:
            client.close()
        if tuner is not None:
            tuner.close()
    say(f"job {job.name}: every bucket is final ({sum(r.ok for r in results)} tuned); this worker measured "
        f"{tuner.measured_now} configs")
    return 0


def run_export(args) -> int:
    """``tsdecode-tune export``: the job's table from what its workers found."""
    from tsdecode.config.tables import kernel_source_hash, user_tables_dir

    from . import job as J
    from .buckets import summary_table

    _quiet_optuna()
    storage = _open(args.storage, must_exist=True)
    job = J.load_job(storage, args.job)
    table_dir = _folder(Path(args.out) if args.out else user_tables_dir(),
                        "--out" if args.out else "the user cache folder")
    identity = J.pinned(storage, job.name)
    if identity is not None and identity.kernel_hash != kernel_source_hash():
        echo(f"warning: the job was measured with kernel {identity.kernel_hash}, this tsdecode has "
             f"{kernel_source_hash()}: the table records the job's, and this installation will call it stale")
    try:
        ex = J.export(storage, job, table_dir, warn=echo)
    except ValueError as e:  # the folder holds another device's table
        raise UsageError(f"{PROG} export: error: {e}") from None
    print(summary_table(ex.results))
    ok = sum(r.ok for r in ex.results)
    pending = sum(r.pending for r in ex.results)
    echo(f"job {job.name}: {ok} of {len(ex.results)} buckets tuned"
         + (f", {pending} not finished yet" if pending else ""))
    if ex.table is None:
        echo("no table written: no bucket of the job is finished yet" if identity is not None
             else f"no table written: no worker has joined job {job.name} yet")
        return 1
    tuned = next(r.bucket.representative for r in ex.results if r.ok)
    for line in where_the_table_is_used(ex.table, tuned):
        echo(line)
    return 0


def run_create(args) -> int:
    """``tsdecode-tune create``: define a job in a storage (workers pin it to their GPU model)."""
    from . import job as J

    cpu = args.kind == "cpu"
    if args.storage is None:
        raise UsageError(f"{PROG} create: error: --storage is required (the storage the workers share)")
    specs = _specs(args, cpu)
    _quiet_optuna()
    settings, heartbeat = _settings(args, cpu, 1)
    storage = _open(args.storage)
    name = args.job if args.job is not None else J.default_job_name(specs, settings, "")
    job = J.save_job(storage, J.Job(name, tuple(specs), settings, heartbeat, interpreter=cpu))
    print(job.name)
    echo(f"job {job.name}: {len(specs)} shapes in {len(job.buckets)} buckets; workers join with: "
         f"{join_command(args.storage, job.name)} [--devices all]")
    return 0
