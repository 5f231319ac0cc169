"""Where plan()'s host time goes: cProfile over repeated plans of one shape (GPU machine).

Usage: python scripts/plan_profile.py [--splits 1] [--calls 300] [--top 30]
Prints the functions with the most own time (tottime) and the most cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import tsdecode  # noqa: E402
from host_overhead import _plan_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", type=int, default=1)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    plan_args, plan_kw = _plan_args(args.splits)
    w = tsdecode.BatchDecodePagedTSWrapper()
    for _ in range(20):  # compile and warm every cache first
        w.plan(*plan_args, **plan_kw)
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        w.plan(*plan_args, **plan_kw)
    profile.disable()
    stats = pstats.Stats(profile).strip_dirs()
    print(f"# {args.calls} plans, splits {args.splits}; times are totals over the calls (s)")
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
