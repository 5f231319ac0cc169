"""``prims_ts_batch_decode_with_kv_cache``: FlashInfer's capture call (the one-shot op with the
caller's workspace and K/V capacity, nothing read on the host), against the float64 reference,
and its errors, each naming the argument its caller passed (query, kv_cache, seq_lens,
max_seq_len, ...), never the one-shot op's (q, paged_kv_cache, seq_lens_kv, max_kv_len).
The CUDA graph test is in ``test_flashinfer_caller.py``, beside the one-shot op's.
"""

import inspect
import re

import pytest
import torch

import tsdecode
import tsdecode as prims_ts
from cases import DEVICE, FP8, Case, build, check, poisoned_out, reference

BF16, FP16 = torch.bfloat16, torch.float16

# lens cross page boundaries (P = 16: 1, 16, 17, 33 tokens); packed and fixed-SQ causal cases too
CASES = {
    "sq1-ragged": Case(lens=(1, 16, 17, 33, 40)),
    "sq1-splits": Case(lens=(1, 17, 300)),  # max_seq_len 512: the heuristic takes several KV splits
    "fixed-sq3-causal": Case(mode="fixed", seq_len_q=3, mask_type="causal", lens=(3, 17, 40)),
    "packed-causal": Case(mode="packed", q_lens=(1, 3, 2), mask_type="causal", lens=(5, 40, 17)),
    "packed-dense-separate-kv": Case(mode="packed", q_lens=(2, 1), separate=True, lens=(33, 9)),
    "causal-window": Case(mode="fixed", seq_len_q=2, mask_type="causal", window_left=7, lens=(9, 33)),
    "fp8-cache-bf16-q": Case(kv_dtype=FP8, lens=(5, 40)),
    "fp16-fp32-out": Case(dtype=FP16, out_dtype=torch.float32, lens=(12, 30), bmm1_scale=0.2, bmm2_scale=1.5),
}
CAPACITY = {"sq1-splits": 512}  # max_seq_len; the others 64


def test_exported_with_flashinfers_signature():
    """``import tsdecode as prims_ts`` has A's four exports; this one takes A's parameters, in A's
    order (six positional, the rest keyword-only), with A's defaults."""
    for name in ("BatchDecodePagedTSWrapper", "batch_decode_with_paged_kv_cache",
                 "get_prims_ts_batch_decode_workspace_size", "prims_ts_batch_decode_with_kv_cache"):
        assert name in tsdecode.__all__ and callable(getattr(prims_ts, name))
    params = inspect.signature(prims_ts.prims_ts_batch_decode_with_kv_cache).parameters
    assert list(params) == ["query", "kv_cache", "workspace_buffer", "block_tables", "seq_lens", "max_seq_len",
                            "seq_len_q", "qo_indptr", "max_seq_len_q", "bmm1_scale", "bmm2_scale", "out",
                            "out_dtype", "mask_type", "window_left", "kv_layout"]
    assert [p.name for p in params.values() if p.kind is p.KEYWORD_ONLY] == list(params)[6:]
    assert {p.name: p.default for p in list(params.values())[6:]} == dict(
        seq_len_q=1, qo_indptr=None, max_seq_len_q=None, bmm1_scale=None, bmm2_scale=1.0, out=None,
        out_dtype=None, mask_type="dense", window_left=-1, kv_layout="HND")


def workspace_for(case: Case, max_seq_len: int) -> torch.Tensor:
    """A workspace sized as FlashInfer's caller sizes it."""
    packed = case.mode == "packed"
    size = tsdecode.get_prims_ts_batch_decode_workspace_size(
        case.batch_size, case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size, max_seq_len,
        seq_len_q=case.seq_len_q if not packed else 1, max_seq_len_q=case.max_seq_len_q if packed else None,
        qo_indptr=torch.zeros(case.batch_size + 1, dtype=torch.int32) if packed else None, q_dtype=case.dtype,
        kv_dtype=case.kv_dtype, out_dtype=case.out_dtype, mask_type=case.mask_type, window_left=case.window_left,
        device=DEVICE)
    return torch.zeros(max(size, 32), dtype=torch.uint8, device=DEVICE)


def call(case: Case, inp, workspace, max_seq_len: int, **kw) -> torch.Tensor:
    args = dict(seq_len_q=case.seq_len_q if case.mode == "fixed" else 1, qo_indptr=inp.qo_indptr,
                max_seq_len_q=case.max_seq_len_q if case.mode == "packed" else None,
                bmm1_scale=case.bmm1_scale, bmm2_scale=case.bmm2_scale, mask_type=case.mask_type,
                window_left=case.window_left)
    args.update(kw)
    return prims_ts.prims_ts_batch_decode_with_kv_cache(inp.q, inp.cache, workspace, inp.block_tables,
                                                        inp.seq_lens, max_seq_len, **args)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_out_given_and_omitted(name):
    """Into a NaN-poisoned ``out`` (returned as is), then with ``out`` omitted (allocated, in
    out_dtype or query's dtype): both match the reference, bit for bit alike."""
    case = CASES[name]
    inp = build(case)
    max_seq_len = CAPACITY.get(name, 64)
    workspace = workspace_for(case, max_seq_len)
    ref = reference(case, inp)
    out = poisoned_out(case, inp)
    assert call(case, inp, workspace, max_seq_len, out=out) is out
    check(case, out, ref)
    allocated = call(case, inp, workspace, max_seq_len, out_dtype=case.out_dtype)
    assert allocated.dtype == (case.out_dtype or case.dtype) and allocated.shape == inp.q.shape
    torch.testing.assert_close(allocated, out, rtol=0, atol=0)


def test_same_answer_as_the_capturable_oneshot():
    """The export is the one-shot op's capture form under its own argument names."""
    case = CASES["packed-causal"]
    inp = build(case)
    workspace = workspace_for(case, 64)
    mine = call(case, inp, workspace, 64)
    theirs = tsdecode.batch_decode_with_paged_kv_cache(
        inp.q, inp.cache, inp.block_tables, inp.seq_lens, qo_indptr=inp.qo_indptr, max_seq_len_q=3,
        mask_type="causal", out=poisoned_out(case, inp), workspace_buffer=workspace, max_kv_len=64, validate=False)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_packed_capacity_from_the_seq_len_q_alias():
    """Packed queries take max_seq_len_q's alias, a non-default seq_len_q."""
    case = CASES["packed-causal"]
    inp = build(case)
    out = call(case, inp, workspace_for(case, 64), 64, max_seq_len_q=None, seq_len_q=3)
    check(case, out, reference(case, inp))


def test_a_smaller_workspace_runs_fewer_splits():
    """A workspace smaller than the size helper's runs fewer KV splits (as a plan's does), not wrong."""
    case = CASES["sq1-splits"]
    inp = build(case)
    assert workspace_for(case, 512).numel() > 32  # the full-size plan splits
    out = call(case, inp, torch.zeros(32, dtype=torch.uint8, device=DEVICE), 512)
    check(case, out, reference(case, inp))


def test_reads_nothing_on_the_host(monkeypatch):
    """What a CUDA graph captures: no metadata read, no plan(), with a capture simulated (CPU
    stand-in for the GPU test)."""
    from tsdecode import api, oneshot

    case = CASES["packed-causal"]
    inp = build(case)
    workspace = workspace_for(case, 64)
    call(case, inp, workspace, 64)  # the call outside the capture

    def no_host_read(*args, **kw):
        raise AssertionError("metadata read on the host")

    for module in (api, oneshot):
        monkeypatch.setattr(module, "read_metadata", no_host_read)
    monkeypatch.setattr(api, "capturing", lambda device: True)
    out = poisoned_out(case, inp)
    call(case, inp, workspace, 64, out=out)
    check(case, out, reference(case, inp))


# --- errors: each names the argument the caller passed ------------------------------------------

@pytest.fixture
def inp():
    return build(Case(lens=(5, 40)))


@pytest.fixture
def packed():
    return build(Case(mode="packed", q_lens=(1, 2), lens=(5, 40)))


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _strided_query(q: torch.Tensor) -> torch.Tensor:
    """q's values with a head-dim stride of 2."""
    wide = torch.empty((*q.shape[:-1], 2 * q.shape[-1]), dtype=q.dtype, device=q.device)
    wide[..., ::2] = q
    return wide[..., ::2]


def _separate(cache: torch.Tensor, v_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    return cache[:, 0].contiguous(), cache[:, 1].contiguous().to(v_dtype or cache.dtype)


WORKSPACE = 1 << 20
ON = "cuda:0" if DEVICE.type == "cuda" else "cpu"  # a device as the errors name it
# name: (arguments replaced, from the fixture's tensors; the class; a pattern naming the argument)
ERRORS = {
    "query not a tensor": (lambda i: dict(query=i.q.tolist()), TypeError, r"^query must be a torch.Tensor, got list"),
    "query dtype": (lambda i: dict(query=i.q.float()), NotImplementedError, r"^query torch.float32 is not supported"),
    "query rank": (lambda i: dict(query=i.q[0]), ValueError, r"^query must be \[B, Hq, D\], \[B, SQ, Hq, D\]"),
    "query SQ vs seq_len_q": (lambda i: dict(query=i.q[:, None], seq_len_q=2), ValueError,
                              r"^query is \[B, SQ, Hq, D\] with SQ=1 but seq_len_q=2"),
    "query 3-D with seq_len_q": (lambda i: dict(seq_len_q=2), ValueError, r"needs query as token-major"),
    "query batch": (lambda i: dict(query=i.q[:1]), ValueError, r"query has 1 requests .* seq_lens has 2 lengths"),
    "query head dim": (lambda i: dict(query=i.q[..., :32]), ValueError,
                       r"^query's head dim is 32 but kv_cache's is 64"),
    "query heads": (lambda i: dict(query=i.q[:, :7]), ValueError, r"^query has Hq=7 query heads, .*: kv_cache \["),
    "query group size": (lambda i: dict(query=i.q.repeat(1, 33, 1)), NotImplementedError,
                         r"group size query.shape\[-2\] \(query heads Hq\)/kv_cache's KV heads Hkv must be <= 128"),
    "query head-dim stride": (lambda i: dict(query=_strided_query(i.q), out=torch.empty_like(i.q)), ValueError,
                              r"^query must be contiguous in the head dim"),
    "query device": (lambda i: dict(query=_meta(i.q)), ValueError, rf"^query is on meta but kv_cache is on {ON}"),
    "kv_cache not a tensor": (lambda i: dict(kv_cache="cache"), TypeError, r"^kv_cache must be a torch.Tensor"),
    "kv_cache three parts": (lambda i: dict(kv_cache=(i.cache,) * 3), ValueError,
                             r"^a separate kv_cache must be \(K, V\)"),
    "kv_cache K not a tensor": (lambda i: dict(kv_cache=(None, i.cache[:, 1])), TypeError,
                                r"^kv_cache\[0\] \(K\) must be a torch.Tensor"),
    "kv_cache shape": (lambda i: dict(kv_cache=i.cache[:, :1]), ValueError, r"^kv_cache must be \[num_pages, 2"),
    "kv_cache dtype": (lambda i: dict(kv_cache=i.cache.half()), NotImplementedError,
                       r"^kv_cache torch.float16 .* got query torch.bfloat16"),
    "kv_cache strides": (lambda i: dict(kv_cache=i.cache.transpose(3, 4).contiguous().transpose(3, 4)), ValueError,
                         r"^kv_cache K/V needs compact HND strides"),
    "kv_cache K and V dtypes": (lambda i: dict(kv_cache=_separate(i.cache, FP16)), TypeError,
                                r"^kv_cache K and V dtypes differ"),
    "kv_cache head dim": (lambda i: dict(query=i.q[..., :32].contiguous(), kv_cache=i.cache[..., :32].contiguous()),
                          NotImplementedError, r"^kv_cache's head dim D \(and query.shape\[-1\]\) must be one of"),
    "workspace_buffer none": (lambda i: dict(workspace_buffer=None), TypeError,
                              r"^workspace_buffer must be a torch.Tensor, got NoneType"),
    "workspace_buffer dtype": (lambda i: dict(workspace_buffer=torch.zeros(WORKSPACE // 4, device=DEVICE)), TypeError,
                               r"^workspace_buffer must be int8 or uint8"),
    "workspace_buffer strided": (lambda i: dict(workspace_buffer=torch.zeros(2 * WORKSPACE, dtype=torch.uint8,
                                                                                         device=DEVICE)[::2]),
                                 ValueError, r"^workspace_buffer must be contiguous"),
    "workspace_buffer unaligned": (lambda i: dict(workspace_buffer=torch.zeros(WORKSPACE, dtype=torch.uint8,
                                                                                   device=DEVICE)[1:]),
                                   ValueError, r"^workspace_buffer must be 32-byte aligned"),
    "workspace_buffer device": (lambda i: dict(workspace_buffer=torch.zeros(WORKSPACE, dtype=torch.uint8,
                                                                            device="meta")),
                                ValueError, rf"^workspace_buffer must be on {ON}, got meta"),
    "block_tables dtype": (lambda i: dict(block_tables=i.block_tables.long()), TypeError,
                           r"^block_tables must be int32"),
    "block_tables rank": (lambda i: dict(block_tables=i.block_tables[0]), ValueError, r"^block_tables must be 2-D"),
    "block_tables rows": (lambda i: dict(block_tables=i.block_tables[:1]), ValueError, r"block_tables has 1 rows"),
    "seq_lens not a tensor": (lambda i: dict(seq_lens=i.seq_lens.tolist()), TypeError,
                              r"^seq_lens must be a torch.Tensor, got list"),
    "seq_lens dtype": (lambda i: dict(seq_lens=i.seq_lens.long()), TypeError, r"^seq_lens must be int32"),
    "seq_lens shape": (lambda i: dict(seq_lens=i.seq_lens[:, None]), ValueError,
                       r"^seq_lens must have shape \[B\]=\[2\]"),
    "seq_lens strided": (lambda i: dict(seq_lens=torch.stack([i.seq_lens, i.seq_lens], 1)[:, 0]), ValueError,
                         r"^seq_lens must be contiguous"),
    "seq_lens batch": (lambda i: dict(seq_lens=i.seq_lens[:1]), ValueError, r"seq_lens has 1 lengths"),
    "seq_lens device": (lambda i: dict(seq_lens=_meta(i.seq_lens)), ValueError, rf"^seq_lens must be on {ON}, got meta"),
    "max_seq_len zero": (lambda i: dict(max_seq_len=0), ValueError, r"^max_seq_len must be >= 1, got 0$"),
    "max_seq_len float": (lambda i: dict(max_seq_len=64.0), TypeError, r"^max_seq_len must be an int, got float"),
    "max_seq_len none": (lambda i: dict(max_seq_len=None), TypeError, r"^max_seq_len must be an int, got NoneType"),
    "max_seq_len over int32": (lambda i: dict(max_seq_len=2**31), NotImplementedError, r"^max_seq_len must be <="),
    "seq_len_q zero": (lambda i: dict(seq_len_q=0), ValueError, r"^seq_len_q must be >= 1"),
    "max_seq_len_q fixed": (lambda i: dict(max_seq_len_q=2), ValueError, r"max_seq_len_q must equal seq_len_q=1"),
    "out not a tensor": (lambda i: dict(out=i.q.tolist()), TypeError, r"^out must be a torch.Tensor"),
    "out shape": (lambda i: dict(out=torch.empty_like(i.q[..., :32])), ValueError,
                  r"^out must be query's shape = \[2, 8, 64\], got \[2, 8, 32\]"),
    "out vs out_dtype": (lambda i: dict(out=torch.empty_like(i.q), out_dtype=FP16), TypeError,
                         r"^out_dtype=torch.float16 disagrees with out.dtype=torch.bfloat16"),
    "out dtype": (lambda i: dict(out=torch.empty(i.q.shape, dtype=torch.int32, device=DEVICE)), NotImplementedError,
                  r"^out.dtype torch.int32 is not supported with query torch.bfloat16"),
    "out device": (lambda i: dict(out=_meta(i.q)), ValueError, rf"^out must be on {ON}, got meta"),
    "out aliases query": (lambda i: dict(out=i.q), ValueError, r"^out must not alias query"),
    "out aliases kv_cache": (lambda i: dict(out=i.cache.view(-1)[:i.q.numel()].view(i.q.shape)), ValueError,
                             r"^out must not alias kv_cache"),
    "out overlaps itself": (lambda i: dict(out=torch.empty(1, *i.q.shape[1:], dtype=BF16, device=DEVICE).expand(i.q.shape)),
                            ValueError, r"^out must not overlap itself"),
    "out_dtype not a dtype": (lambda i: dict(out_dtype="float16"), TypeError, r"^out_dtype must be a torch.dtype"),
    "out_dtype unsupported": (lambda i: dict(out_dtype=torch.int8), NotImplementedError,
                              r"^out_dtype torch.int8 is not supported"),
    "mask_type": (lambda i: dict(mask_type="sliding"), ValueError, r"^mask_type must be one of"),
    "window_left without causal": (lambda i: dict(window_left=4), ValueError,
                                   r"^window_left=4 needs mask_type='causal'"),
    "kv_layout": (lambda i: dict(kv_layout="NHD"), NotImplementedError, r"^kv_layout='NHD' is not supported"),
    "bmm1_scale tensor": (lambda i: dict(bmm1_scale=torch.tensor(0.1)), TypeError,
                          r"^bmm1_scale must be a real number"),
    "bmm2_scale infinite": (lambda i: dict(bmm2_scale=float("inf")), ValueError, r"^bmm2_scale must be finite"),
}
PACKED_ERRORS = {
    "packed without max_seq_len_q": (lambda i: dict(max_seq_len_q=None), ValueError,
                                     r"^packed queries \(qo_indptr given\) need max_seq_len_q \(or its alias"),
    "packed alias disagrees": (lambda i: dict(seq_len_q=3, max_seq_len_q=4), ValueError,
                               r"^seq_len_q=3 \(alias of max_seq_len_q in packed mode\) disagrees"),
    "packed query rank": (lambda i: dict(query=i.q[:, None]), ValueError, r"^packed query \(with qo_indptr\) must be"),
    "packed query over capacity": (lambda i: dict(query=torch.cat([i.q] * 2)), ValueError,
                                   r"^query holds 6 query tokens; packed, it holds at least one token a request"),
    "qo_indptr not a tensor": (lambda i: dict(qo_indptr=i.qo_indptr.tolist()), TypeError,
                               r"^qo_indptr must be a torch.Tensor"),
    "qo_indptr dtype": (lambda i: dict(qo_indptr=i.qo_indptr.long()), TypeError, r"^qo_indptr must be int32"),
    "qo_indptr rank": (lambda i: dict(qo_indptr=i.qo_indptr[:, None]), ValueError, r"^qo_indptr must be 1-D"),
    "qo_indptr batch": (lambda i: dict(qo_indptr=i.qo_indptr[:2]), ValueError,
                        r"qo_indptr has 2 offsets \(B\+1\), block_tables has 2 rows, seq_lens has 2 lengths"),
}
# The one-shot op's names for the same arguments, which these errors must not use.
ONESHOT_NAMES = re.compile(r"paged_kv_cache|seq_lens_kv|max_kv_len|validate|(?<![\w.])q(?:'s|\.| has| is| must| holds| of)")


def _check_error(i, kw, exc, pattern):
    args = dict(query=i.q, kv_cache=i.cache, workspace_buffer=torch.zeros(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                block_tables=i.block_tables, seq_lens=i.seq_lens, max_seq_len=64)
    if i.qo_indptr is not None:
        args.update(qo_indptr=i.qo_indptr, max_seq_len_q=2)
    args.update(kw(i))
    with pytest.raises(exc, match=pattern) as info:
        prims_ts.prims_ts_batch_decode_with_kv_cache(**args)
    assert not ONESHOT_NAMES.search(str(info.value)), str(info.value)


@pytest.mark.parametrize("name", list(ERRORS))
def test_error_names_the_callers_argument(inp, name):
    _check_error(inp, *ERRORS[name])


@pytest.mark.parametrize("name", list(PACKED_ERRORS))
def test_packed_error_names_the_callers_argument(packed, name):
    _check_error(packed, *PACKED_ERRORS[name])


def test_out_inside_the_workspace_names_it(inp):
    """An out in workspace_buffer's memory is refused, naming it (the partials would overwrite it)."""
    workspace = torch.zeros(WORKSPACE, dtype=torch.uint8, device=DEVICE)
    out = workspace[:2 * inp.q.numel()].view(BF16).view(inp.q.shape)
    with pytest.raises(ValueError, match=r"^out must not alias workspace_buffer"):
        prims_ts.prims_ts_batch_decode_with_kv_cache(inp.q, inp.cache, workspace, inp.block_tables, inp.seq_lens, 64,
                                                     out=out)


def test_cpu_tensors_name_query_device(inp, monkeypatch):
    """Without the interpreter, CPU tensors are refused naming query.device (the one-shot: q.device)."""
    if DEVICE.type == "cuda":
        pytest.skip("checks the CPU path")
    monkeypatch.setattr(tsdecode.api, "INTERPRETER", False)
    monkeypatch.setattr(tsdecode.oneshot, "INTERPRETER", False)
    with pytest.raises(ValueError, match=r"^query\.device must be a CUDA device .*, got cpu$"):
        prims_ts.prims_ts_batch_decode_with_kv_cache(inp.q, inp.cache, torch.zeros(WORKSPACE, dtype=torch.uint8),
                                                     inp.block_tables, inp.seq_lens, 64)


# --- torch.compile --------------------------------------------------------------------------------

def test_compiled_matches_reference_and_reads_new_lengths():
    """Compiled (fullgraph) it is one op; new lengths and pages need no recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    case = Case(lens=(1, 17, 40), mode="packed", q_lens=(1, 2, 1), max_kv_len=64, extra_cols=2)
    inp = build(case)
    workspace = torch.zeros(1 << 20, dtype=torch.uint8, device=DEVICE)
    counter = CompileCounterWithBackend("aot_eager")

    def step(query, kv_cache, block_tables, seq_lens, qo_indptr):
        return prims_ts.prims_ts_batch_decode_with_kv_cache(
            query, kv_cache, workspace, block_tables, seq_lens, 64, qo_indptr=qo_indptr, max_seq_len_q=2)

    fn = torch.compile(step, fullgraph=True, backend=counter)
    for lens in ((1, 17, 40), (33, 2, 48)):
        inp.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        for b in range(3):
            for col in range(inp.block_tables.shape[1]):
                if not 0 <= int(inp.block_tables[b, col]) < inp.num_pages:
                    inp.block_tables[b, col] = (b + col) % inp.num_pages
        check(case, fn(inp.q, inp.cache, inp.block_tables, inp.seq_lens, inp.qo_indptr), reference(case, inp))
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", ["causal-window", "fp16-fp32-out"])
def test_compiled_keeps_every_keyword(name):
    """Compiled, the op gets the mask, the window, the scales and the output dtype as given (the
    op's call passes each keyword on to this function)."""
    torch._dynamo.reset()
    case = CASES[name]
    inp = build(case)
    workspace = workspace_for(case, 64)
    fn = torch.compile(lambda query, kv_cache, bt, seq_lens: prims_ts.prims_ts_batch_decode_with_kv_cache(
        query, kv_cache, workspace, bt, seq_lens, 64, seq_len_q=case.seq_len_q, bmm1_scale=case.bmm1_scale,
        bmm2_scale=case.bmm2_scale, out_dtype=case.out_dtype, mask_type=case.mask_type, window_left=case.window_left),
        fullgraph=True, backend="aot_eager")
    out = fn(inp.q, inp.cache, inp.block_tables, inp.seq_lens)
    assert out.dtype == (case.out_dtype or case.dtype)
    check(case, out, reference(case, inp))


def test_compiled_errors_name_the_callers_arguments(inp):
    """Errors the op raises when the graph runs name this function's arguments too, as do those
    found while tracing (quoted in dynamo's error under fullgraph)."""
    torch._dynamo.reset()
    workspace = torch.zeros(1 << 20, dtype=torch.uint8, device=DEVICE)
    fn = torch.compile(lambda query, kv_cache, bt, seq_lens: prims_ts.prims_ts_batch_decode_with_kv_cache(
        query, kv_cache, workspace, bt, seq_lens, 64), fullgraph=True, backend="aot_eager")
    with pytest.raises(TypeError, match=r"^seq_lens must be int32"):
        fn(inp.q, inp.cache, inp.block_tables, inp.seq_lens.long())
    with pytest.raises(ValueError, match=r"^kv_cache must be \[num_pages, 2"):
        fn(inp.q, inp.cache[:, :1], inp.block_tables, inp.seq_lens)
    traced = torch.compile(lambda query, kv_cache, bt, seq_lens: prims_ts.prims_ts_batch_decode_with_kv_cache(
        query, kv_cache, workspace, bt, seq_lens, True), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="max_seq_len must be an int"):
        traced(inp.q, inp.cache, inp.block_tables, inp.seq_lens)
