"""Command-line plumbing shared by ``tsdecode-tune`` and its ``report`` subcommand: one-line usage
errors (exit code 2) and the argument types."""

from __future__ import annotations

import argparse
import math

PROG = "tsdecode-tune"


class UsageError(Exception):
    """A bad command line, grid or environment: the message goes to stderr, the exit code is 2."""


class ToolError(RuntimeError):
    """A one-line failure of a storage, a job or the run lock (``study.StorageError``,
    ``job.JobError``, ``study.StudyBusy``): ``cli.main`` prints "tsdecode-tune: error: <message>"
    and exits 2."""


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing usage and exiting."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: error: {message}")


def int_list(text: str) -> list[int]:
    """``"1,8,64"`` -> [1, 8, 64]: positive integers (ValueError otherwise)."""
    items = [x.strip() for x in text.split(",")]
    if "" in items:
        raise ValueError(f"expected a comma-separated list of integers, got {text!r} (an empty item)")
    try:
        values = [int(x) for x in items]
    except ValueError:
        raise ValueError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def int_list_type(text: str) -> list[int]:
    """``int_list`` as an argparse type."""
    try:
        return int_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# The largest integer a flag takes (int64): a larger one, e.g. of 400 digits, would overflow a float
# later, mid-run (the sizes the kernels index in int32 are checked against their own limits).
MAX_INT = 2**63 - 1
# Seconds: what the waits of a run can hold (a poll takes at most 2**31 - 1 ms, about 24.8 days,
# and a trial's re-timing waits twice --trial-timeout).
WEEK_S = 7 * 24 * 3600
YEAR_S = 365 * 24 * 3600


def bounded(kind: type, minimum: float, strict: bool, maximum: int | None = None, unit: str = ""):
    """An argparse type: a finite ``kind`` (int or float) >= ``minimum`` (> if ``strict``) and <=
    ``maximum`` (ints: at most MAX_INT); nan and inf are refused because "no limit" is spelled by
    leaving the flag out. ``unit`` names the maximum in the message ("a week")."""
    noun = "an integer" if kind is int else "a number"
    if maximum is None and kind is int:
        maximum = MAX_INT

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if kind is float and not math.isfinite(value):  # (an int of 400 digits overflows isfinite)
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"expected {noun} {'>' if strict else '>='} {minimum}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"expected {noun} <= {maximum}{f' ({unit})' if unit else ''}, "
                                             f"got {text!r}")
        return value

    return parse


nonnegative_float = bounded(float, 0, strict=False)
positive_int = bounded(int, 1, strict=False)
# Durations in seconds and the CUDA-graph replay time in milliseconds.
seconds_up_to_a_week = bounded(float, 0, strict=True, maximum=WEEK_S, unit="a week")
seconds_up_to_a_year = bounded(float, 0, strict=True, maximum=YEAR_S, unit="a year")
replay_ms = bounded(float, 0, strict=True, maximum=60_000, unit="a minute")
# Seeds: int64, what torch.manual_seed takes (a report's inputs; the tuner's sampler hashes its own).
seed_int = bounded(int, -MAX_INT - 1, strict=False)
# Compile processes per worker: each is a process (all started at once).
compile_workers = bounded(int, 0, strict=False, maximum=256)
