"""Run a few decode shapes once each (eager) so a profiler (ncu) can time each kernel alone.

Usage: ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum python scripts/ncu_probe.py
       [--kv-dtype float8_e4m3fn] [--config BLOCK_N/SPLITS/WARPS/STAGES] [B:L ...]
Shapes are llama3-8b (Hq=32, Hkv=8, D=128, P=16), table or heuristic config unless --config
gives one (block_m 16; fitted to each shape); default 8:8192 1:32768 1:1024 32:1024 32:8192.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import tsdecode  # noqa: E402
from tuner.grids import ShapeSpec  # noqa: E402
from tuner.measure import make_inputs  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("shapes", nargs="*", default=["8:8192", "1:32768", "1:1024", "32:1024", "32:8192"])
ap.add_argument("--kv-dtype", default="bfloat16")
ap.add_argument("--config", default=None, help="block_n/splits/warps/stages, e.g. 16/1/1/5")
args = ap.parse_args()
config = None
if args.config:
    n, splits, warps, stages = (int(x) for x in args.config.split("/"))
    config = tsdecode.KernelConfig(block_n=n, block_m=16, num_kv_splits=splits, num_warps=warps,
                                   num_stages=stages)

for text in args.shapes:
    b, l = (int(x) for x in text.split(":"))
    spec = ShapeSpec(batch_size=b, kv_len=l, kv_dtype=args.kv_dtype)
    s = make_inputs(spec, "cuda", copies=1, seed=1)[0]
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(s.block_tables, s.seq_lens, 32, 8, 128, 16, q_data_type=s.q.dtype,
           kv_data_type=s.cache.dtype, o_data_type=s.out.dtype, config=config)
    print(spec.name, w.config, flush=True)
    for _ in range(2):
        w.run(s.q, s.cache, out=s.out)
    torch.cuda.synchronize()
