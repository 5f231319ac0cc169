"""torch.compile: run() and the one-shot op trace as one opaque op each (fullgraph, no graph
break), give the reference's results, follow re-plans without recompiling, and take the block
table, lengths and packed offsets as op inputs: new values or new tensors need no recompile, and
a write to them inside the compiled region is ordered before the op. CPU: the ops run the kernels
in the interpreter; GPU: also inductor's CUDA graphs.
"""

from __future__ import annotations

import copy
import gc
import pickle

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tsdecode
from cases import DEVICE, Case, build, check, plan_wrapper, poisoned_out, reference
from tsdecode import api

# aot_eager: dynamo + functionalization + the ops' fake implementations, without inductor's
# compile time on CPU (the GPU test below uses inductor).
BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _counted():
    return CompileCounterWithBackend(BACKEND)


def _count_runs(monkeypatch) -> list:
    """Count the op bodies' eager runs (``api.run_plan`` calls): one per compiled call."""
    calls = []
    real = api.run_plan

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(api, "run_plan", counting)
    return calls


@pytest.mark.parametrize("lengths", ["plan", "run"])
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("with_out", [False, True])
def test_compiled_run_matches_reference(lengths, separate, with_out, monkeypatch):
    case = Case(lens=(1, 17, 40), separate=separate, bmm2_scale=0.5, lengths=lengths, config=tsdecode.KernelConfig(
        block_n=16, block_m=16, num_kv_splits=2, num_warps=1, num_stages=1))
    inp = build(case)
    w = plan_wrapper(case, inp)
    counter = _counted()
    runs = _count_runs(monkeypatch)
    seq_lens = inp.seq_lens if lengths == "run" else None

    def step(q, cache, seq_lens, block_tables, out):
        return w.run(q, cache, seq_lens, block_tables, bmm2_scale=0.5, out=out) * 2.0

    fn = torch.compile(step, fullgraph=True, backend=counter)
    for seed in range(2):  # new q values: the same graph
        q = torch.randn(inp.q.shape, generator=torch.Generator().manual_seed(seed)).to(inp.q)
        inp.q = q
        out = poisoned_out(case, inp) if with_out else None
        result = fn(q, inp.cache, seq_lens, inp.block_tables, out)
        check(case, result / 2.0, reference(case, inp))
        if with_out:
            check(case, out, reference(case, inp))
    assert counter.frame_count == 1 and len(runs) == 2


def test_new_block_tables_and_lengths_need_no_recompile():
    """The block table and the run's lengths are op inputs: new values in place and new tensors of
    the same shapes reuse the graph, and each call reads them (issue 29: no recompile when they
    change)."""
    case = Case(lens=(5, 33, 20), lengths="run", max_kv_len=64, extra_cols=2)
    inp = build(case)
    w = plan_wrapper(case, inp)
    counter = _counted()
    fn = torch.compile(lambda q, cache, lens, bt: w.run(q, cache, lens, bt), fullgraph=True, backend=counter)
    check(case, fn(inp.q, inp.cache, inp.seq_lens, inp.block_tables), reference(case, inp))
    inp.seq_lens.copy_(torch.tensor([40, 1, 17], dtype=torch.int32))  # in place
    for b in range(3):  # rows need up to 3 live pages now: valid IDs in every column
        for col in range(inp.block_tables.shape[1]):
            if not 0 <= int(inp.block_tables[b, col]) < inp.num_pages:
                inp.block_tables[b, col] = (b + col) % inp.num_pages
    check(case, fn(inp.q, inp.cache, inp.seq_lens, inp.block_tables), reference(case, inp))
    inp.seq_lens = torch.tensor([64, 9, 2], dtype=torch.int32, device=DEVICE)  # new tensors
    inp.block_tables = inp.block_tables.flip(0).contiguous()
    check(case, fn(inp.q, inp.cache, inp.seq_lens, inp.block_tables), reference(case, inp))
    assert counter.frame_count == 1


def test_compiled_run_follows_replans_without_recompiling():
    case = Case(lens=(5, 33, 20), max_kv_len=48)
    inp = build(case)
    w = tsdecode.BatchDecodePagedTSWrapper()
    counter = _counted()
    fn = torch.compile(lambda q, cache, bt: w.run(q, cache, None, bt), fullgraph=True, backend=counter)
    for lens in ((5, 33, 20), (9, 48, 1), (16, 17, 31)):  # each a new plan owning its lengths
        inp.seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        for b in range(3):
            for col in range(inp.block_tables.shape[1]):
                if not 0 <= int(inp.block_tables[b, col]) < inp.num_pages:
                    inp.block_tables[b, col] = (b + col) % inp.num_pages
        plan_wrapper(Case(lens=lens, max_kv_len=48), inp, wrapper=w)
        check(case, fn(inp.q, inp.cache, inp.block_tables), reference(case, inp))
    assert counter.frame_count == 1


def test_new_wrappers_and_batch_sizes_need_no_recompile():
    """A new wrapper (an engine's next step, a model's next layer) and a re-plan to another batch
    size reuse the graph: the handle is a tensor input, the output takes q's shape (dynamic)."""
    counter = _counted()
    fn = torch.compile(lambda w, q, cache, bt: w.run(q, cache, None, bt), fullgraph=True, dynamic=True,
                       backend=counter)
    first = None
    # batch sizes >= 2: dynamo specialises a size of 1 in any graph (its 0/1 rule)
    for lens in ((5, 33, 20), (9, 48), (16, 17, 31, 2), (3, 3, 3), (7, 8), (1, 60, 2, 2, 9)):
        case = Case(lens=lens)
        inp = build(case)
        w = plan_wrapper(case, inp)
        check(case, fn(w, inp.q, inp.cache, inp.block_tables), reference(case, inp))
        first = first or counter.frame_count  # the first call's compile (it may restart once)
    assert counter.frame_count == first


def test_compiled_run_packed_causal_queries():
    case = Case(lens=(7, 30, 18), mode="packed", q_lens=(1, 4, 2), mask_type="causal", window_left=5,
                bmm1_scale=1, lengths="run")
    inp = build(case)
    w = plan_wrapper(case, inp)
    counter = _counted()
    fn = torch.compile(lambda q, cache, lens, bt, indptr: w.run(q, cache, lens, bt, qo_indptr=indptr, bmm1_scale=1),
                       fullgraph=True, backend=counter)
    check(case, fn(inp.q, inp.cache, inp.seq_lens, inp.block_tables, inp.qo_indptr), reference(case, inp))
    inp.qo_indptr.copy_(torch.tensor([0, 3, 4, 7], dtype=torch.int32))  # new query lengths in place
    check(case, fn(inp.q, inp.cache, inp.seq_lens, inp.block_tables, inp.qo_indptr), reference(case, inp))
    assert counter.frame_count == 1


def test_block_table_written_inside_the_compiled_region_is_read():
    """The block table is an op input, so a write to it inside the compiled region is ordered
    before the op, which reads the new page ID. (Replaces "refused": the plan held the block table
    then, and a deferred write would have been missed.)"""
    case = Case(lens=(20, 33))
    inp = build(case)
    w = plan_wrapper(case, inp)
    spare = inp.num_pages - 1  # a page no request uses
    assert spare not in inp.block_tables[:, :3].tolist()

    def step(q, cache, block_tables):
        block_tables[0, 0] = spare
        return w.run(q, cache, None, block_tables)

    fn = torch.compile(step, fullgraph=True, backend=BACKEND)
    result = fn(inp.q, inp.cache, inp.block_tables)
    assert int(inp.block_tables[0, 0]) == spare  # the write reached the caller's tensor
    check(case, result, reference(case, inp))


def test_copies_of_a_wrapper_are_wrappers_of_their_own():
    """copy.copy shares the plan until the copy re-plans; each compiled run follows its own
    wrapper. A planned wrapper refuses deepcopy and pickle (compiled kernels, scratch); an
    unplanned one copies with a handle of its own."""
    case = Case(lens=(5, 33))
    inp = build(case)
    w = plan_wrapper(case, inp)
    twin = copy.copy(w)
    assert int(twin._handle) != int(w._handle) and twin._plan is w._plan
    fn_twin = torch.compile(lambda q, cache, bt: twin.run(q, cache, None, bt), fullgraph=True, backend=BACKEND)
    fn_w = torch.compile(lambda q, cache, bt: w.run(q, cache, None, bt), fullgraph=True, backend=BACKEND)
    check(case, fn_twin(inp.q, inp.cache, inp.block_tables), reference(case, inp))
    other = Case(lens=(12, 3), seed=1)
    other_inp = build(other)
    plan_wrapper(other, other_inp, wrapper=twin)
    check(other, fn_twin(other_inp.q, other_inp.cache, other_inp.block_tables), reference(other, other_inp))
    check(case, fn_w(inp.q, inp.cache, inp.block_tables), reference(case, inp))
    for deep in (copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))):
        with pytest.raises(TypeError, match="cannot be deep-copied or pickled"):
            deep(w)
        fresh = deep(tsdecode.BatchDecodePagedTSWrapper())
        assert fresh._plan is None and api._WRAPPERS[int(fresh._handle)] is fresh


def test_the_registry_keeps_no_wrapper_alive_and_the_op_refuses_a_gone_one():
    case = Case(lens=(5, 33))
    inp = build(case)
    w = plan_wrapper(case, inp)
    handle, plan = w._handle, w._plan
    assert api._WRAPPERS[int(handle)] is w
    del w
    gc.collect()
    assert int(handle) not in api._WRAPPERS
    with pytest.raises(RuntimeError, match="no longer exists or has no plan"):
        torch.ops.tsdecode.run_planned(handle, inp.q, inp.cache, None, plan.seq_lens, inp.block_tables, None,
                                       poisoned_out(case, inp), 1.0, 1.0, True)


def test_compiled_errors_are_the_eager_ones():
    case = Case(lens=(5, 33))
    inp = build(case)
    w = plan_wrapper(case, inp)
    scale = torch.tensor(0.5)
    bt = inp.block_tables
    with pytest.raises(TypeError, match="bmm1_scale must be a real number"):  # at trace time
        torch.compile(lambda q, cache: w.run(q, cache, None, bt, bmm1_scale=scale), backend=BACKEND)(inp.q, inp.cache)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="bmm1_scale must be a real number"):  # fullgraph: dynamo's, quoting it
        torch.compile(lambda q, cache: w.run(q, cache, None, bt, bmm1_scale=scale), fullgraph=True,
                      backend=BACKEND)(inp.q, inp.cache)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="this plan owns the lengths"):  # ownership: while tracing
        torch.compile(lambda q, cache: w.run(q, cache, inp.seq_lens, bt), fullgraph=True,
                      backend=BACKEND)(inp.q, inp.cache)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"q must be \[B, Hq, D\]"):  # in the op, at run time
        torch.compile(lambda q, cache: w.run(q[:, :4], cache, None, bt), fullgraph=True,
                      backend=BACKEND)(inp.q, inp.cache)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="page ID"):  # the metadata check, in the op
        torch.compile(lambda q, cache, bt: w.run(q, cache, None, bt), fullgraph=True,
                      backend=BACKEND)(inp.q, inp.cache, torch.full_like(bt, -1))


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("with_out", [False, True])
def test_compiled_oneshot_matches_reference(separate, with_out):
    case = Case(lens=(1, 17, 40), separate=separate, out_dtype=torch.float32)
    inp = build(case)
    out = poisoned_out(case, inp) if with_out else None

    def step(q, cache, block_tables, seq_lens, out):
        return tsdecode.batch_decode_with_paged_kv_cache(
            q, cache, block_tables, seq_lens, out=out, out_dtype=torch.float32) + 1.0

    result = torch.compile(step, fullgraph=True, backend=BACKEND)(
        inp.q, inp.cache, inp.block_tables, inp.seq_lens, out)
    assert result.dtype == torch.float32
    check(case, result - 1.0, reference(case, inp))
    if with_out:
        check(case, out, reference(case, inp))


@pytest.mark.parametrize("out_dtype", [torch.float64, torch.int32])
def test_compiled_oneshot_dtype_error_names_out_dtype(out_dtype):
    """A compiled one-shot call given an unsupported out_dtype (and no out) raises the eager
    error, naming out_dtype, the argument its caller passed (not out.dtype)."""
    case = Case(lens=(5, 33))
    inp = build(case)
    fn = torch.compile(lambda q, cache, bt, lens: tsdecode.batch_decode_with_paged_kv_cache(
        q, cache, bt, lens, out_dtype=out_dtype), fullgraph=True, backend=BACKEND)
    with pytest.raises(NotImplementedError, match=f"out_dtype {out_dtype} is not supported"):
        fn(inp.q, inp.cache, inp.block_tables, inp.seq_lens)


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(window_left=3), ValueError, "window_left=3 needs mask_type='causal'"),
    (dict(mask_type="sliding"), ValueError, "mask_type must be one of"),
    (dict(bmm1_scale=torch.tensor(0.5)), TypeError, "bmm1_scale must be a real number"),
    (dict(bmm2_scale="2"), TypeError, "bmm2_scale must be a real number"),
    (dict(out_dtype="bf16"), TypeError, "out_dtype must be a torch.dtype"),
])
def test_oneshot_argument_errors_without_fullgraph_are_the_eager_ones(kwargs, error, pattern):
    """Without fullgraph, a one-shot argument error found while dynamo traces the call reaches the
    caller as the eager error: the function dynamo falls back to raises it before any launch."""
    case = Case(lens=(5, 33))
    inp = build(case)
    fn = torch.compile(lambda q, cache, bt, lens: tsdecode.batch_decode_with_paged_kv_cache(
        q, cache, bt, lens, **kwargs), backend=BACKEND)
    with pytest.raises(error, match=pattern):
        fn(inp.q, inp.cache, inp.block_tables, inp.seq_lens)


def test_compiled_oneshot_packed_queries():
    case = Case(lens=(7, 30, 18), mode="packed", q_lens=(1, 4, 2), mask_type="causal")
    inp = build(case)

    def step(q, cache, block_tables, seq_lens, qo_indptr):
        return tsdecode.batch_decode_with_paged_kv_cache(
            q, cache, block_tables, seq_lens, qo_indptr=qo_indptr, mask_type="causal")

    result = torch.compile(step, fullgraph=True, backend=BACKEND)(
        inp.q, inp.cache, inp.block_tables, inp.seq_lens, inp.qo_indptr)
    check(case, result, reference(case, inp))


def test_compiled_capturable_oneshot():
    """The one-shot's capture mode (workspace_buffer, max_kv_len, out, validate=False) compiles
    to one op too, and reads new lengths and page IDs on every call without recompiling."""
    case = Case(lens=(1, 17, 40), mode="packed", q_lens=(1, 2, 1), max_kv_len=64, extra_cols=2)
    inp = build(case)
    workspace = torch.zeros(1 << 20, dtype=torch.uint8, device=DEVICE)
    counter = _counted()

    def step(q, cache, block_tables, seq_lens, qo_indptr, out):
        return tsdecode.batch_decode_with_paged_kv_cache(
            q, cache, block_tables, seq_lens, qo_indptr=qo_indptr, max_seq_len_q=2, out=out,
            workspace_buffer=workspace, max_kv_len=64, validate=False)

    fn = torch.compile(step, fullgraph=True, backend=counter)
    for lens in ((1, 17, 40), (33, 2, 48)):
        inp.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        for b in range(3):
            for col in range(inp.block_tables.shape[1]):
                if not 0 <= int(inp.block_tables[b, col]) < inp.num_pages:
                    inp.block_tables[b, col] = (b + col) % inp.num_pages
        out = poisoned_out(case, inp)
        fn(inp.q, inp.cache, inp.block_tables, inp.seq_lens, inp.qo_indptr, out)
        check(case, out, reference(case, inp))
    assert counter.frame_count == 1


@pytest.mark.parametrize("max_kv_len", [True, 40.5, "64"])
def test_compiled_capturable_oneshot_checks_max_kv_len(max_kv_len):
    """A compiled capturable one-shot refuses a max_kv_len that is not an int, as the eager call
    does (a bool True was taken as a capacity of 1, cutting every length to one key)."""
    case = Case(lens=(5, 33, 40))
    inp = build(case)
    workspace = torch.zeros(1 << 20, dtype=torch.uint8, device=DEVICE)
    fn = torch.compile(lambda q, cache, bt, lens, out: tsdecode.batch_decode_with_paged_kv_cache(
        q, cache, bt, lens, out=out, workspace_buffer=workspace, max_kv_len=max_kv_len, validate=False),
        fullgraph=True, backend=BACKEND)
    out = poisoned_out(case, inp)
    with pytest.raises(Exception, match="max_kv_len must be an int"):  # fullgraph: dynamo's, quoting it
        fn(inp.q, inp.cache, inp.block_tables, inp.seq_lens, out)


@pytest.mark.parametrize("kwargs, name", [(dict(seq_len_q=np.int64(1)), "seq_len_q must be an int"),
                                          (dict(window_left=np.int64(-1)), "window_left must be an int"),
                                          (dict(bmm1_scale=np.float64(0.2)), "bmm1_scale must be a real number")])
def test_compiled_oneshot_numpy_scalars_are_refused_by_name(kwargs, name):
    """Dynamo traces a numpy scalar as a tensor: a compiled one-shot call refuses one with an
    error naming the argument (eager calls take them)."""
    case = Case(lens=(5, 33))
    inp = build(case)
    fn = torch.compile(lambda q, cache, bt, lens: tsdecode.batch_decode_with_paged_kv_cache(
        q, cache, bt, lens, **kwargs), fullgraph=True, backend=BACKEND)
    with pytest.raises(Exception, match=name):  # fullgraph: dynamo's, quoting it
        fn(inp.q, inp.cache, inp.block_tables, inp.seq_lens)


def test_dynamic_shapes():
    """dynamic=True: symbolic batch and head dims (the default bmm1_scale is taken at run time)."""
    w = tsdecode.BatchDecodePagedTSWrapper()
    run = torch.compile(lambda q, cache, lens, bt: w.run(q, cache, lens, bt), fullgraph=True, dynamic=True,
                        backend=BACKEND)
    oneshot = torch.compile(
        lambda q, cache, bt, lens: tsdecode.batch_decode_with_paged_kv_cache(q, cache, bt, lens),
        fullgraph=True, dynamic=True, backend=BACKEND)
    for lens in ((5, 33, 20), (9, 48)):
        case = Case(lens=lens, lengths="run")
        inp = build(case)
        ref = reference(case, inp)
        check(case, oneshot(inp.q, inp.cache, inp.block_tables, inp.seq_lens), ref)
        plan_wrapper(case, inp, wrapper=w)
        check(case, run(inp.q, inp.cache, inp.seq_lens, inp.block_tables), ref)


def test_a_module_reload_keeps_the_ops():
    """importlib.reload (e.g. IPython's autoreload) neither re-defines the ops (an error) nor
    drops them (the library object's lifetime is their registration)."""
    import importlib

    from tsdecode import torch_ops

    importlib.reload(torch_ops)
    gc.collect()
    assert hasattr(torch.ops.tsdecode, "run_planned") and hasattr(torch.ops.tsdecode, "decode_oneshot")
    case = Case(lens=(5, 33))
    inp = build(case)
    w = plan_wrapper(case, inp)
    check(case, torch.compile(lambda q, cache, bt: w.run(q, cache, None, bt), fullgraph=True, backend=BACKEND)(
        inp.q, inp.cache, inp.block_tables), reference(case, inp))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_inductor_with_and_without_cuda_graphs(mode, monkeypatch):
    """Inductor, and its CUDA graphs (the op runs between the captured parts: one eager run per
    call, counted). Run-owned lengths changed in place between calls; a re-plan with plan-owned
    lengths between calls (a captured op would replay the old plan: its lengths copy, its
    scratch); without CUDA graphs also a block-table write inside the compiled region, which the
    op reads (with them, a write to an input makes inductor skip its CUDA graphs, so the page is
    remapped outside)."""
    case = Case(lens=(100, 37, 250), num_qo_heads=16, num_kv_heads=4, head_dim=128, extra_cols=0, lengths="run")
    inp = build(case)
    cols = inp.block_tables.shape[1]
    for b in range(len(case.lens)):  # every column a valid page: lengths change up to C*P
        for c in range(cols):
            if inp.block_tables[b, c] >= inp.num_pages:
                inp.block_tables[b, c] = (b + c) % inp.num_pages
    max_kv_len = cols * case.page_size
    w = plan_wrapper(case, inp, max_kv_len=max_kv_len)
    write_inside = mode is None
    runs = _count_runs(monkeypatch)
    owned = {"lens": inp.seq_lens}

    def step(q, cache, seq_lens, block_tables, page):
        if write_inside:
            block_tables[1, 0] = page
        return w.run(q, cache, seq_lens, block_tables) * 1.0

    fn = torch.compile(step, fullgraph=True, mode=mode)
    pages = (int(inp.block_tables[1, 0]), int(inp.block_tables[2, 5]))
    calls = 0
    for i in range(6):
        inp.seq_lens[0] = 100 - 10 * i
        inp.seq_lens[1] = 37 + 40 * i
        if i >= 3:  # re-plans with plan-owned lengths, same shapes
            plan_wrapper(Case(lens=tuple(inp.seq_lens.tolist()), num_qo_heads=16, num_kv_heads=4, head_dim=128),
                         inp, wrapper=w, max_kv_len=max_kv_len)
            owned["lens"] = None
        page = torch.tensor(pages[i % 2], dtype=torch.int32, device=DEVICE)
        if not write_inside:
            inp.block_tables[1, 0] = page
        inp.q = torch.randn_like(inp.q)
        result = fn(inp.q, inp.cache, owned["lens"], inp.block_tables, page)
        calls += 1
        torch.cuda.synchronize()
        assert int(inp.block_tables[1, 0]) == pages[i % 2]
        check(case, result, reference(case, inp))
    assert len(runs) >= calls  # warm-up runs included; never fewer (a replay skipping the op)
