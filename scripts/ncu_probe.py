"""Run a few decode shapes once each (eager) so a profiler (ncu) can time each kernel alone.

Usage: ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum python scripts/ncu_probe.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import tsdecode  # noqa: E402
from tuner.grids import ShapeSpec  # noqa: E402
from tuner.measure import make_inputs  # noqa: E402

SHAPES = [(8, 8192), (1, 32768), (1, 1024), (32, 1024), (32, 8192)]

for b, l in SHAPES:
    spec = ShapeSpec(batch_size=b, kv_len=l)
    s = make_inputs(spec, "cuda", copies=1, seed=1)[0]
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(s.block_tables, s.seq_lens, 32, 8, 128, 16, q_data_type=s.q.dtype,
           kv_data_type=s.cache.dtype, o_data_type=s.out.dtype)
    print(spec.name, w.config, flush=True)
    for _ in range(2):
        w.run(s.q, s.cache, out=s.out)
    torch.cuda.synchronize()
