"""``tsdecode-tune`` / ``python -m tuner``: tune the decode kernel for this device and write its table.

Subcommands: ``tune`` (the default: ``tsdecode-tune --preset llama3-8b`` means
``tsdecode-tune tune --preset llama3-8b``; ``--devices all`` runs a worker per GPU), ``worker``
(join a job in a shared storage, e.g. from another host), ``export`` (write a job's table from
its storage), ``create`` (define a job without running it), ``explain`` (which table entry and
config a shape gets) and ``report`` (benchmark reports, ``tuner.report``). Their flags are in
``tuner.parsers``; the four that run or define a job are in ``tuner.run``. See docs/tuning.md.

Without a CUDA GPU (or with ``--device cpu``) the kernels run in Triton's interpreter: ``main``
checks ``torch.cuda.is_available()`` first and sets TRITON_INTERPRET=1 before anything imports
triton (this module imports neither tsdecode nor triton at import time for that reason). Timings
are then wall-clock and meaningless; the mode exists to exercise the pipeline.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import sys

from .arguments import PROG, Parser, ToolError, UsageError
from .parsers import build_parser, empty_value, unknown_flags
from .run import interrupts_stop_the_run, is_interrupt, run_create, run_export, run_tune, run_worker

SUBCOMMANDS = ("tune", "worker", "export", "create", "explain", "report")
# What the tune subcommand needs beyond the runtime: the "tune" extra.
TUNE_EXTRA = ("optuna", "pandas", "filelock")


def require_tune_extra() -> None:
    """UsageError naming the install command if a module of the "tune" extra is missing."""
    missing = []
    for name in TUNE_EXTRA:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UsageError(f"{PROG}: error: the tuner needs {' and '.join(missing)}, not installed here: "
                         f'pip install "tsdecode[tune]"')


def _flag(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _requested_device(argv: list[str]) -> str | None:
    """--device, or "cpu" for --devices cpu[:N] (interpreter workers)."""
    devices = _flag(argv, "--devices")
    if devices is not None and _flag(argv, "--device") is None and devices.strip().startswith("cpu"):
        return "cpu"
    return _flag(argv, "--device")


def select_device(argv: list[str]) -> str:
    """"cuda" (or the requested cuda:N) when a GPU is usable, else "cpu" with the interpreter on.
    Runs before anything imports triton, which decides at ``@triton.jit`` time whether kernels are
    interpreted."""
    import torch

    requested = _requested_device(argv)
    if requested is not None and requested != "cpu":
        try:
            kind = torch.device(requested).type
        except RuntimeError:
            kind = None
        if kind != "cuda":
            raise UsageError(f"{PROG}: error: --device {requested}: expected cuda, cuda:N or cpu (--devices "
                             "cpu:N runs N CPU workers)")
        if not torch.cuda.is_available():
            raise UsageError(f"{PROG}: error: --device {requested}: torch finds no CUDA GPU here")
        return requested
    if requested is None and torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        if "tsdecode.kernels.decode" in sys.modules:
            raise UsageError("CPU mode needs TRITON_INTERPRET=1 before tsdecode's kernels are imported; "
                             "set it in the environment")
        os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


# ---------------------------------------------------------------------------------------------
# explain, report
# ---------------------------------------------------------------------------------------------


def run_explain(args, device: str) -> int:
    import torch

    import tsdecode

    from .grids import DTYPES, INPUT_DTYPE_NAMES

    try:
        hq, hkv = (int(x) for x in args.heads.split(":"))
    except ValueError:
        raise UsageError(f"{PROG} explain: error: --heads expects HQ:HKV like 32:8, got {args.heads!r}") from None
    if hq < 1 or hkv < 1 or hq % hkv:
        raise UsageError(f"{PROG} explain: error: --heads {args.heads}: HQ and HKV must be positive, HQ a multiple "
                         "of HKV")
    if args.window_left >= 0 and args.mask != "causal":
        raise UsageError(f"{PROG} explain: error: --window-left {args.window_left} needs --mask causal")

    def dtype(flag, name, allowed):
        if name is not None and name not in DTYPES:  # a known one it cannot take is refused below, named
            raise UsageError(f"{PROG} explain: error: {flag}: unknown dtype {name!r}; one of {list(allowed)}")
        return None if name is None else DTYPES[name]

    try:
        text = tsdecode.explain(
            args.batch_size, args.kv_len, hq, hkv, args.head_dim, args.page_size, seq_len_q=args.seq_len_q,
            packed=args.packed, mask_type=args.mask, window_left=args.window_left,
            q_dtype=dtype("--q-dtype", args.q_dtype, INPUT_DTYPE_NAMES),
            kv_dtype=dtype("--kv-dtype", args.kv_dtype, INPUT_DTYPE_NAMES),
            o_dtype=dtype("--o-dtype", args.o_dtype, DTYPES), device=torch.device(device),
            config_dir=args.config_dir)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise UsageError(f"{PROG} explain: error: {_as_explain_flags(str(e))}") from None
    print(text)
    return 0


# tsdecode.explain's parameters as the flags of the explain subcommand that set them.
EXPLAIN_FLAGS = {"batch_size": "--batch-size", "max_kv_len": "--kv-len", "kv_len": "--kv-len",
                 "head_dim": "--head-dim", "page_size": "--page-size", "max_seq_len_q": "--seq-len-q",
                 "seq_len_q": "--seq-len-q", "window_left": "--window-left", "mask_type": "--mask",
                 "q_data_type": "--q-dtype", "q_dtype": "--q-dtype", "kv_data_type": "--kv-dtype",
                 "kv_dtype": "--kv-dtype", "o_data_type": "--o-dtype", "o_dtype": "--o-dtype"}


def _as_explain_flags(message: str) -> str:
    """An error of tsdecode.explain with its parameter names replaced by the flags typed."""
    names = sorted(EXPLAIN_FLAGS, key=len, reverse=True)
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: EXPLAIN_FLAGS[m.group(1)], message)


def run_report(report_argv: list[str]) -> int:
    from . import report

    parser = Parser(prog=f"{PROG} report", description=report.help_description())
    report.add_report_arguments(parser)
    return int(report.run_report(parser.parse_args(report_argv)) or 0)


def main(argv: list[str] | None = None) -> int:
    try:
        with interrupts_stop_the_run():
            return _main(list(sys.argv[1:] if argv is None else argv))
    except BaseException as e:  # Ctrl-C or SIGTERM where no subcommand handles it (importing torch, ...)
        if not is_interrupt(e):
            raise
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def console_main() -> int:
    """The ``tsdecode-tune`` command (and ``python -m tuner``): ``main``, then the process's exit
    with Ctrl-C and SIGTERM ignored. The run's work is written by then; a late signal would only cut
    torch's exit-time cleanup short with a traceback (``main`` itself, called in-process by tests,
    leaves the handlers as they were)."""
    try:
        code = main()
    except KeyboardInterrupt:  # between main's return and here
        print(f"{PROG}: interrupted", file=sys.stderr)
        code = 130
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return code


def _main(argv: list[str]) -> int:
    try:
        if argv and argv[0] in ("create", "export"):  # no device of their own
            device = "cpu" if argv[0] == "create" and _flag(argv, "--for") == "cpu" else "cuda"
        else:
            device = select_device(argv)  # first: decides TRITON_INTERPRET before triton is imported
        if argv and argv[0] == "report":  # its own parser, from tuner.report
            return run_report(argv[1:])
        if not argv or argv[0] not in SUBCOMMANDS + ("-h", "--help"):
            argv = ["tune"] + argv
        parser = build_parser(device == "cpu")
        args, extra = parser.parse_known_args(argv)
        if extra:
            raise unknown_flags(parser, args.command, extra)
        empty = empty_value(parser, args)
        if empty is not None:
            raise empty
        if args.command == "explain":
            return run_explain(args, device)
        require_tune_extra()
        if args.command == "worker":
            return run_worker(args, args.device or device)
        if args.command == "export":
            return run_export(args)
        if args.command == "create":
            return run_create(args)
        return run_tune(args, device)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    except ToolError as e:  # a storage, job or run lock refused: one line
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())
