"""The flags of ``tsdecode-tune``'s subcommands (``report`` has its own, in ``tuner.report``),
and TUNE_WORDS, the plain-words glossary their help prints."""

from __future__ import annotations

import argparse

from .arguments import (PROG, Parser, UsageError, compile_workers, int_list_type, positive_int,
                        replay_ms, seconds_up_to_a_week, seconds_up_to_a_year, seed_int)


# The search-space flags: a KernelConfig field and what its values are.
SPACE_FLAGS = {"block_n": "K/V tile sizes in tokens", "block_m": "query-row tile sizes",
               "num_kv_splits": "numbers of K/V splits a request is cut into",
               "num_warps": "warps per program", "num_stages": "pipeline stages"}

# The words of tune's help and output, once in plain words (the tune and create --help).
DEFAULT_GRID_WORDS = ("Without --preset, --grid-file or --batch-sizes and --kv-lens, a run on the CPU tunes the "
                      "smoke preset (a few small test shapes, to try the tool); on a GPU it asks for a grid.")
TUNE_WORDS = (
    "Words: a bucket is a group of the grid's shapes tuned together and given one table entry (same dtypes, "
    "heads, head dim, page size, query mode and mask; batch size and K/V length rounded up to the same powers "
    "of two), written 'bucket (B, L)'. Each bucket is searched by one Optuna study: a series of trials, each "
    "measuring one kernel config; a study's 12-digit ID hashes what its times depend on (kernel, GPU model, "
    "shapes, space, settings, the default config), so a rerun finds it again. The default config is the one "
    "plans pick where no table has an entry (tsdecode's heuristic). Where the space is too large to try every "
    "config, the next configs are proposed by TPE, Optuna's default sampler, from the times measured so far. "
    "A config is fitted to a bucket's shapes before it runs (e.g. no more K/V splits than a request has K/V "
    "tiles); two configs that fit to the same one are measured once. The finalists are the best configs of "
    "a bucket, re-timed with the default config at the end. The measuring process is the child process that runs and times "
    "the candidates (restarted after a crash or timeout); it is not the 'worker' subcommand.")


def add_tune_arguments(p: argparse.ArgumentParser, cpu: bool, run: bool = True) -> None:
    """tune's flags; without ``run`` (create) only those the job records: the grid, the search and
    the measurement settings, --storage and --job, none of the device or output flags of a run."""
    from .grids import add_grid_arguments

    add_grid_arguments(p)
    s = p.add_argument_group("search")
    s.add_argument("--trials", type=positive_int, default=4 if cpu else 48,
                   help="configs measured per bucket (configs that fit to one already measured do not count; "
                        "default 48, on the CPU 4)")
    s.add_argument("--time-budget", type=seconds_up_to_a_year, default=None, metavar="SECONDS",
                   help="wall-clock budget of the whole search, shared evenly by the buckets still to tune")
    s.add_argument("--seed", type=seed_int, default=0, help="sampler seed (default %(default)s)")
    s.add_argument("--top-k", type=positive_int, default=3,
                   help="best configs of a bucket (the finalists) re-timed with the default config at the end "
                        "(default %(default)s)")
    s.add_argument("--retime-rounds", type=positive_int, default=2 if cpu else 5,
                   help="interleaved re-timing rounds (default 5, on the CPU 2)")
    if run:
        s.add_argument("--stale-only", action="store_true",
                       help="tune only the grid's buckets that the table lacks or holds timed against another "
                            "default config or kernel than today's (e.g. after upgrading tsdecode)")
    for name, what in SPACE_FLAGS.items():
        s.add_argument(f"--{name.replace('_', '-')}", type=int_list_type, default=None, metavar="LIST",
                       help=f"search only these {what} (KernelConfig.{name}; default: every value that can be "
                            "valid for the shape)")
    m = p.add_argument_group("measurement")
    if run:
        m.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
        m.add_argument("--devices", default=None, metavar="SPEC",
                       help="one worker process per device, all sharing the job's studies: 'all' (every visible "
                            "GPU), GPU indices like 0,1,3, or cpu:N (N interpreter workers, without a GPU)")
    m.add_argument("--trial-timeout", type=seconds_up_to_a_week, default=900.0 if cpu else 300.0, metavar="SECONDS",
                   help="per-candidate limit; a candidate past it is pruned and the measuring process restarted "
                        "(a rerun with a larger limit measures it again; default 300, on the CPU 900)")
    m.add_argument("--replay-ms", type=replay_ms, default=80.0,
                   help="CUDA-graph replay time per measurement (default %(default)s)")
    m.add_argument("--check-requests", type=positive_int, default=2,
                   help="requests checked against the float64 reference on GPU (default %(default)s; CPU "
                        "checks all)")
    if run:
        m.add_argument("--compile-workers", type=compile_workers, default=None,
                       help="processes precompiling candidates while others are measured, per worker (default: "
                            "(CPUs - 2 - 2 x workers) / workers, between 1 and 8, i.e. min(8, CPUs - 4) on one GPU; "
                            "0 on the CPU; 0 disables)")
    m.add_argument("--heartbeat-grace", type=seconds_up_to_a_week, default=None, metavar="SECONDS",
                   help="a running trial whose worker shows no sign of life for this long is failed and queued "
                        "again (with a PostgreSQL or SQLite storage; a journal file has no heartbeats; this host's "
                        "dead workers are noticed at once; default: 2 x --trial-timeout)")
    if run:
        add_run_arguments(m)
    o = p.add_argument_group("output" if run else "job")
    if run:
        o.add_argument("--out", default=None, metavar="DIR",
                       help="folder for the table, the trial log and CSV, and the study storage (default: the "
                            "table in the user cache folder, where plans find it, and the rest beside it in tuning/)")
        storage = ("where the trials are stored (Optuna): a journal file (a path ending in .journal; default: "
                   "<GPU>_study.journal in --out, else in the user cache folder's tuning/), sqlite:///FILE.db, or "
                   "postgresql://USER@HOST:PORT/DB to let workers of other hosts join")
    else:
        storage = ("required: the storage the workers share: a journal file (a path ending in .journal; one "
                   "host), sqlite:///FILE.db, or postgresql://USER@HOST:PORT/DB")
    o.add_argument("--storage", default=None, help=storage)
    o.add_argument("--job", default=None, metavar="NAME",
                   help=f"the job's name in the storage (default: run-<hash of the grid, settings"
                        f"{' and GPU model' if run else ''}>); other hosts join it with: tsdecode-tune worker "
                        "--storage URL --job NAME")
    if run:
        o.add_argument("--no-progress", action="store_true", help="no progress bars/lines")


def add_run_arguments(p) -> None:
    """--isolation and --inject-hook: how a tune or worker process measures."""
    p.add_argument("--isolation", choices=("process", "inline"), default="process",
                   help="measure in a separate measuring process, restarted after a crash or timeout "
                        "(default), or in this process")
    p.add_argument("--inject-hook", default=None, metavar="MODULE:FUNC",
                   help="testing: call FUNC(stage, spec, config, out=None) at the stages compile, plan, output "
                        "and time (a number returned at time replaces the measured time in us); raising fails "
                        "the candidate")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage", required=True, help="the job's study storage (URL or journal file)")
    p.add_argument("--job", required=True, metavar="NAME", help="the job to join")
    p.add_argument("--devices", default=None, metavar="SPEC",
                   help="one worker per device of this host: all, 0,1,3 or cpu:N (default: one worker on the "
                        "default device)")
    p.add_argument("--compile-workers", type=compile_workers, default=None,
                   help="compile processes per worker (default as for tune)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for this host's trial log (default: the user cache folder's tuning/)")
    add_run_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars/lines")
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)  # a supervisor's worker: its device
    p.add_argument("--label", default=None, help=argparse.SUPPRESS)  # ... and its name in messages
    p.add_argument("--supervisor", type=int, default=None, help=argparse.SUPPRESS)  # ... and the PID it ends with


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage", required=True, help="the job's study storage (URL or journal file)")
    p.add_argument("--job", required=True, metavar="NAME", help="the job whose table to write")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder of the table (default: the user cache folder, where plans find it)")


def add_create_arguments(p: argparse.ArgumentParser, cpu: bool) -> None:
    add_tune_arguments(p, cpu, run=False)
    p.add_argument("--for", dest="kind", choices=("gpu", "cpu"), default="gpu",
                   help="the workers' device kind: its defaults and timing method (default %(default)s)")


def add_explain_arguments(p: argparse.ArgumentParser) -> None:
    from .grids import DTYPES, INPUT_DTYPE_NAMES

    names, inputs = ", ".join(DTYPES), ", ".join(INPUT_DTYPE_NAMES)
    p.add_argument("--batch-size", type=positive_int, required=True, help="requests in the batch")
    p.add_argument("--kv-len", type=positive_int, required=True,
                   help="the wrapper's planned max_kv_len (its K/V capacity); for the one-shot op, the longest "
                        "request's K/V tokens")
    p.add_argument("--heads", default="32:8", help="query heads:K/V heads, HQ:HKV (default %(default)s)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="size of one head (default %(default)s)")
    p.add_argument("--page-size", type=positive_int, default=16,
                   help="tokens per page of the K/V cache (default %(default)s)")
    p.add_argument("--seq-len-q", type=positive_int, default=1,
                   help="query tokens per request; with --packed the most a request has (default %(default)s)")
    p.add_argument("--packed", action="store_true",
                   help="packed queries: requests have different numbers of query tokens (qo_indptr)")
    p.add_argument("--mask", choices=("dense", "causal"), default="dense",
                   help="dense: every query token sees all K/V tokens; causal: only those up to its own "
                        "position (default %(default)s)")
    p.add_argument("--window-left", type=int, default=-1,
                   help="sliding window, with --mask causal: each query token sees itself and at most this many "
                        "K/V tokens before it (default %(default)s: no window)")
    p.add_argument("--q-dtype", default="bfloat16", help=f"query dtype: one of {inputs} (default %(default)s)")
    p.add_argument("--kv-dtype", default=None, help=f"K/V cache dtype: one of {inputs} (default: as --q-dtype)")
    p.add_argument("--o-dtype", default=None, help=f"output dtype: one of {names} (default: as --q-dtype)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--config-dir", default=None, help="table file or folder searched first")


def build_parser(cpu: bool) -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Tune tsdecode's decode kernel on this device and write its config "
                    "table. The default subcommand is 'tune' (tsdecode-tune tune --help: its flags, and the "
                    "words its output uses).",
                    epilog="Examples: tsdecode-tune --preset llama3-8b --time-budget 300 | "
                           "tsdecode-tune explain --batch-size 8 --kv-len 8192 | tsdecode-tune report --help")
    sub = parser.add_subparsers(dest="command", metavar="{tune,worker,export,create,explain,report}",
                                parser_class=Parser)
    add_tune_arguments(sub.add_parser("tune", help="search configs and write the table (default)",
                                      description=f"{TUNE_WORDS} {DEFAULT_GRID_WORDS}"), cpu)
    add_worker_arguments(sub.add_parser(
        "worker", help="join a job in a shared storage and tune its studies",
        description="Join a job (a grid and its search settings, defined by tune or create) in a storage that "
                    "several processes or hosts share, and measure its trials on this host's GPU(s) until every "
                    "bucket is final; then any host writes the table with tsdecode-tune export. See "
                    "docs/tuning.md."))
    add_export_arguments(sub.add_parser(
        "export", help="write a job's table from its storage (also partial)",
        description="Write the table of a job from what its workers stored so far: the finished buckets "
                    "(exit 0), or nothing yet (exit 1). See docs/tuning.md."))
    add_create_arguments(sub.add_parser("create", help="define a job in a storage for workers to run",
                                        description="Define a job (the grid and the search and measurement settings) "
                                                    "in a storage, for workers to run: tsdecode-tune worker --storage "
                                                    "URL --job NAME. The device and output flags are the workers'. "
                                                    + TUNE_WORDS), cpu)
    add_explain_arguments(sub.add_parser("explain", help="which table entry and config a shape gets"))
    sub.add_parser("report", help="benchmark reports (see tsdecode-tune report --help)", add_help=False)
    return parser


def empty_value(parser: argparse.ArgumentParser, args: argparse.Namespace) -> UsageError | None:
    """The usage error for a flag given an empty value (``--out ""`` would mean the default
    folder, ``--devices ""`` one process): no flag takes one. (--job names its own rule.)"""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices[args.command]._actions:
        value = getattr(args, action.dest, None)
        if action.option_strings and action.dest != "job" and isinstance(value, str) and not value.strip():
            default = "" if action.required else " (leave the flag out for its default)"
            return UsageError(f"{PROG} {args.command}: error: {action.option_strings[0]}: expected a value, got "
                              f"{value!r}{default}")
    return None


def unknown_flags(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> UsageError:
    """The usage error for arguments ``command`` does not take; for a flag another subcommand
    takes (create has no device or output flags), which one."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        others = [name for name, p in sub.choices.items() if name != command and any(
            flag in a.option_strings and a.help != argparse.SUPPRESS for a in p._actions)]
        if others:
            owners = " and ".join([", ".join(others[:-1]), others[-1]] if len(others) > 1 else others)
            why = ("; create only defines the job: the workers that run it choose their device and output"
                   if command == "create" else "")
            return UsageError(f"{PROG} {command}: error: {flag} is a flag of {owners}, not of {command}{why}")
    return UsageError(f"{PROG}: error: unrecognized arguments: {' '.join(extra)}")
