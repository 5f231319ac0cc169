"""Kernel time of explicit configs on a few shapes, in the same run (CUDA graphs, interleaved rounds).

Shapes: B:L:Hq:Hkv[:r][:fp8][:f16][:dD][:pP][:qN] (r = ragged lengths in [L/2, L], fp8 =
float8_e4m3fn K/V cache, f16 = float16 q, output and 16-bit cache instead of bfloat16, dD = head
dim D instead of 128, pP = page size P instead of 16, qN = N query tokens a request with the
causal mask).
Configs, comma-separated:
  block_n[xblock_m]/splits/warps/stages   explicit (block_m 16 unless given; splits "pX": the count
                        closest to X programs per SM, round(X * SMs / (B * Hkv)))
  heur                  what the plan picks (tuned table, else the config model)
  model                 the config model's pick without a table (as select_config falls back to it)
  tree@PATH             the pick of another source tree of tsdecode (its table or model, e.g. the
                        previous main), run on this tree's kernels: a config-selection A/B with
                        the kernels held fixed (``ab_trees.py`` times two trees' kernels too);
                        one PATH per run
each with an optional ":" suffix of letters choosing explicit launch arguments
(``kernels.launch.DecodeLaunch``): "t" or "s" forces the split kernel's transposed or standard
product form (default: ``transposed_products`` picks), "p" turns programmatic dependent launch off.
Prints us per round, the best, the ratio to the first config, % of the copy bandwidth measured in
the same run and the relative error against the float64 reference.

Example: python scripts/ab_configs.py --shapes 64:16384:32:8:r --configs heur,32/16/4/2,16/p8/1/3:t
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from bench_decode import check_correct, time_config  # noqa: E402
from tsdecode.config.heuristic import heuristic_config  # noqa: E402
from tsdecode.config.select import scale_splits_to_raggedness  # noqa: E402
from tsdecode.config.space import MAX_NUM_KV_SPLITS, KernelConfig, fit_config  # noqa: E402
from tsdecode.device import DeviceProperties, device_properties  # noqa: E402
from tuner.grids import ShapeSpec  # noqa: E402
from tuner.measure import bytes_moved, copy_bandwidth_gbs, make_inputs, num_copies  # noqa: E402

SUFFIX_LETTERS = {"t": ("transposed", True), "s": ("transposed", False), "p": ("pdl", False)}


def parse_shape(text: str) -> ShapeSpec:
    f = text.split(":")
    flags = f[4:]
    io_dtype = "float16" if "f16" in flags else "bfloat16"  # q and out (and a 16-bit cache)

    def number(prefix: str, default: int) -> int:
        return next((int(x[1:]) for x in flags if x.startswith(prefix) and x[1:].isdigit()), default)

    spec = ShapeSpec(batch_size=int(f[0]), kv_len=int(f[1]), num_qo_heads=int(f[2]), num_kv_heads=int(f[3]),
                     ragged="r" in flags, kv_dtype="float8_e4m3fn" if "fp8" in flags else io_dtype,
                     q_dtype=io_dtype, o_dtype=io_dtype, head_dim=number("d", 128), page_size=number("p", 16),
                     seq_len_q=number("q", 1))
    if spec.seq_len_q > 1:
        spec = dataclasses.replace(spec, mask_type="causal")
    return spec


def model_pick(spec: ShapeSpec, lens: list[int], props: DeviceProperties) -> KernelConfig:
    """The config model's pick for the plan's shape, as ``select_config`` makes it without a table."""
    shape = spec.to_problem_shape(lens)
    config, _ = scale_splits_to_raggedness(heuristic_config(shape, props), shape, props)
    return fit_config(config, shape)[0]


def other_tree_pick(module, spec: ShapeSpec, s) -> KernelConfig:
    """The config another tree's plan picks for the shape (either call form), as this tree's type."""
    from ab_trees import plan_calls

    _, picked = plan_calls(module, spec, [s])
    return KernelConfig(**picked.kernel_config.to_dict())


def parse_config(text: str, spec: ShapeSpec, props: DeviceProperties) -> KernelConfig:
    fields = text.split("/")
    n, _, m = fields[0].partition("x")
    n, m, w, st = int(n), int(m or 16), int(fields[2]), int(fields[3])
    if fields[1].startswith("p"):
        s = max(1, round(float(fields[1][1:]) * props.sm_count / (spec.batch_size * spec.num_kv_heads)))
        s = min(s, MAX_NUM_KV_SPLITS, -(-spec.kv_len // n))  # the space's limit, one tile a split
    else:
        s = int(fields[1])
    return KernelConfig(block_n=n, block_m=m, num_kv_splits=s, num_warps=w, num_stages=st)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", required=True, help="comma-separated B:L:Hq:Hkv[:flags]")
    ap.add_argument("--configs", required=True, help="comma-separated configs (see above)")
    ap.add_argument("--replay-ms", type=float, default=40.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ab_configs needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    props = device_properties(dev)
    names = args.configs.split(",")
    launches = {}
    for name in names:
        suffix = name.partition(":")[2]
        unknown = set(suffix) - set(SUFFIX_LETTERS)
        if unknown or len(suffix) != len(set(suffix)) or {"t", "s"} <= set(suffix):
            raise SystemExit(f"{name}: the suffix takes each of the letters t or s, and p, at most once")
        launches[name] = dict(SUFFIX_LETTERS[c] for c in suffix)
    trees = {n.partition(":")[0][len("tree@"):] for n in names if n.startswith("tree@")}
    if len(trees) > 1:
        raise SystemExit(f"one tree@PATH a run (the other tree loads as one package), got {sorted(trees)}")
    other = None
    if trees:
        from ab_trees import load_other_tree

        other = load_other_tree(trees.pop())
    copy = copy_bandwidth_gbs(dev)
    print(f"# copy {copy:.0f} GB/s; torch {torch.__version__}; {props.name}", flush=True)
    for text in args.shapes.split(","):
        spec = parse_shape(text)
        sets = make_inputs(spec, dev, copies=num_copies(spec), seed=1)
        lens = [int(n) for n in sets[0].seq_lens.tolist()]
        nbytes = bytes_moved(spec, lens)
        configs = {}
        for name in names:
            base = name.partition(":")[0]
            if base == "heur":
                configs[name] = None
            elif base == "model":
                configs[name] = model_pick(spec, lens, props)
            elif base.startswith("tree@"):
                configs[name] = other_tree_pick(other, spec, sets[0])
            else:
                configs[name] = parse_config(base, spec, props)
            if launches[name].get("transposed") and configs[name] is not None and not configs[name].uses_dot:
                raise SystemExit(f"{name}: the transposed form needs tl.dot (block_m >= 16)")
        res = {k: [] for k in configs}
        chosen = {}
        for name in list(configs) * args.rounds:
            us, sel = time_config(spec, sets, configs[name], args.replay_ms, launch=launches[name])
            res[name].append(us)
            chosen[name] = sel.kernel_config
        first = min(next(iter(res.values())))
        print(spec.name, flush=True)
        for name, times in res.items():
            c = chosen[name]
            err = check_correct(spec, sets[0], c, launch=launches[name])
            print(f"  {name:12s} block_n {c.block_n} block_m {c.block_m} splits {c.num_kv_splits} warps "
                  f"{c.num_warps} stages {c.num_stages}: {min(times):8.1f} us "
                  f"({', '.join(f'{t:.1f}' for t in times)}) {min(times) / first:6.3f}x "
                  f"{100 * nbytes / min(times) / 1e3 / copy:6.1f}% copy  err {err:.1e}", flush=True)
        del sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
