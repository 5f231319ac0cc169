"""Same-run timing of explicit configs on a few shapes (CUDA-graph method, two interleaved rounds).

Shapes: B:L:Hq:Hkv[:r] (r = ragged lengths in [L/2, L]); configs: block_n/splits/warps/stages,
or "heur" for what the plan picks today (table or heuristic). Prints us per round, the best, the
ratio to the first config and % of the copy bandwidth measured in the same run.
Example: python scripts/ab_configs.py --shapes 64:16384:32:8:r --configs heur,32/16/4/2,16/2/1/3
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402

from tsdecode import KernelConfig  # noqa: E402
from tuner.grids import ShapeSpec  # noqa: E402
from tuner.measure import bytes_moved, copy_bandwidth_gbs, make_inputs, num_copies  # noqa: E402
from bench_decode import check_correct, time_config  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", required=True)
ap.add_argument("--configs", required=True)
ap.add_argument("--replay-ms", type=float, default=40.0)
args = ap.parse_args()
dev = torch.device("cuda")
copy = copy_bandwidth_gbs(dev)
print(f"# copy {copy:.0f} GB/s; torch {torch.__version__}; {torch.cuda.get_device_name(dev)}", flush=True)
for text in args.shapes.split(","):
    f = text.split(":")
    spec = ShapeSpec(batch_size=int(f[0]), kv_len=int(f[1]), num_qo_heads=int(f[2]), num_kv_heads=int(f[3]),
                     ragged=len(f) > 4 and f[4] == "r")
    sets = make_inputs(spec, dev, copies=num_copies(spec), seed=1)
    nbytes = bytes_moved(spec, [int(n) for n in sets[0].seq_lens.tolist()])
    configs = {}
    for c in args.configs.split(","):
        if c == "heur":
            configs[c] = None
        else:
            n, s, w, st = (int(x) for x in c.split("/"))
            configs[c] = KernelConfig(block_n=n, block_m=16, num_kv_splits=s, num_warps=w, num_stages=st)
    res = {k: [] for k in configs}
    chosen = {}
    for name in list(configs) * 2:
        us, sel = time_config(spec, sets, configs[name], args.replay_ms)
        res[name].append(us)
        chosen[name] = sel.kernel_config
    first = min(next(iter(res.values())))
    print(spec.name, flush=True)
    for name, times in res.items():
        c = chosen[name]
        err = check_correct(spec, sets[0], c)
        print(f"  {name:10s} n{c.block_n} s{c.num_kv_splits} w{c.num_warps} st{c.num_stages}: {min(times):8.1f} us "
              f"({', '.join(f'{t:.1f}' for t in times)}) {min(times) / first:6.3f}x "
              f"{100 * nbytes / min(times) / 1e3 / copy:6.1f}% copy  err {err:.1e}", flush=True)
    del sets
    torch.cuda.empty_cache()
