"""Kernel vs the float64 reference on random inputs, for every feature and their combinations.

Runs on the GPU when there is one, else through Triton's interpreter on CPU tensors. The CPU run
is a representative subset; ``test_gpu.py`` adds the full matrix and CUDA graphs on the GPU.
"""

import dataclasses

import pytest
import torch

from tsdecode import KernelConfig
from tsdecode.kernels import decode
from cases import FP8, Case, DEVICE, build, check, plan_wrapper, poisoned_out, reference, run_and_check

KC = KernelConfig
BF16, FP16 = torch.bfloat16, torch.float16

CASES = {
    # SQ = 1, the heuristic config, lengths 1 / page boundary / not a multiple of the tile
    "gqa-default": Case(lens=(1, 16, 33, 130)),
    "gqa-fp16": Case(dtype=FP16, lens=(5, 64, 100)),
    "mha-fma": Case(num_qo_heads=4, num_kv_heads=4, lens=(1, 31, 96)),
    "mqa-g8": Case(num_qo_heads=8, num_kv_heads=1, lens=(7, 48)),
    # one KV head of one request (B*Hkv = 1): the heuristic's split count hits its bound
    "mqa-b1": Case(num_qo_heads=8, num_kv_heads=1, lens=(70,)),
    "mqa-b1-fp8": Case(num_qo_heads=8, num_kv_heads=1, kv_dtype=torch.float8_e4m3fn, lens=(70,)),
    "g32-two-m-blocks": Case(num_qo_heads=32, num_kv_heads=1, lens=(9, 40), config=KC(block_n=16, block_m=16, num_kv_splits=2)),
    "g32-wide-rows-lean": Case(num_qo_heads=64, num_kv_heads=2, lens=(9, 140), config=KC(block_n=16, block_m=32, num_kv_splits=3, num_warps=1, num_stages=5)),
    "g4-sq8-wide-rows-lean": Case(mode="fixed", seq_len_q=8, mask_type="causal", lens=(9, 70), config=KC(block_n=16, block_m=32, num_kv_splits=2, num_warps=1, num_stages=5)),
    # explicit configs: tiles, FMA/dot, splits (more splits than tiles for short requests)
    "splits-3-bn16": Case(lens=(1, 17, 100), config=KC(block_n=16, block_m=16, num_kv_splits=3)),
    "splits-7-bn32": Case(lens=(2, 200, 45), config=KC(block_n=32, block_m=16, num_kv_splits=7)),
    "fma-bm4": Case(lens=(3, 70), config=KC(block_n=16, block_m=4, num_kv_splits=2)),
    "fma-bm2-g4": Case(num_qo_heads=8, num_kv_heads=2, lens=(19, 50), config=KC(block_n=32, block_m=2, num_kv_splits=1)),
    "bn128-single-page": Case(page_size=128, lens=(1, 129, 300), config=KC(block_n=128, block_m=16, num_kv_splits=2)),
    # page sizes (P < block_n spans pages per tile; P >= block_n stays in one page)
    "page1": Case(page_size=1, lens=(1, 9, 23)),
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
    # fixed SQ > 1, masks, windows
    "fixed-sq2-dense": Case(mode="fixed", seq_len_q=2, lens=(2, 40)),
    "fixed-sq4-causal": Case(mode="fixed", seq_len_q=4, mask_type="causal", lens=(4, 37, 70)),
    "fixed-sq3-causal-window": Case(mode="fixed", seq_len_q=3, mask_type="causal", window_left=5, lens=(3, 40), config=KC(block_n=16, block_m=16, num_kv_splits=3)),
    "window0": Case(mask_type="causal", window_left=0, lens=(1, 20)),
    "sq1-causal-window": Case(mask_type="causal", window_left=16, lens=(1, 17, 90), config=KC(block_n=16, block_m=16, num_kv_splits=2)),
    # packed queries
    "packed-dense": Case(mode="packed", q_lens=(1, 3, 2), lens=(5, 40, 17)),
    "packed-causal-window": Case(mode="packed", q_lens=(2, 4, 1), mask_type="causal", window_left=7, lens=(4, 33, 18), config=KC(block_n=16, block_m=8, num_kv_splits=2)),
    "packed-capacity": Case(mode="packed", q_lens=(1, 2), seq_len_q=5, lens=(3, 30)),
    # cache layouts and tables
    "separate-kv": Case(separate=True, lens=(7, 50)),
    "padded-page-stride": Case(page_stride_pad=40, lens=(20, 33), config=KC(block_n=16, block_m=16, num_kv_splits=2)),
    "padded-table-shared-pages": Case(table_pad=5, shared_pages=True, lens=(18, 40, 3)),
    # dtypes and scales
    "fp8-cache-bf16-q": Case(kv_dtype=FP8, lens=(5, 40)),
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


# Cases with <= 8 query rows per KV head on the tl.dot path (either product form applies).
FORM_CASES = {name: CASES[name] for name in (
    "gqa-default", "mqa-g8", "splits-7-bn32", "bn128-single-page", "page3-odd", "d96", "fixed-sq2-dense",
    "sq1-causal-window", "padded-page-stride", "fp8-cache-bf16-q", "fp8-cache-fp16-q-fp32-out",
    "fp8-q-fp8-out", "scales")}
FORM_CASES["packed-causal-8-rows"] = Case(mode="packed", q_lens=(2, 1, 2), mask_type="causal", lens=(5, 40, 17))
FORM_CASES["fp8-mha-causal-sq2"] = Case(num_qo_heads=4, num_kv_heads=4, kv_dtype=FP8, mode="fixed", seq_len_q=2,
                                        mask_type="causal", lens=(2, 33, 70))


@pytest.mark.parametrize("form", ["0", "1"])
@pytest.mark.parametrize("name", list(FORM_CASES))
def test_both_product_forms(monkeypatch, form, name):
    """The standard (S = Q K^T) and transposed (S^T = K Q^T) split kernels, each forced on 16-bit
    and 8-bit caches alike (the rule picks one per dtype), match the reference."""
    monkeypatch.setattr(decode, "_TRANSPOSED_MODE", form)
    case = FORM_CASES[name]
    run_and_check(dataclasses.replace(case, config=case.config or KC(block_n=16, block_m=16, num_kv_splits=2)))


def test_transposed_products_rule(monkeypatch):
    """8-bit caches take the transposed form at <= 8 rows on the dot path; nothing else does."""
    monkeypatch.setattr(decode, "_TRANSPOSED_MODE", "auto")
    dot, fma = KC(block_n=16, block_m=16), KC(block_n=16, block_m=4)
    assert decode.transposed_products(FP8, 4, dot) and decode.transposed_products(FP8, 1, dot)
    assert decode.transposed_products(FP8, 8, dot)
    assert not decode.transposed_products(FP8, 9, dot) and not decode.transposed_products(FP8, 4, fma)
    assert not decode.transposed_products(BF16, 4, dot) and not decode.transposed_products(FP16, 1, dot)
    monkeypatch.setattr(decode, "_TRANSPOSED_MODE", "1")
    assert decode.transposed_products(BF16, 4, dot) and not decode.transposed_products(BF16, 16, dot)
    monkeypatch.setattr(decode, "_TRANSPOSED_MODE", "0")
    assert not decode.transposed_products(FP8, 4, dot)


def test_every_config_same_answer():
    """Several configs on one problem agree with the reference (and so with each other)."""
    base = Case(lens=(2, 45, 130), mode="fixed", seq_len_q=2, mask_type="causal")
    for cfg in (
        KC(block_n=16, block_m=16, num_kv_splits=1, num_warps=1, num_stages=1),
        KC(block_n=32, block_m=32, num_kv_splits=4, num_warps=2, num_stages=3),
        KC(block_n=64, block_m=4, num_kv_splits=5, num_warps=8, num_stages=4),
        KC(block_n=16, block_m=1, num_kv_splits=9, num_warps=4, num_stages=2),
        KC(block_n=16, block_m=16, num_kv_splits=3, num_warps=1, num_stages=5),
    ):
        run_and_check(dataclasses.replace(base, config=cfg))


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
    w.run(inp.q, inp.cache, out=out)
    check(case, out, ref)


def test_bound_seq_lens_read_live_and_pages_remapped():
    """bind_seq_lens=True: runs read the caller's live lengths; remapped page IDs are read live."""
    case = Case(lens=(20, 64, 33), config=KC(block_n=16, block_m=16, num_kv_splits=3))
    inp = build(case)
    # bound lengths may grow to max_kv_len: the first 4 columns of every row must be valid pages
    for b in range(3):
        for col in range(4):
            if inp.block_tables[b, col] >= inp.num_pages:
                inp.block_tables[b, col] = (b * 4 + col) % inp.num_pages
    w = plan_wrapper(case, inp, bind_seq_lens=True, max_kv_len=64)
    check(case, w.run(inp.q, inp.cache), reference(case, inp))
    inp.seq_lens.copy_(torch.tensor([64, 1, 17], dtype=torch.int32))
    # remap: move request 1's live page and request 2's second page to other pool pages
    k, v = inp.cache[:, 0], inp.cache[:, 1]
    for b, col in ((1, 0), (2, 1)):
        old = int(inp.block_tables[b, col])
        new = (old + 1) % inp.num_pages
        inp.cache[new].copy_(torch.randn(inp.cache[new].shape).to(inp.cache.dtype))
        inp.block_tables[b, col] = new
    ref = reference(case, inp)
    out = poisoned_out(case, inp)
    w.run(inp.q, inp.cache, out=out)
    check(case, out, ref)


def test_bound_plan_validates_columns_up_to_max_kv_len():
    case = Case(lens=(20, 64, 33))
    inp = build(case)  # rows 0 and 2 hold garbage past their live pages
    w = plan_wrapper(case, inp, bind_seq_lens=True)
    with pytest.raises(ValueError, match="page ID"):
        w.run(inp.q, inp.cache)


def test_unbound_seq_lens_are_copied_at_plan():
    case = Case(lens=(20, 40))
    inp = build(case)
    w = plan_wrapper(case, inp)
    ref = reference(case, inp)
    inp.seq_lens.fill_(1)  # changing the caller's tensor after plan has no effect
    check(case, w.run(inp.q, inp.cache), ref)


def test_failed_replan_keeps_previous_plan():
    case = Case(lens=(10, 30))
    inp = build(case)
    w = plan_wrapper(case, inp)
    with pytest.raises(ValueError):
        w.plan(inp.block_tables, inp.seq_lens, 8, 3, 64, 16)
    check(case, w.run(inp.q, inp.cache), reference(case, inp))


def test_merge_takes_more_splits_than_one_pass_holds():
    """The merge kernel reads BLOCK_S splits a pass (at most 8192 / its head-dim slice): 300
    splits of a 2-row problem take two passes of 256, the online rescale across passes included
    (the tuned H200 entries for Hq=8, Hkv=1 at B=1 run 512 splits)."""
    case = Case(num_qo_heads=2, num_kv_heads=1, head_dim=64, lens=(16 * 300 - 5,),
                config=KC(block_n=16, block_m=16, num_kv_splits=300, num_warps=1, num_stages=3))
    w = run_and_check(case)
    merge = w._plan.launch._merge_constexprs
    assert w.config.kernel_config.num_kv_splits == 300 and merge["BLOCK_S"] == 256 and merge["BLOCK_D"] == 32


@pytest.mark.parametrize("mode,seq_len_q,q_lens", [("sq1", 1, None), ("fixed", 3, None), ("packed", 4, (4, 1))])
def test_splits_fit_the_window_not_the_whole_request(mode, seq_len_q, q_lens):
    """A sliding window leaves each program at most ceil((SQ + window_left) / block_n) + 1 tiles
    to walk however long the request: more splits than that are cut (they would be empty), and
    the answer is the reference's."""
    case = Case(mode=mode, seq_len_q=seq_len_q, q_lens=q_lens, mask_type="causal", window_left=20,
                lens=(40, 300), config=KC(block_n=16, block_m=16, num_kv_splits=12))
    w = run_and_check(case)
    sel = w.config
    assert sel.kernel_config.num_kv_splits == -(-(seq_len_q + 20) // 16) + 1 < 12
    assert any("window_left 20" in a for a in sel.adjustments)
    # without a window the same request keeps its 12 splits (300 tokens: 19 tiles)
    dense = run_and_check(dataclasses.replace(case, mask_type="dense", window_left=-1, mode="sq1",
                                              seq_len_q=1, q_lens=None))
    assert dense.config.kernel_config.num_kv_splits == 12


def test_config_reports_source_and_adjustments():
    case = Case(lens=(10, 20), config=KC(block_n=16, block_m=64, num_kv_splits=100))
    inp = build(case)
    w = plan_wrapper(case, inp)
    sel = w.config
    assert sel.source == "explicit"
    assert sel.kernel_config.num_kv_splits == 2  # 20 tokens = 2 tiles of 16
    assert sel.kernel_config.block_m == 16  # only 4 rows per KV head
    assert any("num_kv_splits" in a for a in sel.adjustments)
    check(case, w.run(inp.q, inp.cache), reference(case, inp))
    w2 = plan_wrapper(dataclasses.replace(case, config=None), inp)
    assert w2.config.source in ("heuristic", "table")


def test_specialization_key_is_as_fine_as_triton():
    """Plans share compiled kernels by ``_specialization_key``: it must tell apart every argument
    triton compiles variants for (dtype, address mod 16, integer values) and ignore only what
    triton ignores (floats, the value of an integer the kernel does not specialise)."""
    from triton.runtime.jit import JITFunction

    # The split kernel as triton compiles it (under the interpreter the module holds another type).
    kernel = JITFunction(decode._split_kv_kernel.fn, do_not_specialize=["max_kv_len"])
    names = kernel.arg_names
    base = torch.zeros(64, dtype=torch.int32)
    args = dict(q_ptr=BF16, k_ptr=FP8, v_ptr=FP8, block_tables_ptr=base[:8], seq_lens_ptr=base[8:12],
                qo_indptr_ptr=base[8:12], out_ptr=BF16, partial_o_ptr=torch.zeros(4), partial_lse_ptr=torch.zeros(4),
                qk_scale_log2=0.125, bmm2_scale=1.0, window_left=-1, max_kv_len=8192, num_kv_heads=8,
                num_kv_splits=6)

    def key(jit=kernel, **changes):
        values = {**args, **changes}
        return decode._specialization_key(jit, tuple(values[n] for n in names[: len(values)]))

    same = key()
    assert key(max_kv_len=8191) == key(max_kv_len=1) == same  # unspecialised (32-bit either way)
    assert key(max_kv_len=2**33) != same and key(max_kv_len=2**33) == key(max_kv_len=2**40)
    assert key(max_kv_len=2**63) != key(max_kv_len=2**40)
    assert key(qk_scale_log2=3.0, bmm2_scale=-2.0) == same
    assert key(seq_lens_ptr=base[9:13]) != same  # 4 bytes off a 16-byte boundary
    assert key(seq_lens_ptr=base[12:16]) == same  # 48 bytes: still aligned
    assert key(block_tables_ptr=base[:8].to(torch.int64)) != same
    assert key(q_ptr=FP16) != same and key(k_ptr=BF16, v_ptr=BF16) != same
    assert key(num_kv_heads=16) != same and key(num_kv_splits=16) != same and key(window_left=0) != same
    assert key(num_kv_splits=object()) is None  # an argument it cannot key: no sharing
    # Without the decorator's argument every integer counts.
    plain = JITFunction(decode._split_kv_kernel.fn)
    assert key(plain, max_kv_len=8191) != key(plain)
