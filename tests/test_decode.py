"""Kernel vs the float64 reference on random inputs, for every feature and their combinations.

Runs on the GPU when there is one, else through Triton's interpreter on CPU tensors. The CPU run
is a representative subset; ``test_gpu.py`` adds the full matrix and CUDA graphs on the GPU.
Every case runs through the wrapper in FlashInfer's call form, with the lengths owned by the plan
or passed to every run (``Case.lengths``), block-table rows padded with garbage or -1 past the
live pages, into a NaN-poisoned ``out``.
"""

import dataclasses
import threading

import pytest
import torch

import tsdecode
from tsdecode import KernelConfig, batch_decode_with_paged_kv_cache
from tsdecode.reference import reference_decode
from tsdecode.kernels import decode, launch
from cases import (DEVICE, FP8, Case, build, check, plan_wrapper, poisoned_out, reference, run_and_check,
                   run_oneshot, run_wrapper)

KC = KernelConfig
BF16, FP16 = torch.bfloat16, torch.float16

CASES = {
    # SQ = 1, the heuristic config, lengths 1 / page boundary / not a multiple of the tile
    "gqa-default": Case(lens=(1, 16, 33, 130)),
    "gqa-fp16": Case(dtype=FP16, lens=(5, 64, 100), lengths="run"),
    "mha-fma": Case(num_qo_heads=4, num_kv_heads=4, lens=(1, 31, 96)),
    "mqa-g8": Case(num_qo_heads=8, num_kv_heads=1, lens=(7, 48), lengths="run", max_kv_len=100),
    # one KV head of one request (B*Hkv = 1): the heuristic's split count hits its bound
    "mqa-b1": Case(num_qo_heads=8, num_kv_heads=1, lens=(70,)),
    "mqa-b1-fp8": Case(num_qo_heads=8, num_kv_heads=1, kv_dtype=torch.float8_e4m3fn, lens=(70,)),
    "g32-two-m-blocks": Case(num_qo_heads=32, num_kv_heads=1, lens=(9, 40), config=KC(block_n=16, block_m=16, num_kv_splits=2)),
    "g32-wide-rows-lean": Case(num_qo_heads=64, num_kv_heads=2, lens=(9, 140), config=KC(block_n=16, block_m=32, num_kv_splits=3, num_warps=1, num_stages=5)),
    # two row blocks of G x SQ = 32 rows: the second block's first query token (4) sets where its
    # programs' window starts
    "g4-sq8-window-two-m-blocks": Case(mode="fixed", seq_len_q=8, mask_type="causal", window_left=5, lens=(20, 70, 37),
                                       config=KC(block_n=16, block_m=16, num_kv_splits=2)),
    "g4-sq8-wide-rows-lean": Case(mode="fixed", seq_len_q=8, mask_type="causal", lens=(9, 70), config=KC(block_n=16, block_m=32, num_kv_splits=2, num_warps=1, num_stages=5)),
    # explicit configs: tiles, FMA/dot, splits (more splits than tiles for short requests)
    "splits-3-bn16": Case(lens=(1, 17, 100), config=KC(block_n=16, block_m=16, num_kv_splits=3)),
    "splits-7-bn32": Case(lens=(2, 200, 45), config=KC(block_n=32, block_m=16, num_kv_splits=7), lengths="run"),
    "fma-bm4": Case(lens=(3, 70), config=KC(block_n=16, block_m=4, num_kv_splits=2)),
    "fma-bm2-g4": Case(num_qo_heads=8, num_kv_heads=2, lens=(19, 50), config=KC(block_n=32, block_m=2, num_kv_splits=1)),
    "bn128-single-page": Case(page_size=128, lens=(1, 129, 300), config=KC(block_n=128, block_m=16, num_kv_splits=2)),
    # page sizes (P < block_n spans pages per tile; P >= block_n stays in one page)
    "page1": Case(page_size=1, lens=(1, 9, 23), lengths="run", pad_value=-1),
    "page3-odd": Case(page_size=3, lens=(4, 10)),
    "page8": Case(page_size=8, lens=(8, 41)),
    "page32": Case(page_size=32, lens=(32, 65), config=KC(block_n=16, block_m=16, num_kv_splits=2)),
    "page64": Case(page_size=64, lens=(64, 100)),
    "page256": Case(page_size=256, lens=(1, 257)),
    # head dims (96 and 192 are padded to the next power of two)
    "d96": Case(head_dim=96, lens=(5, 37)),
    "d128": Case(head_dim=128, lens=(5, 37)),
    "d192": Case(head_dim=192, lens=(5, 37), config=KC(block_n=16, block_m=16, num_kv_splits=2)),
    "d256": Case(head_dim=256, num_qo_heads=2, num_kv_heads=1, lens=(3, 20)),
    # the config model's 128-token tile of an fp8 D=256 cache (6 rows: the transposed products)
    "d256-fp8-bn128": Case(head_dim=256, num_qo_heads=12, num_kv_heads=2, kv_dtype=FP8, page_size=24,
                           lens=(5, 130, 300), config=KC(block_n=128, block_m=16, num_kv_splits=2, num_warps=4, num_stages=2)),
    # ... and of short requests, one split: a tile or two a request, the last one partly masked
    "d256-fp8-bn128-one-split": Case(head_dim=256, num_qo_heads=12, num_kv_heads=2, kv_dtype=FP8, page_size=8,
                                     lens=(1, 103, 215), config=KC(block_n=128, block_m=16, num_kv_splits=1, num_warps=4, num_stages=2)),
    # the model's one-tile programs of a small wide-family problem (D=256, pages across tiles)
    "d256-fp8-short": Case(head_dim=256, num_qo_heads=6, num_kv_heads=2, kv_dtype=FP8, page_size=8,
                           lens=(1, 100, 147), config=KC(block_n=32, block_m=16, num_kv_splits=5, num_warps=4, num_stages=2)),
    # four-warp fp8 tiles of 8K elements or more at one stage (the loads straight to registers):
    # a chain of tiles across pages, and the 128 x 256 tile at one split
    "d256-fp8-bn64-one-stage": Case(head_dim=256, num_qo_heads=10, num_kv_heads=2, kv_dtype=FP8, page_size=24,
                                    lens=(5, 130, 300), config=KC(block_n=64, block_m=16, num_kv_splits=2, num_warps=4, num_stages=1)),
    "d256-fp8-bn128-one-stage": Case(head_dim=256, num_qo_heads=12, num_kv_heads=2, kv_dtype=FP8, page_size=8,
                                     lens=(1, 103, 215), config=KC(block_n=128, block_m=16, num_kv_splits=1, num_warps=4, num_stages=1)),
    # four-warp programs of one 8K-element tile, one stage (the model's in place of one-warp
    # programs of two tiles): 128 tokens at D=64 over 3-token pages, 64 at D=128 of an fp8 cache
    "d64-bn128-four-warp-one-tile": Case(head_dim=64, num_qo_heads=16, num_kv_heads=2, page_size=3, lens=(2, 129, 300),
                                         config=KC(block_n=128, block_m=16, num_kv_splits=3, num_warps=4, num_stages=1)),
    "d128-fp8-bn64-four-warp-one-tile": Case(head_dim=128, num_qo_heads=12, num_kv_heads=2, kv_dtype=FP8, page_size=2,
                                             lens=(64, 65, 190), config=KC(block_n=64, block_m=16, num_kv_splits=3, num_warps=4, num_stages=1)),
    # fp8 programs of many rows short of warps: one 256-token tile a program at D = 128, no pipeline
    "d128-fp8-bn256-four-warp-one-tile": Case(head_dim=128, num_qo_heads=30, num_kv_heads=2, kv_dtype=FP8, page_size=16,
                                              lens=(1, 256, 300, 513), config=KC(block_n=256, block_m=16, num_kv_splits=3,
                                                                                 num_warps=4, num_stages=1)),
    # four-warp fp8 programs of one 32-token tile gathering two 16-token pages, no pipeline
    "d128-fp8-bn32-four-warp-one-stage": Case(head_dim=128, num_qo_heads=16, num_kv_heads=2, kv_dtype=FP8, page_size=16,
                                              lens=(1, 17, 60, 96), config=KC(block_n=32, block_m=16, num_kv_splits=3,
                                                                              num_warps=4, num_stages=1)),
    # four-warp programs no more than the SMs, one tile holding the whole request (one split): 256
    # tokens at D=64 over 3-token pages, two stages; 128 at D=128 of an fp8 cache over 4-token
    # pages, no pipeline; 128 at D=64 over one-token pages
    "d64-bn256-four-warp-whole-request": Case(head_dim=64, num_qo_heads=20, num_kv_heads=2, page_size=3,
                                              lens=(1, 130, 218), config=KC(block_n=256, block_m=16, num_kv_splits=1,
                                                                            num_warps=4, num_stages=2)),
    "d128-fp8-bn128-four-warp-whole-request": Case(head_dim=128, num_qo_heads=14, num_kv_heads=2, kv_dtype=FP8,
                                                   page_size=4, lens=(1, 64, 105),
                                                   config=KC(block_n=128, block_m=16, num_kv_splits=1, num_warps=4,
                                                             num_stages=1)),
    "d64-page1-bn128-four-warp-whole-request": Case(head_dim=64, num_qo_heads=24, num_kv_heads=2, page_size=1,
                                                    lens=(2, 77, 105), pad_value=-1,
                                                    config=KC(block_n=128, block_m=16, num_kv_splits=1, num_warps=4,
                                                              num_stages=2)),
    # eight-warp programs no more than the SMs, one 32K-element tile holding the whole request, no
    # pipeline: 256 tokens at D=128 over 24-token pages (16 and 32 query rows a program); 128 at D=256
    # of an fp8 cache over 16-token pages
    "d128-bn256-eight-warp-whole-request": Case(head_dim=128, num_qo_heads=14, num_kv_heads=2, page_size=24,
                                                lens=(1, 129, 200), config=KC(block_n=256, block_m=16, num_kv_splits=1,
                                                                              num_warps=8, num_stages=1)),
    "d128-g32-bn256-eight-warp-whole-request": Case(head_dim=128, num_qo_heads=32, num_kv_heads=1, page_size=24,
                                                    lens=(3, 256), config=KC(block_n=256, block_m=32, num_kv_splits=1,
                                                                             num_warps=8, num_stages=1)),
    "d256-fp8-bn128-eight-warp-whole-request": Case(head_dim=256, num_qo_heads=16, num_kv_heads=2, kv_dtype=FP8,
                                                    page_size=16, lens=(1, 64, 120),
                                                    config=KC(block_n=128, block_m=16, num_kv_splits=1, num_warps=8,
                                                              num_stages=1)),
    # four-warp programs that split a chain into one 64-token tile each, no pipeline (few programs
    # leaving SMs idle): D=256 over 64-token pages, D=128 over 24-token pages; one-split one-warp
    # 16-token programs over 8-token pages (short requests past half a wave)
    "d256-bn64-chain-split": Case(head_dim=256, num_qo_heads=30, num_kv_heads=2, page_size=64, lens=(1, 65, 173),
                                  config=KC(block_n=64, block_m=16, num_kv_splits=3, num_warps=4, num_stages=1)),
    "d128-bn64-chain-split": Case(head_dim=128, num_qo_heads=24, num_kv_heads=2, page_size=24, lens=(2, 64, 267),
                                  config=KC(block_n=64, block_m=16, num_kv_splits=5, num_warps=4, num_stages=1)),
    "d128-page8-bn16-one-split": Case(head_dim=128, num_qo_heads=12, num_kv_heads=4, page_size=8, lens=(1, 17, 179),
                                      config=KC(block_n=16, block_m=16, num_kv_splits=1, num_warps=1, num_stages=5)),
    # fixed SQ > 1, masks, windows
    "fixed-sq2-dense": Case(mode="fixed", seq_len_q=2, lens=(2, 40)),
    "fixed-sq4-causal": Case(mode="fixed", seq_len_q=4, mask_type="causal", lens=(4, 37, 70), lengths="run"),
    "fixed-sq3-causal-window": Case(mode="fixed", seq_len_q=3, mask_type="causal", window_left=5, lens=(3, 40), config=KC(block_n=16, block_m=16, num_kv_splits=3)),
    "window0": Case(mask_type="causal", window_left=0, lens=(1, 20)),
    "sq1-causal-window": Case(mask_type="causal", window_left=16, lens=(1, 17, 90), config=KC(block_n=16, block_m=16, num_kv_splits=2)),
    # packed queries
    "packed-dense": Case(mode="packed", q_lens=(1, 3, 2), lens=(5, 40, 17), lengths="run"),
    "packed-causal-window": Case(mode="packed", q_lens=(2, 4, 1), mask_type="causal", window_left=7, lens=(4, 33, 18), config=KC(block_n=16, block_m=8, num_kv_splits=2)),
    "packed-capacity": Case(mode="packed", q_lens=(1, 2), seq_len_q=5, lens=(3, 30)),
    # cache layouts and tables
    "separate-kv": Case(separate=True, lens=(7, 50), lengths="run", pad_value=-1),
    "padded-page-stride": Case(page_stride_pad=40, lens=(20, 33), config=KC(block_n=16, block_m=16, num_kv_splits=2)),
    "padded-table-shared-pages": Case(table_pad=5, shared_pages=True, lens=(18, 40, 3), pad_value=-1),
    # dtypes and scales
    "fp8-cache-bf16-q": Case(kv_dtype=FP8, lens=(5, 40), lengths="run", max_kv_len=64),
    "fp8-cache-fp16-q-fp32-out": Case(dtype=FP16, kv_dtype=FP8, out_dtype=torch.float32, lens=(9, 31)),
    "fp8-q-fp8-out": Case(dtype=FP8, kv_dtype=FP8, lens=(6, 40)),
    "fp8-q-bf16-out": Case(dtype=FP8, kv_dtype=FP8, out_dtype=BF16, lens=(6, 40)),
    "bf16-fp32-out": Case(out_dtype=torch.float32, lens=(12, 30)),
    "scales": Case(bmm1_scale=0.3, bmm2_scale=2.5, lens=(10, 44)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name):
    run_and_check(CASES[name])


@pytest.mark.parametrize("name", ["gqa-default", "packed-dense", "fixed-sq4-causal", "separate-kv", "fp8-cache-bf16-q"])
def test_oneshot_matches_reference(name):
    run_and_check(CASES[name], via="oneshot")


@pytest.mark.parametrize("name", ["gqa-fp16", "splits-7-bn32", "packed-causal-window", "page1"])
def test_unvalidated_run_matches_reference(name):
    """run(validate=False), the form a CUDA graph captures, computes the same answer."""
    run_and_check(CASES[name], validate=False)


# Cases with <= 8 query rows per KV head on the tl.dot path (either product form applies).
FORM_CASES = {name: CASES[name] for name in (
    "gqa-default", "mqa-g8", "splits-7-bn32", "bn128-single-page", "page3-odd", "d96", "fixed-sq2-dense",
    "sq1-causal-window", "padded-page-stride", "fp8-cache-bf16-q", "fp8-cache-fp16-q-fp32-out",
    "fp8-q-fp8-out", "scales")}
FORM_CASES["packed-causal-8-rows"] = Case(mode="packed", q_lens=(2, 1, 2), mask_type="causal", lens=(5, 40, 17))
FORM_CASES["fp8-mha-causal-sq2"] = Case(num_qo_heads=4, num_kv_heads=4, kv_dtype=FP8, mode="fixed", seq_len_q=2,
                                        mask_type="causal", lens=(2, 33, 70))


def force_product_form(monkeypatch, form: str) -> None:
    """Make the launcher take the standard ("0") or transposed ("1") form wherever the transposed
    one applies (tl.dot path, <= 8 rows per KV head), whatever the cache dtype."""
    monkeypatch.setattr(launch, "transposed_products",
                        lambda kv_dtype, rows, config: form == "1" and config.uses_dot and rows <= 8)


@pytest.mark.parametrize("form", ["0", "1"])
@pytest.mark.parametrize("name", list(FORM_CASES))
def test_both_product_forms(monkeypatch, form, name):
    """The standard (S = Q K^T) and transposed (S^T = K Q^T) split kernels, each forced on 16-bit
    and 8-bit caches alike (the rule picks one per dtype), match the reference."""
    force_product_form(monkeypatch, form)
    case = FORM_CASES[name]
    case = dataclasses.replace(case, config=case.config or KC(block_n=16, block_m=16, num_kv_splits=2))
    w = run_and_check(case)
    assert w._plan.launch._split_constexprs["TRANSPOSED"] is (form == "1")


def test_transposed_products_rule():
    """8-bit caches take the transposed form at <= 8 rows on the dot path; nothing else does.
    (The TSDECODE_TRANSPOSED switch that forced a form is gone: an A/B passes ``transposed=``
    to ``DecodeLaunch``, which the next test covers.)"""
    dot, fma = KC(block_n=16, block_m=16), KC(block_n=16, block_m=4)
    rule = launch.transposed_products
    assert rule(FP8, 4, dot) and rule(FP8, 1, dot) and rule(FP8, 8, dot)
    assert not rule(FP8, 9, dot) and not rule(FP8, 4, fma)
    assert not rule(BF16, 4, dot) and not rule(FP16, 1, dot)


@pytest.mark.parametrize("transposed", [None, False, True])
def test_launcher_takes_an_explicit_product_form(transposed):
    """``DecodeLaunch(transposed=...)`` overrides the rule (None keeps it): the explicit argument
    that replaced the import-time switch."""
    from tsdecode.config.space import ProblemShape

    shape = ProblemShape(batch_size=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                         max_kv_len=64, kv_dtype=FP8)
    config = KC(block_n=16, block_m=16)
    made = launch.DecodeLaunch(shape, config, 2, torch.device("cpu"), None, transposed=transposed)
    expected = launch.transposed_products(FP8, 4, config) if transposed is None else transposed
    assert made._split_constexprs["TRANSPOSED"] is expected


def test_every_config_same_answer():
    """Several configs on one problem agree with the reference (and so with each other)."""
    base = Case(lens=(2, 45, 130), mode="fixed", seq_len_q=2, mask_type="causal")
    for i, cfg in enumerate((
        KC(block_n=16, block_m=16, num_kv_splits=1, num_warps=1, num_stages=1),
        KC(block_n=32, block_m=32, num_kv_splits=4, num_warps=2, num_stages=3),
        KC(block_n=64, block_m=4, num_kv_splits=5, num_warps=8, num_stages=4),
        KC(block_n=16, block_m=1, num_kv_splits=9, num_warps=4, num_stages=2),
        KC(block_n=16, block_m=16, num_kv_splits=3, num_warps=1, num_stages=5),
    )):
        run_and_check(dataclasses.replace(base, config=cfg, lengths="run" if i % 2 else "plan"))


@pytest.mark.parametrize("kv_dtype", [FP8, BF16])
@pytest.mark.parametrize("config", [KC(block_n=16, block_m=16, num_kv_splits=1, num_warps=1, num_stages=5),
                                    KC(block_n=32, block_m=16, num_kv_splits=3, num_warps=2, num_stages=3)])
def test_scores_rising_along_the_sequence(kv_dtype, config):
    """Scores that rise by ~1.2 (log2 units) a token, ~350 over a request: the online softmax's
    running max grows on every tile, and a rescale skipped or applied with a stale max overflows
    (fp32 past 2**128, fp16 probabilities past 2**16). K[j] = c_j * u, q = u, c_j in [0, 30]."""
    case = Case(kv_dtype=kv_dtype, lens=(300, 37), config=config)
    inp = build(case)
    gen = torch.Generator().manual_seed(3)
    u = torch.randint(0, 2, (case.head_dim,), generator=gen).float() * 2 - 1
    k = inp.cache[:, 0]  # [pages, Hkv, P, D] view of the combined cache
    for b, n in enumerate(case.lens):
        for j in range(n):
            page = int(inp.block_tables[b, j // case.page_size])
            k[page, :, j % case.page_size] = (30.0 * j / (n - 1) * u).to(kv_dtype).to(k.device)
    inp.q.copy_(u.expand_as(inp.q).to(inp.q.dtype))
    ref = reference(case, inp)
    w = plan_wrapper(case, inp)
    out = poisoned_out(case, inp)
    run_wrapper(w, case, inp, out=out)
    check(case, out, ref)


@pytest.mark.parametrize("validate", [True, False])
def test_run_owned_lengths_and_pages_read_on_every_run(validate):
    """Lengths passed to every run (the plan does not own them): each run reads the tensor's
    current values, changed in place between runs anywhere in [1, max_kv_len]; page IDs remapped
    in place in the block table are read too. (Replaces bind_seq_lens=True, which bound the
    caller's tensor at plan.)"""
    case = Case(lens=(20, 64, 33), config=KC(block_n=16, block_m=16, num_kv_splits=3), lengths="run",
                max_kv_len=64, extra_cols=0)
    inp = build(case)  # C = 4 columns: row 1 uses all of them
    w = plan_wrapper(case, inp)
    out = poisoned_out(case, inp)
    run_wrapper(w, case, inp, out=out, validate=validate)
    check(case, out, reference(case, inp))
    # new lengths in place; rows 0 and 2 now need all 4 columns: valid IDs there first
    for b in (0, 2):
        for col in range(4):
            if not 0 <= int(inp.block_tables[b, col]) < inp.num_pages:
                inp.block_tables[b, col] = (b * 4 + col) % inp.num_pages
    inp.seq_lens.copy_(torch.tensor([64, 1, 50], dtype=torch.int32))
    # remap: move request 1's live page and request 2's second page to other pool pages
    for b, col in ((1, 0), (2, 1)):
        new = (int(inp.block_tables[b, col]) + 1) % inp.num_pages
        inp.cache[new].copy_(torch.randn(inp.cache[new].shape).to(inp.cache.dtype))
        inp.block_tables[b, col] = new
    out.fill_(float("nan"))
    run_wrapper(w, case, inp, out=out, validate=validate)
    check(case, out, reference(case, inp))


@pytest.mark.parametrize("splits", [1, 2])
def test_an_unvalidated_length_above_max_kv_len_is_cut_to_it(splits):
    """run(validate=False) does not check lengths (docs/api.md): one above the plan's max_kv_len is
    cut to it, so the kernel walks no block-table column past the plan's capacity. Here the table
    has exactly those two columns; a length of 60 left uncut would read the next row's page IDs."""
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(10, 2, 1, 16, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    q = torch.randn(2, 4, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    bt = torch.tensor([[0, 1], [8, 9]], dtype=torch.int32, device=DEVICE)
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(DEVICE, 2, 4, 1, 64, 16, 32, q_data_type=torch.bfloat16,
           config=KernelConfig(block_n=16, block_m=16, num_kv_splits=splits))
    cut = torch.tensor([32, 32], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    w.run(q, cache, torch.tensor([60, 32], dtype=torch.int32, device=DEVICE), bt, out=out, validate=False)
    ref = reference_decode(q, cache, bt, cut)
    assert torch.allclose(out.double(), ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(out, w.run(q, cache, cut, bt, validate=False))


def test_run_owned_lengths_accept_garbage_past_live_pages_up_to_max_kv_len():
    """With lengths passed per run and max_kv_len far beyond them, the block table's columns past
    each request's live pages may hold anything (garbage, -1, out-of-range IDs): only live pages
    are read and checked. (Replaces "a bound plan validates columns up to max_kv_len", which
    refused such padding.)"""
    case = Case(lens=(20, 64, 33), lengths="run", max_kv_len=4096, extra_cols=3)
    inp = build(case)
    bt = inp.block_tables
    bt[0, 2:] = -1
    bt[2, 3:] = 10**9
    w = plan_wrapper(case, inp)
    out = poisoned_out(case, inp)
    run_wrapper(w, case, inp, out=out)
    check(case, out, reference(case, inp))
    bt[1, 3] = -1  # a live page: refused by a validated run
    with pytest.raises(ValueError, match="negative page ID"):
        run_wrapper(w, case, inp)


def test_plan_owned_lengths_are_copied_at_plan():
    """Lengths given to plan (a CPU tensor here) are the plan's own: changing the caller's tensor
    after plan has no effect. (Was: plan copies an unbound seq_lens_kv.)"""
    case = Case(lens=(20, 40))
    inp = build(case)
    host = torch.tensor(case.lens, dtype=torch.int64)
    w = plan_wrapper(case, inp, seq_lens=host)
    ref = reference(case, inp)
    host.fill_(1)
    inp.seq_lens.fill_(1)
    out = poisoned_out(case, inp)
    w.run(inp.q, inp.cache, None, inp.block_tables, out=out)
    check(case, out, ref)


def test_failed_replan_keeps_previous_plan():
    case = Case(lens=(10, 30))
    inp = build(case)
    w = plan_wrapper(case, inp)
    with pytest.raises(ValueError):
        w.plan(inp.q.device, 2, 8, 3, 64, 16, 30)  # 8 query heads over 3 KV heads
    with pytest.raises(ValueError):
        w.plan(inp.q.device, 2, 8, 2, 64, 16, 30, seq_lens=[10, 31])  # over max_kv_len
    check(case, run_wrapper(w, case, inp), reference(case, inp))


def test_wrappers_run_from_several_threads_at_once():
    """Wrappers of their own, run and re-planned from threads at once (plan-owned and run-owned
    lengths, validated or not, split or one-pass, a packed plan), each give the reference's
    answer. Triton's interpreter keeps a launch's grid in globals, so its launches must not overlap."""
    cases = [Case(lens=(300, 40), num_qo_heads=4, num_kv_heads=1, seed=0),
             Case(lens=(70, 9, 33), lengths="run", seed=1),
             Case(lens=(50, 20), mode="packed", q_lens=(3, 1), seq_len_q=4, mask_type="causal", seed=2),
             Case(lens=(40,), num_qo_heads=4, num_kv_heads=1, dtype=FP8, out_dtype=FP8, seed=3)]
    inputs = [build(case) for case in cases]
    refs = [reference(case, inp) for case, inp in zip(cases, inputs)]
    failures = []

    def work(k):
        case, inp = cases[k], inputs[k]
        try:
            for step in range(4):
                w = plan_wrapper(case, inp)
                out = poisoned_out(case, inp)
                run_wrapper(w, case, inp, out=out, validate=step % 2 == 0)
                check(case, out, refs[k])
        except Exception as e:  # noqa: BLE001 -- reported below, with the case
            failures.append((k, repr(e)))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def test_merge_takes_more_splits_than_one_pass_holds():
    """The merge kernel reads BLOCK_S splits a pass (at most 8192 / its head-dim slice): 300
    splits of a 2-row problem take two passes of 256, the online rescale across passes included
    (the tuned H200 entries for Hq=8, Hkv=1 at B=1 run 512 splits)."""
    case = Case(num_qo_heads=2, num_kv_heads=1, head_dim=64, lens=(16 * 300 - 5,),
                config=KC(block_n=16, block_m=16, num_kv_splits=300, num_warps=1, num_stages=3))
    w = run_and_check(case)
    merge = w._plan.launch._merge_constexprs
    assert w.config.kernel_config.num_kv_splits == 300 and merge["BLOCK_S"] == 256 and merge["BLOCK_D"] == 32


@pytest.mark.parametrize("bmm2_scale", [2.5, -0.7])
@pytest.mark.parametrize("mode,q_lens,mask_type", [("sq1", None, "dense"), ("packed", (2, 1, 3), "causal")],
                         ids=["sq1", "packed-causal"])
def test_one_split_plans_apply_bmm2_scale(mode, q_lens, mask_type, bmm2_scale):
    """One split writes the output directly, with no merge pass to scale it: a bmm2_scale dropped
    there leaves every one-split output unscaled (or of the wrong sign)."""
    run_and_check(Case(mode=mode, q_lens=q_lens, mask_type=mask_type, lens=(3, 17, 44), bmm1_scale=0.3,
                       bmm2_scale=bmm2_scale,
                       config=KC(block_n=16, block_m=16, num_kv_splits=1, num_warps=4, num_stages=2)))


@pytest.mark.parametrize("mode,seq_len_q,q_lens", [("sq1", 1, None), ("fixed", 3, None), ("packed", 4, (4, 1))])
def test_splits_fit_the_window_not_the_whole_request(mode, seq_len_q, q_lens):
    """A sliding window leaves each program at most ceil((SQ + window_left) / block_n) + 1 tiles
    to walk however long the request: more splits than that are cut (they would be empty), and
    the answer is the reference's."""
    case = Case(mode=mode, seq_len_q=seq_len_q, q_lens=q_lens, mask_type="causal", window_left=20,
                lens=(40, 300), config=KC(block_n=16, block_m=16, num_kv_splits=10))
    w = run_and_check(case)
    sel = w.config
    assert sel.kernel_config.num_kv_splits == -(-(seq_len_q + 20) // 16) + 1 < 10
    assert any("window_left 20" in a for a in sel.adjustments)
    # without a window the same request keeps its 10 splits (300 tokens: 19 tiles, 2 a split)
    dense = run_and_check(dataclasses.replace(case, mask_type="dense", window_left=-1, mode="sq1",
                                              seq_len_q=1, q_lens=None))
    assert dense.config.kernel_config.num_kv_splits == 10


@pytest.mark.parametrize("page_size,block_n", [(24, 16), (48, 32)])
@pytest.mark.parametrize("splits", [1, 3])
def test_tiles_that_cross_pages_longer_than_a_tile(page_size, block_n, splits):
    """A page longer than a tile but not a multiple of it: a tile spans two pages (24-token
    pages, 16-token tiles: tile 1 is page 0's tokens 16-23 and page 1's 0-7), at lengths around
    every page and tile boundary."""
    lens = (1, block_n - 1, block_n + 1, page_size - 1, page_size, page_size + 1, 2 * page_size + 5,
            5 * block_n + 3)
    run_and_check(Case(page_size=page_size, lens=lens, seed=page_size + splits,
                       config=KC(block_n=block_n, block_m=16, num_kv_splits=splits)))


@pytest.mark.parametrize("mode,seq_len_q", [("sq1", 1), ("fixed", 3), ("packed", 1)])
@pytest.mark.parametrize("window_left", [4, 16])
def test_window_start_at_every_offset_in_a_tile(mode, seq_len_q, window_left):
    """Sixteen requests put the first query row's window start (K/V length - query length -
    window_left) at each of the 16 offsets of a 16-token tile: a program's key range that starts
    one key late skips a tile only where the window starts on a tile's last key."""
    q_lens = tuple(1 + i % 4 for i in range(16)) if mode == "packed" else None
    first_q = q_lens or (seq_len_q,) * 16
    lens = tuple(37 + i + first_q[i] for i in range(16))
    run_and_check(Case(mode=mode, seq_len_q=seq_len_q, q_lens=q_lens, mask_type="causal", window_left=window_left,
                       lens=lens, seed=window_left, config=KC(block_n=16, block_m=16, num_kv_splits=2)))


@pytest.mark.parametrize("case", [
    Case(num_qo_heads=12, num_kv_heads=2, lens=(3, 40, 77), config=KC(block_n=16, block_m=4, num_kv_splits=2)),
    Case(mode="fixed", seq_len_q=5, lens=(9, 33), config=KC(block_n=16, block_m=16, num_kv_splits=2)),
    Case(mode="packed", q_lens=(5, 2, 3), mask_type="causal", lens=(9, 33, 17),
         config=KC(block_n=16, block_m=16, num_kv_splits=1)),
], ids=["fma-6-rows-bm4", "fixed-sq5-20-rows-bm16", "packed-20-rows-bm16"])
def test_last_partial_block_of_query_rows(case):
    """Query rows a KV head (G x SQ, or G x the packed capacity) above block_m and not a multiple
    of it: the last block of rows is partly filled and must still run."""
    run_and_check(case)


@pytest.mark.parametrize("validate", [True, False])
def test_packed_run_below_capacity_writes_only_its_tokens(validate):
    """A packed run of fewer query tokens than the plan's capacity, into a view at the start of a
    larger buffer: nothing past this call's tokens is written."""
    case = Case(mode="packed", q_lens=(1, 2, 1), seq_len_q=6, lens=(5, 40, 17), lengths="run",
                config=KC(block_n=16, block_m=16, num_kv_splits=3))
    inp = build(case)
    total_q, capacity = sum(case.q_lens), case.batch_size * case.max_seq_len_q
    buf = torch.full((capacity, case.num_qo_heads, case.head_dim), 7.0, dtype=case.dtype, device=inp.q.device)
    buf[:total_q] = float("nan")
    out = buf[:total_q]
    run_wrapper(plan_wrapper(case, inp), case, inp, out=out, validate=validate)
    check(case, out, reference(case, inp))
    assert (buf[total_q:] == 7.0).all(), "the merge wrote past this call's query tokens"


@pytest.mark.parametrize("page_size,block_n", [(8, 16), (16, 16), (32, 16)])
def test_cache_slots_past_each_length_are_never_read(page_size, block_n):
    """The slots of a request's last page past its length may hold anything, NaN included: the
    kernel must not load them (0 x NaN would reach the output)."""
    case = Case(page_size=page_size, lens=(3, page_size + 5, 3 * page_size - 1, 50), seed=page_size,
                config=KC(block_n=block_n, block_m=16, num_kv_splits=2))
    assert all(n % page_size for n in case.lens)  # every last page has slots past the length
    inp = build(case)
    for b, n in enumerate(case.lens):
        page = int(inp.block_tables[b, (n - 1) // page_size])
        inp.cache[page, :, :, n % page_size:] = float("nan")  # K and V past the length
    out = poisoned_out(case, inp)
    run_wrapper(plan_wrapper(case, inp), case, inp, out=out)
    check(case, out, reference(case, inp))


@pytest.mark.parametrize("case", [
    Case(mask_type="causal", lens=(50, 77, 130), window_left=20, config=KC(block_n=16, block_m=16, num_kv_splits=1)),
    Case(mask_type="causal", lens=(50, 77, 130), window_left=20, config=KC(block_n=16, block_m=4, num_kv_splits=2)),
    Case(mode="fixed", seq_len_q=3, mask_type="causal", lens=(50, 77, 130), window_left=9,
         config=KC(block_n=16, block_m=16, num_kv_splits=2)),
    Case(mode="packed", q_lens=(3, 1, 2), mask_type="causal", lens=(50, 77, 130), window_left=9,
         config=KC(block_n=16, block_m=16, num_kv_splits=2)),
    # The interpreter reads an e4m3 NaN as 480, so this form tells only on a GPU.
    pytest.param(Case(kv_dtype=FP8, mask_type="causal", lens=(50, 77, 130), window_left=20,
                      config=KC(block_n=16, block_m=16, num_kv_splits=2)), marks=pytest.mark.gpu),
], ids=["one-split", "fma-splits", "fixed-sq3", "packed", "fp8-transposed"])
def test_cache_slots_before_a_window_are_never_read(case):
    """Keys before every query row's window are masked, so their K and V slots may hold anything,
    NaN included (an engine may point the table at pages it let go)."""
    inp = build(case)
    ref = reference(case, inp)
    q_lens = case.q_lens or (case.seq_len_q,) * case.batch_size
    for b, (n, sq) in enumerate(zip(case.lens, q_lens)):
        first_visible = n - sq - case.window_left  # of the request's first query row
        assert first_visible % case.config.block_n  # the window starts inside a tile
        for key in range(first_visible):
            page = int(inp.block_tables[b, key // case.page_size])
            inp.cache[page, :, :, key % case.page_size] = float("nan")  # K and V
    out = poisoned_out(case, inp)
    run_wrapper(plan_wrapper(case, inp), case, inp, out=out)
    check(case, out, ref)


@pytest.mark.parametrize("q_scale", [2.0**20, 2.0**-22], ids=["large", "small"])
@pytest.mark.parametrize("num_qo_heads,block_m", [(8, 4), (32, 16), (8, 16)], ids=["fma", "dot", "transposed"])
def test_a_bfloat16_q_over_an_fp8_cache_keeps_its_range(num_qo_heads, block_m, q_scale):
    """A bfloat16 q may hold values past float16's 65504 or under its 2^-14, where the float16
    products of an fp8 cache would give inf or lose bits; with ``bmm1_scale`` divided by the same
    factor the scores, and so the output, are those of the usual q, bit for bit (each row of q is
    scaled by a power of two into float16's range, the scores by its inverse). The interpreter
    converts the FMA form's operands as a GPU does, so that form shows the float16 limit on the CPU
    too; its dot forms compute in float32, so there they check only that each row's scale reaches
    its scores (a column of S, a row of S^T)."""
    case = Case(kv_dtype=FP8, num_qo_heads=num_qo_heads, lens=(9, 40, 77), seed=3,
                config=KC(block_n=16, block_m=block_m, num_kv_splits=2))
    inp = build(case)
    usual = run_wrapper(plan_wrapper(case, inp), case, inp)
    case = dataclasses.replace(case, bmm1_scale=case.head_dim ** -0.5 / q_scale)
    q = (inp.q.double() * q_scale).to(torch.bfloat16)
    assert torch.equal(q.double() / q_scale, inp.q.double())  # exact: a power of two in range
    assert q.abs().max() > 65504 if q_scale > 1 else q.abs().max() < 2.0**-14
    inp = dataclasses.replace(inp, q=q)
    w = plan_wrapper(case, inp)
    constexprs = w._plan.launch._split_constexprs
    assert constexprs["SCALE_Q_ROWS"] and constexprs["USE_DOT"] == (block_m == 16)
    assert constexprs["TRANSPOSED"] == (block_m == 16 and num_qo_heads == 8)
    out = poisoned_out(case, inp)
    run_wrapper(w, case, inp, out=out)
    check(case, out, reference(case, inp))
    assert torch.equal(out, usual), "the scaled q's output differs from the usual q's"


@pytest.mark.parametrize("hkv,page_size", [(1, 16), (2, 1)], ids=["one-kv-head", "one-token-pages"])
@pytest.mark.parametrize("via", ["wrapper", "oneshot"])
def test_an_nhd_cache_whose_heads_or_tokens_are_one_passes_as_hnd(hkv, page_size, via):
    """With one KV head (or one-token pages) an NHD cache [.., P, Hkv, D] holds the same bytes as
    HND: its transposed view has an unusual stride only along a dim of size 1, which the kernels
    never step along, so it is taken as it is."""
    case = Case(num_qo_heads=4 * hkv, num_kv_heads=hkv, page_size=page_size, lens=(1, 37, 20),
                config=KC(block_n=16, block_m=16, num_kv_splits=2) if via == "wrapper" else None)
    inp = build(case)
    ref = reference(case, inp)
    nhd = torch.empty((inp.num_pages, 2, page_size, hkv, case.head_dim), dtype=inp.cache.dtype,
                      device=inp.cache.device)
    nhd.copy_(inp.cache.transpose(2, 3))
    hnd_view = nhd.transpose(2, 3)  # NHD storage, seen as HND
    assert hnd_view.stride() != inp.cache.contiguous().stride() and torch.equal(hnd_view, inp.cache)
    inp = dataclasses.replace(inp, cache=hnd_view)
    out = poisoned_out(case, inp)
    if via == "oneshot":
        run_oneshot(case, inp, out=out)
    else:
        run_wrapper(plan_wrapper(case, inp), case, inp, out=out)
    check(case, out, ref)


def test_config_reports_source_and_adjustments():
    case = Case(lens=(10, 20), config=KC(block_n=16, block_m=64, num_kv_splits=100))
    inp = build(case)
    w = plan_wrapper(case, inp)
    sel = w.config
    assert sel.source == "explicit"
    assert sel.kernel_config.num_kv_splits == 2  # max_kv_len 20 = 2 tiles of 16
    assert sel.kernel_config.block_m == 16  # only 4 rows per KV head
    assert any("num_kv_splits" in a for a in sel.adjustments)
    check(case, run_wrapper(w, case, inp), reference(case, inp))
    w2 = plan_wrapper(dataclasses.replace(case, config=None), inp)
    assert w2.config.source in ("heuristic", "table")


def test_the_users_table_cache_is_isolated(fresh_tables):
    """conftest points the user cache folder (platformdirs honours XDG_CACHE_HOME) at a temporary
    folder of this test session and unsets TSDECODE_CONFIG_DIR, so a table that tsdecode-tune wrote
    on this machine never changes a test's config."""
    import os
    import tempfile

    user_dir = fresh_tables.user_tables_dir().resolve()
    session = os.path.realpath(os.environ["XDG_CACHE_HOME"])
    assert str(user_dir).startswith(session) and session.startswith(os.path.realpath(tempfile.gettempdir()))
    assert "TSDECODE_CONFIG_DIR" not in os.environ
    trace = []
    from tsdecode.config.select import select_config
    from tsdecode.config.space import ProblemShape
    from tsdecode.device import device_properties

    shape = ProblemShape(batch_size=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, max_kv_len=64)
    selected = select_config(shape, device_properties(DEVICE), trace=trace)
    if DEVICE.type == "cpu":
        assert selected.source == "heuristic", (selected, trace)


def test_specialization_key_is_as_fine_as_triton():
    """Plans share compiled kernels by ``_specialization_key``: it must tell apart every argument
    triton compiles variants for (dtype, address mod 16, integer values) and ignore only what
    triton ignores (floats, the value of an integer the kernel does not specialise)."""
    from triton.runtime.jit import JITFunction

    # The split kernel as triton compiles it (under the interpreter the module holds another type).
    kernel = JITFunction(decode._split_kv_kernel.fn, do_not_specialize=["max_kv_len"])
    names = kernel.arg_names
    base = torch.zeros(64, dtype=torch.int32)
    # The first 15 parameters by position: q, k, v, block table, lengths, offsets, out, the two
    # partials, qk scale, bmm2 scale, window_left, max_kv_len, num_kv_heads, num_kv_splits.
    values = [BF16, FP8, FP8, base[:8], base[8:12], base[8:12], BF16, torch.zeros(4), torch.zeros(4),
              0.125, 1.0, -1, 8192, 8, 6]
    assert names[12] == "max_kv_len"
    index = {"q": 0, "k": 1, "v": 2, "block_tables": 3, "seq_lens": 4, "qk_scale": 9, "bmm2_scale": 10,
             "window_left": 11, "max_kv_len": 12, "num_kv_heads": 13, "num_kv_splits": 14}

    def key(jit=kernel, **changes):
        args = list(values)
        for name, value in changes.items():
            args[index[name]] = value
        return launch._specialization_key(jit, tuple(args))

    same = key()
    assert key(max_kv_len=8191) == key(max_kv_len=1) == same  # unspecialised (32-bit either way)
    assert key(max_kv_len=2**33) != same and key(max_kv_len=2**33) == key(max_kv_len=2**40)
    assert key(max_kv_len=2**63) != key(max_kv_len=2**40)
    assert key(qk_scale=3.0, bmm2_scale=-2.0) == same
    assert key(seq_lens=base[9:13]) != same  # 4 bytes off a 16-byte boundary
    assert key(seq_lens=base[12:16]) == same  # 48 bytes: still aligned
    assert key(block_tables=base[:8].to(torch.int64)) != same
    assert key(q=FP16) != same and key(k=BF16, v=BF16) != same
    assert key(num_kv_heads=16) != same and key(num_kv_splits=16) != same and key(window_left=0) != same
    assert key(num_kv_splits=object()) is None  # an argument it cannot key: no sharing
    # Without the decorator's argument every integer counts.
    plain = JITFunction(decode._split_kv_kernel.fn)
    assert key(plain, max_kv_len=8191) != key(plain)


# 2**30 elements between requests: request 2 starts 2**31 elements past request 0, past int32.
_FAR = 2**30


def _far_apart(rows: int, cols: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rows, *cols] view whose rows lie _FAR elements apart, starting 2**31 elements into its
    storage (the storage is allocated, not touched: its pages cost nothing until written), and
    the storage's flat view."""
    storage = torch.empty(2**31 + (rows - 1) * _FAR + 4096, dtype=dtype)
    inner = [1]
    for n in reversed(cols[1:]):
        inner.insert(0, inner[0] * n)
    view = storage.as_strided((rows, *cols), (_FAR, *inner), storage_offset=2**31)
    return view, storage


@pytest.mark.skipif(DEVICE.type != "cpu", reason="addresses 4-8 GiB of storage; the CPU only maps it")
@pytest.mark.parametrize("validate", [True, False])
def test_q_rows_more_than_int32_elements_apart_are_refused(validate):
    """The kernels index q in int32 (b * stride(0) would wrap and read another row): a q whose
    requests lie 2**30 elements apart (its last element 2**31 past its first) is refused by name,
    by the one-shot op and by a run, validated or not."""
    gen = torch.Generator().manual_seed(0)
    q, _ = _far_apart(3, (1, 64), FP8)
    cache = torch.randn(3, 2, 1, 16, 64, generator=gen).to(FP8)
    tables = torch.arange(3, dtype=torch.int32)[:, None]
    lens = torch.full((3,), 16, dtype=torch.int32)
    out = torch.empty(3, 1, 64, dtype=FP16)
    with pytest.raises(NotImplementedError, match="q's last element lies 2,147,483,711 elements past"):
        batch_decode_with_paged_kv_cache(q, cache, tables, lens, out=out)
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan("cpu", 3, 1, 1, 64, 16, 16, q_data_type=FP8, kv_data_type=FP8, o_data_type=FP16, seq_lens=[16] * 3)
    with pytest.raises(NotImplementedError, match="q's last element lies"):
        w.run(q, cache, None, tables, out=out, validate=validate)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="addresses 4-8 GiB of storage; the CPU only maps it")
@pytest.mark.parametrize("validate", [True, False])
def test_out_rows_more_than_int32_elements_apart_are_refused(validate):
    """The split and merge kernels index out in int32: an out whose requests lie 2**30 elements
    apart is refused by name, validated or not (a row past 2**31 was written elsewhere or never)."""
    case = Case(lens=(16, 16, 16), num_qo_heads=1, num_kv_heads=1, dtype=FP16,
                config=KC(block_n=16, block_m=16, num_kv_splits=2))
    inp = build(case)
    out, _ = _far_apart(3, (1, 64), FP16)
    w = plan_wrapper(case, inp)
    with pytest.raises(NotImplementedError, match="out's last element lies"):
        run_wrapper(w, case, inp, out=out, validate=validate)


def test_a_plan_of_q_past_int32_elements_is_refused():
    """B*SQ*Hq*D of 2**31 or more cannot be indexed in int32: the plan refuses it, naming the
    product, before anything is allocated."""
    with pytest.raises(NotImplementedError, match=r"B\*SQ\*Hq\*D = 65536\*1\*128\*256 must fit in int32"):
        tsdecode.BatchDecodePagedTSWrapper().plan("cpu", 65536, 128, 8, 256, 16, 1024, q_data_type=FP16)
