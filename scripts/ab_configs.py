"""Same-run timing of explicit configs on a few shapes (CUDA-graph method, two interleaved rounds).

Shapes: B:L:Hq:Hkv[:r][:fp8][:f16][:dD][:qN] (r = ragged lengths in [L/2, L], fp8 = float8_e4m3fn
K/V cache, f16 = float16 q and output (and cache) instead of bfloat16, dD = head dim D instead of
128, qN = N query tokens a request with the causal mask);
configs: block_n[xblock_m]/splits/warps/stages (block_m 16 unless given; splits "pX": the count
closest to X programs per SM,
round(X * SMs / (B * Hkv))), "heur" for what the plan picks today (table or heuristic) or "rule"
for what it picks without a table (``heuristic_config``, scaled to ragged lengths; "rule-wide"
the same without its lean tiles for 17-32 query rows, ``_wide_rows_lean``; "rule@PATH" the
rule of the configs.py at PATH, e.g. an earlier revision's, with no "/R"), each with an
optional "/R" that launches the split kernel with triton's maxnreg=R register cap (an
experiment: not part of the config space), and an optional ":" suffix of letters: "t" or "s"
forces the split kernel's transposed or standard product form (``transposed_products``; without
either the rule picks), "h" stores the split partials in the output dtype instead of fp32 (an
experiment: the plan's scratch, patched here).
Prints us per round, the best, the ratio to the first config and % of the copy bandwidth
measured in the same run.
Example: python scripts/ab_configs.py --shapes 64:16384:32:8:r --configs heur,32/16/4/2,16/p8/1/3:h
"""
import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402

import tsdecode.api  # noqa: E402
from tsdecode import KernelConfig  # noqa: E402
from tsdecode.configs import MAX_NUM_KV_SPLITS, config_from_table_hit, device_num_sms  # noqa: E402
from tsdecode.kernels import decode  # noqa: E402
from tuner.grids import ShapeSpec  # noqa: E402
from tuner.measure import bytes_moved, copy_bandwidth_gbs, make_inputs, num_copies  # noqa: E402
from bench_decode import check_correct, time_config  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", required=True)
ap.add_argument("--configs", required=True)
ap.add_argument("--replay-ms", type=float, default=40.0)
args = ap.parse_args()

_split_kernel = decode._split_kv_kernel
MAXNREG = [None]


class _CappedLaunch:
    """Launches the split kernel with maxnreg=MAXNREG[0] when set."""

    def __getitem__(self, grid):
        launch = _split_kernel[grid]
        return lambda *a, **kw: launch(*a, **kw, **({"maxnreg": MAXNREG[0]} if MAXNREG[0] else {}))

    def warmup(self, *a, **kw):  # plan() compiles through this
        return _split_kernel.warmup(*a, **kw, **({"maxnreg": MAXNREG[0]} if MAXNREG[0] else {}))


decode._split_kv_kernel = _CappedLaunch()
_allocate_scratch = tsdecode.api.allocate_scratch
HALF_PARTIALS = [None]  # the output dtype when set: partial_o stored in it instead of fp32


def _scratch(geometry, config, device):
    scratch = _allocate_scratch(geometry, config, device)
    if scratch is None or HALF_PARTIALS[0] is None:
        return scratch
    return scratch[0].to(HALF_PARTIALS[0]), scratch[1]


tsdecode.api.allocate_scratch = _scratch


def _configs_module(path: str):
    """A configs.py at ``path`` (e.g. ``git show REV:tsdecode/configs.py > /tmp/old.py``) as a
    module of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_rule_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


dev = torch.device("cuda")
num_sms = device_num_sms(dev)
copy = copy_bandwidth_gbs(dev)
print(f"# copy {copy:.0f} GB/s; torch {torch.__version__}; {torch.cuda.get_device_name(dev)}", flush=True)
for text in args.shapes.split(","):
    f = text.split(":")
    io_dtype = "float16" if "f16" in f[4:] else "bfloat16"  # q and out (and a 16-bit cache)
    spec = ShapeSpec(batch_size=int(f[0]), kv_len=int(f[1]), num_qo_heads=int(f[2]), num_kv_heads=int(f[3]),
                     ragged="r" in f[4:], kv_dtype="float8_e4m3fn" if "fp8" in f[4:] else io_dtype,
                     q_dtype=io_dtype, o_dtype=io_dtype,
                     head_dim=next((int(x[1:]) for x in f[4:] if x.startswith("d")), 128),
                     seq_len_q=next((int(x[1:]) for x in f[4:] if x.startswith("q")), 1))
    if spec.seq_len_q > 1:
        spec = dataclasses.replace(spec, mask_type="causal")
    sets = make_inputs(spec, dev, copies=num_copies(spec), seed=1)
    lens = [int(n) for n in sets[0].seq_lens.tolist()]
    nbytes = bytes_moved(spec, lens)
    # The plan's shape without a table: ragged lengths as the plan measures them (longest / mean).
    shape = dataclasses.replace(spec.to_problem_shape(), kv_len_spread=max(lens) * len(lens) / sum(lens))
    configs, caps, forms, halves = {}, {}, {}, {}
    for c in args.configs.split(","):
        name, _, suffix = c.partition(":")
        assert set(suffix) <= set("tsh"), f"unknown suffix letters in {c!r}"
        forms[c] = "1" if "t" in suffix else "0" if "s" in suffix else "auto"
        halves[c] = sets[0].out.dtype if "h" in suffix else None
        fields = name.split("/")
        if name.startswith("rule@"):  # another revision's rule: a configs.py copied aside
            base = _configs_module(name[len("rule@"):])
            base_shape = base.ProblemShape(**{k.name: getattr(shape, k.name)
                                              for k in dataclasses.fields(base.ProblemShape)})
            rule, _ = base.scale_splits_to_raggedness(
                base.heuristic_config(base_shape, num_sms), base_shape, num_sms)
            configs[c] = KernelConfig(**base.fit_config(rule, base_shape)[0].to_dict())
            caps[c] = None
        elif fields[0] in ("heur", "rule", "rule-wide"):
            wide_rows_lean = tsdecode.configs._wide_rows_lean
            if fields[0] == "rule-wide":  # the rule without its wide-rows lean tiles
                tsdecode.configs._wide_rows_lean = lambda *a: False
            no_table = config_from_table_hit(shape, None, num_sms).kernel_config
            tsdecode.configs._wide_rows_lean = wide_rows_lean
            configs[c] = None if fields[0] == "heur" else no_table
            caps[c] = int(fields[1]) if len(fields) > 1 else None
        else:
            n, _, m = fields[0].partition("x")
            n, m, w, st = int(n), int(m or 16), int(fields[2]), int(fields[3])
            if fields[1].startswith("p"):
                s = max(1, round(float(fields[1][1:]) * num_sms / (spec.batch_size * spec.num_kv_heads)))
                s = min(s, MAX_NUM_KV_SPLITS, -(-spec.kv_len // n))  # the config's limit, one tile a split
            else:
                s = int(fields[1])
            configs[c] = KernelConfig(block_n=n, block_m=m, num_kv_splits=s, num_warps=w, num_stages=st)
            caps[c] = int(fields[4]) if len(fields) > 4 else None
    res = {k: [] for k in configs}
    chosen = {}
    for name in list(configs) * 2:
        MAXNREG[0] = caps[name]
        decode._TRANSPOSED_MODE = forms[name]
        HALF_PARTIALS[0] = halves[name]
        us, sel = time_config(spec, sets, configs[name], args.replay_ms)
        res[name].append(us)
        chosen[name] = sel.kernel_config
    first = min(next(iter(res.values())))
    print(spec.name, flush=True)
    for name, times in res.items():
        c = chosen[name]
        MAXNREG[0] = caps[name]
        decode._TRANSPOSED_MODE = forms[name]
        HALF_PARTIALS[0] = halves[name]
        err = check_correct(spec, sets[0], c)
        print(f"  {name:10s} n{c.block_n} m{c.block_m} s{c.num_kv_splits} w{c.num_warps} st{c.num_stages}: {min(times):8.1f} us "
              f"({', '.join(f'{t:.1f}' for t in times)}) {min(times) / first:6.3f}x "
              f"{100 * nbytes / min(times) / 1e3 / copy:6.1f}% copy  err {err:.1e}", flush=True)
    del sets
    torch.cuda.empty_cache()
