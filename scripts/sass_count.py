"""SASS instruction counts, registers and shared memory of the split kernel for sm90, offline.

Compiles ``_split_kv_kernel`` for one config without a GPU (triton's bundled ptxas), specialised
as the runtime's launch specialises it (``tsdecode.kernels.launch``: the plan's constexprs, the
product form ``transposed_products`` picks unless forced, PDL on as on sm90; pointers 16-byte
aligned and each integer argument as triton specialises its value, for a contiguous q [B, Hq, D]
and combined cache [pages, 2, Hkv, P, D] and a block table padded to 16 columns). Prints
registers, spills, shared memory, the instruction count per opcode and the memory / conversion
instructions. ``--source`` compiles another copy of decode.py; ``--compare`` diffs TTIR, TTGIR
and SASS of two copies (e.g. to show a constexpr-gated change leaves every other variant's
machine code alone); a decode.py inside another source tree's ``tsdecode/kernels/`` that imports
its package is loaded with that tree. ``--compare-tree ROOT`` compiles a grid of variants (five
q/cache dtype pairs x dense, causal and windowed masks x five configs), each with its own tree's
kernel and launcher constexprs, and lists those whose SASS differs from this tree's: a change whose
other variants compile to the same machine code cannot change their speed. Codegen differs
between triton versions: this counts what the installed triton emits. To count what another
version emits: ``pip download triton==X --no-deps``, ``pip install --no-deps --target /tmp/tX <the
wheel>``, run with ``PYTHONPATH=/tmp/tX``.

Usage: python scripts/sass_count.py [--kv-dtype fp8e4nv] [--block-n 64] [--block-m 16] [--warps 2]
       [--stages 2] [--splits 6] [--group 4] [--head-dim 128] [--page-size 16]
       [--transposed | --standard] [--maxnreg 128] [--source decode.py] [--compare other/decode.py]
       python scripts/sass_count.py --compare-tree /path/to/other/tree [--grid-filter TEXT ...]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
os.environ["TRITON_INTERPRET"] = "0"  # compiles for sm90: never the interpreter
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tsdecode.config.space import KernelConfig, ProblemShape  # noqa: E402
from tsdecode.kernels import launch as this_launch  # noqa: E402

DEFAULT_SOURCE = os.path.join(os.path.dirname(__file__), "..", "tsdecode", "kernels", "decode.py")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8e4nv": torch.float8_e4m3fn}
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
                torch.float32: "fp32", torch.int32: "i32"}
BLOCK_TABLE_COLUMNS = 16  # tuner.measure.make_inputs pads rows to a multiple of 16


def load_module(path: str, name: str):
    """A decode.py as a module: standalone, or, where it imports its package, with that package
    (another source tree's tsdecode loaded as ``tsdecode_other``)."""
    spec = importlib.util.spec_from_file_location(f"tsdecode.kernels.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the module look themselves up here
    try:
        spec.loader.exec_module(module)
        return module
    except ImportError:
        del sys.modules[spec.name]
        kernels = os.path.dirname(os.path.abspath(path))
        if os.path.basename(kernels) != "kernels" or os.path.basename(os.path.dirname(kernels)) != "tsdecode":
            raise
    from ab_trees import load_other_tree

    load_other_tree(os.path.dirname(os.path.dirname(kernels)))
    return importlib.import_module(f"tsdecode_other.kernels.{os.path.basename(path)[:-3]}")


def launch_arguments(shape: ProblemShape, config: KernelConfig, transposed: bool | None,
                     launch=this_launch) -> tuple[dict, dict]:
    """({runtime argument: value}, {constexpr: value}) of the split kernel as ``launch`` (a tree's
    ``tsdecode.kernels.launch``) launches it on sm90 (tensors as CPU stand-ins of the right dtype)."""
    splits = config.num_kv_splits
    total_q = shape.batch_size * shape.max_seq_len_q
    hq, hkv, d, p = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.page_size
    sq = shape.max_seq_len_q
    # q and out contiguous, (batch, token, head) strides: [B, Hq, D], or [B, SQ, Hq, D]
    q_strides = (hq * d, 0, d) if sq == 1 else (sq * hq * d, hq * d, d)
    partials = None
    if splits > 1:
        partials = partial_o, partial_lse = launch.allocate_partials(shape, config, total_q, torch.device("cpu"))
        po_strides, lse_strides = partial_o.stride()[:3], partial_lse.stride()[:2]
    else:
        partial_o = partial_lse = torch.empty(1, dtype=shape.o_dtype)
        po_strides, lse_strides = (0, 0, 0), (0, 0)
    values = dict(
        q_ptr=torch.empty(1, dtype=shape.q_dtype), k_ptr=torch.empty(1, dtype=shape.kv_dtype),
        v_ptr=torch.empty(1, dtype=shape.kv_dtype), block_tables_ptr=torch.empty(1, dtype=torch.int32),
        seq_lens_ptr=torch.empty(1, dtype=torch.int32), qo_indptr_ptr=torch.empty(1, dtype=torch.int32),
        out_ptr=torch.empty(1, dtype=shape.o_dtype), partial_o_ptr=partial_o, partial_lse_ptr=partial_lse,
        qk_scale_log2=1.0, bmm2_scale=1.0, window_left=shape.window_left, max_kv_len=shape.max_kv_len,
        num_kv_heads=hkv, num_kv_splits=splits,
        stride_q_batch=q_strides[0], stride_q_tok=q_strides[1], stride_q_head=q_strides[2],
        stride_o_batch=q_strides[0], stride_o_tok=q_strides[1], stride_o_head=q_strides[2],
        stride_k_page=2 * hkv * p * d, stride_k_head=p * d, stride_v_page=2 * hkv * p * d, stride_v_head=p * d,
        stride_bt_row=BLOCK_TABLE_COLUMNS, stride_po_tok=po_strides[0], stride_po_head=po_strides[1],
        stride_po_split=po_strides[2], stride_lse_tok=lse_strides[0], stride_lse_head=lse_strides[1],
    )
    plan = launch.DecodeLaunch(shape, config, total_q, torch.device("cpu"), partials, transposed=transposed)
    # the launcher's own constexprs, as on sm90: PDL on (it is off for a CPU device), no interpreter
    constexprs = dict(plan._split_constexprs, USE_PDL=True, DOT_FP32=False)
    return values, constexprs


def compile_split(module, shape: ProblemShape, config: KernelConfig, transposed: bool | None = None,
                  maxnreg: int | None = None, launch=this_launch):
    """triton.compile of ``module._split_kv_kernel`` for sm90, specialised as ``launch`` launches it."""
    fn = module._split_kv_kernel
    values, constexprs = launch_arguments(shape, config, transposed, launch)
    unspecialised = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize or ()}
    signature, fixed, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            if name in constexprs:
                fixed[name] = constexprs[name]
            elif param.has_default:
                fixed[name] = param.default
            else:
                raise SystemExit(f"{name}: a constexpr of this decode.py that sass_count.py does not set")
            signature[name] = "constexpr"
            continue
        if name not in values:  # an argument of another copy of the kernel: a plain int
            signature[name] = "i32"
            continue
        kind, key = native_specialize_impl(BaseBackend, values[name], False, name not in unspecialised, True)
        if isinstance(values[name], torch.Tensor):
            kind = "*" + TRITON_TYPES[values[name].dtype]
            key = "D"  # the launch's tensors are 16-byte aligned
        if kind == "constexpr":  # an integer argument equal to 1
            signature[name], fixed[name] = "constexpr", key
            continue
        signature[name] = kind
        if isinstance(key, str) and name not in unspecialised:
            parsed = BaseBackend.parse_attr(key)
            if parsed:
                attrs[(i,)] = parsed
    source = ASTSource(fn=fn, signature=signature, constexprs=fixed, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=config.num_warps, num_stages=config.num_stages,
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


# (cache, q) dtypes: output float16 for an fp8 q, else q's dtype
GRID_DTYPES = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.float8_e4m3fn, torch.float16), (torch.float8_e4m3fn, torch.bfloat16),
               (torch.float8_e4m3fn, torch.float8_e4m3fn))
GRID_MASKS = (("dense", 1, -1), ("causal", 3, -1), ("windowed", 2, 100))  # (mask kind, SQ, window_left)
# (G, D, P, block_m, block_n, splits, warps, stages): tl.dot and FMA products, one split and several
GRID_CONFIGS = ((4, 128, 16, 16, 64, 1, 4, 2), (8, 128, 16, 16, 16, 4, 1, 5), (1, 64, 3, 4, 32, 2, 2, 3),
                (16, 256, 16, 16, 32, 8, 8, 3), (2, 128, 64, 16, 128, 1, 1, 3))


def grid_variants():
    """(label, shape, config) of every variant ``--compare-tree`` compiles."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8"}
    for kv, q in GRID_DTYPES:
        out = torch.float16 if q.itemsize == 1 else q
        for g, d, p, block_m, block_n, splits, warps, stages in GRID_CONFIGS:
            for mask, sq, window in GRID_MASKS:
                shape = ProblemShape(batch_size=4, num_qo_heads=8 * g, num_kv_heads=8, head_dim=d, page_size=p,
                                     max_kv_len=4096, max_seq_len_q=sq, mask_kind=mask, q_dtype=q, kv_dtype=kv,
                                     o_dtype=out, window_left=window)
                config = KernelConfig(block_n=block_n, block_m=block_m, num_kv_splits=splits, num_warps=warps,
                                      num_stages=stages)
                yield (f"kv {name[kv]} q {name[q]} {mask} SQ {sq} G {g} D {d} P {p} block_n {block_n} "
                       f"block_m {block_m} splits {splits} warps {warps} stages {stages}"), shape, config


def compare_trees(root: str, grid_filter: list[str]) -> int:
    """Compile each grid variant (whose label holds every text of ``grid_filter``) with this tree
    and the tree at ``root``; print whether its SASS differs. Returns how many differ."""
    from ab_trees import load_other_tree

    load_other_tree(root)
    other_decode = importlib.import_module("tsdecode_other.kernels.decode")
    other_launch = importlib.import_module("tsdecode_other.kernels.launch")
    this_decode = importlib.import_module("tsdecode.kernels.decode")
    variants = [v for v in grid_variants() if all(text in v[0] for text in grid_filter)]
    differ = 0
    for label, shape, config in variants:
        ours = compile_split(this_decode, shape, config)
        theirs = compile_split(other_decode, shape, config, launch=other_launch)
        same = strip_locations(disassemble(ours)[0]) == strip_locations(disassemble(theirs)[0])
        differ += not same
        print(f"{'identical' if same else 'DIFFERS  '}  {label}", flush=True)
    print(f"triton {triton.__version__}, sm90: {differ} of {len(variants)} variants' SASS differs from {root}'s "
          "(source locations ignored)")
    return differ


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-dtype", default="fp8e4nv", choices=tuple(KV_DTYPES), help="K/V cache dtype (q and "
                    "output: bf16 over an fp8 cache, else the cache's)")
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--block-m", type=int, default=16, help="packed query rows per program")
    ap.add_argument("--warps", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--splits", type=int, default=6, help="1 compiles the direct-output variant")
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head (G; Hkv = 8)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    form = ap.add_mutually_exclusive_group()
    form.add_argument("--transposed", action="store_const", const=True, dest="form",
                      help="force S^T = K Q^T, O^T = V^T P^T (default: the launcher's choice)")
    form.add_argument("--standard", action="store_const", const=False, dest="form",
                      help="force S = Q K^T, O = P V")
    ap.add_argument("--maxnreg", type=int, default=None, help="triton's register cap (a compile option)")
    ap.add_argument("--source", default=DEFAULT_SOURCE)
    ap.add_argument("--compare", default=None, help="another decode.py: diff TTIR, TTGIR, SASS")
    ap.add_argument("--compare-tree", default=None, metavar="ROOT",
                    help="another source tree: list the grid's variants whose SASS differs from this tree's")
    ap.add_argument("--grid-filter", action="append", default=[], metavar="TEXT",
                    help="with --compare-tree: only the variants whose label contains TEXT (e.g. 'kv fp8 q bf16'; "
                    "repeated: every TEXT)")
    args = ap.parse_args(argv)
    if args.compare_tree:
        compare_trees(args.compare_tree, args.grid_filter)
        return 0
    kv = KV_DTYPES[args.kv_dtype]
    io = torch.bfloat16 if kv.itemsize == 1 else kv
    shape = ProblemShape(batch_size=1, num_qo_heads=8 * args.group, num_kv_heads=8, head_dim=args.head_dim,
                         page_size=args.page_size, max_kv_len=8192, q_dtype=io, kv_dtype=kv, o_dtype=io)
    config = KernelConfig(block_n=args.block_n, block_m=args.block_m, num_kv_splits=args.splits,
                          num_warps=args.warps, num_stages=args.stages)
    config.validate()
    kernel = compile_split(load_module(args.source, "counted"), shape, config, args.form, args.maxnreg)
    sass, usage = disassemble(kernel)
    ops = opcodes(sass)
    regs = re.search(r"REG:(\d+)", usage)
    spill = re.search(r"LOCAL:(\d+)", usage)
    form_name = {True: "transposed", False: "standard", None: "launcher's"}[args.form]
    print(f"triton {triton.__version__}, sm90, kv {args.kv_dtype}, G {args.group}, D {args.head_dim}, "
          f"P {args.page_size}, block_n {args.block_n}, block_m {args.block_m}, {args.warps} warps, "
          f"{args.stages} stages, {args.splits} splits, {form_name} product form")
    print(f"registers {regs.group(1) if regs else '?'}, local (spill) {spill.group(1) if spill else '?'} B, "
          f"shared {kernel.metadata.shared} B, {len(ops)} SASS instructions")
    print("by opcode:", ", ".join(f"{k} {v}" for k, v in
                                  collections.Counter(o.split(".")[0] for o in ops).most_common(20)))
    memory = collections.Counter(o for o in ops if re.match(r"(LDG|LDS|STS|LDSM|STSM|LDGSTS|F2FP)", o))
    print("memory and conversions:", ", ".join(f"{k} {v}" for k, v in memory.most_common()))
    if args.compare:
        other = compile_split(load_module(args.compare, "compared"), shape, config, args.form, args.maxnreg)
        other_sass, _ = disassemble(other)
        for name, a, b in (("ttir", kernel.asm["ttir"], other.asm["ttir"]),
                           ("ttgir", kernel.asm["ttgir"], other.asm["ttgir"]),
                           ("sass", sass, other_sass)):
            same = strip_locations(a) == strip_locations(b)
            print(f"{name}: {'identical' if same else 'differs'} (source locations ignored)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
