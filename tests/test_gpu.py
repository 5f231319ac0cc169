"""GPU-only tests: the full feature matrix, extreme sizes and CUDA-graph capture/replay.

Skipped without CUDA. Run on the GPU machine with ``scripts/gpu_check.sh``.
"""

import dataclasses
import itertools
import random

import pytest
import torch

import tsdecode
from tsdecode import KernelConfig
from tsdecode.configs import BLOCK_M_CHOICES, BLOCK_N_CHOICES
from tsdecode.kernels import decode
from cases import FP8, Case, build, check, plan_wrapper, poisoned_out, reference, run_and_check, run_oneshot

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
    """n sampled combinations of dtype x query mode x geometry x random valid config."""
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
        out.append(pytest.param(Case(
            lens=tuple(lens), num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=p,
            dtype=q, kv_dtype=kv, out_dtype=o, mode=mode, seq_len_q=sq, q_lens=q_lens,
            mask_type=mask, window_left=window, config=config, seed=i,
            separate=bool(i % 2), page_stride_pad=64 * (i % 3 == 1), table_pad=3 * (i % 4 == 2),
            shared_pages=i % 5 == 0,
        ), id=f"m{i}"))
    return out


@pytest.mark.parametrize("case", _matrix(160))
def test_full_matrix(case):
    run_and_check(case)


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


@pytest.mark.parametrize("form", ["0", "1"])
@pytest.mark.parametrize("kv_dtype", [BF16, FP16, FP8])
@pytest.mark.parametrize("block_n,warps,stages", [(16, 1, 3), (16, 1, 5), (32, 2, 2), (64, 4, 2), (128, 8, 3)])
def test_both_product_forms(monkeypatch, form, kv_dtype, block_n, warps, stages):
    """The standard and the transposed split kernel (``decode.transposed_products``), each forced on
    every cache dtype: G = 1 / 4 / 8 and causal SQ = 2 at G = 4 (8 rows), pages smaller than and
    equal to the tile, ragged lengths across page and tile boundaries, one and several splits."""
    monkeypatch.setattr(decode, "_TRANSPOSED_MODE", form)
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


def test_million_token_request():
    """K/V length 2**20 (1,048,576 tokens) in one request, split across many programs."""
    case = Case(lens=(1 << 20, 3), num_qo_heads=8, num_kv_heads=1, head_dim=64, page_size=256, extra_cols=0)
    run_and_check(case)


def test_batch_4096():
    case = Case(lens=tuple(1 + (7 * i) % 61 for i in range(4096)), num_qo_heads=8, num_kv_heads=2, head_dim=64)
    run_and_check(case)


def _graph(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("mode", ["sq1", "packed"])
def test_cuda_graph_bound_lengths_and_remapped_pages(splits, mode):
    case = Case(lens=(700, 64, 333, 1), num_qo_heads=32, num_kv_heads=8, head_dim=128, mode=mode,
                q_lens=(1, 2, 1, 1) if mode == "packed" else None,
                config=KernelConfig(block_n=64, block_m=16, num_kv_splits=splits), extra_cols=0)
    inp = build(case)
    max_kv_len = 700
    cols = inp.block_tables.shape[1]
    for b in range(4):  # every row valid up to max_kv_len
        for c in range(cols):
            if inp.block_tables[b, c] >= inp.num_pages:
                inp.block_tables[b, c] = (b + c) % inp.num_pages
    w = plan_wrapper(case, inp, bind_seq_lens=True, max_kv_len=max_kv_len)
    out = poisoned_out(case, inp)
    g = _graph(lambda: w.run(inp.q, inp.cache, out=out))
    for step, new_lens in enumerate([(700, 64, 333, 1), (1, 700, 65, 129), (300, 2, 700, 16)]):
        inp.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        if step == 2:  # remap two pages in place
            for b, c in ((0, 3), (2, 10)):
                new = (int(inp.block_tables[b, c]) + 7) % inp.num_pages
                inp.block_tables[b, c] = new
        inp.q.copy_(torch.randn(inp.q.shape).to(inp.q.dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(case, out, reference(case, inp))


def test_cuda_graph_fixed_lengths():
    case = Case(lens=(100, 900, 17), num_qo_heads=32, num_kv_heads=8, head_dim=128)
    inp = build(case)
    w = plan_wrapper(case, inp)
    out = poisoned_out(case, inp)
    g = _graph(lambda: w.run(inp.q, inp.cache, out=out))
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
        with pytest.raises(RuntimeError, match="CUDA graph"):
            with torch.cuda.graph(g):
                tsdecode.batch_decode_with_paged_kv_cache(inp.q, inp.cache, inp.block_tables, inp.seq_lens)


def test_plan_refuses_capture_and_keeps_its_plan():
    """plan() reads metadata on the host: during a capture it raises (before launching anything
    into the graph), and the wrapper's previous plan still runs and matches the reference."""
    case = Case(lens=(10, 20))
    inp = build(case)
    w = plan_wrapper(case, inp)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="CUDA graph capture"):
            with torch.cuda.graph(g):
                w.plan(inp.block_tables, inp.seq_lens, case.num_qo_heads, case.num_kv_heads,
                       case.head_dim, case.page_size, q_data_type=case.dtype)
    out = poisoned_out(case, inp)
    w.run(inp.q, inp.cache, out=out)
    check(case, out, reference(case, inp))


def _compiled_kernel_count() -> int:
    from tsdecode.kernels import decode

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
])
def test_plan_compiles_every_kernel_run_uses(lens, splits, extra):
    """run() after plan() compiles nothing (capture-safe): plan() compiles the same split and merge
    kernels (``DecodeLaunch.compile``), including the merge's head-dim slicing for the real grid,
    for every query mode, mask, dtype and cache form."""
    case = Case(lens=lens, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                config=KernelConfig(block_n=16, block_m=16, num_kv_splits=splits, num_warps=2, num_stages=3),
                **extra)
    inp = build(case)
    for fn in (decode._split_kv_kernel, decode._merge_kernel):
        fn.device_caches.clear()  # kernels other tests compiled in this process must not count
    decode.clear_compiled_cache()  # ... nor kernels earlier plans share
    w = plan_wrapper(case, inp)
    before = _compiled_kernel_count()
    assert before >= (2 if splits > 1 else 1)
    out = poisoned_out(case, inp)
    w.run(inp.q, inp.cache, out=out)
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
        out = poisoned_out(case, inp)
        w.run(inp.q, inp.cache, out=out)
        torch.cuda.synchronize(dev1)
        check(case, out, ref)
        check(case, run_oneshot(case, inp), ref)
        # Capture on a cuda:1 stream (torch.cuda.graph's default capture stream lives on the
        # device current when a process first captures), replay with cuda:0 current.
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=torch.cuda.Stream(dev1)):
            w.run(inp.q, inp.cache, out=out)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize(dev1)
        check(case, out, ref)


def test_shared_memory_per_sm_is_the_gpus_own():
    """The heuristic's residency model reads the GPU's shared memory a SM from torch (no silent
    fallback to the H100/H200 constant on a GPU where torch exposes it)."""
    from tsdecode.configs import device_shared_memory_per_sm

    props = torch.cuda.get_device_properties(0)
    assert hasattr(props, "shared_memory_per_multiprocessor")
    assert device_shared_memory_per_sm(torch.device("cuda", 0)) == props.shared_memory_per_multiprocessor > 0
    if (props.major, props.minor) == (9, 0):
        assert props.shared_memory_per_multiprocessor == 233472


@pytest.mark.parametrize("splits,separate,extra", [
    (1, False, {}), (5, False, {}), (5, True, {}),
    (5, False, dict(mode="packed", seq_len_q=4, q_lens=(1, 4, 2), mask_type="causal", kv_dtype=FP8)),
])
def test_runs_launch_compiled_kernels_directly(monkeypatch, splits, separate, extra):
    """After a plan's first run, run() launches the compiled kernels without triton's dispatch;
    the results match the reference for new scales (floats are not specialised) and for inputs
    with other alignments and strides, which go through the dispatch once (a variant triton
    compiles separately) and directly afterwards."""
    case = Case(lens=(100, 900, 17), num_qo_heads=32, num_kv_heads=8, head_dim=128, separate=separate,
                page_stride_pad=8, config=KernelConfig(block_n=16, num_kv_splits=splits, num_warps=1,
                                                       num_stages=3), **extra)
    inp = build(case)
    w = plan_wrapper(case, inp)
    launch = w._plan.launch
    assert len(launch._direct) == 1  # plan's entry for a compact combined cache: not these inputs
    dispatched = _count_dispatches(monkeypatch)

    def run_checked(q, out, bmm1_scale=None, bmm2_scale=1.0, expect_dispatch=False):
        c = dataclasses.replace(case, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale)
        dispatched.clear()
        out.fill_(float("nan"))
        w.run(q, inp.cache, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, out=out)
        torch.cuda.synchronize()
        assert bool(dispatched) == expect_dispatch, dispatched
        check(c, out, reference(c, dataclasses.replace(inp, q=q)))

    out = poisoned_out(case, inp)
    run_checked(inp.q, out, expect_dispatch=True)  # the plan's first run builds the direct entry
    assert len(launch._direct) == 2
    run_checked(inp.q, out)
    run_checked(inp.q, out, bmm1_scale=0.3, bmm2_scale=-1.7)
    # q 2 bytes off a 16-byte boundary, out with a padded head stride: new specialisations.
    q_shifted = torch.empty(inp.q.numel() + 1, dtype=inp.q.dtype, device=inp.q.device)[1:].view(inp.q.shape)
    q_shifted.copy_(inp.q)
    out_wide = torch.empty(inp.q.shape[0], inp.q.shape[1], 160, dtype=out.dtype, device=out.device)[..., :128]
    run_checked(q_shifted, out, expect_dispatch=True)
    run_checked(q_shifted, out)
    run_checked(inp.q, out_wide, expect_dispatch=True)
    run_checked(inp.q, out_wide, bmm2_scale=0.5)
    run_checked(inp.q, out)
    assert len(launch._direct) == 4


def _count_dispatches(monkeypatch) -> list:
    """Kernels launched through triton's dispatch (``kernel[grid](...)``) from now on."""
    dispatched = []
    for fn in (decode._split_kv_kernel, decode._merge_kernel):
        real_run = fn.run
        monkeypatch.setattr(fn, "run", lambda *a, _real=real_run, _fn=fn, **kw: dispatched.append(_fn) or _real(*a, **kw))
    return dispatched


@pytest.mark.parametrize("splits,extra", [
    (1, {}), (6, {}), (6, dict(mode="packed", seq_len_q=4, q_lens=(1, 4, 2), mask_type="causal", kv_dtype=FP8)),
])
def test_first_run_after_plan_launches_directly(monkeypatch, splits, extra):
    """plan() keeps the kernels it compiled for contiguous q/out and a compact combined cache, so a
    plan's first run with such inputs (and a graph captured right after plan) launches them
    directly; results match the reference."""
    case = Case(lens=(100, 900, 17), num_qo_heads=32, num_kv_heads=8, head_dim=128,
                config=KernelConfig(block_n=16, num_kv_splits=splits, num_warps=1, num_stages=3), **extra)
    inp = build(case)
    ref = reference(case, inp)
    w, w2 = plan_wrapper(case, inp), plan_wrapper(case, inp)
    dispatched = _count_dispatches(monkeypatch)  # (plan's compile goes through it too)
    out = poisoned_out(case, inp)
    w.run(inp.q, inp.cache, out=out)
    torch.cuda.synchronize()
    assert not dispatched
    check(case, out, ref)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w2.run(inp.q, inp.cache, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert not dispatched
    check(case, out, ref)


def test_plans_share_compiled_kernels(monkeypatch):
    """A plan whose kernels an earlier plan compiled (same config; another batch size and longest
    length, as at the next decode step) calls no warm-up and no dispatch, and its first runs match
    the reference; another config or a bound lengths tensor at another alignment compiles its own."""
    assert "max_kv_len" in decode._split_kv_kernel.do_not_specialize
    config = KernelConfig(block_n=16, num_kv_splits=6, num_warps=1, num_stages=3)
    first = Case(lens=(1024, 512), num_qo_heads=32, num_kv_heads=8, head_dim=128, config=config)
    plan_wrapper(first, build(first))
    warmups = []
    for fn in (decode._split_kv_kernel, decode._merge_kernel):
        real = fn.warmup
        monkeypatch.setattr(fn, "warmup", lambda *a, _real=real, _fn=fn, **kw: warmups.append(_fn) or _real(*a, **kw))
    dispatched = _count_dispatches(monkeypatch)
    # max_kv_len 1000 (not a multiple of 16); the block table keeps its width (an engine's does):
    # its row stride is an integer argument triton specialises on.
    step = dataclasses.replace(first, lens=(1000, 33, 700, 5), extra_cols=first.extra_cols + 1)
    inp = build(step)
    w = plan_wrapper(step, inp)
    assert not warmups
    out = poisoned_out(step, inp)
    w.run(inp.q, inp.cache, out=out)
    torch.cuda.synchronize()
    assert not dispatched
    check(step, out, reference(step, inp))
    other = dataclasses.replace(step, config=dataclasses.replace(config, num_kv_splits=5))
    plan_wrapper(other, inp)
    assert warmups == [decode._split_kv_kernel, decode._merge_kernel]
    odd_lens = torch.empty(len(step.lens) + 1, dtype=torch.int32, device="cuda")[1:]  # 4 bytes off
    odd_lens.copy_(inp.seq_lens)
    # Bound lengths validate max_kv_len's columns in every row: valid IDs past each row's pages.
    table = torch.where(inp.block_tables < inp.num_pages, inp.block_tables, 0)
    assert table.stride() == inp.block_tables.stride()
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(table, odd_lens, 32, 8, 128, step.page_size, q_data_type=step.dtype, config=config,
           bind_seq_lens=True)
    assert len(warmups) == 4
    out = poisoned_out(step, inp)
    w.run(inp.q, inp.cache, out=out)
    torch.cuda.synchronize()
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
    w.run(inp.q, inp.cache, out=out)

    def reject(self, split_args, merge_args):
        raise TypeError("launcher takes other arguments")

    monkeypatch.setattr(decode._DirectLaunch, "__call__", reject)
    for _ in range(2):
        out.fill_(float("nan"))
        w.run(inp.q, inp.cache, out=out)
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
    """The heuristic's programs per SM (``resident_programs_per_sm``: measured registers and
    shared memory, counted per register sub-partition) equal the CUDA driver's count for the
    kernel the plan compiles, at the configs the plan picks (the H200 table's entries or the
    heuristic) for nine shapes of the heuristic's families. The resource table was measured
    on an H200 with triton 3.6: elsewhere the model is an estimate and this test is skipped."""
    import triton

    from tsdecode.configs import ProblemShape, device_shared_memory_per_sm, resident_programs_per_sm

    props = torch.cuda.get_device_properties(0)
    if (props.major, props.minor) != (9, 0) or not triton.__version__.startswith("3.6"):
        pytest.skip("the resource table was measured on sm_90 with triton 3.6")
    dev = torch.device("cuda")
    pages = -(-kv_len // 16)
    tables = torch.arange(batch * pages, dtype=torch.int32, device=dev).reshape(batch, pages)
    lens = torch.full((batch,), kv_len, dtype=torch.int32, device=dev)
    for fn in (decode._split_kv_kernel, decode._merge_kernel):
        fn.device_caches.clear()
    decode.clear_compiled_cache()
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(tables, lens, hq, hkv, head_dim, 16, q_data_type=BF16, kv_data_type=kv_dtype,
           o_data_type=BF16)
    config = w._plan.selected.kernel_config
    shape = ProblemShape(batch_size=batch, num_qo_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                         page_size=16, max_kv_len=kv_len, kv_dtype=kv_dtype)
    kernels = [k for cache in decode._split_kv_kernel.device_caches.values()
               for k in (cache[0] if isinstance(cache, tuple) else cache).values()]
    assert len(kernels) == 1
    model = resident_programs_per_sm(config, shape, device_shared_memory_per_sm(dev))
    assert model == _driver_resident_programs(kernels[0], config.num_warps), config
