"""Count the split-pass kernel's SASS instructions for sm90 without a GPU (triton's bundled ptxas).

Compiles ``_split_kv_kernel`` for one llama3-8b-like config (G=4, D=128, P=16, SQ=1, dense, 16
rows) with the JIT's usual specialisation (pointers and page/head strides divisible by 16) and
prints registers, shared memory, the instruction count per opcode and the memory / conversion
instructions with their widths. ``--source`` compiles another copy of decode.py; ``--compare``
diffs TTIR, TTGIR and SASS of two copies (e.g. to show a constexpr-gated change leaves every
other variant's machine code alone). Codegen differs between triton versions: this counts what
the installed triton emits (triton 3.9 on the CPU machine, 3.6 on the lent H200). To count what
the H200's triton emits without the device: ``pip download triton==3.6.0 --no-deps``, ``pip
install --no-deps --target /tmp/t36 <the wheel>``, then run this with ``PYTHONPATH=/tmp/t36``.

Usage: python scripts/sass_count.py [--kv-dtype fp8e4nv] [--block-n 64] [--warps 2] [--stages 2]
       [--maxnreg 128]
       [--source path/to/decode.py] [--compare other/decode.py]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

DEFAULT_SOURCE = os.path.join(os.path.dirname(__file__), "..", "tsdecode", "kernels", "decode.py")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTERS = ("q_ptr", "k_ptr", "v_ptr", "block_tables_ptr", "seq_lens_ptr", "qo_indptr_ptr", "out_ptr",
            "partial_o_ptr", "partial_lse_ptr")
DIVISIBLE_INTS = ("stride_q_batch", "stride_q_head", "stride_o_batch", "stride_o_head", "stride_k_page",
                  "stride_k_head", "stride_v_page", "stride_v_head", "stride_po_tok", "stride_po_head",
                  "stride_po_split", "stride_lse_tok", "stride_lse_head", "max_kv_len")


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(f"tsdecode.kernels.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the module look themselves up here
    spec.loader.exec_module(module)
    return module


def compile_split(module, kv: str, block_n: int, warps: int, stages: int, splits: int,
                  maxnreg: int | None = None, group: int = 4, block_m: int = 16,
                  transposed: bool = False):
    """triton.compile of the split kernel for sm90; kv: 'bf16', 'fp16' or 'fp8e4nv'."""
    fn = module._split_kv_kernel
    q = "bf16" if kv in ("bf16", "fp8e4nv") else kv
    compute = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp8e4nv": tl.float16}[kv]
    types = dict(q_ptr=f"*{q}", k_ptr=f"*{kv}", v_ptr=f"*{kv}", block_tables_ptr="*i32",
                 seq_lens_ptr="*i32", qo_indptr_ptr="*i32", out_ptr=f"*{q}", partial_o_ptr="*fp32",
                 partial_lse_ptr="*fp32", qk_scale_log2="fp32", bmm2_scale="fp32")
    constexprs = dict(GROUP_SIZE=group, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, SEQ_LEN_Q=1, PACKED=False,
                      CAUSAL=False, WINDOW=False, NUM_M_BLOCKS=1, BLOCK_M=block_m, BLOCK_N=block_n,
                      DIRECT_OUT=splits == 1, USE_DOT=True, DOT_FP32=False, COMPUTE_DTYPE=compute,
                      NUM_STAGES=stages, USE_PDL=True,
                      # a constexpr of branch exp/fp8-v-convert-first's decode.py (--source it)
                      **({"CONVERT_V_FIRST": kv == "fp8e4nv"} if "CONVERT_V_FIRST" in fn.arg_names else {}),
                      **({"TRANSPOSED": transposed} if "TRANSPOSED" in fn.arg_names else {}))
    signature, values = {}, {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name], values[name] = "constexpr", constexprs[name]
        else:
            signature[name] = types.get(name, "i32")
    for i, p in enumerate(fn.params):  # constexprs with defaults (not set above) keep them
        if p.is_constexpr and p.name not in values:
            signature[p.name], values[p.name] = "constexpr", p.default
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name in POINTERS or name in DIVISIBLE_INTS}
    source = ASTSource(fn=fn, signature=signature, constexprs=values, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages,
                                       **({"maxnreg": maxnreg} if maxnreg else {})))


def disassemble(kernel) -> tuple[str, str]:
    """(SASS text, cuobjdump resource usage) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True,
                              text=True, check=True).stdout
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    return sass, usage


def opcodes(sass: str) -> list[str]:
    return re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M)


def strip_locations(text: str) -> list[str]:
    lines = (re.sub(r"loc\([^)]*\)|#loc\d*", "", line).rstrip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#loc")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-dtype", default="fp8e4nv", choices=("bf16", "fp16", "fp8e4nv"))
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--splits", type=int, default=6, help="1 compiles the direct-output variant")
    ap.add_argument("--maxnreg", type=int, default=None, help="triton's register cap (compile option)")
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head (G)")
    ap.add_argument("--block-m", type=int, default=16, help="packed query rows per program")
    ap.add_argument("--transposed", action="store_true", help="S^T = K Q^T, O^T = V^T P^T form")
    ap.add_argument("--source", default=DEFAULT_SOURCE)
    ap.add_argument("--compare", default=None, help="another decode.py: diff TTIR, TTGIR, SASS")
    args = ap.parse_args(argv)
    opts = (args.kv_dtype, args.block_n, args.warps, args.stages, args.splits)
    shape = dict(group=args.group, block_m=args.block_m, transposed=args.transposed)
    kernel = compile_split(load_module(args.source, "counted"), *opts, maxnreg=args.maxnreg, **shape)
    sass, usage = disassemble(kernel)
    ops = opcodes(sass)
    regs = re.search(r"REG:(\d+)", usage)
    print(f"triton {triton.__version__}, sm90, kv {args.kv_dtype}, block_n {args.block_n}, "
          f"{args.warps} warps, {args.stages} stages, {args.splits} splits")
    spill = re.search(r"LOCAL:(\d+)", usage)
    print(f"registers {regs.group(1) if regs else '?'}, local (spill) {spill.group(1) if spill else '?'} B, "
          f"shared {kernel.metadata.shared} B, "
          f"{len(ops)} SASS instructions")
    print("by opcode:", ", ".join(f"{k} {v}" for k, v in
                                  collections.Counter(o.split(".")[0] for o in ops).most_common(20)))
    memory = collections.Counter(o for o in ops if re.match(r"(LDG|LDS|STS|LDSM|STSM|LDGSTS|F2FP)", o))
    print("memory and conversions:", ", ".join(f"{k} {v}" for k, v in memory.most_common()))
    if args.compare:
        other = compile_split(load_module(args.compare, "compared"), *opts, maxnreg=args.maxnreg, **shape)
        other_sass, _ = disassemble(other)
        for name, a, b in (("ttir", kernel.asm["ttir"], other.asm["ttir"]),
                           ("ttgir", kernel.asm["ttgir"], other.asm["ttgir"]),
                           ("sass", sass, other_sass)):
            same = strip_locations(a) == strip_locations(b)
            print(f"{name}: {'identical' if same else 'differs'} (source locations ignored)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
