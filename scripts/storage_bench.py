"""Contention of Optuna storages under several tuning workers: ``python scripts/storage_bench.py``.

Each of N processes runs the tuner's storage traffic for one trial, K times, on one shared study:
``ask`` (a new trial over KernelConfig-sized categorical distributions), three user attributes
(the fitted key, the worker, the config), one read of the study's trials (the duplicate check),
and ``tell``. The rate is all processes' trials over the wall time from a common start. A second
phase measures the trial queue: N processes pop the study's WAITING trials (what every worker
does with a grid study) and any trial popped by two processes is counted ("double pops"). A
storage named "sqlite-nolock" is SQLite without the tuner's queue lock (``study.queue_lock``).

The numbers behind the tuner's default storage (docs/tuning.md) come from this script; its runs
are in docs/perf-notes.md.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tuner.arguments import ToolError, int_list_type, positive_int  # noqa: E402

DISTS = {"block_n": [16, 32, 64, 128, 256], "block_m": [16, 32], "num_kv_splits": [1, 2, 4, 8, 16, 32],
         "num_warps": [1, 2, 4, 8], "num_stages": [1, 2, 3, 4, 5]}


def _open(url: str):
    from tuner.study import open_storage

    return open_storage(url.removeprefix("nolock:"))


def _ask_tell(url: str, study_name: str, trials: int, barrier, out) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from optuna.distributions import CategoricalDistribution

    from tuner.study import queue_lock

    study = optuna.load_study(study_name=study_name, storage=_open(url),
                              sampler=optuna.samplers.RandomSampler(seed=os.getpid()))
    dists = {k: CategoricalDistribution(v) for k, v in DISTS.items()}
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(trials):
        with queue_lock(url):
            trial = study.ask(dists)
        for key, value in (("key", str(trial.params)), ("worker", os.getpid()), ("config", trial.params)):
            trial.set_user_attr(key, value)
        study.get_trials(deepcopy=False)
        study.tell(trial, 1.0)
    out.put(time.perf_counter() - t0)


def _pop(url: str, study_name: str, barrier, out) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from tuner.study import pop_waiting, queue_lock

    study = optuna.load_study(study_name=study_name, storage=_open(url))
    barrier.wait()
    popped, errors = [], 0
    while True:
        try:
            with queue_lock(url):
                trial_id = pop_waiting(study)
        except Exception:  # e.g. "database is locked"
            errors += 1
            continue
        if trial_id is None:
            break
        popped.append(trial_id)
    out.put((popped, errors))


def run(url: str, processes: int, trials: int) -> dict[str, float]:
    """Ask/tell rate (trials/s over all processes) and the queue phase's double pops."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = f"bench-{processes}-{time.time_ns()}"
    study = optuna.create_study(study_name=name, storage=_open(url))
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(processes + 1), ctx.Queue()
    procs = [ctx.Process(target=_ask_tell, args=(url, name, trials, barrier, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    barrier.wait()
    t0 = time.perf_counter()
    for _ in procs:
        out.get()
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    for _ in range(trials * processes // 2):
        study.enqueue_trial({k: v[0] for k, v in DISTS.items()})
    barrier = ctx.Barrier(processes + 1)
    procs = [ctx.Process(target=_pop, args=(url, name, barrier, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    barrier.wait()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    ids = [i for popped, _ in results for i in popped]
    return {"trials_per_s": trials * processes / wall, "double_pops": len(ids) - len(set(ids)),
            "pop_errors": sum(e for _, e in results), "queued": trials * processes // 2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/storage_bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage", action="append", default=None,
                        help="storage URL or 'journal' / 'sqlite' / 'sqlite-nolock' (a fresh file in a temporary "
                             "folder); repeatable (default: journal, sqlite and sqlite-nolock)")
    parser.add_argument("--processes", type=int_list_type, default="1,2,4,8",
                        help="process counts (default %(default)s)")
    parser.add_argument("--trials", type=positive_int, default=60, help="trials per process (default %(default)s)")
    args = parser.parse_args(argv)
    counts = args.processes
    for storage in args.storage or []:
        if storage not in ("journal", "sqlite", "sqlite-nolock"):
            try:
                _open(storage)
            except ToolError as e:
                parser.error(f"--storage {storage}: {e}")
    with tempfile.TemporaryDirectory() as tmp:
        print("storage,processes,trials_per_s,double_pops,pop_errors,queued", flush=True)
        for storage in args.storage or ["journal", "sqlite", "sqlite-nolock"]:
            for n in counts:
                url = {"journal": str(Path(tmp) / f"j{n}.journal"), "sqlite": f"sqlite:///{Path(tmp) / f's{n}.db'}",
                       "sqlite-nolock": f"nolock:sqlite:///{Path(tmp) / f'u{n}.db'}"}.get(storage, storage)
                r = run(url, n, args.trials)
                shown = storage.split("@")[-1] if "://" in storage else storage
                print(f"{shown},{n},{r['trials_per_s']:.1f},{r['double_pops']},{r['pop_errors']},{r['queued']}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
