"""fp8 caches: tsdecode's error against an exact reference is no larger than that of FlashInfer's
own fp8 oracle.

FlashInfer's PrimTS decode tests check fp8 outputs against an oracle that models their kernel: the
softmax numerators, scaled so the running maximum maps to 448 (e4m3's largest value) in 128-token
tiles, are rounded to e4m3 before P @ V, while the denominators sum the unrounded values. tsdecode
keeps P in higher precision (fp16 operands, fp32 accumulation). At each shape this test computes

  (a) an exact reference: float64 attention on the dequantized K/V (the stored e4m3 values, the
      scales folded into bmm1_scale / bmm2_scale as FlashInfer's callers do),
  (b) FlashInfer's oracle: the same float64 math with P rounded to e4m3 as above, its output
      rounded to the output dtype like a kernel's,
  (c) tsdecode's output,

and asserts that rel_err(c, a) <= rel_err(b, a) (with a small margin). The messages carry the
errors observed, the tolerance to quote: see ``test_fp8_error_is_no_larger_than_flashinfers_oracle``.
"""

from __future__ import annotations

import math

import pytest
import torch

import tsdecode
from tsdecode.reference import reference_decode

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn
BF16, FP16 = torch.bfloat16, torch.float16
P_SCALE = 448.0  # FlashInfer's oracle: the running maximum's probability maps to e4m3's largest value
P_TILE = 128  # ... in K/V tiles of 128 tokens
MARGIN = 1.05  # tsdecode's error may exceed the oracle's by 5% (plus ABS_SLACK) and still pass
ABS_SLACK = 1e-4


def make_problem(lens, num_qo_heads, num_kv_heads, head_dim, page_size, q_dtype, sharpness, seed):
    """FlashInfer's fixture: real values 0.25 * N(0, 1) (q's times ``sharpness``), stored in e4m3 as
    real / scale (q too when q is fp8), pages in random order, -1 past the live pages."""
    gen = torch.Generator().manual_seed(seed)
    q_scale = 0.5 if q_dtype == FP8 else 1.0
    k_scale, v_scale = 0.25, 0.75
    pages = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(pages) + 2
    q_real = 0.25 * sharpness * torch.randn(len(lens), num_qo_heads, head_dim, generator=gen)
    k_real = 0.25 * torch.randn(num_pages, num_kv_heads, page_size, head_dim, generator=gen)
    v_real = 0.25 * torch.randn(num_pages, num_kv_heads, page_size, head_dim, generator=gen)
    q = (q_real / q_scale).to(q_dtype)
    cache = torch.stack([(k_real / k_scale).to(FP8), (v_real / v_scale).to(FP8)], dim=1)
    order = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(lens), max(pages) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    bmm1_scale = q_scale * k_scale / math.sqrt(head_dim)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32), bmm1_scale, v_scale


def flashinfer_oracle(q, cache, table, lens, bmm1_scale, bmm2_scale, p_dtype=FP8) -> torch.Tensor:
    """float64 decode (SQ = 1, dense) with FlashInfer's fp8 P: per request and query head, over
    128-token tiles, p = 448 * exp(s - running max) rounded to e4m3 (``p_dtype``) for P @ V; the
    denominator sums the unrounded p."""
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads, page_size = cache.shape[2], cache.shape[3]
    group = num_qo_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        ids = table[b, :math.ceil(n / page_size)].long()
        k, v = (cache[ids, i].double().permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :n]
                .repeat_interleave(group, dim=0) for i in (0, 1))  # [Hq, n, D]
        s = torch.einsum("hd,hnd->hn", q[b].double(), k) * bmm1_scale
        m = torch.full((num_qo_heads,), -math.inf, dtype=torch.float64)
        denom = torch.zeros(num_qo_heads, dtype=torch.float64)
        acc = torch.zeros(num_qo_heads, head_dim, dtype=torch.float64)
        for t in range(0, n, P_TILE):
            tile = s[:, t:t + P_TILE]
            m_new = torch.maximum(m, tile.max(dim=1).values)
            p = torch.exp(tile - m_new[:, None]) * P_SCALE
            p_e4m3 = p.float().to(p_dtype).double()
            correction = torch.exp(m - m_new)
            denom = denom * correction + p.sum(dim=1)
            acc = acc * correction[:, None] + torch.einsum("hn,hnd->hd", p_e4m3, v[:, t:t + P_TILE])
            m = m_new
        out[b] = bmm2_scale * acc / denom[:, None]
    return out


def rel_err(x: torch.Tensor, exact: torch.Tensor) -> float:
    x, exact = x.double().cpu(), exact.double().cpu()
    return float((x - exact).norm() / exact.norm())


def compare(lens, num_qo_heads, num_kv_heads, head_dim, page_size, q_dtype, out_dtype, sharpness, config=None,
            seed=0) -> tuple[float, float, str]:
    """(tsdecode's error, the oracle's error, a description) against the exact reference."""
    q, cache, table, seq_lens, bmm1, bmm2 = make_problem(lens, num_qo_heads, num_kv_heads, head_dim, page_size,
                                                         q_dtype, sharpness, seed)
    exact = reference_decode(q, cache, table, seq_lens, bmm1_scale=bmm1, bmm2_scale=bmm2)
    oracle = flashinfer_oracle(q, cache, table, seq_lens, bmm1, bmm2).to(out_dtype)
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(DEVICE, len(lens), num_qo_heads, num_kv_heads, head_dim, page_size, max(lens), q_data_type=q_dtype,
           kv_data_type=FP8, o_data_type=out_dtype, seq_lens=list(lens), config=config)
    out = torch.full(q.shape, float("nan"), dtype=out_dtype, device=DEVICE)
    w.run(q.to(DEVICE), cache.to(DEVICE), None, table.to(DEVICE), bmm1_scale=bmm1, bmm2_scale=bmm2, out=out)
    assert torch.isfinite(out.double()).all(), "unwritten output elements"
    ours, theirs = rel_err(out, exact), rel_err(oracle, exact)
    where = (f"B={len(lens)} lens={tuple(lens)} Hq={num_qo_heads} Hkv={num_kv_heads} D={head_dim} P={page_size} "
             f"q={str(q_dtype).removeprefix('torch.')} out={str(out_dtype).removeprefix('torch.')} "
             f"sharpness={sharpness} splits={w.config.kernel_config.num_kv_splits}")
    return ours, theirs, where


def assert_no_worse(ours: float, theirs: float, where: str) -> None:
    message = (f"{where}: tsdecode rel L2 err {ours:.3e}, FlashInfer's fp8 oracle (P in e4m3) {theirs:.3e}, "
               f"ratio {ours / theirs:.3f}")
    print(message)
    assert ours <= MARGIN * theirs + ABS_SLACK, message


CPU_SHAPES = [  # (lens, Hq, Hkv, D, P, sharpness, config)
    ((100, 300), 8, 2, 64, 16, 1.0, None),
    ((517,), 4, 1, 128, 32, 1.0, None),
    ((1, 40, 129), 8, 1, 64, 16, 4.0, None),
    ((260, 33), 16, 2, 64, 16, 4.0, tsdecode.KernelConfig(block_n=32, block_m=16, num_kv_splits=3)),
]


@pytest.mark.parametrize("lens,hq,hkv,d,p,sharpness,config", CPU_SHAPES,
                         ids=[f"s{i}" for i in range(len(CPU_SHAPES))])
def test_fp8_error_is_no_larger_than_flashinfers_oracle(lens, hq, hkv, d, p, sharpness, config):
    """bf16 q over an fp8 cache, fp16 output (CPU: Triton's interpreter). tsdecode's relative L2
    error to the exact reference stays well under 1% where FlashInfer's oracle is at ~1-4%."""
    ours, theirs, where = compare(lens, hq, hkv, d, p, BF16, FP16, sharpness, config)
    assert_no_worse(ours, theirs, where)
    assert ours < 5e-3, where


GPU_SHAPES = [  # (lens, Hq, Hkv, D, P, q dtype, sharpness, config)
    ((8192,), 32, 8, 128, 16, BF16, 1.0, None),
    ((1000, 4099, 17, 2048), 32, 8, 128, 16, BF16, 4.0, None),
    ((300,) * 64, 64, 8, 128, 32, BF16, 2.0, None),
    ((5000, 77), 8, 1, 64, 64, BF16, 4.0, tsdecode.KernelConfig(block_n=64, block_m=16, num_kv_splits=8)),
    ((2048, 100), 16, 2, 256, 16, BF16, 1.0, None),
    ((8192,), 32, 8, 128, 16, FP8, 1.0, None),
    ((1000, 4099, 17, 2048), 32, 8, 128, 16, FP8, 4.0, None),
    ((300,) * 64, 32, 32, 128, 16, FP8, 2.0, None),
    ((5000, 77), 8, 1, 64, 64, FP8, 4.0, tsdecode.KernelConfig(block_n=16, block_m=16, num_kv_splits=5,
                                                               num_warps=1, num_stages=3)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("lens,hq,hkv,d,p,q_dtype,sharpness,config", GPU_SHAPES,
                         ids=[f"g{i}" for i in range(len(GPU_SHAPES))])
def test_fp8_error_is_no_larger_than_flashinfers_oracle_gpu(lens, hq, hkv, d, p, q_dtype, sharpness, config):
    """bf16 or fp8 q over an fp8 cache, fp16 output, on the GPU: longer requests, more heads,
    several splits."""
    ours, theirs, where = compare(lens, hq, hkv, d, p, q_dtype, FP16, sharpness, config)
    assert_no_worse(ours, theirs, where)
    assert ours < 5e-3, where


def test_the_oracle_models_p_in_e4m3():
    """The oracle without the rounding is the exact reference (so its error is the rounding's)."""
    q, cache, table, lens, bmm1, bmm2 = make_problem((300, 17), 4, 1, 64, 16, BF16, 1.0, seed=3)
    exact = reference_decode(q, cache, table, lens, bmm1_scale=bmm1, bmm2_scale=bmm2)
    oracle = flashinfer_oracle(q, cache, table, lens, bmm1, bmm2)
    assert 1e-3 < rel_err(oracle, exact) < 0.1
    unrounded = flashinfer_oracle(q, cache, table, lens, bmm1, bmm2, p_dtype=torch.float64)
    assert rel_err(unrounded, exact) < 1e-6


@pytest.mark.parametrize("splits", [1, 4], ids=["one-split", "merged"])
def test_fp8_output_rounds_each_element_to_nearest(splits):
    """fp8 q, cache and output (one split, and four merged). Each output element is the exact
    value rounded to e4m3: within one e4m3 step of it (an eighth of its binade; subnormals 2^-9),
    so a rounding that drops a carry into the exponent (0.49 -> 0.25) fails. Values span several
    binades (bmm2_scale 4)."""
    config = tsdecode.KernelConfig(block_n=16, block_m=16, num_kv_splits=splits)
    lens = (200, 37, 129)
    q, cache, table, seq_lens, bmm1, _ = make_problem(lens, 8, 2, 64, 16, FP8, 2.0, seed=5)
    exact = reference_decode(q, cache, table, seq_lens, bmm1_scale=bmm1, bmm2_scale=4.0)
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(DEVICE, len(lens), 8, 2, 64, 16, max(lens), q_data_type=FP8, kv_data_type=FP8,
           seq_lens=list(lens), config=config)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEVICE).to(FP8)
    w.run(q.to(DEVICE), cache.to(DEVICE), None, table.to(DEVICE), bmm1_scale=bmm1, bmm2_scale=4.0, out=out)
    got, want = out.double().cpu(), exact.double()
    assert torch.isfinite(got).all(), "unwritten output elements"
    assert want.abs().max() > 0.5 and (want.abs() < 0.05).any()  # several binades
    binade = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0 ** -6))))
    assert ((got - want).abs() <= binade / 8 + 2.0 ** -9).all(), (got - want).abs().max()
