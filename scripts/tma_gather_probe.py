"""Does triton's tensor-descriptor gather (``desc.gather(rows, col)``) compile for sm90? No GPU needed.

Compiles a 16-row bf16 gather through a host-side descriptor for sm90 and sm100 with the
installed triton and prints what ptxas says. Triton 3.6 lowers it to the TMA ``tile::gather4``
copy, which ptxas accepts only for sm_100 and newer: no TMA gather on the H100/H200.
Usage: PYTHONPATH=/tmp/t36 python scripts/tma_gather_probe.py   (t36: see sass_count.py)
"""
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _gather_rows(desc, idx_ptr, out_ptr, N: tl.constexpr, D: tl.constexpr):
    rows = tl.load(idx_ptr + tl.arange(0, N))
    x = desc.gather(rows, 0)
    tl.store(out_ptr + tl.arange(0, N)[:, None] * D + tl.arange(0, D)[None, :], x)


def main() -> int:
    signature = {"desc": "tensordesc<bf16[1, 128]>", "idx_ptr": "*i32", "out_ptr": "*bf16",
                 "N": "constexpr", "D": "constexpr"}
    source = ASTSource(fn=_gather_rows, signature=signature, constexprs={"N": 16, "D": 128})
    print(f"triton {triton.__version__}")
    for cc in (90, 100):
        try:
            ptx = triton.compile(source, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=4)).asm["ptx"]
            print(f"sm{cc}: compiled, {ptx.count('tile::gather4')} tile::gather4 copies")
        except Exception as e:  # ptxas's message names the feature and the target it needs
            lines = [ln for ln in str(e).splitlines() if "requires" in ln] or str(e).splitlines()[:1]
            print(f"sm{cc}: failed: {lines[0].strip()[:200]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
