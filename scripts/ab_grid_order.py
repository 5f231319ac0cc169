"""Same-run A/B of the split kernel's program order (an experiment; the shipped kernel is unchanged).

The op's grid is (B*Hkv*row blocks, splits): consecutive programs are the KV heads of one
request's split, which read neighbouring 4 KiB slices of the same pages. The no-math gather floor
of ``method_probe.py``, which ran 1-2.5 us a call under the op's split pass alone on the missed
target rows, orders its programs the other way: a head's splits in a row. This script builds the
split kernel with its two program ids swapped (grid (splits, B*Hkv*row blocks)) from decode.py's
own source and times both orders on the target rows, the table's config each, two interleaved
rounds, with each order's output checked against the float64 reference.

Usage: python scripts/ab_grid_order.py [--replay-ms 40]
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402

from tsdecode.kernels import decode  # noqa: E402
from tuner.grids import ShapeSpec  # noqa: E402
from tuner.measure import bytes_moved, copy_bandwidth_gbs, make_inputs, num_copies  # noqa: E402
from bench_decode import check_correct, time_config  # noqa: E402

SHAPES = [  # (B, L, Hq, Hkv): the missed bf16 target rows, then two met ones as controls
    (8, 8192, 32, 8), (8, 8192, 64, 8), (32, 1024, 32, 8), (8, 1024, 32, 32), (8, 1024, 32, 8),
    (1, 32768, 32, 8), (1, 8192, 32, 8), (1, 1024, 32, 8), (32, 8192, 32, 8), (128, 8192, 32, 8),
]


def swapped_kernel():
    """decode._split_kv_kernel with split = program_id(0) and the (request, head, row block) index
    = program_id(1), compiled from a copy of its source."""
    source = inspect.getsource(decode._split_kv_kernel.fn)
    old = "    pid = tl.program_id(0)\n    split = tl.program_id(1)\n"
    assert source.count(old) == 1, "the split kernel's program ids moved: update this script"
    source = source.replace(old, "    split = tl.program_id(0)\n    pid = tl.program_id(1)\n")
    path = os.path.join(tempfile.mkdtemp(), "split_kernel_swapped.py")
    with open(path, "w") as f:
        f.write("import triton\nimport triton.language as tl\n\n" + source)
    spec = importlib.util.spec_from_file_location("split_kernel_swapped", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._split_kv_kernel


SWAPPED = [False]
_init = decode.DecodeLaunch.__init__


def _init_with_order(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if SWAPPED[0]:
        x, y, z = self._grid
        self._grid = (y, x, z)


decode.DecodeLaunch.__init__ = _init_with_order


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replay-ms", type=float, default=40.0)
    args = ap.parse_args()
    dev = torch.device("cuda")
    kernels = {"heads of a split": decode._split_kv_kernel, "splits of a head": swapped_kernel()}
    copy = copy_bandwidth_gbs(dev)
    print(f"# copy {copy:.0f} GB/s; torch {torch.__version__}; {torch.cuda.get_device_name(dev)}", flush=True)
    for b, n, hq, hkv in SHAPES:
        spec = ShapeSpec(batch_size=b, kv_len=n, num_qo_heads=hq, num_kv_heads=hkv)
        sets = make_inputs(spec, dev, copies=num_copies(spec), seed=1)
        nbytes = bytes_moved(spec, [int(x) for x in sets[0].seq_lens.tolist()])
        times = {name: [] for name in kernels}
        for name in list(kernels) * 2:
            SWAPPED[0] = name == "splits of a head"
            decode._split_kv_kernel = kernels[name]
            us, selected = time_config(spec, sets, None, args.replay_ms)
            times[name].append(us)
        errors = {}
        for name in kernels:
            SWAPPED[0] = name == "splits of a head"
            decode._split_kv_kernel = kernels[name]
            errors[name] = check_correct(spec, sets[0], selected.kernel_config)
        c = selected.kernel_config
        print(f"{spec.name}  n{c.block_n} s{c.num_kv_splits} w{c.num_warps} st{c.num_stages}", flush=True)
        first = min(times["heads of a split"])
        for name, ts in times.items():
            print(f"  {name:17s} {min(ts):8.1f} us ({', '.join(f'{t:.1f}' for t in ts)}) {min(ts) / first:6.3f}x "
                  f"{100 * nbytes / min(ts) / 1e3 / copy:6.1f}% copy  err {errors[name]:.1e}", flush=True)
        del sets
        torch.cuda.empty_cache()
    SWAPPED[0] = False
    decode._split_kv_kernel = kernels["heads of a split"]


if __name__ == "__main__":
    main()
