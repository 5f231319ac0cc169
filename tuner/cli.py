"""``tsdecode-tune`` / ``python -m tuner``: tune the decode kernel for this GPU and write its table.

Subcommands: ``tune`` (the default: ``tsdecode-tune --preset llama3-8b`` means
``tsdecode-tune tune --preset llama3-8b``), ``explain`` (which table entry and config a shape
gets) and ``report`` (delegated to ``tuner.report`` when it is installed). See docs/tuning.md.

Without a CUDA GPU (or with ``--device cpu``) the kernels run in Triton's interpreter: ``main``
checks ``torch.cuda.is_available()`` first and sets TRITON_INTERPRET=1 before anything imports
triton (this module imports neither tsdecode nor triton at import time for that reason). Timings
are then wall-clock and meaningless; the mode exists to exercise the pipeline (tests).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

PROG = "tsdecode-tune"
SUBCOMMANDS = ("tune", "explain", "report")
CPU_NOTE = (
    "NOTE: no CUDA GPU in use: kernels run in Triton's interpreter on the CPU. Timings are "
    "wall-clock and MEANINGLESS; the table written only exercises the pipeline."
)


class UsageError(Exception):
    """A bad command line or grid: exit code 2 with the message on stderr."""


# ---------------------------------------------------------------------------------------------
# Device selection (before triton is imported)
# ---------------------------------------------------------------------------------------------


def _requested_device(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return None


def select_device(argv: list[str]) -> str:
    """"cuda" (or the requested cuda:N) when a GPU is usable, else "cpu" with the interpreter on.

    Must run before anything imports triton: triton decides at ``@triton.jit`` time whether
    kernels are interpreted.
    """
    import torch

    requested = _requested_device(argv)
    if requested is not None and not requested.startswith("cpu"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {requested}: CUDA is not available")
        return requested
    if requested is None and torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        if "tsdecode.kernels.decode" in sys.modules:
            raise UsageError("CPU mode needs TRITON_INTERPRET=1 before tsdecode's kernels are "
                             "imported; set it in the environment")
        os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


# ---------------------------------------------------------------------------------------------
# Parsers
# ---------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # exit 2 with a clear one-line message, no traceback
        raise UsageError(f"{self.prog}: error: {message}")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def _bounded(kind: type, minimum: float, strict: bool):
    """An argparse type: ``kind`` (int or float; finite) at least ``minimum`` (above it if
    ``strict``)."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not math.isfinite(value):  # nan, inf: "no limit" is spelled by leaving the flag out
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(
                f"expected {noun} {'>' if strict else '>='} {minimum}, got {text!r}"
            )
        return value

    return parse


_positive_float = _bounded(float, 0, strict=True)
_positive_int = _bounded(int, 1, strict=False)
_nonneg_int = _bounded(int, 0, strict=False)


def add_tune_arguments(p: argparse.ArgumentParser, cpu: bool) -> None:
    from .grids import add_grid_arguments

    add_grid_arguments(p)
    s = p.add_argument_group("search")
    s.add_argument("--trials", type=_positive_int, default=4 if cpu else 48,
                   help="configs measured per bucket (duplicates after fitting to the shape do "
                        "not count; default %(default)s)")
    s.add_argument("--time-budget", type=_positive_float, default=None, metavar="SECONDS",
                   help="wall-clock budget of the whole search, shared evenly by the buckets "
                        "still to tune (default: none)")
    s.add_argument("--seed", type=int, default=0, help="sampler seed (default %(default)s)")
    s.add_argument("--top-k", type=_nonneg_int, default=3,
                   help="best configs re-timed against the default at the end (default %(default)s)")
    s.add_argument("--retime-rounds", type=_positive_int, default=2 if cpu else 5,
                   help="interleaved re-timing rounds (default %(default)s)")
    s.add_argument("--stale-only", action="store_true",
                   help="tune only the grid's buckets that the output table lacks or holds timed "
                        "against another heuristic default or kernel than today's (e.g. after "
                        "upgrading tsdecode); the others keep their entries")
    for name, choices in (("block-n", "BLOCK_N_CHOICES"), ("block-m", "BLOCK_M_CHOICES"),
                          ("num-kv-splits", None), ("num-warps", "NUM_WARPS_CHOICES"),
                          ("num-stages", "NUM_STAGES_CHOICES")):
        s.add_argument(f"--{name}", type=_int_list, default=None, metavar="LIST",
                       help=f"restrict {name.replace('-', '_')} to these values" +
                            (" (default: per shape)" if choices is None else "") +
                            (" (default: below 16 only at 1-2 query rows a KV head)"
                             if name == "block-m" else ""))
    m = p.add_argument_group("measurement")
    m.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    m.add_argument("--trial-timeout", type=_positive_float, default=900.0 if cpu else 300.0,
                   metavar="SECONDS", help="per-candidate limit; a candidate past it is pruned "
                                           "and the worker restarted (default %(default)s)")
    m.add_argument("--replay-ms", type=_positive_float, default=80.0,
                   help="CUDA-graph replay time per measurement (default %(default)s)")
    m.add_argument("--check-requests", type=_positive_int, default=2,
                   help="requests checked against the float64 reference on GPU (default %(default)s; "
                        "CPU checks all)")
    m.add_argument("--compile-workers", type=_nonneg_int, default=None,
                   help="processes precompiling candidates while others are measured (default: "
                        "min(8, CPUs - 4) on GPU, 0 on CPU; 0 disables)")
    m.add_argument("--isolation", choices=("process", "inline"), default="process",
                   help="measure in a restartable worker process (default) or in this process")
    m.add_argument("--inject-hook", default=None, metavar="MODULE:FUNC",
                   help="testing: call FUNC(stage, spec, config, out=None) at stages compile/plan/"
                        "output; raising fails the candidate")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, metavar="DIR",
                   help="output folder for the table, trial log/CSV and study DB (default: the "
                        "user table folder, tables.user_config_dir())")
    o.add_argument("--storage", default=None,
                   help="Optuna storage URL (default sqlite:///<out>/<gpu>_study.db; a path ending "
                        "in .journal uses a journal file)")
    o.add_argument("--no-progress", action="store_true", help="no progress bars/lines")


def add_explain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=_positive_int, required=True)
    p.add_argument("--kv-len", type=_positive_int, required=True)
    p.add_argument("--heads", default="32:8", help="HQ:HKV (default %(default)s)")
    p.add_argument("--head-dim", type=_positive_int, default=128)
    p.add_argument("--page-size", type=_positive_int, default=16)
    p.add_argument("--seq-len-q", type=_positive_int, default=1)
    p.add_argument("--packed", action="store_true")
    p.add_argument("--mask", choices=("dense", "causal"), default="dense")
    p.add_argument("--window-left", type=int, default=-1)
    p.add_argument("--q-dtype", default="bfloat16")
    p.add_argument("--kv-dtype", default=None)
    p.add_argument("--o-dtype", default=None)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--config-dir", default=None, help="table file or folder searched first")


def build_parser(cpu: bool) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, description="Tune tsdecode's decode kernel on this GPU and write its config "
        "table. The default subcommand is 'tune'.",
        epilog="Examples: tsdecode-tune --preset llama3-8b --time-budget 300 | "
               "tsdecode-tune explain --batch-size 8 --kv-len 8192 | tsdecode-tune report --help",
    )
    sub = parser.add_subparsers(dest="command", metavar="{tune,explain,report}", parser_class=_Parser)
    add_tune_arguments(sub.add_parser("tune", help="search configs and write the table (default)"), cpu)
    add_explain_arguments(sub.add_parser("explain", help="which table entry and config a shape gets"))
    sub.add_parser("report", help="benchmark reports (tuner.report; see tsdecode-tune report --help)",
                   add_help=False)
    return parser


# ---------------------------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------------------------


def _limits(args):
    from .search import SpaceLimits

    from tsdecode import configs as C

    fields = {}
    for name, allowed in (("block_n", C.BLOCK_N_CHOICES), ("block_m", C.BLOCK_M_CHOICES),
                          ("num_warps", C.NUM_WARPS_CHOICES), ("num_stages", C.NUM_STAGES_CHOICES)):
        values = getattr(args, name)
        if values is None:
            continue
        bad = [v for v in values if v not in allowed]
        if bad:
            raise UsageError(f"{PROG}: error: --{name.replace('_', '-')} {bad} not in {list(allowed)}")
        fields[name] = tuple(sorted(set(values)))
    if args.num_kv_splits is not None:
        bad = [v for v in args.num_kv_splits if not 1 <= v <= C.MAX_NUM_KV_SPLITS]
        if bad:
            raise UsageError(f"{PROG}: error: --num-kv-splits {bad} not in [1, {C.MAX_NUM_KV_SPLITS}]")
        fields["num_kv_splits"] = tuple(sorted(set(args.num_kv_splits)))
    return SpaceLimits(**fields)


def _no_grid_given(args) -> bool:
    return not (args.preset or args.grid_file or args.batch_sizes or args.kv_lens)


def _output_dir(args) -> Path:
    """--out (default: the user table folder), created now: before the worker starts, so that a
    path that cannot be a folder is a usage error."""
    from tsdecode import tables

    out_dir = Path(args.out) if args.out else tables.user_config_dir()
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{PROG}: error: --out {out_dir}: exists and is not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{PROG}: error: --out {out_dir}: cannot create the folder "
                         f"({e.strerror or e})") from None
    return out_dir


def run_tune(args, device: str) -> int:
    cpu = device == "cpu"
    from .grids import specs_from_args

    if cpu and _no_grid_given(args):
        args.preset = ["smoke"]
    try:
        specs = specs_from_args(args)
    except (ValueError, OSError) as e:  # bad preset, list, TOML file or empty grid
        raise UsageError(f"{PROG}: error: {e}") from None
    limits = _limits(args)
    if cpu and any(s.batch_size * s.kv_len > 1 << 16 for s in specs):
        print(f"{PROG}: warning: shapes this large take very long in the interpreter (and their "
              "timings mean nothing); the smoke preset is meant for CPU runs", file=sys.stderr)
    if args.inject_hook:
        from .runner import load_hook

        try:
            load_hook(args.inject_hook)
        except Exception as e:
            raise UsageError(f"{PROG}: error: --inject-hook: {e}") from None
    out_dir = _output_dir(args)

    import warnings

    import optuna

    from . import runner, search

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    echo = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if cpu:
        echo("=" * 78 + "\n" + CPU_NOTE + "\n" + "=" * 78)

    compile_workers = args.compile_workers
    if compile_workers is None:
        # Leave cores to the measuring worker and this process (host jitter delays replays).
        compile_workers = 0 if cpu else max(0, min(8, (os.cpu_count() or 1) - 4))
    settings = search.TuneSettings(
        trials=args.trials, time_budget=args.time_budget, seed=args.seed, top_k=args.top_k,
        retime_rounds=args.retime_rounds, trial_timeout=args.trial_timeout,
        lookahead=max(1, compile_workers), limits=limits,
        timing="wall" if cpu else "cuda-graph", replay_ms=args.replay_ms,
        check_requests=args.check_requests,
    )
    buckets = search.group_buckets(specs)
    options = runner.WorkerOptions(device=device, hook=args.inject_hook,
                                   check_requests=args.check_requests, replay_ms=args.replay_ms)
    t_start = time.monotonic()
    client = pool = tuner = None
    try:
        if args.isolation == "process":
            client = runner.WorkerClient(options)
            hello = client.start()
        else:
            client = runner.InlineClient(options)
            hello = client.call("hello")
        device_info = runner.device_info_from_dict(hello["device"])
        copy_bw = hello["copy_bandwidth_gbs"]
        paths = search.OutputPaths.for_device(out_dir, device_info.name, args.storage)
        echo(f"device: {device_info.describe()}; copy bandwidth {copy_bw:.0f} GB/s"
             + (" (host memory, wall-clock)" if cpu else ""))
        echo(f"grid: {len(specs)} shapes in {len(buckets)} buckets; {args.trials} configs per "
             f"bucket" + (f", time budget {args.time_budget:.0f} s" if args.time_budget else ""))
        echo(f"output: {paths.table}\n        {paths.jsonl}\n        {paths.csv}\n"
             f"storage: {paths.storage}")
        if compile_workers > 0:
            pool = runner.CompilePool(compile_workers, device, args.inject_hook)
        run_info = {"device_name": device_info.name, "interpreter": cpu,
                    "triton": hello["triton"], "torch": hello["torch"],
                    "grid": [s.name for s in specs]}
        tuner = search.Tuner(settings, client, device_info=device_info, copy_bandwidth_gbs=copy_bw,
                             paths=paths, pool=pool, progress=not args.no_progress, echo=echo,
                             run_info=run_info, shared_memory_per_sm=hello["shared_memory_per_sm"])
        tuner.log.write({"kind": "run", "device": device_info.to_dict(), "copy_bandwidth_gbs": copy_bw,
                         "settings": settings.to_dict(), "worker_pid": hello["pid"], **run_info})
        if args.stale_only:
            stale = tuner.stale_buckets(buckets)
            echo(f"--stale-only: {len(buckets) - len(stale)} of {len(buckets)} buckets up to date "
                 f"in {paths.table}; tuning {len(stale)}")
            buckets = stale
        results = tuner.run(buckets)
    except runner.WorkerUnavailable as e:
        echo(f"{PROG}: error: {e}")
        return 1
    except search.StudyBusy as e:
        raise UsageError(f"{PROG}: error: {e}") from None
    except KeyboardInterrupt:
        echo(f"{PROG}: interrupted; finished trials are saved, rerun the same command to resume")
        return 130
    finally:
        if pool is not None:
            pool.close(wait=False)
        if client is not None:
            client.close()
        if tuner is not None:
            tuner.close()
    elapsed = time.monotonic() - t_start
    print(search.summary_table(results))
    if pool is not None and pool.compiled:
        echo(f"precompiled {pool.compiled} candidates in {compile_workers} processes "
             f"({pool.busy_s:.0f} s of compile work)")
    if tuner.measured_now:
        echo(f"the measuring worker planned {tuner.measured_now} valid candidates in "
             f"{tuner.plan_s:.0f} s (compiling what was not precompiled)")
    ok = sum(r.ok for r in results)
    echo(f"{ok}/{len(results)} buckets tuned in {elapsed:.0f} s; table {paths.table}")
    if cpu:
        echo(CPU_NOTE)
    return 0 if ok == len(results) else 1


def run_explain(args, device: str) -> int:
    import torch

    from tsdecode import tables

    from .grids import DTYPES

    try:
        hq, hkv = (int(x) for x in args.heads.split(":"))
    except ValueError:
        raise UsageError(f"{PROG} explain: error: --heads expects HQ:HKV like 32:8, got {args.heads!r}") from None

    def dtype(name):
        if name is None:
            return None
        if name not in DTYPES:
            raise UsageError(f"{PROG} explain: error: unknown dtype {name!r}; one of {list(DTYPES)}")
        return DTYPES[name]

    try:
        text = tables.explain(
            args.batch_size, args.kv_len, hq, hkv, args.head_dim, args.page_size,
            seq_len_q=args.seq_len_q, packed=args.packed, mask_type=args.mask,
            window_left=args.window_left, q_dtype=dtype(args.q_dtype), kv_dtype=dtype(args.kv_dtype),
            o_dtype=dtype(args.o_dtype), device=torch.device(device), config_dir=args.config_dir,
        )
    except (ValueError, TypeError) as e:
        raise UsageError(f"{PROG} explain: error: {e}") from None
    print(text)
    return 0


def run_report(report_argv: list[str]) -> int:
    """Delegate to tuner.report (imported only here: it is optional)."""
    try:
        from . import report
    except ImportError as e:
        raise UsageError(f"{PROG} report: error: the report module is not available ({e})") from None
    parser = _Parser(prog=f"{PROG} report", description=(report.__doc__ or "").split("\n\n")[0])
    report.add_report_arguments(parser)
    return int(report.run_report(parser.parse_args(report_argv)) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        device = select_device(argv)  # first: decides TRITON_INTERPRET before triton is imported
        if argv and argv[0] == "report":  # its own parser, from tuner.report
            return run_report(argv[1:])
        if not argv or argv[0] not in SUBCOMMANDS + ("-h", "--help"):
            argv = ["tune"] + argv
        args = build_parser(device == "cpu").parse_args(argv)
        if args.command == "explain":
            return run_explain(args, device)
        return run_tune(args, device)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0) if isinstance(e.code, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())
