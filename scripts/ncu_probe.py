"""Run a few decode shapes eagerly, twice each, so a profiler (Nsight Compute) can time each kernel alone.

Usage: ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum python scripts/ncu_probe.py
       [--kv-dtype float8_e4m3fn] [--config BLOCK_N/SPLITS/WARPS/STAGES] [B:L ...]
Shapes are llama3-8b (Hq=32, Hkv=8, D=128, P=16), the runtime's config (table or model) unless
--config gives one (block_m 16; fitted to each shape); default 8:8192 1:32768 1:1024 32:1024
32:8192. The first run of each shape checks its metadata (validate=True), the second does not,
so ``--launch-skip 1 --launch-count 1`` on the split kernel profiles the first shape's second run.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import tsdecode  # noqa: E402
from tuner.grids import ShapeSpec  # noqa: E402
from tuner.measure import decode_call, make_inputs, plan_wrapper  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*", default=["8:8192", "1:32768", "1:1024", "32:1024", "32:8192"],
                    help="B:L pairs")
    ap.add_argument("--kv-dtype", default="bfloat16", help="bfloat16, float16 or float8_e4m3fn")
    ap.add_argument("--config", default=None, help="block_n/splits/warps/stages, e.g. 16/1/1/5")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ncu_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    config = None
    if args.config:
        n, splits, warps, stages = (int(x) for x in args.config.split("/"))
        config = tsdecode.KernelConfig(block_n=n, block_m=16, num_kv_splits=splits, num_warps=warps,
                                       num_stages=stages)
    io = "float16" if args.kv_dtype == "float16" else "bfloat16"
    for text in args.shapes:
        b, length = (int(x) for x in text.split(":"))
        spec = ShapeSpec(batch_size=b, kv_len=length, kv_dtype=args.kv_dtype, q_dtype=io, o_dtype=io)
        s = make_inputs(spec, "cuda", copies=1, seed=1)[0]
        w = plan_wrapper(spec, s, config)
        print(spec.name, w.config, flush=True)
        decode_call(w, s, validate=True)()
        decode_call(w, s)()
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
