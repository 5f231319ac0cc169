"""One test per error path: bad input raises the class FlashInfer's PrimTS API (version A) raises,
with a message naming the argument.

Classes: ``TypeError`` for the wrong kind of object (a tensor's dtype, a non-int size, a non-bool
flag), ``ValueError`` for a wrong value, shape, device or layout, ``NotImplementedError`` for a
valid request tsdecode does not run (NHD, unsupported dtype pairs, head dims, page sizes, group
sizes, GPUs, sizes over int32), ``RuntimeError`` for a run before plan (and a one-shot call under
CUDA graph capture: ``test_flashinfer_caller.py``).
"""

import os
import re
import subprocess
import sys

import pytest
import torch

import tsdecode
from tsdecode import KernelConfig
from cases import DEVICE, FP8, Case, build, errors, plan_wrapper, reference, run_wrapper

BF16 = torch.bfloat16


@pytest.fixture
def inp():
    return build(Case(lens=(5, 40)))


def oneshot(inp, **kw):
    args = dict(q=inp.q, paged_kv_cache=inp.cache, block_tables=inp.block_tables, seq_lens_kv=inp.seq_lens)
    args.update(kw)
    return tsdecode.batch_decode_with_paged_kv_cache(**args)


PLAN_ARGS = dict(device=DEVICE, batch_size=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                 max_kv_len=40, q_data_type=BF16)


def plan(**kw):
    """A plan of the ``inp`` fixture's problem (B=2, Hq=8, Hkv=2, D=64, P=16, bf16) in FlashInfer's
    call form; ``kw`` overrides any argument."""
    args = dict(PLAN_ARGS)
    args.update(kw)
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(**args)
    return w


ONESHOT_ERRORS = {
    "q not a tensor": (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    "q fp32": (dict(q="fp32"), NotImplementedError, "q torch.float32 is not supported"),
    "q 2-D": (dict(q="2d"), ValueError, "q must be"),
    "q head dim": (dict(q="d32"), ValueError, "head dim"),
    "q batch": (dict(q="b3"), ValueError, r"disagree on the batch size B: q has 3 requests"),
    "q heads not multiple": (dict(q="h3"), ValueError, "not a multiple of the cache's Hkv=2"),
    "q dtype vs cache": (dict(q="fp16"), NotImplementedError, "paged_kv_cache torch.bfloat16 .* needs a query of the same dtype, got q torch.float16"),
    "fp8 q over a bf16 cache": (dict(q="fp8"), NotImplementedError, "paged_kv_cache torch.bfloat16 .* got q torch.float8_e4m3fn"),
    "cache 4-D": (dict(paged_kv_cache="4d"), ValueError, "paged_kv_cache must be"),
    "cache tuple of 3": (dict(paged_kv_cache="tuple3"), ValueError, r"must be \(K, V\)"),
    "cache K/V shapes": (dict(paged_kv_cache="kv-shape"), ValueError, "shapes differ"),
    "cache non-compact": (dict(paged_kv_cache="strided"), ValueError, "compact"),
    "kv_layout NHD": (dict(kv_layout="NHD"), NotImplementedError, "kv_layout='NHD' is not supported"),
    "kv_layout other": (dict(kv_layout="HDN"), ValueError, "kv_layout must be 'HND'"),
    "kv_layout not str": (dict(kv_layout=0), TypeError, "kv_layout must be a str"),
    "block_tables int64": (dict(block_tables="int64"), TypeError, "block_tables must be int32"),
    "block_tables 1-D": (dict(block_tables="1d"), ValueError, "block_tables must be 2-D"),
    "block_tables col stride": (dict(block_tables="colstride"), ValueError, "rows must be contiguous"),
    "page id out of range": (dict(block_tables="oob"), ValueError, "page ID"),
    "negative page id": (dict(block_tables="neg"), ValueError, "negative page ID"),
    "seq_lens int64": (dict(seq_lens_kv="int64"), TypeError, "seq_lens_kv must be int32"),
    "seq_lens shape": (dict(seq_lens_kv="shape"), ValueError, r"seq_lens_kv has 1 lengths"),
    "seq_len zero": (dict(seq_lens_kv="zero"), ValueError, r"seq_lens_kv\[0\]=0"),
    "seq_len over capacity": (dict(seq_lens_kv="big"), ValueError, "needs 6251 pages but block_tables has C=4"),
    # INT32_MAX (a padding sentinel, or garbage): the same error, not a NotImplementedError about the
    # max_kv_len the caller never passed (the plan took the longest length for it)
    "seq_len int32 max": (dict(seq_lens_kv="int32max"), ValueError,
                          r"seq_lens_kv\[1\]=2147483647 needs 134217728 pages but block_tables has C=4"),
    "mask_type": (dict(mask_type="sliding"), ValueError, "mask_type"),
    "window without causal": (dict(window_left=4), ValueError, "needs mask_type='causal'"),
    "window below -1": (dict(window_left=-2, mask_type="causal"), ValueError, "window_left must be >= -1"),
    "bmm1_scale tensor": (dict(bmm1_scale="tensor"), TypeError, "bmm1_scale must be a real number"),
    "bmm2_scale None": (dict(bmm2_scale=None), TypeError, "bmm2_scale must be a real number"),
    "bmm2_scale nan": (dict(bmm2_scale=float("nan")), ValueError, "bmm2_scale must be finite"),
    "bmm1_scale past float32": (dict(bmm1_scale=3e38), ValueError,
                                "bmm1_scale must be finite and at most 2.359e[+]38 .* got 3e[+]38"),
    "bmm2_scale past float32": (dict(bmm2_scale=-1e39), ValueError,
                                "bmm2_scale must be finite and at most 3.403e[+]38 .* got -1e[+]39"),
    "window past every length": (dict(window_left=2**64, mask_type="causal"), ValueError,
                                 r"window_left must be -1 \(no window\) or at most 2,147,483,392"),
    "q on another device": (dict(q="meta"), ValueError, "q is on meta but paged_kv_cache is on"),
    "out_dtype fp8 with bf16 q": (dict(out_dtype=FP8), NotImplementedError, "out_dtype .*float8.* not supported"),
    "out_dtype int": (dict(out_dtype=torch.int32), NotImplementedError, "out_dtype torch.int32 is not supported"),
    "out_dtype not a dtype": (dict(out_dtype="bf16"), TypeError, "out_dtype must be a torch.dtype"),
    "out int8": (dict(out="int8"), NotImplementedError, r"out\.dtype torch\.int8 is not supported"),
    "empty batch": (dict(q="b0", block_tables="b0", seq_lens_kv="b0"), ValueError,
                    "at least one request: q has 0 requests"),
    "out shape": (dict(out="shape"), ValueError, r"out must be q's shape"),
    "out dtype vs out_dtype": (dict(out="bf16", out_dtype=torch.float16), TypeError, "disagrees"),
    "out aliases q": (dict(out="alias"), ValueError, "must not alias q"),
    "out stride 0 over requests": (dict(out="expand"), ValueError, "out must not overlap itself"),
    "out heads interleaved": (dict(out="interleaved"), ValueError, "out must not overlap itself"),
    "seq_len_q without 4-D q": (dict(seq_len_q=2), ValueError, "needs q as"),
    "seq_len_q bool": (dict(seq_len_q=True), TypeError, "seq_len_q must be an int"),
    "fixed max_seq_len_q mismatch": (dict(max_seq_len_q=3), ValueError, "must equal seq_len_q"),
    "causal query longer than kv": (dict(q="sq8", seq_len_q=8, mask_type="causal"), ValueError, "causal mask needs"),
    "qo_indptr int64": (dict(qo_indptr="int64"), TypeError, "qo_indptr must be int32"),
    "qo_indptr 2-D": (dict(qo_indptr="2d"), ValueError, r"qo_indptr must be 1-D \[B\+1\] .* got shape \[1, 3\]"),
    "qo_indptr shape": (dict(qo_indptr="shape"), ValueError, r"qo_indptr has 2 offsets \(B\+1\), block_tables has 2 rows"),
    "qo_indptr not from 0": (dict(qo_indptr="start1"), ValueError, r"qo_indptr\[0\] must be 0"),
    "qo_indptr not increasing": (dict(qo_indptr="flat"), ValueError, "strictly increase"),
    "qo_indptr last offset": (dict(qo_indptr="short"), ValueError, r"qo_indptr\[-1\]=3 must equal total_q=2"),
    "qo_indptr capacity": (dict(qo_indptr="long2", max_seq_len_q=1), ValueError, "more than max_seq_len_q=1"),
    # garbage offsets past q's tokens: their error, not a NotImplementedError about B*SQ*Hq*D from the
    # capacity the plan would have derived from them
    "qo_indptr last offset past q": (dict(qo_indptr="huge-last"), ValueError, r"qo_indptr\[-1\]=5000000 must equal total_q=2"),
    "qo_indptr offset past q": (dict(qo_indptr="huge-mid"), ValueError, r"strictly increase .* qo_indptr\[1\]=5000000"),
    "qo_indptr alias disagrees": (dict(qo_indptr="ok", seq_len_q=3, max_seq_len_q=4), ValueError, "disagrees"),
    "packed q 4-D": (dict(qo_indptr="ok", q="4d"), ValueError, "packed q"),
    "validate not bool": (dict(validate=0), TypeError, "validate must be a bool"),
    "q of no heads": (dict(q="h0"), ValueError, r"q\.shape\[-2\] \(query heads Hq\) must be >= 1, got 0"),
    "cache of no KV heads": (dict(paged_kv_cache="hkv0"), ValueError,
                             r"paged_kv_cache shape \[num_pages, 2, Hkv, P, D\] needs Hkv, P and D of at least 1"),
    "cache (K, V) of no KV heads": (dict(paged_kv_cache="kv-hkv0"), ValueError,
                                    r"paged_kv_cache K and V shape .* needs Hkv, P and D of at least 1"),
    "head dim unsupported": (dict(q="d80", paged_kv_cache="d80"), NotImplementedError,
                             r"paged_kv_cache's head dim D \(and q\.shape\[-1\]\) must be one of"),
    "mask_type not str": (dict(mask_type=None), TypeError, "mask_type must be a str"),
    "validate=False without capture args": (dict(validate=False), ValueError, "workspace_buffer, max_kv_len and out"),
}


def _materialize(inp, kw):
    q, cache, bt, sl = inp.q, inp.cache, inp.block_tables, inp.seq_lens
    out = dict(kw)
    special = {
        ("q", "fp32"): lambda: q.float(),
        ("q", "2d"): lambda: q[0],
        ("q", "d32"): lambda: q[..., :32],
        ("q", "b3"): lambda: torch.cat([q, q[:1]]),
        ("q", "h3"): lambda: q[:, :3],
        ("q", "fp16"): lambda: q.half(),
        ("q", "fp8"): lambda: q.to(FP8),
        ("q", "sq8"): lambda: q[:, None].expand(2, 8, 8, 64).contiguous(),
        ("q", "4d"): lambda: q[:, None],
        ("paged_kv_cache", "4d"): lambda: cache[:, 0],
        ("paged_kv_cache", "tuple3"): lambda: (cache[:, 0], cache[:, 1], cache[:, 0]),
        ("paged_kv_cache", "kv-shape"): lambda: (cache[:, 0], cache[:-1, 1]),
        ("paged_kv_cache", "strided"): lambda: cache.transpose(3, 4).contiguous().transpose(3, 4),
        ("block_tables", "int64"): lambda: bt.long(),
        ("block_tables", "1d"): lambda: bt[0],
        ("block_tables", "colstride"): lambda: bt.t().contiguous().t(),
        ("block_tables", "oob"): lambda: bt.clone().index_fill_(1, torch.tensor([0], device=bt.device), 10**6),
        ("block_tables", "neg"): lambda: bt.clone().index_fill_(1, torch.tensor([0], device=bt.device), -1),
        ("seq_lens_kv", "int64"): lambda: sl.long(),
        ("seq_lens_kv", "shape"): lambda: sl[:1],
        ("seq_lens_kv", "zero"): lambda: torch.zeros_like(sl),
        ("seq_lens_kv", "big"): lambda: sl + 10**5,
        ("seq_lens_kv", "int32max"): lambda: torch.cat([sl[:1], torch.full_like(sl[1:], 2**31 - 1)]),
        ("bmm1_scale", "tensor"): lambda: torch.tensor(0.1),
        ("out", "shape"): lambda: torch.empty(q.shape[0], 8, 32, dtype=BF16, device=q.device),
        ("out", "bf16"): lambda: torch.empty_like(q),
        ("out", "int8"): lambda: torch.empty(q.shape, dtype=torch.int8, device=q.device),
        ("q", "b0"): lambda: q[:0],
        ("block_tables", "b0"): lambda: bt[:0],
        ("seq_lens_kv", "b0"): lambda: sl[:0],
        ("out", "alias"): lambda: q,
        ("out", "expand"): lambda: torch.empty_like(q[:1]).expand(q.shape),
        ("out", "interleaved"): lambda: torch.empty(q.numel(), dtype=q.dtype, device=q.device)
        .as_strided(q.shape, (q.shape[1] * 32, 32, 1)),
        ("qo_indptr", "int64"): lambda: torch.tensor([0, 1, 2], device=q.device),
        ("qo_indptr", "shape"): lambda: torch.tensor([0, 2], dtype=torch.int32, device=q.device),
        ("qo_indptr", "start1"): lambda: torch.tensor([1, 1, 2], dtype=torch.int32, device=q.device),
        ("qo_indptr", "flat"): lambda: torch.tensor([0, 0, 2], dtype=torch.int32, device=q.device),
        ("qo_indptr", "short"): lambda: torch.tensor([0, 1, 3], dtype=torch.int32, device=q.device),
        ("qo_indptr", "long2"): lambda: torch.tensor([0, 1, 3], dtype=torch.int32, device=q.device),
        ("qo_indptr", "ok"): lambda: torch.tensor([0, 1, 2], dtype=torch.int32, device=q.device),
        ("qo_indptr", "huge-last"): lambda: torch.tensor([0, 1, 5 * 10**6], dtype=torch.int32, device=q.device),
        ("qo_indptr", "huge-mid"): lambda: torch.tensor([0, 5 * 10**6, 2], dtype=torch.int32, device=q.device),
        ("qo_indptr", "2d"): lambda: torch.tensor([[0, 1, 2]], dtype=torch.int32, device=q.device),
        ("q", "meta"): lambda: q.to("meta"),
        ("q", "h0"): lambda: q[:, :0],
        ("q", "d80"): lambda: torch.randn(*q.shape[:-1], 80, device=q.device).to(q.dtype),
        ("paged_kv_cache", "hkv0"): lambda: cache[:, :, :0],
        ("paged_kv_cache", "kv-hkv0"): lambda: (cache[:, 0, :0], cache[:, 1, :0]),
        ("paged_kv_cache", "d80"): lambda: torch.randn(*cache.shape[:-1], 80, device=cache.device).to(cache.dtype),
    }
    for key, value in kw.items():
        if isinstance(value, str) and (key, value) in special:
            out[key] = special[(key, value)]()
    if kw.get("qo_indptr") == "long2":  # 3 query tokens for the offsets [0, 1, 3]
        out["q"] = torch.cat([q, q[:1]])
    return out


@pytest.mark.parametrize("name", list(ONESHOT_ERRORS))
def test_oneshot_error(inp, name):
    kw, exc, pattern = ONESHOT_ERRORS[name]
    with pytest.raises(exc, match=pattern):
        oneshot(inp, **_materialize(inp, kw))


@pytest.mark.parametrize("out_shape", [(2, 8, 32), (1, 8, 64)])
def test_oneshot_capture_form_checks_out_against_q(inp, out_shape, monkeypatch):
    """The capturable one-shot (workspace_buffer, max_kv_len, out, validate=False) still checks
    out's shape on the host, with no metadata read: an out of another shape was written past."""
    monkeypatch.setattr(tsdecode.api, "_check_metadata_values", lambda *a: pytest.fail("metadata read"))
    workspace = torch.empty(1 << 20, dtype=torch.uint8, device=inp.q.device)
    out = torch.empty(out_shape, dtype=BF16, device=inp.q.device)
    with pytest.raises(ValueError, match=re.escape(f"out must be q's shape = [2, 8, 64], got {list(out_shape)}")):
        oneshot(inp, out=out, workspace_buffer=workspace, max_kv_len=64, validate=False)


@pytest.mark.parametrize("lens, error, pattern", [
    ("int64", TypeError, "seq_lens_kv must be int32, got torch.int64"),
    ("2-D", ValueError, r"seq_lens_kv must have shape \[B\]=\[2\]"),
    ("strided", ValueError, r"seq_lens_kv must be contiguous"),
    ("list", TypeError, "seq_lens_kv must be a torch.Tensor, got list"),
])
def test_oneshot_capture_form_names_seq_lens_kv(inp, lens, error, pattern):
    """The capturable one-shot's checks of the lengths name the argument its caller passed,
    seq_lens_kv (not the wrapper's seq_lens)."""
    sl = inp.seq_lens
    value = {"int64": sl.long(), "2-D": sl[:, None], "strided": torch.stack([sl, sl], 1)[:, 0],
             "list": sl.tolist()}[lens]
    workspace = torch.empty(1 << 20, dtype=torch.uint8, device=inp.q.device)
    with pytest.raises(error, match=pattern):
        oneshot(inp, seq_lens_kv=value, out=torch.empty_like(inp.q), workspace_buffer=workspace, max_kv_len=64,
                validate=False)


PLAN_ERRORS = {
    "device bool": (dict(device=True), TypeError, "device must be an int, str or torch.device"),
    "device not a device": (dict(device="tpu:x"), ValueError, "device"),
    "batch_size zero": (dict(batch_size=0), ValueError, "batch_size must be >= 1"),
    "batch_size bool": (dict(batch_size=True), TypeError, "batch_size must be an int"),
    "num_qo_heads float": (dict(num_qo_heads=8.0), TypeError, "num_qo_heads must be an int"),
    "num_kv_heads zero": (dict(num_kv_heads=0), ValueError, "num_kv_heads must be >= 1"),
    "heads not a multiple": (dict(num_kv_heads=3), ValueError, r"num_qo_heads \(8\) must be a multiple of num_kv_heads \(3\)"),
    "head_dim unsupported": (dict(head_dim=80), NotImplementedError, "head_dim must be one of"),
    "page_size huge": (dict(page_size=4096), NotImplementedError, "page_size must be in"),
    "page_size zero": (dict(page_size=0), ValueError, "page_size must be >= 1"),
    "group too large": (dict(num_qo_heads=512, num_kv_heads=2), NotImplementedError, "group size"),
    "max_kv_len zero": (dict(max_kv_len=0), ValueError, "max_kv_len must be >= 1"),
    "max_kv_len over int32": (dict(max_kv_len=2**31), NotImplementedError, "max_kv_len must be <="),
    "B*SQ*Hq over int32": (dict(batch_size=2**21, max_seq_len_q=2**7, num_qo_heads=128, num_kv_heads=8),
                           NotImplementedError, r"B\*SQ\*Hq"),
    "max_seq_len_q zero": (dict(max_seq_len_q=0), ValueError, "max_seq_len_q must be >= 1"),
    "packed_query not bool": (dict(packed_query=1), TypeError, "packed_query must be a bool"),
    "q_data_type not dtype": (dict(q_data_type="bf16"), TypeError, "q_data_type must be a torch.dtype"),
    "q_data_type fp32": (dict(q_data_type=torch.float32), NotImplementedError, "q_data_type torch.float32"),
    "fp8 q with bf16 cache": (dict(q_data_type=FP8, kv_data_type=BF16), NotImplementedError,
                              "kv_data_type torch.bfloat16 .* needs a query of the same dtype, got q_data_type torch.float8"),
    "fp8 q with int8 out": (dict(q_data_type=FP8, kv_data_type=FP8, o_data_type=torch.int8), NotImplementedError,
                            "o_data_type torch.int8"),
    "bf16 q with fp16 cache": (dict(kv_data_type=torch.float16), NotImplementedError,
                               "kv_data_type torch.float16 .* needs a query of the same dtype, got q_data_type torch.bfloat16"),
    "kv_data_type int8": (dict(kv_data_type=torch.int8), NotImplementedError, "kv_data_type torch.int8"),
    "o_data_type fp8 for bf16 q": (dict(o_data_type=FP8), NotImplementedError, "o_data_type torch.float8_e4m3fn"),
    "mask_type": (dict(mask_type="sliding"), ValueError, "mask_type must be one of"),
    "mask_type not str": (dict(mask_type=["causal"]), TypeError, "mask_type must be a str"),
    "window without causal": (dict(window_left=3), ValueError, "needs mask_type='causal'"),
    "seq_lens over max_kv_len": (dict(seq_lens=[5, 41]), ValueError, r"seq_lens\[1\]=41 must be in \[1, max_kv_len=40\]"),
    "seq_lens zero": (dict(seq_lens=[0, 5]), ValueError, r"seq_lens\[0\]=0 must be in"),
    "seq_lens count": (dict(seq_lens=[5]), ValueError, "seq_lens must hold B=2 lengths, got 1"),
    "seq_lens not ints": (dict(seq_lens=[5.0, 40]), TypeError, r"seq_lens\[0\] must be an int"),
    "seq_lens a string": (dict(seq_lens="5,40"), TypeError, "seq_lens must be a sequence of ints or a CPU tensor"),
    "seq_lens 2-D tensor": (dict(seq_lens=torch.tensor([[5, 40]])), ValueError, "seq_lens must be 1-D"),
    "seq_lens float tensor": (dict(seq_lens=torch.tensor([5.0, 40.0])), TypeError, "seq_lens must be int32 or int64"),
    "seq_lens on a device": (dict(seq_lens="meta"), ValueError, "plan's seq_lens must be host values"),
    "causal SQ over a plan-owned length": (dict(max_seq_len_q=8, mask_type="causal", seq_lens=[5, 40]), ValueError,
                                           r"causal mask needs query length <= K/V length; request 0 has 8"),
    "config wrong type": (dict(config={"block_n": 64}), TypeError, "config must be a tsdecode.KernelConfig"),
    "config outside space": (dict(config=KernelConfig(block_n=48)), ValueError, "KernelConfig.block_n"),
}


@pytest.mark.parametrize("name", list(PLAN_ERRORS))
def test_plan_error(name):
    kw, exc, pattern = PLAN_ERRORS[name]
    if kw.get("seq_lens") == "meta":
        kw = dict(seq_lens=torch.tensor([5, 40], dtype=torch.int32, device="meta"))
    with pytest.raises(exc, match=pattern):
        plan(**kw)


def test_run_before_plan():
    w = tsdecode.BatchDecodePagedTSWrapper()
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(torch.zeros(1), torch.zeros(1), None, torch.zeros(1))
    with pytest.raises(RuntimeError, match="after plan"):
        w.config


@pytest.mark.parametrize("kv_layout, exc, pattern", [
    ("NHD", NotImplementedError, "kv_layout='NHD' is not supported"),
    ("hnd", ValueError, "kv_layout must be 'HND'"),
    (None, TypeError, "kv_layout must be a str"),
])
def test_wrapper_kv_layout(kv_layout, exc, pattern):
    with pytest.raises(exc, match=pattern):
        tsdecode.BatchDecodePagedTSWrapper(kv_layout=kv_layout)


UNVALIDATED_CHECKS = ("q dtype", "q shape", "q device", "cache dtype", "cache geometry", "cache device",
                      "out dtype", "out shape", "out device",
                      "bmm1_scale inf")  # what run(validate=False) still checks: shapes, dtypes, devices, scales


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("what", ["q dtype", "q shape", "q device", "cache dtype", "cache geometry",
                                  "cache device", "page range", "out dtype", "out shape", "out device",
                                  "bmm1_scale inf"])
def test_run_checks_against_plan(inp, what, validate, monkeypatch):
    """A validated run checks q, the cache and out against the plan; an unvalidated one still
    checks their shapes, dtypes and devices on the host (a mismatch would read or write out of
    bounds, or hand a GPU kernel another device's pointer), with the same errors and without
    reading the metadata."""
    if not validate and what not in UNVALIDATED_CHECKS:
        pytest.skip("not checked without validation (page IDs)")
    w = plan(seq_lens=[5, 40])
    if not validate:
        monkeypatch.setattr(tsdecode.api, "_check_metadata_values", lambda *a: pytest.fail("metadata read"))
    q, cache, out, kw = inp.q, inp.cache, None, {}
    exc = ValueError
    if what == "q dtype":
        q, exc, pattern = q.half(), TypeError, r"q dtype must be torch.bfloat16 \(as planned by q_data_type"
    elif what == "q shape":
        q, pattern = q[:1], r"q must be \[B, Hq, D\] = \[2, 8, 64\], got \[1, 8, 64\]"
    elif what == "q device":
        q, pattern = torch.empty(q.shape, dtype=q.dtype, device="meta"), "q must be on"
    elif what == "cache dtype":
        cache, exc, pattern = (cache.half(), TypeError,
                               r"paged_kv_cache dtype must be torch.bfloat16 \(as planned by kv_data_type")
    elif what == "cache geometry":
        cache = torch.zeros(cache.shape[0], 2, 2, 8, 64, dtype=cache.dtype, device=cache.device)
        pattern = r"paged_kv_cache pages must be \[Hkv=2, P=16, D=64\]"
    elif what == "cache device":
        cache, pattern = torch.empty(cache.shape, dtype=cache.dtype, device="meta"), "paged_kv_cache must be on"
    elif what == "page range":
        cache, pattern = cache[:1], "page ID .* but paged_kv_cache has only 1 pages"
    elif what == "out dtype":
        out, exc, pattern = (torch.empty(q.shape, dtype=torch.float16, device=q.device), TypeError,
                             r"out dtype must be torch.bfloat16 \(as planned by o_data_type")
    elif what == "out shape":
        out, pattern = torch.empty(2, 8, 32, dtype=BF16, device=q.device), "out must be q's shape"
    elif what == "out device":
        out, pattern = torch.empty(q.shape, dtype=BF16, device="meta"), "out must be on"
    else:
        kw, pattern = dict(bmm1_scale=float("inf")), "bmm1_scale must be finite"
    with pytest.raises(exc, match=pattern):
        w.run(q, cache, None, inp.block_tables, out=out, validate=validate, **kw)


RUN_METADATA_ERRORS = {  # (plan kw, run change, exception, pattern)
    "block_tables rows": ({}, dict(block_tables="3rows"), ValueError, r"block_tables must have one row per request \(B=2\), got 3"),
    "block_tables int64": ({}, dict(block_tables="int64"), TypeError, "block_tables must be int32"),
    "block_tables too narrow": ({}, dict(block_tables="narrow"), ValueError, r"seq_lens\[1\]=40 needs 3 pages but block_tables has C=2"),
    "block_tables on another device": ({}, dict(block_tables="meta"), ValueError, "block_tables must be on"),
    "block_tables rows overlap": ({}, dict(block_tables="overlap"), ValueError,
                                  r"block_tables row stride must be >= C=4 \(rows may be padded, not overlap\), got "
                                  r"stride\(0\)=3"),
    "seq_lens int64": ({}, dict(seq_lens="int64"), TypeError, "seq_lens must be int32"),
    "seq_lens shape": ({}, dict(seq_lens="1"), ValueError, r"seq_lens must have shape \[B\]=\[2\]"),
    "seq_lens strided": ({}, dict(seq_lens="strided"), ValueError, "seq_lens must be contiguous"),
    "seq_lens on another device": ({}, dict(seq_lens="meta"), ValueError, "seq_lens must be on"),
    "seq_lens over max_kv_len": ({}, dict(seq_lens="41"), ValueError, r"seq_lens\[1\]=41 must be in \[1, max_kv_len=40\]"),
    "seq_lens zero": ({}, dict(seq_lens="0"), ValueError, r"seq_lens\[0\]=0 must be in"),
    "causal SQ over a length": (dict(max_seq_len_q=6, mask_type="causal"), dict(q="sq6"), ValueError,
                                r"request 0 has 6 query tokens and seq_lens\[0\]=5"),
}


UNVALIDATED_METADATA_CHECKS = ("block_tables rows", "block_tables int64", "block_tables on another device",
                               "seq_lens int64", "seq_lens shape", "seq_lens strided", "seq_lens on another device")


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("name", list(RUN_METADATA_ERRORS))
def test_run_checks_metadata(inp, name, validate):
    """A validated run checks the per-run metadata (run-owned lengths) against the plan; an
    unvalidated one its tensors' shapes, dtypes, devices and the strides the kernels assume."""
    if not validate and name not in UNVALIDATED_METADATA_CHECKS:
        pytest.skip("not checked without validation (values)")
    plan_kw, change, exc, pattern = RUN_METADATA_ERRORS[name]
    w = plan(**plan_kw)
    q, bt, sl = inp.q, inp.block_tables, inp.seq_lens
    made = {
        ("block_tables", "3rows"): lambda: torch.cat([bt, bt[:1]]),
        ("block_tables", "int64"): lambda: bt.long(),
        ("block_tables", "narrow"): lambda: bt[:, :2],
        ("block_tables", "meta"): lambda: torch.empty(bt.shape, dtype=torch.int32, device="meta"),
        ("block_tables", "overlap"): lambda: bt.contiguous().view(-1).as_strided(bt.shape, (bt.shape[1] - 1, 1)),
        ("seq_lens", "int64"): lambda: sl.long(),
        ("seq_lens", "1"): lambda: sl[:1],
        ("seq_lens", "strided"): lambda: torch.stack([sl, sl], 1)[:, 0],
        ("seq_lens", "meta"): lambda: torch.empty(2, dtype=torch.int32, device="meta"),
        ("seq_lens", "41"): lambda: sl + 1,
        ("seq_lens", "0"): lambda: sl * 0,
        ("q", "sq6"): lambda: q[:, None].expand(2, 6, 8, 64).contiguous(),
    }
    args = dict(q=q, block_tables=bt, seq_lens=sl)
    for key, value in change.items():
        args[key] = made[(key, value)]()
    with pytest.raises(exc, match=pattern):
        w.run(args["q"], inp.cache, args["seq_lens"], args["block_tables"], validate=validate)


def _wider_head_dim(t: torch.Tensor) -> torch.Tensor:
    """t's values as a view of the first half of a buffer with twice t's head dim."""
    wide = torch.randn(*t.shape[:-1], 2 * t.shape[-1], device=t.device).to(t.dtype)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


def _nhd_view(t: torch.Tensor, heads: int) -> torch.Tensor:
    """t's values (HND, heads at dim ``heads``) stored as NHD and seen through a transposed view."""
    return t.transpose(heads, heads + 1).contiguous().transpose(heads, heads + 1)


CACHE_LAYOUTS = {  # (separate K/V, the cache from build's, the validated run's error)
    "combined, a slice of a wider head dim": (False, _wider_head_dim, "compact inside a page"),
    "combined, an NHD cache's view": (False, lambda c: _nhd_view(c, 2), "compact HND strides inside a page"),
    "separate, K a slice of a wider head dim": (True, lambda kv: (_wider_head_dim(kv[0]), kv[1]),
                                               "K needs compact HND strides"),
    "separate, V an NHD cache's view": (True, lambda kv: (kv[0], _nhd_view(kv[1], 1)),
                                        "V needs compact HND strides"),
}


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("layout", list(CACHE_LAYOUTS))
def test_a_cache_laid_out_otherwise_inside_a_page_is_refused_unvalidated_too(layout, validate):
    """The kernels take only the page and head strides of K and V and step through a page with
    token stride D and head-dim stride 1. A cache of the planned shape and dtype laid out
    otherwise inside a page (a slice of a wider head dim, an NHD cache's transposed view, K and V
    of different layouts) must be refused by run(validate=False) with the validated run's error,
    out left untouched, instead of being read as if compact (a silently wrong output)."""
    separate, change, pattern = CACHE_LAYOUTS[layout]
    case = Case(lens=(5, 40, 17), separate=separate, lengths="run")
    inp = build(case)
    cache = change(inp.cache)
    for t in (cache if separate else (cache,)):
        assert t.stride(-1) == 1
    assert all(torch.equal(a, b) for a, b in zip(cache if separate else (cache,),
                                                  inp.cache if separate else (inp.cache,)))
    w = plan_wrapper(case, inp)
    out = torch.full(inp.q.shape, float("nan"), device=inp.q.device).to(BF16)
    with pytest.raises(ValueError, match=pattern):
        w.run(inp.q, cache, inp.seq_lens, inp.block_tables, out=out, validate=validate)
    assert torch.isnan(out.float()).all()


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("what", ["block_tables column-major", "seq_lens strided"])
def test_metadata_read_with_unit_stride_is_refused_unvalidated_too(what, validate):
    """The kernels read a block-table row and the lengths with unit stride (of the table they
    take only the row stride). A column-major block table, or strided lengths, of the planned
    shape and dtype must be refused by run(validate=False) with the validated run's error, out
    left untouched, instead of being read as if contiguous (other requests' page IDs and lengths:
    a silently wrong output here, where every entry is a page ID inside the cache and every
    length in range; reads outside the cache elsewhere)."""
    case = Case(lens=(5, 40, 17), lengths="run", pad_value=0)
    inp = build(case)
    bt, lens = inp.block_tables, inp.seq_lens
    if what == "block_tables column-major":
        bt, pattern = bt.t().contiguous().t(), "block_tables rows must be contiguous"
    else:
        holder = torch.stack([lens, lens.flip(0)], 1)  # in-range lengths between the real ones
        lens, pattern = holder[:, 0], "seq_lens must be contiguous"
    assert torch.equal(bt, inp.block_tables) and torch.equal(lens, inp.seq_lens)
    w = plan_wrapper(case, inp)
    out = torch.full(inp.q.shape, float("nan"), device=inp.q.device).to(BF16)
    with pytest.raises(ValueError, match=pattern):
        w.run(inp.q, inp.cache, lens, bt, out=out, validate=validate)
    assert torch.isnan(out.float()).all()


@pytest.mark.parametrize("validate", [True, False])
def test_who_owns_the_lengths_is_checked_even_without_validation(inp, validate):
    """seq_lens to run iff the plan does not own them; qo_indptr iff the plan is packed: checked
    with validate=False too (FlashInfer A)."""
    owned = plan(seq_lens=[5, 40])
    with pytest.raises(ValueError, match="this plan owns the lengths"):
        owned.run(inp.q, inp.cache, inp.seq_lens, inp.block_tables, validate=validate)
    per_run = plan()
    with pytest.raises(ValueError, match="seq_lens is required"):
        per_run.run(inp.q, inp.cache, None, inp.block_tables, validate=validate)
    with pytest.raises(ValueError, match="qo_indptr was given but the plan is not packed"):
        per_run.run(inp.q, inp.cache, inp.seq_lens, inp.block_tables, validate=validate,
                    qo_indptr=torch.tensor([0, 1, 2], dtype=torch.int32, device=inp.q.device))
    packed = plan(packed_query=True, max_seq_len_q=2)
    with pytest.raises(ValueError, match="qo_indptr is required"):
        packed.run(inp.q, inp.cache, inp.seq_lens, inp.block_tables, validate=validate)
    with pytest.raises(TypeError, match="validate must be a bool"):
        per_run.run(inp.q, inp.cache, inp.seq_lens, inp.block_tables, validate=1)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("what", ["strided", "int64", "B offsets", "another device"])
def test_packed_offsets_are_checked_unvalidated_too(what, validate):
    """The kernels read qo_indptr as int32 [B+1] with unit stride. Offsets of another layout,
    dtype or length must be refused by run(validate=False) with the validated run's error, out
    left untouched: a strided view is read as other offsets (here requests without query tokens,
    rows left unwritten), int64 offsets as pairs of int32 halves by a GPU kernel compiled for
    int32 ones, B offsets one past their end, and another device's by a pointer the kernel cannot
    use."""
    case = Case(lens=(5, 40, 17), lengths="run", mode="packed", q_lens=(2, 3, 1), seq_len_q=3)
    inp = build(case)
    indptr = inp.qo_indptr
    if what == "strided":
        indptr, exc, pattern = torch.stack([indptr, indptr], 1)[:, 0], ValueError, "qo_indptr must be contiguous"
        assert torch.equal(indptr, inp.qo_indptr)
    elif what == "int64":
        indptr, exc, pattern = indptr.long(), TypeError, "qo_indptr must be int32"
    elif what == "another device":
        indptr, exc, pattern = torch.empty(4, dtype=torch.int32, device="meta"), ValueError, "qo_indptr must be on"
    else:
        indptr, exc, pattern = indptr[:-1], ValueError, r"qo_indptr must have shape \[B\+1\]=\[4\], got \[3\]"
    w = plan_wrapper(case, inp)
    out = torch.full(inp.q.shape, float("nan"), device=inp.q.device).to(BF16)
    with pytest.raises(exc, match=pattern):
        w.run(inp.q, inp.cache, inp.seq_lens, inp.block_tables, qo_indptr=indptr, out=out, validate=validate)
    assert torch.isnan(out.float()).all()


def test_packed_run_checks_the_offsets(inp):
    w = plan(packed_query=True, max_seq_len_q=2)
    q3 = torch.cat([inp.q, inp.q[:1]])  # 3 query tokens

    def run(offsets, q=q3):
        indptr = offsets if isinstance(offsets, torch.Tensor) else torch.tensor(offsets, dtype=torch.int32)
        return w.run(q, inp.cache, inp.seq_lens, inp.block_tables, qo_indptr=indptr.to(inp.q.device))

    with pytest.raises(ValueError, match=r"qo_indptr\[-1\]=2 must equal total_q=3"):
        run([0, 1, 2])
    with pytest.raises(ValueError, match="request 0 has 3 query tokens .* more than max_seq_len_q=2"):
        run([0, 3, 3])
    with pytest.raises(ValueError, match="strictly increase"):
        run([0, 0, 3])
    with pytest.raises(TypeError, match="qo_indptr must be int32"):
        run(torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match=r"qo_indptr must have shape \[B\+1\]=\[3\]"):
        run([0, 3])
    with pytest.raises(ValueError, match="q holds 5 query tokens; .* from B=2 to 4"):
        run([0, 2, 5], q=torch.cat([q3, q3[:2]]))
    out = run([0, 2, 3])
    assert out.shape == q3.shape
    with pytest.raises(ValueError, match=r"q must be packed \[total_q, Hq, D\] \(the plan is packed\), with "
                                         r"total_q at most B\*max_seq_len_q = 4; got shape \[2, 1, 8, 64\]"):
        run([0, 1, 2], q=inp.q[:, None])


@pytest.mark.parametrize("validate", [True, False])
def test_a_packed_q_of_fewer_tokens_than_requests_is_refused_unvalidated_too(inp, validate):
    """Each request of a packed q has one query token or more: a q of fewer tokens than B would
    have the kernels read past its end under offsets run(validate=False) does not read."""
    w = plan(packed_query=True, max_seq_len_q=2)
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32, device=inp.q.device)
    out = torch.full((1, *inp.q.shape[1:]), float("nan"), device=inp.q.device).to(BF16)
    with pytest.raises(ValueError, match="q holds 1 query tokens; .* from B=2 to 4"):
        w.run(inp.q[:1], inp.cache, inp.seq_lens, inp.block_tables, qo_indptr=indptr, out=out, validate=validate)
    assert torch.isnan(out.float()).all()


def test_cpu_tensors_need_interpreter(monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("checks the CPU path")
    monkeypatch.setattr(tsdecode.api, "INTERPRETER", False)  # as if triton compiled for a GPU
    with pytest.raises(ValueError, match="CUDA device"):
        plan()


def test_no_measurement_switches_in_the_product():
    """The TSDECODE_* measurement switches (TSDECODE_TRANSPOSED, TSDECODE_FP8_COMPUTE,
    TSDECODE_DISABLE_PDL) are gone on purpose: an A/B passes a config or an explicit argument.
    With them set to anything, tsdecode imports and plans exactly as without them. (Replaces the
    test that their unknown values were rejected.)"""
    script = (
        "import torch, tsdecode\n"
        "w = tsdecode.BatchDecodePagedTSWrapper()\n"
        "w.plan('cpu', 2, 8, 2, 64, 16, 64, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn,"
        " config=tsdecode.KernelConfig(block_n=16, block_m=16, num_kv_splits=2))\n"
        "c = w._plan.launch._split_constexprs\n"
        "print(c['TRANSPOSED'], c['COMPUTE_DTYPE'], c['USE_PDL'], w._plan.launch.pdl)\n"
    )
    if DEVICE.type == "cuda":
        script = script.replace("'cpu'", "'cuda'")
    outputs = []
    for switches in ({}, dict(TSDECODE_TRANSPOSED="0", TSDECODE_FP8_COMPUTE="bfloat16", TSDECODE_DISABLE_PDL="1"),
                     dict(TSDECODE_TRANSPOSED="yes", TSDECODE_FP8_COMPUTE="fp16", TSDECODE_DISABLE_PDL="true")):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TSDECODE_")}
        env.update(switches)
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        outputs.append(r.stdout.strip().splitlines()[-1])
    assert outputs[0].startswith("True fp16") and len(set(outputs)) == 1, outputs


@pytest.mark.parametrize("capability, dtypes, pattern", [
    ((8, 0), (BF16, FP8, BF16), "kv_data_type float8_e4m3fn needs a GPU of compute capability >= 8.9"),
    ((8, 6), (FP8, FP8, FP8), "q_data_type float8_e4m3fn needs .* this GPU has compute capability 8.6"),
    ((7, 5), (BF16, BF16, BF16), "q_data_type bfloat16 needs a GPU of compute capability >= 8.0"),
    ((7, 5), (torch.float16, torch.float16, BF16), "o_data_type bfloat16 needs"),
    ((8, 9), (BF16, FP8, BF16), None),
    ((8, 0), (BF16, BF16, torch.float32), None),
    ((7, 5), (torch.float16, torch.float16, torch.float16), None),
])
def test_dtypes_the_gpu_cannot_run(capability, dtypes, pattern):
    """fp8 needs sm89+, bf16 sm80+: a NotImplementedError naming the argument, the dtype and the
    GPU's capability at plan time, instead of a triton compile error."""
    from tsdecode.validation import validate_dtypes_on_gpu

    named = tuple(zip(("q_data_type", "kv_data_type", "o_data_type"), dtypes))
    if pattern is None:
        validate_dtypes_on_gpu(capability, named)
    else:
        with pytest.raises(NotImplementedError, match=pattern):
            validate_dtypes_on_gpu(capability, named)


@pytest.mark.gpu
def test_plan_checks_the_gpus_capability(device_override):
    """A GPU described (``tsdecode.device.set_override``) as an A100 refuses an fp8 cache, as a
    T4 a bf16 query; the same plans work on this GPU."""
    from tsdecode.device import DeviceProperties

    device_override(DeviceProperties("NVIDIA A100-SXM4-80GB", 108, (8, 0)))
    with pytest.raises(NotImplementedError, match="compute capability >= 8.9"):
        plan(kv_data_type=FP8)
    device_override(DeviceProperties("Tesla T4", 40, (7, 5)))
    with pytest.raises(NotImplementedError, match="bfloat16 needs a GPU of compute capability >= 8.0"):
        plan()
    device_override(None)
    plan(kv_data_type=FP8)
    plan()


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("target", ["cache", "K", "V", "block_tables", "seq_lens", "workspace_buffer"])
def test_out_must_not_overlap_any_input(target, validate):
    """run refuses an out whose bytes overlap any tensor the kernels read or write (checked by
    byte span: combined or separate cache, the block table, the run's lengths and the plan's
    workspace), validated or not (unvalidated, the kernels would write into an input they read,
    the caller's cache included), and accepts the same buffer's bytes right past that tensor."""
    case = Case(lens=(40, 33), separate=target in ("K", "V"), lengths="run",
                config=KernelConfig(block_n=16, block_m=16, num_kv_splits=2))  # every row: 3 live pages
    inp = build(case)
    q = inp.q
    out_bytes = q.numel() * q.element_size()
    block_tables, seq_lens, cache = inp.block_tables, inp.seq_lens, inp.cache
    workspace = torch.zeros(1 << 16, dtype=torch.uint8, device=q.device)  # holds the 2 splits' partials
    # One byte buffer holds the target tensor followed by room for out.
    if target == "cache":
        victim = cache
    elif target in ("K", "V"):
        victim = cache[0 if target == "K" else 1]
    else:
        victim = {"block_tables": block_tables, "seq_lens": seq_lens, "workspace_buffer": workspace}[target]
    vbytes = victim.numel() * victim.element_size()
    nbytes = vbytes + -vbytes % 32
    buf = torch.zeros(nbytes + out_bytes + 64, dtype=torch.uint8, device=q.device)
    moved = buf[:vbytes].view(victim.dtype).view(victim.shape)
    moved.copy_(victim)
    if target == "cache":
        cache = moved
    elif target in ("K", "V"):
        cache = (moved, cache[1]) if target == "K" else (cache[0], moved)
    elif target == "block_tables":
        block_tables = moved
    elif target == "seq_lens":
        seq_lens = moved
    else:
        workspace = moved
    w = plan_wrapper(case, inp, workspace_buffer=workspace)
    overlapping = buf[vbytes - 2 : vbytes - 2 + out_bytes].view(BF16).view(q.shape)
    with pytest.raises(ValueError, match=f"out must not alias {target if target in ('block_tables', 'seq_lens', 'workspace_buffer') else 'paged_kv_cache'}"):
        w.run(q, cache, seq_lens, block_tables, out=overlapping, validate=validate)
    past = buf[nbytes : nbytes + out_bytes].view(BF16).view(q.shape)
    past.fill_(float("nan"))
    assert w.run(q, cache, seq_lens, block_tables, out=past, validate=validate) is past
    ref = w.run(q, cache, seq_lens, block_tables)
    assert torch.isfinite(past.float()).all() and torch.equal(past, ref)


@pytest.mark.parametrize("target", ["cache", "V", "q", "block_tables", "seq_lens"])
def test_workspace_must_not_overlap_any_input(target):
    """A validated run refuses a plan whose split partials (in workspace_buffer) overlap a tensor
    the kernels read (the partials would overwrite it and the answer be wrong), naming both, and
    accepts the same buffer's bytes right past that tensor."""
    case = Case(lens=(40, 33), separate=target == "V", lengths="run",
                config=KernelConfig(block_n=16, block_m=16, num_kv_splits=2))
    inp = build(case)
    ref = reference(case, inp)
    need = tsdecode.workspace.workspace_bytes(plan_wrapper(case, inp)._plan.shape, 2)
    tensors = dict(q=inp.q, cache=inp.cache, block_tables=inp.block_tables, seq_lens=inp.seq_lens)
    victim = inp.cache[1] if target == "V" else tensors[target]
    vbytes = victim.numel() * victim.element_size()
    nbytes = vbytes + -vbytes % 256
    buf = torch.zeros(nbytes + need + 256, dtype=torch.uint8, device=inp.q.device)
    buf = buf[-buf.data_ptr() % 256:]
    moved = buf[:vbytes].view(victim.dtype).view(victim.shape)
    moved.copy_(victim)
    if target == "V":
        tensors["cache"] = (inp.cache[0], moved)
    else:
        tensors[target] = moved
    args = (tensors["q"], tensors["cache"], tensors["seq_lens"], tensors["block_tables"])
    name = {"cache": "paged_kv_cache", "V": "paged_kv_cache V"}.get(target, target)
    w = plan_wrapper(case, inp, workspace_buffer=buf[nbytes - 256:nbytes - 256 + need])
    with pytest.raises(ValueError, match=f"workspace_buffer must not overlap {name}"):
        w.run(*args)
    w = plan_wrapper(case, inp, workspace_buffer=buf[nbytes:nbytes + need])
    out = torch.full(inp.q.shape, float("nan"), dtype=BF16, device=inp.q.device)
    assert w.run(*args, out=out) is out
    rel, _ = errors(out, ref)
    assert rel < 1.2e-2, rel


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("out_kind", ["expanded over the batch", "q itself", "the cache's first bytes"])
def test_an_overlapping_out_is_refused_unvalidated_too(out_kind, validate):
    """An out of q's shape and dtype whose elements share memory with each other (a stride-0
    view) or with an input (q, the cache) must be refused by run(validate=False) with the
    validated run's error: written as it was, requests overwrite each other's rows, or the
    kernels overwrite the cache they are reading (a silently wrong output and a damaged cache)."""
    case = Case(lens=(5, 40, 17), lengths="run")
    inp = build(case)
    cache_before = inp.cache.clone()
    if out_kind == "expanded over the batch":
        out = torch.full(inp.q.shape[1:], float("nan"), device=inp.q.device).to(BF16).expand(inp.q.shape)
        pattern = "out must not overlap itself"
    elif out_kind == "q itself":
        out, pattern = inp.q, "out must not alias q"
    else:
        out = inp.cache.view(-1)[: inp.q.numel()].view(inp.q.shape)
        pattern = "out must not alias paged_kv_cache"
    w = plan_wrapper(case, inp)
    with pytest.raises(ValueError, match=pattern):
        w.run(inp.q, inp.cache, inp.seq_lens, inp.block_tables, out=out, validate=validate)
    assert torch.equal(inp.cache, cache_before)


@pytest.mark.parametrize("owner", ["plan", "run", "run, max_kv_len 4096"])
@pytest.mark.parametrize("bad", [-1, "num_pages", 10**6])
@pytest.mark.parametrize("covered", [True, False])
def test_page_ids_are_checked_over_exactly_the_live_pages(owner, bad, covered):
    """A validated run checks the page IDs of each request's live pages, whoever owns the lengths
    and however large max_kv_len is: a bad ID (negative, one past the last page, far past it) in
    the last live column of a row is refused, one in the first column past it is never read and
    accepted. (Replaces the plan-time check, which covered ceil(max_kv_len / P) columns of every
    row for bound lengths.)"""
    case = Case(lens=(20, 40, 33), lengths="plan" if owner == "plan" else "run",
                max_kv_len=4096 if "4096" in owner else None)  # P=16: 2, 3 and 3 live pages; C = 4
    inp = build(case)
    if bad == "num_pages":  # the first ID past the cache: an off-by-one in the bound lets it through
        bad = (inp.cache[0] if isinstance(inp.cache, (tuple, list)) else inp.cache).shape[0]
    bt = inp.block_tables
    for row, n in enumerate(case.lens):
        bt[row, -(-n // 16):] = 0  # valid IDs past the live pages
    bt[0, 1 if covered else 2] = bad  # row 0's last live column is 1
    w = plan_wrapper(case, inp)
    if covered:
        with pytest.raises(ValueError, match="page ID"):
            run_wrapper(w, case, inp)
    else:
        out = run_wrapper(w, case, inp)
        assert torch.allclose(out.float(), reference(case, inp).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape, stride, overlaps", [
    ((2, 8, 64), (512, 64, 1), False),      # contiguous
    ((2, 8, 64), (1024, 128, 1), False),    # padded heads
    ((2, 8, 64), (64, 128, 1), False),      # head-major
    ((2, 8, 64), (0, 64, 1), True),         # one request's rows for all
    ((2, 8, 64), (256, 32, 1), True),       # heads overlap by half
    ((2, 8, 64), (512, 64, 0), True),       # one element per head
    ((1, 8, 64), (0, 64, 1), False),        # size-1 dims' strides do not matter
    ((2, 0, 64), (0, 0, 0), False),         # empty
])
def test_overlaps_itself(shape, stride, overlaps):
    from tsdecode.memory import overlaps_itself
    t = torch.empty(4096, dtype=BF16).as_strided(shape, stride)
    assert overlaps_itself(t) is overlaps


def test_padded_out_is_accepted_and_written():
    """A non-overlapping strided out (rows of a wider buffer) passes the self-overlap check and
    gets exactly the result; the padding stays untouched."""
    case = Case(lens=(5, 40))
    inp = build(case)
    wide = torch.full((*inp.q.shape[:-1], 96), float("nan"), dtype=BF16, device=inp.q.device)
    out = wide[..., 16:80]
    result = oneshot(inp, out=out)
    assert result is out
    torch.testing.assert_close(out.float(), reference(case, inp).float(), rtol=2e-2, atol=2e-2)
    assert torch.isnan(wide[..., :16].float()).all() and torch.isnan(wide[..., 80:].float()).all()


def test_strided_lengths_where_they_are_only_read_on_the_host():
    """seq_lens_kv as a strided view: the one-shot op (which reads it on the host and plans with
    its own copy) and a plan given it as host lengths accept it and match the reference; lengths
    passed to run are read in place by the kernels, so a validated run refuses a strided tensor.
    (Was: the one-shot and an unbound plan copy it; bind_seq_lens=True refuses it.)"""
    case = Case(lens=(5, 40))
    inp = build(case)
    ref = reference(case, inp).float()
    holder = torch.zeros(2 * len(case.lens), dtype=torch.int32, device=inp.q.device)
    holder[::2] = inp.seq_lens
    holder[1::2] = 10**6  # what an accidental stride-1 read would see
    strided = holder[::2]
    torch.testing.assert_close(oneshot(inp, seq_lens_kv=strided).float(), ref, rtol=2e-2, atol=2e-2)
    w = plan(seq_lens=strided.cpu())
    torch.testing.assert_close(w.run(inp.q, inp.cache, None, inp.block_tables).float(), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="seq_lens must be contiguous"):
        plan().run(inp.q, inp.cache, strided, inp.block_tables)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU device under the interpreter")
def test_a_plan_on_cpu_0_runs_cpu_tensors(inp):
    """"cpu:0" names the one CPU device that tensors report as "cpu": a plan on it runs them."""
    w = plan(device="cpu:0")
    out = w.run(inp.q, inp.cache, inp.seq_lens, inp.block_tables)
    assert torch.equal(out, oneshot(inp))


def test_explain_takes_numpy_integers():
    """explain() accepts numpy integers for its sizes as plan() does, and says the same."""
    np = pytest.importorskip("numpy")
    args = (4, 1000, 8, 2, 128, 16)
    assert tsdecode.explain(*map(np.int64, args), device=DEVICE) == tsdecode.explain(*args, device=DEVICE)


def test_numpy_scalars_are_accepted():
    """Integral and real scalars other than int/float (numpy's) work like the Python values;
    bools stay refused."""
    np = pytest.importorskip("numpy")
    case = Case(lens=(5, 40), mask_type="causal", window_left=7)
    inp = build(case)
    expected = oneshot(inp, mask_type="causal", window_left=7, bmm1_scale=0.125, bmm2_scale=0.5)
    got = oneshot(inp, mask_type="causal", window_left=np.int64(7), bmm1_scale=np.float32(0.125),
                  bmm2_scale=np.float64(0.5))
    assert torch.equal(got, expected)
    w = plan(batch_size=np.int64(2), num_qo_heads=np.int64(8), num_kv_heads=np.int32(2), head_dim=np.int64(64),
             page_size=np.int64(16), max_kv_len=np.int64(40), seq_lens=[np.int64(5), np.int32(40)])
    assert type(w.config.kernel_config.num_kv_splits) is int
    torch.testing.assert_close(w.run(inp.q, inp.cache, None, inp.block_tables), oneshot(inp), rtol=0, atol=0)
    with pytest.raises(TypeError, match="window_left must be an int"):
        oneshot(inp, mask_type="causal", window_left=True)


# --- FlashInfer A's error classes, one per condition its docstrings state -------------------------

def _a_condition(name, inp):
    """Run the call that violates condition ``name``."""
    q, cache, bt, sl = inp.q, inp.cache, inp.block_tables, inp.seq_lens
    calls = {
        "NHD wrapper": lambda: tsdecode.BatchDecodePagedTSWrapper("NHD"),
        "NHD one-shot": lambda: oneshot(inp, kv_layout="NHD"),
        "NHD workspace size": lambda: tsdecode.get_prims_ts_batch_decode_workspace_size(
            2, 8, 2, 64, 16, 40, kv_layout="NHD", device=DEVICE),
        "q/kv dtype pair": lambda: plan(kv_data_type=torch.float16),
        "q/o dtype pair": lambda: plan(q_data_type=torch.float16, o_data_type=FP8),
        "head dim 32": lambda: plan(head_dim=32),
        "page size 2048": lambda: plan(page_size=2048),
        "group size 256": lambda: plan(num_qo_heads=256, num_kv_heads=1),
        "max_kv_len over the limit": lambda: plan(max_kv_len=2**31 - 1),
        "B*SQ*Hq over int32": lambda: plan(batch_size=2**24, num_qo_heads=128, num_kv_heads=128),
        "run before plan": lambda: tsdecode.BatchDecodePagedTSWrapper().run(q, cache, sl, bt),
        "plan-owned lengths passed to run": lambda: plan(seq_lens=[5, 40]).run(q, cache, sl, bt),
        "run-owned lengths missing": lambda: plan().run(q, cache, None, bt),
        "length outside [1, max_kv_len]": lambda: plan(max_kv_len=39).run(q, cache, sl, bt),
        "too few table columns": lambda: plan().run(q, cache, sl, bt[:, :1]),
        "live page ID out of range": lambda: plan().run(q, cache[:2], sl, bt),
        "B mismatch": lambda: plan(batch_size=3).run(torch.cat([q, q[:1]]), cache, torch.cat([sl, sl[:1]]), bt),
        "device mismatch": lambda: plan().run(q, cache, sl.to("meta"), bt),
        "plan seq_lens off the CPU": lambda: plan(seq_lens=torch.tensor([5, 40], device="meta")),
        "plan seq_lens count": lambda: plan(seq_lens=[5, 40, 7]),
        "non-positive size": lambda: plan(num_qo_heads=-8),
        "qo_indptr not int32": lambda: plan(packed_query=True, max_seq_len_q=2).run(
            q, cache, sl, bt, qo_indptr=torch.tensor([0, 1, 2], device=q.device)),
        "non-integer size": lambda: plan(head_dim=64.0),
        "boolean size": lambda: plan(page_size=True),
        "non-bool flag": lambda: plan(packed_query="yes"),
        "workspace not a tensor": lambda: plan(workspace_buffer=bytearray(64)),
        "workspace dtype": lambda: plan(workspace_buffer=torch.zeros(64, dtype=torch.float32)),
    }
    return calls[name]()


A_ERRORS = {  # condition: (class, text the message must contain)
    "NHD wrapper": (NotImplementedError, "kv_layout"),
    "NHD one-shot": (NotImplementedError, "kv_layout"),
    "NHD workspace size": (NotImplementedError, "kv_layout"),
    "q/kv dtype pair": (NotImplementedError, "kv_data_type"),
    "q/o dtype pair": (NotImplementedError, "o_data_type"),
    "head dim 32": (NotImplementedError, "head_dim"),
    "page size 2048": (NotImplementedError, "page_size"),
    "group size 256": (NotImplementedError, "num_qo_heads/num_kv_heads"),
    "max_kv_len over the limit": (NotImplementedError, "max_kv_len"),
    "B*SQ*Hq over int32": (NotImplementedError, "B*SQ*Hq"),
    "run before plan": (RuntimeError, "plan()"),
    "plan-owned lengths passed to run": (ValueError, "seq_lens"),
    "run-owned lengths missing": (ValueError, "seq_lens"),
    "length outside [1, max_kv_len]": (ValueError, "seq_lens[1]=40"),
    "too few table columns": (ValueError, "block_tables"),
    "live page ID out of range": (ValueError, "block_tables"),
    "B mismatch": (ValueError, "block_tables"),
    "device mismatch": (ValueError, "seq_lens"),
    "plan seq_lens off the CPU": (ValueError, "seq_lens"),
    "plan seq_lens count": (ValueError, "seq_lens"),
    "non-positive size": (ValueError, "num_qo_heads"),
    "qo_indptr not int32": (TypeError, "qo_indptr"),
    "non-integer size": (TypeError, "head_dim"),
    "boolean size": (TypeError, "page_size"),
    "non-bool flag": (TypeError, "packed_query"),
    "workspace not a tensor": (TypeError, "workspace_buffer"),
    "workspace dtype": (TypeError, "workspace_buffer"),
}


@pytest.mark.parametrize("name", list(A_ERRORS))
def test_flashinfer_error_classes(inp, name):
    """The class FlashInfer's PrimTS API (v0.7.0.post1) raises for each condition its docstrings
    state, and a message naming the argument. (Under CUDA graph capture: test_flashinfer_caller.)"""
    exc, text = A_ERRORS[name]
    with pytest.raises(exc) as info:
        _a_condition(name, inp)
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    assert text in str(info.value), str(info.value)


# --- issue 28, finding 7: errors name what the caller passed --------------------------------------

def test_float32_cache_is_named_paged_kv_cache(inp):
    with pytest.raises(NotImplementedError) as info:
        oneshot(inp, q=inp.q, paged_kv_cache=inp.cache.float())
    msg = str(info.value)
    assert "paged_kv_cache" in msg and "float32" in msg and "kv dtype" not in msg, msg


def test_block_tables_with_wrong_rows_is_a_block_tables_problem(inp):
    bt = torch.cat([inp.block_tables, inp.block_tables[:1]])
    with pytest.raises(ValueError) as info:
        oneshot(inp, block_tables=bt)
    msg = str(info.value)
    assert "block_tables has 3 rows" in msg and "seq_lens_kv must have shape" not in msg, msg
    # the same through the wrapper: named block_tables, not a lengths shape
    with pytest.raises(ValueError, match=r"block_tables must have one row per request \(B=2\), got 3 rows"):
        plan().run(inp.q, inp.cache, inp.seq_lens, bt)


def test_nhd_cache_to_the_oneshot_says_hnd_is_expected(inp):
    """An NHD cache [pages, 2, P, Hkv, D] (P=16 here, which does not divide Hq=8) read as HND has
    Hkv=16: the message says which shape was expected and that the layout is HND, not
    "num_qo_heads (8) must be a multiple of num_kv_heads (16)" (the caller passed no head counts)."""
    nhd = inp.cache.transpose(2, 3).contiguous()  # [pages, 2, P=16, Hkv=2, D]
    for cache in (nhd, (nhd[:, 0], nhd[:, 1])):
        with pytest.raises(ValueError) as info:
            oneshot(inp, paged_kv_cache=cache)
        msg = str(info.value)
        assert "HND" in msg and "[num_pages, 2, Hkv, P, D]" in msg and "NHD" in msg, msg
        assert "num_qo_heads (8) must be a multiple" not in msg and "num_kv_heads (16)" not in msg, msg


@pytest.mark.parametrize("q4", ["sq1", "sq3", "bad heads"])
def test_4d_q_to_the_oneshot_never_mentions_a_planned_shape(inp, q4):
    q = inp.q[:, None]
    if q4 == "sq3":
        q = q.expand(2, 3, 8, 64).contiguous()
    elif q4 == "bad heads":
        q = q[:, :, :3]
    with pytest.raises(ValueError) as info:
        oneshot(inp, q=q)
    msg = str(info.value)
    assert "planned" not in msg and "q" in msg, msg


def test_a_valid_call_after_the_errors_still_works(inp):
    case = Case(lens=(5, 40))
    rel, _ = errors(oneshot(inp), reference(case, inp))
    assert rel < 2e-2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", 0, "cuda:1"])
def test_a_cuda_device_on_a_machine_without_one(device):
    """plan() and the workspace size name the device asked for and say what runs on a CPU (not
    torch's AssertionError from deep inside)."""
    with pytest.raises(ValueError, match=r"device cuda.* is a CUDA device, but torch finds none here; .*TRITON_INTERPRET"):
        plan(device=device)
    with pytest.raises(ValueError, match="is a CUDA device, but torch finds none"):
        tsdecode.get_prims_ts_batch_decode_workspace_size(2, 8, 2, 64, 16, 40, device=device)


def test_cpu_tensors_to_the_oneshot_name_q_device_in_both_forms(inp, monkeypatch):
    """Without the interpreter, CPU tensors to the one-shot op are refused naming q.device, the
    device the op runs on, in the capturable form as in the default one (not a plan's "device")."""
    if DEVICE.type == "cuda":
        pytest.skip("checks the CPU path")
    monkeypatch.setattr(tsdecode.api, "INTERPRETER", False)  # as if triton compiled for a GPU
    monkeypatch.setattr(tsdecode.oneshot, "INTERPRETER", False)
    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    for kw in ({}, dict(out=torch.empty_like(inp.q), workspace_buffer=workspace, max_kv_len=64, validate=False)):
        with pytest.raises(ValueError, match=r"^q\.device must be a CUDA device .*, got cpu$"):
            oneshot(inp, **kw)


@pytest.mark.parametrize("kw, pattern", [
    (dict(max_seq_len=0), "max_seq_len must be >= 1, got 0"),
    (dict(max_seq_len=1 << 40), "max_seq_len must be <= "),
    (dict(max_seq_len=40, seq_len_q=0), "seq_len_q must be >= 1, got 0"),
    (dict(batch_size=0, max_seq_len=40), "batch_size must be >= 1, got 0"),
])
def test_the_workspace_size_names_its_own_arguments(kw, pattern):
    """get_prims_ts_batch_decode_workspace_size's errors name its arguments (max_seq_len, not the
    plan's max_kv_len)."""
    args = dict(batch_size=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, device=DEVICE)
    args.update(kw)
    with pytest.raises((ValueError, NotImplementedError), match=re.escape(pattern)):
        tsdecode.get_prims_ts_batch_decode_workspace_size(**args)
