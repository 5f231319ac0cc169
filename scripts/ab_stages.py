"""Same-run A/B: deeper K/V pipelines (num_stages 5 and 7; the space had 1-4 when this ran, and
takes 5 since: docs/perf-notes.md, "Sixth lease"; 7 lies outside it).

Counted offline first (``PYTHONPATH=/tmp/t36 scripts/sass_count.py``, triton 3.6, sm90): through
the page table the pipeliner gives the K/V tiles one shared-memory buffer at 2-4 stages (one
tile per program in flight), two at 5-6 and three at 7. Each target shape
(or ``--only`` substring) runs its table/heuristic config, the same config at stages 5 and 7, and
for lean configs (block_n=16, 1 warp) stage 5 at half the splits; two interleaved rounds, best of
the two, relative error of each variant vs the float64 reference on two requests.
Run from the repo root on the GPU: python scripts/ab_stages.py [--only B8_L8192,float8]
"""
import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402

import tsdecode  # noqa: E402
from tsdecode import configs  # noqa: E402
from tsdecode.reference import reference_decode  # noqa: E402
from tuner.measure import bytes_moved, copy_bandwidth_gbs, graph_time_us, make_inputs, num_copies, relative_error  # noqa: E402
from bench_decode import target_suite  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--only", default="", help="comma-separated substrings of shape names")
ap.add_argument("--replay-ms", type=float, default=40.0)
args = ap.parse_args()
dev = torch.device("cuda")
copy = copy_bandwidth_gbs(dev)
print(f"# copy {copy:.0f} GB/s; torch {torch.__version__}; {torch.cuda.get_device_name(dev)}", flush=True)
seen = set()
SPACE_STAGES = configs.NUM_STAGES_CHOICES
for target in target_suite():
    spec = target.spec
    if spec.name in seen or (args.only and not any(s in spec.name for s in args.only.split(","))):
        continue
    seen.add(spec.name)
    sets = make_inputs(spec, dev, copies=num_copies(spec), seed=1)
    nbytes = bytes_moved(spec)

    def plan(s, config=None):
        w = tsdecode.BatchDecodePagedTSWrapper()
        w.plan(s.block_tables, s.seq_lens, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size,
               q_data_type=s.q.dtype, kv_data_type=s.cache.dtype, o_data_type=s.out.dtype, config=config)
        return w

    configs.NUM_STAGES_CHOICES = SPACE_STAGES  # the table lookup checks the config space's hash
    base = plan(sets[0])._plan.selected.kernel_config
    configs.NUM_STAGES_CHOICES = tuple(sorted(set(SPACE_STAGES) | {5, 6, 7}))
    variants = {"base": base, "st5": dataclasses.replace(base, num_stages=5),
                "st7": dataclasses.replace(base, num_stages=7)}
    if base.num_warps == 1 and base.num_kv_splits >= 2:
        variants["st5 S/2"] = dataclasses.replace(base, num_stages=5, num_kv_splits=base.num_kv_splits // 2)
    res = {k: [] for k in variants}
    errs = {}
    for name in list(variants) * 2:
        try:
            ws = [plan(s, variants[name]) for s in sets]
        except Exception as exc:  # out of shared memory etc.
            res[name].append(float("inf"))
            errs[name] = f"{type(exc).__name__}: {str(exc)[:80]}"
            continue
        res[name].append(graph_time_us([lambda w=w, s=s: w.run(s.q, s.cache, out=s.out) for w, s in zip(ws, sets)],
                                       args.replay_ms))
        if name not in errs:
            s = sets[0]
            s.out.fill_(float("nan"))
            ws[0].run(s.q, s.cache, out=s.out)
            errs[name] = relative_error(s.out[:2], reference_decode(s.q[:2], s.cache, s.block_tables[:2], s.seq_lens[:2]))
    ref = min(res["base"])
    print(f"{spec.name}  base {base.block_n}/{base.num_kv_splits}/{base.num_warps}/{base.num_stages}", flush=True)
    for name, times in res.items():
        us = min(times)
        err = errs[name] if isinstance(errs[name], str) else f"err {errs[name]:.1e}"
        print(f"  {name:8s} {us:9.1f} us ({', '.join(f'{t:.1f}' for t in times)})  {us / ref:6.3f}x"
              f"  {100 * nbytes / us / 1e3 / copy:6.1f}% copy  {err}", flush=True)
    del sets
    torch.cuda.empty_cache()
