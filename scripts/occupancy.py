"""Registers, shared memory and resident programs per SM of the split kernel per config: model vs driver.

Compiles each config through the public wrapper (Hkv=8, Hq = 8 x G with G = block_m unless
--groups, pages of 16 tokens unless --page-sizes, K/V 1024 tokens, bf16 q; bf16 and fp8 caches;
one split, the direct-output kernel, and two) and reads the compiled kernel's metadata. Columns:
  regs, spills, smem_B   the compiled kernel's registers a thread, spilled bytes, shared memory
  sub                    registers allocated per warp (256-register units) within each of the
                         SM's 4 sub-partitions (16K registers each), as CUDA's occupancy calculator
                         does; with shared memory (1 KiB reserved a block) and 64 warps a SM
  driver                 cuOccupancyMaxActiveBlocksPerMultiprocessor for the loaded kernel (truth)
  model                  tsdecode.config.residency.resident_programs_per_sm (what config
                         selection uses: the measured resources table, this GPU's properties)

Usage: python scripts/occupancy.py [--block-n 16,32] [--warps 1,2] [--stages 3,5] [--head-dims 64,128]
       [--kv bf16,fp8] [--page-sizes 1,16] [--block-m 16,32] [--groups 1,4] [--splits 1,2] [--jobs 8]
       [--csv PATH]
(defaults: every block_n of 16-128, 1-8 warps, 1-5 stages, D = 128, both caches, 16 rows, one and
two splits, one process). Without a GPU: --resources OUT A.csv B.csv ... merges measured CSVs
into the model's table (tsdecode/data/split_kernel_resources.csv; their .log files' first lines,
device and versions, become its source comments).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

import tsdecode  # noqa: E402
from tsdecode.config.residency import resident_programs_per_sm  # noqa: E402
from tsdecode.config.space import KernelConfig, ProblemShape  # noqa: E402
from tsdecode.device import DeviceProperties, device_properties  # noqa: E402
from tsdecode.kernels import decode  # noqa: E402

KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
HEADER = ("kv", "D", "P", "G", "block_m", "block_n", "warps", "stages", "direct", "regs", "spills", "smem_B",
          "sub", "driver", "model")


def compiled_kernels(fn) -> dict:
    out = {}
    for cache in fn.device_caches.values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        out.update(kernels)
    return out


def sub_partition_resident_per_sm(n_regs: int, num_warps: int, shared: int, smem_per_sm: int) -> int:
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = 4 * (16384 // regs_per_warp) // num_warps
    by_smem = smem_per_sm // (shared + 1024) if shared else 32
    return max(0, min(by_regs, by_smem, 64 // num_warps, 32))


def driver_resident_per_sm(kernel, num_warps: int, shared: int) -> int:
    """The CUDA driver's count for the loaded kernel (-1 where it cannot be asked)."""
    try:
        if getattr(kernel, "function", None) is None and hasattr(kernel, "_init_handles"):
            kernel._init_handles()
        libcuda = ctypes.CDLL("libcuda.so.1")
        blocks = ctypes.c_int(0)
        err = libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(blocks), ctypes.c_void_p(int(kernel.function)), ctypes.c_int(32 * num_warps),
            ctypes.c_size_t(shared))
        return blocks.value if err == 0 else -1
    except Exception:  # noqa: BLE001 - a diagnostic column
        return -1


def rows(args, props: DeviceProperties):
    dev = torch.device("cuda")
    smem_per_sm = props.shared_memory_per_sm
    combos = [c for c in itertools.product(args.kv, args.head_dims, args.page_sizes, args.groups or [0],
                                           args.block_m, args.block_n, args.warps, args.stages, args.splits)
              if c[3] <= c[4]]  # G rows fit block_m
    mine = combos[args.slice[0]::args.slice[1]]
    for kv_name, head_dim, page, group, block_m, block_n, warps, stages, splits in mine:
        group = group or block_m
        kv_dtype = KV_DTYPES[kv_name]
        cfg = KernelConfig(block_n=block_n, block_m=block_m, num_kv_splits=splits, num_warps=warps,
                           num_stages=stages)
        key = (kv_name, head_dim, page, group, block_m, block_n, warps, stages, splits)
        before = set(compiled_kernels(decode._split_kv_kernel))
        w = tsdecode.BatchDecodePagedTSWrapper()
        try:  # plan compiles the kernels without launching them
            w.plan(dev, 1, 8 * group, 8, head_dim, page, 1024, q_data_type=torch.bfloat16,
                   kv_data_type=kv_dtype, o_data_type=torch.bfloat16, config=cfg)
        except Exception as exc:  # noqa: BLE001
            print(f"# {key} failed: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            continue
        new = [k for key_, k in compiled_kernels(decode._split_kv_kernel).items() if key_ not in before]
        if not new:
            print(f"# {key}: no new kernel compiled", flush=True)
            continue
        k = new[0]
        shared = int(getattr(k.metadata, "shared", 0))
        shape = ProblemShape(batch_size=1, num_qo_heads=8 * group, num_kv_heads=8, head_dim=head_dim,
                             page_size=page, max_kv_len=1024, kv_dtype=kv_dtype)
        yield (kv_name, head_dim, page, group, block_m, block_n, warps, stages, int(splits == 1), k.n_regs,
               k.n_spills, shared,
               sub_partition_resident_per_sm(k.n_regs, warps, shared, smem_per_sm),
               driver_resident_per_sm(k, warps, shared),
               resident_programs_per_sm(cfg, shape, props))


RESOURCE_COLUMNS = ("kv_bytes", "block_d", "page_size", "group_size", "block_m", "block_n", "num_warps",
                    "num_stages", "direct_out", "registers", "shared_bytes")


def write_resources(inputs: list[str], out: str) -> int:
    """The model's table from measured CSVs: per config (K/V bytes, block_d, page size, G, block_m,
    block_n, warps, stages, one split or more) the registers a thread and shared memory (the most
    where a config was measured twice; CSVs without a P column were measured at 16-token pages)."""
    import csv

    merged: dict[tuple, tuple[int, int]] = {}
    heads = []
    for path in inputs:
        for r in csv.DictReader(open(path)):
            key = (1 if r["kv"] == "fp8" else 2, int(r["D"]), int(r.get("P") or 16),
                   int(r.get("G") or r["block_m"]), int(r["block_m"]), int(r["block_n"]),
                   int(r["warps"]), int(r["stages"]), int(r["direct"]))
            regs, shared = int(r["regs"]), int(r["smem_B"])
            old = merged.get(key, (0, 0))
            merged[key] = (max(old[0], regs), max(old[1], shared))
        log = path[: -len(".csv")] + ".log"
        if os.path.exists(log):
            with open(log) as f:
                heads.append(f"# source {path}: {f.readline().strip().lstrip('# ')}\n")
    with open(out, "w") as f:
        f.write("# Split-KV kernel resources per config: registers a thread and shared memory (bytes) of\n"
                "# the kernel triton compiled through the public plan (Hkv=8, Hq=8*G, pages of page_size\n"
                "# tokens, bf16 q, dense, one query token) on the GPU below. Written by\n"
                "# scripts/occupancy.py --resources from its CSVs; read by\n"
                "# tsdecode.config.residency.split_kernel_resources.\n")
        f.writelines(heads)
        f.write(",".join(RESOURCE_COLUMNS) + "\n")
        for key in sorted(merged):
            f.write(",".join(map(str, (*key, *merged[key]))) + "\n")
    print(f"{len(merged)} configs written to {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    ap.add_argument("--block-n", type=ints, default=[16, 32, 64, 128])
    ap.add_argument("--warps", type=ints, default=[1, 2, 4, 8])
    ap.add_argument("--stages", type=ints, default=[1, 2, 3, 4, 5])
    ap.add_argument("--head-dims", type=ints, default=[128])
    ap.add_argument("--kv", type=lambda t: t.split(","), default=["bf16", "fp8"])
    ap.add_argument("--page-sizes", type=ints, default=[16], help="tokens a page")
    ap.add_argument("--block-m", type=ints, default=[16], help="query rows a program")
    ap.add_argument("--groups", type=ints, default=None,
                    help="query heads a KV head (default: G = block_m; G > block_m skipped)")
    ap.add_argument("--splits", type=ints, default=[1, 2],
                    help="1 compiles the direct-output variant, more the split variant")
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    ap.add_argument("--slice", type=lambda t: tuple(int(x) for x in t.split("/")), default=(0, 1),
                    help=argparse.SUPPRESS)  # i/n: this process's share (--jobs sets it)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--resources", default=None, metavar="OUT",
                    help="no GPU: merge the --csv files given as arguments into OUT, the table "
                         "tsdecode/data/split_kernel_resources.csv")
    ap.add_argument("inputs", nargs="*", help="occupancy CSVs for --resources")
    args = ap.parse_args()
    if args.resources:
        return write_resources(args.inputs, args.resources)
    if not torch.cuda.is_available():
        print("occupancy needs a CUDA GPU", file=sys.stderr)
        return 2
    props = device_properties(torch.device("cuda"))
    smem_per_sm = props.shared_memory_per_sm
    if args.jobs > 1:  # children print CSV lines; this process sorts and prints them
        lists = {"--block-n": args.block_n, "--warps": args.warps, "--stages": args.stages,
                 "--head-dims": args.head_dims, "--kv": args.kv, "--page-sizes": args.page_sizes,
                 "--block-m": args.block_m, "--splits": args.splits,
                 **({"--groups": args.groups} if args.groups else {})}
        argv = [x for flag, values in lists.items() for x in (flag, ",".join(map(str, values)))]
        procs = [subprocess.Popen([sys.executable, __file__, *argv, "--slice", f"{i}/{args.jobs}",
                                   "--csv", "-"], stdout=subprocess.PIPE, text=True)
                 for i in range(args.jobs)]
        found = []
        for p in procs:
            out, _ = p.communicate()
            if p.returncode:
                print(f"# a compile process failed (exit {p.returncode}): its share is missing",
                      file=sys.stderr)
            found += [line.split(",") for line in out.splitlines() if line and not line.startswith("#")
                      and not line.startswith("kv,")]
        order = {name: i for i, name in enumerate(KV_DTYPES)}
        table = sorted(found, key=lambda r: (order[r[0]], *map(int, r[1:9])))
    else:
        table = []
        for row in rows(args, props):
            table.append([str(x) for x in row])
            if args.csv == "-":
                print(",".join(table[-1]), flush=True)
        if args.csv == "-":
            return 0
    lines = [",".join(HEADER)] + [",".join(r) for r in table]
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("\n".join(lines) + "\n")
    print(f"# {props.name}: {props.sm_count} SMs, {smem_per_sm} B shared memory per SM; "
          f"torch {torch.__version__}, triton {triton.__version__}")
    print(" ".join(f"{h:>7s}" for h in HEADER))
    for r in table:
        print(" ".join(f"{x:>7s}" for x in r))
    sub_i, driver_i, model_i = (HEADER.index(c) for c in ("sub", "driver", "model"))
    off = [r for r in table if int(r[driver_i]) >= 0 and int(r[model_i]) != int(r[driver_i])]
    print(f"# model off the driver's count at {len(off)} of {len(table)} configs"
          + (": " + "; ".join("/".join(r[:9]) + f" {r[model_i]} vs {r[driver_i]}" for r in off[:40]) if off else ""))
    sub = [r for r in table if int(r[driver_i]) >= 0 and int(r[sub_i]) != int(r[driver_i])]
    print(f"# sub-partition count off the driver's at {len(sub)} of {len(table)} configs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
