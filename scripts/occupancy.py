"""Registers, shared memory and resident programs per SM of the split-KV kernel, per config.

Compiles each config (Llama-3-8B class: Hq=32, Hkv=8, D=128, P=16; bf16 and fp8 caches) through
the public wrapper and reads the compiled kernel's metadata. "resident/SM" is the bound from
registers (64K per SM, allocated per warp in 256-register units), shared memory (228 KiB per SM,
1 KiB reserved per block) and 64 warps per SM; the wave size is that times the SM count.

Usage: python scripts/occupancy.py [--block-n 16,32] [--warps 1,2] [--stages 3,5] [--head-dims 64,128]
(defaults: every block_n of 16-128, 1-8 warps, 1-5 stages, D = 128)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import tsdecode  # noqa: E402
from tsdecode.configs import KernelConfig  # noqa: E402
from tsdecode.kernels import decode  # noqa: E402


def compiled_kernels(fn) -> dict:
    out = {}
    for cache in fn.device_caches.values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        out.update(kernels)
    return out


def resident_per_sm(n_regs: int, num_warps: int, shared: int, smem_per_sm: int) -> int:
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * num_warps)
    by_smem = smem_per_sm // (shared + 1024) if shared else 32
    return max(0, min(by_regs, by_smem, 64 // num_warps, 32))


def main() -> int:
    ap = argparse.ArgumentParser()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    ap.add_argument("--block-n", type=ints, default=[16, 32, 64, 128])
    ap.add_argument("--warps", type=ints, default=[1, 2, 4, 8])
    ap.add_argument("--stages", type=ints, default=[1, 2, 3, 4, 5])
    ap.add_argument("--head-dims", type=ints, default=[128])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("occupancy needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    print(f"# {props.name}: {props.multi_processor_count} SMs, {smem_per_sm} B shared memory per SM")
    print(f"{'kv':14s} {'D':>3s} {'block_n':>7s} {'warps':>5s} {'stages':>6s} {'regs':>5s} {'spills':>6s} "
          f"{'smem B':>7s} {'resident/SM':>11s} {'wave':>5s}")
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for head_dim, block_n, warps, stages in itertools.product(
                args.head_dims, args.block_n, args.warps, args.stages):
            cfg = KernelConfig(block_n=block_n, block_m=16, num_kv_splits=1, num_warps=warps,
                               num_stages=stages)
            row = f"{str(kv_dtype):14s} {head_dim:3d} {block_n:7d} {warps:5d} {stages:6d}"
            before = set(compiled_kernels(decode._split_kv_kernel))
            tables = torch.zeros((1, 64), dtype=torch.int32, device=dev)
            lens = torch.full((1,), 1024, dtype=torch.int32, device=dev)
            w = tsdecode.BatchDecodePagedTSWrapper()
            try:
                w.plan(tables, lens, 32, 8, head_dim, 16, q_data_type=torch.bfloat16,
                       kv_data_type=kv_dtype, o_data_type=torch.bfloat16, config=cfg)
            except Exception as exc:
                print(f"{row} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            new = [k for key, k in compiled_kernels(decode._split_kv_kernel).items() if key not in before]
            for k in new[:1]:
                shared = int(getattr(k.metadata, "shared", 0))
                res = resident_per_sm(k.n_regs, warps, shared, smem_per_sm)
                print(f"{row} {k.n_regs:5d} {k.n_spills:6d} {shared:7d} {res:11d} "
                      f"{res * props.multi_processor_count:5d}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
