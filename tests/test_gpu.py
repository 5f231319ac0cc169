"""GPU-only tests: the full feature matrix, extreme sizes, CUDA-graph capture/replay and the
launcher's direct launches.

Skipped without CUDA. Run on the GPU machine with ``scripts/gpu_check.sh``. A CUDA graph captures
``run(..., out=..., validate=False)`` (a validated run reads the metadata back to the host).
"""

import dataclasses
import itertools
import random

import pytest
import torch

import tsdecode
from tsdecode import KernelConfig
from tsdecode.config.space import BLOCK_M_CHOICES, BLOCK_N_CHOICES
from tsdecode.kernels import decode, launch
from cases import (FP8, Case, build, check, plan_wrapper, poisoned_out, reference, run_and_check, run_oneshot,
                   run_wrapper)

pytestmark = pytest.mark.gpu
BF16, FP16 = torch.bfloat16, torch.float16

DTYPES = [  # (q, kv, out)
    (BF16, BF16, None), (FP16, FP16, None), (BF16, FP8, None), (FP16, FP8, torch.float32),
    (FP8, FP8, None), (FP8, FP8, BF16),
]
MODES = [  # (mode, seq_len_q, q_lens, mask, window)
    ("sq1", 1, None, "dense", -1),
    ("sq1", 1, None, "causal", 31),
    ("fixed", 4, None, "dense", -1),
    ("fixed", 4, None, "causal", -1),
    ("packed", 1, (1, 5, 2, 3), "causal", 100),
    ("packed", 8, (3, 1, 8, 2), "dense", -1),
]
GEOMS = [  # (Hq, Hkv, D, P)
    (8, 8, 128, 16), (32, 8, 128, 16), (64, 4, 128, 16), (64, 2, 64, 32), (16, 2, 256, 1),
    (32, 8, 96, 64), (28, 4, 192, 8), (32, 1, 128, 128), (8, 2, 128, 256),
]


def _matrix(n: int, seed: int = 1):
    """n sampled combinations of dtype x query mode x geometry x random valid config, with the
    lengths owned by the plan or passed to every run, validated or not."""
    rng = random.Random(seed)
    combos = list(itertools.product(range(len(DTYPES)), range(len(MODES)), range(len(GEOMS))))
    rng.shuffle(combos)
    out = []
    for i, (di, mi, gi) in enumerate(combos[:n]):
        q, kv, o = DTYPES[di]
        mode, sq, q_lens, mask, window = MODES[mi]
        hq, hkv, d, p = GEOMS[gi]
        lens = [rng.choice([1, p, 2 * p + 1, 257, 1000, 4099]) for _ in range(4)]
        lens = [max(n, sq, max(q_lens) if q_lens else 1) for n in lens]
        config = None
        if i % 3:
            config = KernelConfig(
                block_n=rng.choice(BLOCK_N_CHOICES[:4]), block_m=rng.choice(BLOCK_M_CHOICES[:7]),
                num_kv_splits=rng.choice([1, 2, 3, 8, 33]), num_warps=rng.choice([2, 4, 8]),
                num_stages=rng.choice([1, 2, 3]),
            )
        case = Case(
            lens=tuple(lens), num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=p,
            dtype=q, kv_dtype=kv, out_dtype=o, mode=mode, seq_len_q=sq, q_lens=q_lens,
            mask_type=mask, window_left=window, config=config, seed=i,
            separate=bool(i % 2), page_stride_pad=64 * (i % 3 == 1), table_pad=3 * (i % 4 == 2),
            shared_pages=i % 5 == 0, lengths="run" if i % 4 in (1, 2) else "plan",
            max_kv_len=5000 if i % 8 == 1 else None, pad_value=-1 if i % 7 == 3 else None,
        )
        out.append(pytest.param(case, i % 4 != 3, id=f"m{i}"))
    return out


@pytest.mark.parametrize("case,validate", _matrix(160))
def test_full_matrix(case, validate):
    run_and_check(case, validate=validate)


FP8_TILE_FAMILIES = [  # (block_n, num_warps, num_stages): the tuned fp8 and lean families and big tiles
    (16, 1, 3), (16, 1, 5), (32, 1, 1), (32, 2, 2), (64, 2, 2), (64, 4, 2), (64, 4, 5), (128, 4, 2), (128, 8, 3),
]


@pytest.mark.parametrize("block_n,warps,stages", FP8_TILE_FAMILIES)
@pytest.mark.parametrize("hq,hkv,p", [(32, 8, 16), (32, 32, 16), (64, 8, 1)])
def test_fp8_cache_tile_families(block_n, warps, stages, hq, hkv, p):
    """8-bit caches in every tile family the tuner picks for them (1-warp lean tiles included,
    which the sampled matrix above never draws), G = 1/4/8, pages smaller than and equal to the
    tile, ragged lengths across page and tile boundaries, one and several splits."""
    for splits in (1, 5):
        case = Case(lens=(1, block_n - 1, 3 * block_n + 7, 1000), num_qo_heads=hq, num_kv_heads=hkv,
                    head_dim=128, page_size=p, kv_dtype=FP8, seed=block_n + splits,
                    config=KernelConfig(block_n=block_n, block_m=16, num_kv_splits=splits,
                                        num_warps=warps, num_stages=stages))
        run_and_check(case)


def force_product_form(monkeypatch, form: str) -> None:
    """The standard ("0") or transposed ("1") form wherever the transposed one applies."""
    monkeypatch.setattr(launch, "transposed_products",
                        lambda kv_dtype, rows, config: form == "1" and config.uses_dot and rows <= 8)


@pytest.mark.parametrize("form", ["0", "1"])
@pytest.mark.parametrize("kv_dtype", [BF16, FP16, FP8])
@pytest.mark.parametrize("block_n,warps,stages", [(16, 1, 3), (16, 1, 5), (32, 2, 2), (64, 4, 2), (128, 8, 3)])
def test_both_product_forms(monkeypatch, form, kv_dtype, block_n, warps, stages):
    """The standard and the transposed split kernel (``launch.transposed_products``), each forced on
    every cache dtype: G = 1 / 4 / 8 and causal SQ = 2 at G = 4 (8 rows), pages smaller than and
    equal to the tile, ragged lengths across page and tile boundaries, one and several splits."""
    force_product_form(monkeypatch, form)
    q_dtype = FP16 if kv_dtype == FP16 else BF16
    for hq, hkv, sq, p, splits in ((32, 32, 1, 16, 1), (32, 8, 1, 1, 5), (64, 8, 1, 16, 3), (32, 8, 2, 16, 4)):
        case = Case(lens=(sq, block_n - 1, 3 * block_n + 7, 1000), num_qo_heads=hq, num_kv_heads=hkv,
                    head_dim=128, page_size=p, dtype=q_dtype, kv_dtype=kv_dtype, seed=block_n + splits,
                    mode="fixed" if sq > 1 else "sq1", seq_len_q=sq, mask_type="causal" if sq > 1 else "dense",
                    config=KernelConfig(block_n=block_n, block_m=16, num_kv_splits=splits,
                                        num_warps=warps, num_stages=stages))
        run_and_check(case)


@pytest.mark.parametrize("block_n,warps", [(16, 1), (32, 2), (64, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_deep_pipeline_16bit_caches(block_n, warps, dtype):
    """5 stages (two K/V tiles in flight through the page table; the sampled matrix draws 1-3):
    16-bit caches, pages smaller than, equal to and larger than the tile, ragged lengths across
    page and tile boundaries (shorter than the pipeline's prologue too), one and several splits."""
    for p in (1, 16, 64):
        for splits in (1, 5):
            case = Case(lens=(1, block_n - 1, 2 * block_n + 3, 3 * block_n + 7, 1000), num_qo_heads=32,
                        num_kv_heads=8, head_dim=128, page_size=p, dtype=dtype, kv_dtype=dtype,
                        out_dtype=dtype, seed=block_n + splits + p,
                        config=KernelConfig(block_n=block_n, block_m=16, num_kv_splits=splits,
                                            num_warps=warps, num_stages=5))
            run_and_check(case)


@pytest.mark.parametrize("q_dtype,kv_dtype", [(BF16, BF16), (FP16, FP16), (BF16, FP8)])
@pytest.mark.parametrize("head_dim,block_n,stages,p", [(64, 256, 2, 3), (128, 128, 1, 4), (128, 128, 2, 32),
                                                       (64, 128, 2, 1)])
def test_four_warp_one_tile_programs(q_dtype, kv_dtype, head_dim, block_n, stages, p):
    """The model's four-warp programs of one large tile each, every cache dtype: one split whose
    tile holds a whole request (programs no more than the SMs), and many splits of one tile each (a
    long request); lengths of one token, across pages and tiles, up to the tile's end."""
    for splits, lens in ((1, (1, block_n // 2 + 1, block_n)), (40, (1, 3 * block_n + 7, 40 * block_n - 5))):
        case = Case(lens=lens, num_qo_heads=20, num_kv_heads=2, head_dim=head_dim, page_size=p, dtype=q_dtype,
                    kv_dtype=kv_dtype, seed=block_n + splits + p,
                    config=KernelConfig(block_n=block_n, block_m=16, num_kv_splits=splits, num_warps=4,
                                        num_stages=stages))
        run_and_check(case)


@pytest.mark.parametrize("q_dtype,kv_dtype", [(BF16, BF16), (FP16, FP16), (BF16, FP8)])
@pytest.mark.parametrize("head_dim,block_n,p", [(128, 256, 24), (128, 256, 1), (256, 128, 16)])
def test_eight_warp_whole_request_programs(q_dtype, kv_dtype, head_dim, block_n, p):
    """The model's eight-warp programs of one 32K-element tile holding a whole request (one split, no
    pipeline), every cache dtype: lengths of one token, across pages, up to the tile's end."""
    case = Case(lens=(1, block_n // 2 + 1, block_n - 3, block_n), num_qo_heads=28, num_kv_heads=4,
                head_dim=head_dim, page_size=p, dtype=q_dtype, kv_dtype=kv_dtype, seed=block_n + p,
                config=KernelConfig(block_n=block_n, block_m=16, num_kv_splits=1, num_warps=8, num_stages=1))
    run_and_check(case)


@pytest.mark.parametrize("q_dtype,kv_dtype", [(BF16, BF16), (FP16, FP16), (BF16, FP8)])
@pytest.mark.parametrize("head_dim,p", [(128, 64), (128, 24), (256, 48), (256, 16)])
def test_chains_split_into_one_64_token_tile_a_program(q_dtype, kv_dtype, head_dim, p):
    """The model's four-warp programs of one 64-token tile each, no pipeline, where few programs
    split their chain (every cache dtype): lengths of one token, across pages and tiles, up to the
    last split's tile."""
    case = Case(lens=(1, 63, 65, 173, 300), num_qo_heads=30, num_kv_heads=2, head_dim=head_dim, page_size=p,
                dtype=q_dtype, kv_dtype=kv_dtype, seed=head_dim + p,
                config=KernelConfig(block_n=64, block_m=16, num_kv_splits=5, num_warps=4, num_stages=1))
    run_and_check(case)


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("p", [3, 8, 24])
def test_one_split_16_token_lean_programs_across_pages(dtype, p):
    """The model's one-split one-warp programs of 16-token tiles (short requests past half a wave)
    on pages that such tiles cross, 16-bit caches: lengths of one token, across pages and tiles."""
    for hq, hkv in ((12, 4), (128, 16)):
        case = Case(lens=(1, 15, 17, 179, 238), num_qo_heads=hq, num_kv_heads=hkv, head_dim=128, page_size=p,
                    dtype=dtype, kv_dtype=dtype, seed=p + hq,
                    config=KernelConfig(block_n=16, block_m=16, num_kv_splits=1, num_warps=1, num_stages=5))
        run_and_check(case)


def test_million_token_request():
    """K/V length 2**20 (1,048,576 tokens) in one request, split across many programs."""
    case = Case(lens=(1 << 20, 3), num_qo_heads=8, num_kv_heads=1, head_dim=64, page_size=256, extra_cols=0)
    run_and_check(case)


def test_batch_4096():
    case = Case(lens=tuple(1 + (7 * i) % 61 for i in range(4096)), num_qo_heads=8, num_kv_heads=2, head_dim=64,
                lengths="run")
    run_and_check(case)


def _graph(fn):
    """fn run once on a side stream (the warm-up), then captured into a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _all_columns_valid(inp):
    """Valid page IDs in every column, so lengths may grow to C*P between replays."""
    bt = inp.block_tables
    for b in range(bt.shape[0]):
        for c in range(bt.shape[1]):
            if not 0 <= int(bt[b, c]) < inp.num_pages:
                bt[b, c] = (b + c) % inp.num_pages


def aligned_table(case: Case) -> Case:
    """The case with a block-table row stride divisible by 16 (the stride class plan compiles for)."""
    cols = max(-(-n // case.page_size) for n in case.lens) + case.extra_cols
    return dataclasses.replace(case, table_pad=-cols % 16)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("mode", ["sq1", "packed"])
def test_cuda_graph_run_owned_lengths_remapped_pages_and_offsets(splits, mode):
    """run(validate=False) captured after a warm-up; between replays the lengths change in place
    (anywhere in [1, max_kv_len]), pages are remapped in place in the block table and the packed
    offsets change in place: each replay reads them. (Was: bind_seq_lens=True.)"""
    case = Case(lens=(700, 64, 333, 1), num_qo_heads=32, num_kv_heads=8, head_dim=128, mode=mode,
                q_lens=(1, 2, 1, 1) if mode == "packed" else None,
                config=KernelConfig(block_n=64, block_m=16, num_kv_splits=splits), extra_cols=0,
                lengths="run", max_kv_len=700)
    inp = build(case)
    _all_columns_valid(inp)
    w = plan_wrapper(case, inp)
    out = poisoned_out(case, inp)
    g = _graph(lambda: run_wrapper(w, case, inp, out=out, validate=False))
    offsets = [None, (0, 2, 3, 4, 5), (0, 1, 2, 4, 5)]
    for step, new_lens in enumerate([(700, 64, 333, 1), (1, 700, 65, 129), (300, 2, 700, 16)]):
        inp.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        if step == 2:  # remap two live pages in place
            for b, c in ((0, 3), (2, 10)):
                inp.block_tables[b, c] = (int(inp.block_tables[b, c]) + 7) % inp.num_pages
        if mode == "packed" and offsets[step] is not None:
            inp.qo_indptr.copy_(torch.tensor(offsets[step], dtype=torch.int32))
        inp.q.copy_(torch.randn(inp.q.shape).to(inp.q.dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(case, out, reference(case, inp))


def test_cuda_graph_plan_owned_lengths():
    """Plan-owned lengths: a captured run replays with new q values and a page remapped in place
    (the block table is read on every replay)."""
    case = Case(lens=(100, 900, 17), num_qo_heads=32, num_kv_heads=8, head_dim=128)
    inp = build(case)
    w = plan_wrapper(case, inp)
    out = poisoned_out(case, inp)
    g = _graph(lambda: run_wrapper(w, case, inp, out=out, validate=False))
    for step in range(2):
        if step:
            inp.block_tables[1, 5] = inp.num_pages - 1  # a spare page
        inp.q.copy_(torch.randn(inp.q.shape).to(inp.q.dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(case, out, reference(case, inp))


def test_oneshot_refuses_capture():
    case = Case(lens=(10, 20))
    inp = build(case)
    tsdecode.batch_decode_with_paged_kv_cache(inp.q, inp.cache, inp.block_tables, inp.seq_lens)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="CUDA graph.*validate=False"):
            with torch.cuda.graph(g):
                tsdecode.batch_decode_with_paged_kv_cache(inp.q, inp.cache, inp.block_tables, inp.seq_lens)


def test_plan_refuses_capture_and_keeps_its_plan():
    """plan() compiles and may allocate: during a capture it raises (before launching anything
    into the graph), and the wrapper's previous plan still runs and matches the reference."""
    case = Case(lens=(10, 20))
    inp = build(case)
    w = plan_wrapper(case, inp)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="CUDA graph capture"):
            with torch.cuda.graph(g):
                plan_wrapper(dataclasses.replace(case, lens=(20, 10)), inp, wrapper=w)
    out = poisoned_out(case, inp)
    run_wrapper(w, case, inp, out=out)
    check(case, out, reference(case, inp))


def _compiled_kernel_count() -> int:
    total = 0
    for fn in (decode._split_kv_kernel, decode._merge_kernel):
        for cache in fn.device_caches.values():
            total += len(cache[0] if isinstance(cache, tuple) else cache)
    return total


@pytest.mark.parametrize("lens,splits,extra", [
    ((900,), 66, {}), ((300,) * 40, 3, {}), ((5000, 17, 64), 128, {}), ((700, 33), 1, {}),
    ((700, 33, 90), 5, dict(mode="packed", seq_len_q=4, q_lens=(1, 4, 2), mask_type="causal")),
    ((700, 33), 7, dict(mode="fixed", seq_len_q=3, window_left=20, mask_type="causal")),
    ((700, 33), 7, dict(dtype=torch.bfloat16, kv_dtype=FP8, separate=True)),
    ((1000, 16), 4, dict(dtype=FP8, out_dtype=torch.float32, page_stride_pad=16)),
    ((700, 33), 5, dict(lengths="run", max_kv_len=4096)),
])
def test_plan_compiles_every_kernel_run_uses(lens, splits, extra):
    """run() after plan() compiles nothing (capture-safe): plan() compiles the same split and merge
    kernels (``DecodeLaunch.compile``), including the merge's head-dim slicing for the real grid,
    for every query mode, mask, dtype, cache form and length owner (block-table row stride
    divisible by 16, the class plan compiles for)."""
    case = aligned_table(Case(lens=lens, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                              config=KernelConfig(block_n=16, block_m=16, num_kv_splits=splits, num_warps=2,
                                                  num_stages=3), **extra))
    inp = build(case)
    assert inp.block_tables.stride(0) % 16 == 0
    for fn in (decode._split_kv_kernel, decode._merge_kernel):
        fn.device_caches.clear()  # kernels other tests compiled in this process must not count
    launch.clear_compiled_cache()  # ... nor kernels earlier plans share
    w = plan_wrapper(case, inp)
    before = _compiled_kernel_count()
    assert before >= (2 if splits > 1 else 1)
    out = poisoned_out(case, inp)
    run_wrapper(w, case, inp, out=out)
    torch.cuda.synchronize()
    assert _compiled_kernel_count() == before
    check(case, out, reference(case, inp))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("splits", [1, 6])
def test_tensors_on_a_gpu_that_is_not_the_current_one(splits):
    """Triton launches on the current device and stream; with every tensor on cuda:1 while cuda:0
    is current, plan (compile step), run, a graph captured on cuda:1 and the one-shot op must
    still compute on cuda:1 and match the reference, also after a plan of the same problem on
    cuda:0 (plans share compiled kernels per device)."""
    case = Case(lens=(100, 900, 17), num_qo_heads=32, num_kv_heads=8, head_dim=128,
                config=KernelConfig(block_n=32, num_kv_splits=splits, num_warps=4, num_stages=2))
    dev1 = torch.device("cuda", 1)
    plan_wrapper(case, build(case, device=torch.device("cuda", 0)))  # cuda:0's kernels are not cuda:1's
    with torch.cuda.device(0):
        inp = build(case, device=dev1)
        ref = reference(case, inp)
        w = plan_wrapper(case, inp)
        assert w._plan.device == dev1
        out = poisoned_out(case, inp)
        run_wrapper(w, case, inp, out=out)
        torch.cuda.synchronize(dev1)
        check(case, out, ref)
        check(case, run_oneshot(case, inp), ref)
        # Capture on a cuda:1 stream (torch.cuda.graph's default capture stream lives on the
        # device current when a process first captures), replay with cuda:0 current.
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=torch.cuda.Stream(dev1)):
            run_wrapper(w, case, inp, out=out, validate=False)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize(dev1)
        check(case, out, ref)


def test_device_properties_are_the_gpus_own():
    """Config selection reads the GPU's own SM count, shared memory and registers per SM (no
    silent fallback to the H100/H200 constants where torch exposes them)."""
    from tsdecode.device import device_properties

    props = torch.cuda.get_device_properties(0)
    ours = device_properties(torch.device("cuda", 0))
    assert ours.name == props.name and ours.sm_count == props.multi_processor_count
    assert ours.compute_capability == (props.major, props.minor)
    assert hasattr(props, "shared_memory_per_multiprocessor")
    assert ours.shared_memory_per_sm == props.shared_memory_per_multiprocessor > 0
    if hasattr(props, "regs_per_multiprocessor"):
        assert ours.registers_per_sm == props.regs_per_multiprocessor
    if (props.major, props.minor) == (9, 0):
        assert props.shared_memory_per_multiprocessor == 233472


def _count_dispatches(monkeypatch) -> list:
    """Kernels launched through triton's dispatch (``kernel[grid](...)``, warm-ups included) from
    now on."""
    dispatched = []
    for fn in (decode._split_kv_kernel, decode._merge_kernel):
        real_run = fn.run
        monkeypatch.setattr(fn, "run", lambda *a, _real=real_run, _fn=fn, **kw: dispatched.append(_fn) or _real(*a, **kw))
    return dispatched


@pytest.mark.parametrize("splits,separate,extra", [
    (1, False, {}), (5, False, {}), (5, True, {}),
    (5, False, dict(mode="packed", seq_len_q=4, q_lens=(1, 4, 2), mask_type="causal", kv_dtype=FP8)),
])
def test_runs_launch_compiled_kernels_directly(monkeypatch, splits, separate, extra):
    """After a plan's first run, run() launches the compiled kernels without triton's dispatch;
    the results match the reference for new scales (floats are not specialised) and for inputs
    with other alignments and strides, which go through the dispatch once (a variant triton
    compiles separately) and directly afterwards. (The block table's row stride, 58, is not in
    the class plan compiles for: the first run dispatches.)"""
    case = Case(lens=(100, 900, 17), num_qo_heads=32, num_kv_heads=8, head_dim=128, separate=separate,
                page_stride_pad=8, config=KernelConfig(block_n=16, num_kv_splits=splits, num_warps=1,
                                                       num_stages=3), **extra)
    inp = build(case)
    assert inp.block_tables.stride(0) % 16
    w = plan_wrapper(case, inp)
    launch_ = w._plan.launch
    assert len(launch_._direct) == 1  # plan's entry: an aligned table and a compact combined cache
    dispatched = _count_dispatches(monkeypatch)

    def run_checked(q, out, bmm1_scale=None, bmm2_scale=1.0, expect_dispatch=False):
        c = dataclasses.replace(case, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale)
        dispatched.clear()
        out.fill_(float("nan"))
        w.run(q, inp.cache, None, inp.block_tables, qo_indptr=inp.qo_indptr, bmm1_scale=bmm1_scale,
              bmm2_scale=bmm2_scale, out=out)
        torch.cuda.synchronize()
        assert bool(dispatched) == expect_dispatch, dispatched
        check(c, out, reference(c, dataclasses.replace(inp, q=q)))

    out = poisoned_out(case, inp)
    run_checked(inp.q, out, expect_dispatch=True)  # the plan's first run builds the direct entry
    assert len(launch_._direct) == 2
    run_checked(inp.q, out)
    run_checked(inp.q, out, bmm1_scale=0.3, bmm2_scale=-1.7)
    # q 2 bytes off a 16-byte boundary, out with a head stride not divisible by 16: new
    # specialisations (a stride of another multiple of 16 would be the same one).
    q_shifted = torch.empty(inp.q.numel() + 1, dtype=inp.q.dtype, device=inp.q.device)[1:].view(inp.q.shape)
    q_shifted.copy_(inp.q)
    out_wide = torch.empty(*inp.q.shape[:-1], 136, dtype=out.dtype, device=out.device)[..., :128]
    same_class = torch.empty(*inp.q.shape[:-1], 160, dtype=out.dtype, device=out.device)[..., :128]
    run_checked(q_shifted, out, expect_dispatch=True)
    run_checked(q_shifted, out)
    run_checked(inp.q, out_wide, expect_dispatch=True)
    run_checked(inp.q, out_wide, bmm2_scale=0.5)
    run_checked(inp.q, same_class)
    run_checked(inp.q, out)
    assert len(launch_._direct) == 4


@pytest.mark.parametrize("splits,extra", [
    (1, {}), (6, {}), (6, dict(mode="packed", seq_len_q=4, q_lens=(1, 4, 2), mask_type="causal", kv_dtype=FP8)),
    (6, dict(lengths="run")),
])
def test_first_run_after_plan_launches_directly(monkeypatch, splits, extra):
    """plan() keeps the kernels it compiled for contiguous q/out, a compact combined cache and a
    block table whose row stride is divisible by 16, so a plan's first run with such inputs (and a
    graph captured right after plan) launches them directly; results match the reference."""
    case = aligned_table(Case(lens=(100, 900, 17), num_qo_heads=32, num_kv_heads=8, head_dim=128,
                              config=KernelConfig(block_n=16, num_kv_splits=splits, num_warps=1, num_stages=3),
                              **extra))
    inp = build(case)
    ref = reference(case, inp)
    w, w2 = plan_wrapper(case, inp), plan_wrapper(case, inp)
    dispatched = _count_dispatches(monkeypatch)  # (plan's compile goes through it too)
    out = poisoned_out(case, inp)
    run_wrapper(w, case, inp, out=out)
    torch.cuda.synchronize()
    assert not dispatched
    check(case, out, ref)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run_wrapper(w2, case, inp, out=out, validate=False)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert not dispatched
    check(case, out, ref)


def test_plans_share_compiled_kernels(monkeypatch):
    """A plan whose kernels an earlier plan compiled (same config; another batch size and longest
    length, as at the next decode step) calls no warm-up and no dispatch, and its first runs match
    the reference; another config compiles its own; a lengths tensor at another alignment passed
    to run goes through the dispatch once (a variant of its own), then launches directly."""
    assert "max_kv_len" in decode._split_kv_kernel.do_not_specialize
    config = KernelConfig(block_n=16, num_kv_splits=6, num_warps=1, num_stages=3)
    first = aligned_table(Case(lens=(1024, 512), num_qo_heads=32, num_kv_heads=8, head_dim=128, config=config))
    plan_wrapper(first, build(first))
    warmups = []
    for fn in (decode._split_kv_kernel, decode._merge_kernel):
        real = fn.warmup
        monkeypatch.setattr(fn, "warmup", lambda *a, _real=real, _fn=fn, **kw: warmups.append(_fn) or _real(*a, **kw))
    dispatched = _count_dispatches(monkeypatch)
    # max_kv_len 1000 (not a multiple of 16); the block table's row stride stays in its class.
    step = aligned_table(dataclasses.replace(first, lens=(1000, 33, 700, 5)))
    inp = build(step)
    w = plan_wrapper(step, inp)
    assert not warmups
    out = poisoned_out(step, inp)
    run_wrapper(w, step, inp, out=out)
    torch.cuda.synchronize()
    assert not dispatched
    check(step, out, reference(step, inp))
    # a config no other test compiles (a worker of pytest-xdist may have compiled a common one)
    other = dataclasses.replace(step, config=dataclasses.replace(config, num_kv_splits=5, num_stages=4))
    plan_wrapper(other, inp)
    assert warmups == [decode._split_kv_kernel, decode._merge_kernel]
    per_run = dataclasses.replace(step, lengths="run")
    w = plan_wrapper(per_run, inp)
    assert len(warmups) == 2  # shared with the first plan
    odd_lens = torch.empty(len(step.lens) + 1, dtype=torch.int32, device="cuda")[1:]  # 4 bytes off
    odd_lens.copy_(inp.seq_lens)
    for expect in (True, False):
        dispatched.clear()
        out = poisoned_out(step, inp)
        w.run(inp.q, inp.cache, odd_lens, inp.block_tables, out=out)
        torch.cuda.synchronize()
        assert bool(dispatched) is expect
        check(step, out, reference(step, inp))


@pytest.mark.parametrize("extra", [{}, dict(mode="packed", seq_len_q=4, q_lens=(1, 4, 2), mask_type="causal")])
def test_oneshot_op_launches_shared_kernels_directly(monkeypatch, extra):
    """The one-shot op finds the kernels an earlier call compiled, so a later call (other requests,
    same config) launches them without triton's dispatch (or warm-up); results match the reference."""
    first = Case(lens=(100, 900, 17), num_qo_heads=32, num_kv_heads=8, head_dim=128, **extra)
    run_oneshot(first, build(first))
    dispatched = _count_dispatches(monkeypatch)
    later = dataclasses.replace(first, lens=(900, 17, 100))  # same longest and spread: same config
    inp = build(later)
    out = run_oneshot(later, inp, out=poisoned_out(later, inp))
    torch.cuda.synchronize()
    assert not dispatched
    check(later, out, reference(later, inp))


def test_oneshot_op_compiles_no_unused_variant(monkeypatch):
    """A one-shot call whose inputs the plan's compile step does not assume (a padded page stride)
    skips that step (it would compile a variant no launch uses) and goes through the dispatch."""
    case = Case(lens=(100, 900, 17), num_qo_heads=32, num_kv_heads=8, head_dim=128, page_stride_pad=16)
    inp = build(case)
    warmups = []
    for fn in (decode._split_kv_kernel, decode._merge_kernel):
        monkeypatch.setattr(fn, "warmup", lambda *a, _fn=fn, **kw: warmups.append(_fn))
    out = run_oneshot(case, inp, out=poisoned_out(case, inp))
    torch.cuda.synchronize()
    assert not warmups
    check(case, out, reference(case, inp))


def test_direct_launch_falls_back_to_triton_dispatch(monkeypatch):
    """A triton whose compiled-kernel launcher rejects the arguments (TypeError) switches the plan
    to triton's dispatch for good; results stay right."""
    case = Case(lens=(300, 41), num_qo_heads=32, num_kv_heads=8, head_dim=128,
                config=KernelConfig(block_n=16, num_kv_splits=4, num_warps=1, num_stages=3))
    inp = build(case)
    ref = reference(case, inp)
    w = plan_wrapper(case, inp)
    out = poisoned_out(case, inp)
    run_wrapper(w, case, inp, out=out)

    def reject(self, split_args, merge_args, merge_grid):
        raise TypeError("launcher takes other arguments")

    monkeypatch.setattr(launch._DirectLaunch, "__call__", reject)
    for _ in range(2):
        out.fill_(float("nan"))
        run_wrapper(w, case, inp, out=out)
        torch.cuda.synchronize()
        check(case, out, ref)
    assert w._plan.launch._direct_broken and not w._plan.launch._direct


def _driver_resident_programs(kernel, num_warps: int) -> int:
    """cuOccupancyMaxActiveBlocksPerMultiprocessor for a compiled triton kernel (the truth the
    residency model stands in for)."""
    import ctypes

    if getattr(kernel, "function", None) is None:
        kernel._init_handles()
    blocks = ctypes.c_int(0)
    err = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(int(kernel.function)), ctypes.c_int(32 * num_warps),
        ctypes.c_size_t(int(kernel.metadata.shared)))
    assert err == 0, f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed: {err}"
    return blocks.value


@pytest.mark.parametrize("hq,hkv,head_dim,kv_dtype,batch,kv_len", [
    (32, 8, 128, BF16, 1, 32768),  # lean: 16/1/3, splits
    (64, 8, 128, BF16, 1, 8192),  # lean, 8 rows: 5 stages, splits
    (32, 8, 128, BF16, 128, 1024),  # batch lean: one split (direct output), 5 stages
    (32, 8, 64, BF16, 8, 8192),  # D=64 lean
    (32, 8, 64, BF16, 200, 2048),  # D=64 batch lean
    (32, 8, 128, FP8, 1, 8192),  # fp8 lean
    (32, 8, 128, FP8, 128, 8192),  # fp8 at ~46 a SM
    (32, 32, 128, BF16, 64, 6144),  # MHA: 64-token tiles, 4 warps, multi-wave splits
    (64, 2, 128, BF16, 8, 8192),  # 32 rows: block_m 32 lean tiles
])
def test_residency_model_matches_the_driver(hq, hkv, head_dim, kv_dtype, batch, kv_len):
    """The residency model's programs per SM (``config.residency.resident_programs_per_sm``:
    measured registers and shared memory, counted per register sub-partition) equal the CUDA
    driver's count for the kernel the plan compiles, at the configs the plan picks (the H200
    table's entries or the heuristic) for nine shapes. The resource table was measured on an H200
    with triton 3.6: elsewhere the model is an estimate and this test is skipped."""
    import triton

    from tsdecode.config.residency import resident_programs_per_sm
    from tsdecode.config.space import ProblemShape
    from tsdecode.device import device_properties

    props = torch.cuda.get_device_properties(0)
    if (props.major, props.minor) != (9, 0) or not triton.__version__.startswith("3.6"):
        pytest.skip("the resource table was measured on sm_90 with triton 3.6")
    dev = torch.device("cuda", 0)
    for fn in (decode._split_kv_kernel, decode._merge_kernel):
        fn.device_caches.clear()
    launch.clear_compiled_cache()
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(dev, batch, hq, hkv, head_dim, 16, kv_len, q_data_type=BF16, kv_data_type=kv_dtype, o_data_type=BF16,
           seq_lens=[kv_len] * batch)
    config = w.config.kernel_config
    shape = ProblemShape(batch_size=batch, num_qo_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                         page_size=16, max_kv_len=kv_len, kv_dtype=kv_dtype)
    kernels = [k for cache in decode._split_kv_kernel.device_caches.values()
               for k in (cache[0] if isinstance(cache, tuple) else cache).values()]
    assert len(kernels) == 1
    model = resident_programs_per_sm(config, shape, device_properties(dev))
    assert model == _driver_resident_programs(kernels[0], config.num_warps), config
