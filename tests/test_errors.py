"""One test per error path: bad input raises TypeError/ValueError naming the argument."""

import os
import subprocess
import sys

import pytest
import torch

import tsdecode
from tsdecode import KernelConfig
from cases import FP8, Case, DEVICE, build, plan_wrapper, reference

BF16 = torch.bfloat16


@pytest.fixture
def inp():
    return build(Case(lens=(5, 40)))


def oneshot(inp, **kw):
    args = dict(q=inp.q, paged_kv_cache=inp.cache, block_tables=inp.block_tables, seq_lens_kv=inp.seq_lens)
    args.update(kw)
    return tsdecode.batch_decode_with_paged_kv_cache(**args)


def plan(inp, **kw):
    args = dict(block_tables=inp.block_tables, seq_lens_kv=inp.seq_lens, num_qo_heads=8,
                num_kv_heads=2, head_dim=64, page_size=16, q_data_type=BF16)
    args.update(kw)
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(**args)
    return w


ONESHOT_ERRORS = {
    "q not a tensor": (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    "q fp32": (dict(q="fp32"), TypeError, "q dtype"),
    "q 2-D": (dict(q="2d"), ValueError, "q must be"),
    "q head dim": (dict(q="d32"), ValueError, "head dim"),
    "q batch": (dict(q="b3"), ValueError, "q must have the planned shape"),
    "q heads not multiple": (dict(q="h3"), ValueError, "multiple of num_kv_heads"),
    "q dtype vs cache": (dict(q="fp16"), TypeError, "needs q of the same dtype"),
    "cache 4-D": (dict(paged_kv_cache="4d"), ValueError, "paged_kv_cache must be"),
    "cache tuple of 3": (dict(paged_kv_cache="tuple3"), ValueError, r"must be \(K, V\)"),
    "cache K/V shapes": (dict(paged_kv_cache="kv-shape"), ValueError, "shapes differ"),
    "cache non-compact": (dict(paged_kv_cache="strided"), ValueError, "compact"),
    "kv_layout": (dict(kv_layout="NHD"), ValueError, "kv_layout"),
    "block_tables int64": (dict(block_tables="int64"), TypeError, "block_tables must be int32"),
    "block_tables 1-D": (dict(block_tables="1d"), ValueError, "block_tables must be 2-D"),
    "block_tables col stride": (dict(block_tables="colstride"), ValueError, "rows must be contiguous"),
    "page id out of range": (dict(block_tables="oob"), ValueError, "page ID"),
    "negative page id": (dict(block_tables="neg"), ValueError, "negative page ID"),
    "seq_lens int64": (dict(seq_lens_kv="int64"), TypeError, "seq_lens_kv must be int32"),
    "seq_lens shape": (dict(seq_lens_kv="shape"), ValueError, r"seq_lens_kv must have shape"),
    "seq_len zero": (dict(seq_lens_kv="zero"), ValueError, r"seq_lens_kv\[0\]=0"),
    "seq_len over capacity": (dict(seq_lens_kv="big"), ValueError, "C\\*P"),
    "mask_type": (dict(mask_type="sliding"), ValueError, "mask_type"),
    "window without causal": (dict(window_left=4), ValueError, "needs mask_type='causal'"),
    "window below -1": (dict(window_left=-2, mask_type="causal"), ValueError, "window_left must be >= -1"),
    "bmm1_scale tensor": (dict(bmm1_scale="tensor"), TypeError, "bmm1_scale must be a real number"),
    "bmm2_scale None": (dict(bmm2_scale=None), TypeError, "bmm2_scale must be a real number"),
    "bmm2_scale nan": (dict(bmm2_scale=float("nan")), ValueError, "bmm2_scale must be finite"),
    "out_dtype fp8 with bf16 q": (dict(out_dtype=FP8), TypeError, "output dtype"),
    "out_dtype int": (dict(out_dtype=torch.int32), TypeError, "output dtype"),
    "out shape": (dict(out="shape"), ValueError, "out must have q's shape"),
    "out dtype vs out_dtype": (dict(out="bf16", out_dtype=torch.float16), TypeError, "disagrees"),
    "out aliases q": (dict(out="alias"), ValueError, "must not alias q"),
    "out stride 0 over requests": (dict(out="expand"), ValueError, "out must not overlap itself"),
    "out heads interleaved": (dict(out="interleaved"), ValueError, "out must not overlap itself"),
    "seq_len_q without 4-D q": (dict(seq_len_q=2), ValueError, "needs q as"),
    "fixed max_seq_len_q mismatch": (dict(max_seq_len_q=3), ValueError, "must equal seq_len_q"),
    "causal query longer than kv": (dict(q="sq8", seq_len_q=8, mask_type="causal"), ValueError, "causal mask needs"),
    "qo_indptr int64": (dict(qo_indptr="int64"), TypeError, "qo_indptr must be int32"),
    "qo_indptr shape": (dict(qo_indptr="shape"), ValueError, r"qo_indptr must have shape"),
    "qo_indptr not from 0": (dict(qo_indptr="start1"), ValueError, r"qo_indptr\[0\] must be 0"),
    "qo_indptr not increasing": (dict(qo_indptr="flat"), ValueError, "strictly increase"),
    "qo_indptr capacity": (dict(qo_indptr="long2", max_seq_len_q=1), ValueError, "smaller than the longest"),
    "qo_indptr alias disagrees": (dict(qo_indptr="ok", seq_len_q=3, max_seq_len_q=4), ValueError, "disagrees"),
    "packed q 4-D": (dict(qo_indptr="ok", q="4d"), ValueError, "packed q"),
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
        ("bmm1_scale", "tensor"): lambda: torch.tensor(0.1),
        ("out", "shape"): lambda: torch.empty(q.shape[0], 8, 32, dtype=BF16, device=q.device),
        ("out", "bf16"): lambda: torch.empty_like(q),
        ("out", "alias"): lambda: q,
        ("out", "expand"): lambda: torch.empty_like(q[:1]).expand(q.shape),
        ("out", "interleaved"): lambda: torch.empty(q.numel(), dtype=q.dtype, device=q.device)
        .as_strided(q.shape, (q.shape[1] * 32, 32, 1)),
        ("qo_indptr", "int64"): lambda: torch.tensor([0, 1, 2], device=q.device),
        ("qo_indptr", "shape"): lambda: torch.tensor([0, 2], dtype=torch.int32, device=q.device),
        ("qo_indptr", "start1"): lambda: torch.tensor([1, 1, 2], dtype=torch.int32, device=q.device),
        ("qo_indptr", "flat"): lambda: torch.tensor([0, 0, 2], dtype=torch.int32, device=q.device),
        ("qo_indptr", "long2"): lambda: torch.tensor([0, 1, 3], dtype=torch.int32, device=q.device),
        ("qo_indptr", "ok"): lambda: torch.tensor([0, 1, 2], dtype=torch.int32, device=q.device),
    }
    for key, value in kw.items():
        if isinstance(value, str) and (key, value) in special:
            out[key] = special[(key, value)]()
    return out


@pytest.mark.parametrize("name", list(ONESHOT_ERRORS))
def test_oneshot_error(inp, name):
    kw, exc, pattern = ONESHOT_ERRORS[name]
    with pytest.raises(exc, match=pattern):
        oneshot(inp, **_materialize(inp, kw))


PLAN_ERRORS = {
    "num_qo_heads float": (dict(num_qo_heads=8.0), TypeError, "num_qo_heads must be an int"),
    "num_kv_heads zero": (dict(num_kv_heads=0), ValueError, "num_kv_heads must be >= 1"),
    "head_dim unsupported": (dict(head_dim=80), ValueError, "head_dim must be one of"),
    "page_size huge": (dict(page_size=4096), ValueError, "page_size must be in"),
    "group too large": (dict(num_qo_heads=512, num_kv_heads=2), ValueError, "group size"),
    "q_data_type not dtype": (dict(q_data_type="bf16"), TypeError, "must be a torch.dtype"),
    "fp8 q with bf16 cache": (dict(q_data_type=FP8, kv_data_type=BF16), TypeError, "needs q of the same dtype"),
    "kv_data_type int8": (dict(kv_data_type=torch.int8), TypeError, "kv dtype"),
    "max_kv_len over capacity": (dict(max_kv_len=10**6), ValueError, "exceeds the block-table capacity"),
    "max_kv_len below lengths": (dict(max_kv_len=10), ValueError, "more than max_kv_len"),
    "bind_seq_lens not bool": (dict(bind_seq_lens=1), TypeError, "bind_seq_lens must be a bool"),
    "config wrong type": (dict(config={"block_n": 64}), TypeError, "config must be a tsdecode.KernelConfig"),
    "config outside space": (dict(config=KernelConfig(block_n=48)), ValueError, "KernelConfig.block_n"),
    "seq_lens on another device": (dict(seq_lens_kv="meta"), ValueError, "seq_lens_kv must be on"),
}


@pytest.mark.parametrize("name", list(PLAN_ERRORS))
def test_plan_error(inp, name):
    kw, exc, pattern = PLAN_ERRORS[name]
    if kw.get("seq_lens_kv") == "meta":
        kw = dict(seq_lens_kv=torch.empty(2, dtype=torch.int32, device="meta"))
    with pytest.raises(exc, match=pattern):
        plan(inp, **kw)


def test_run_before_plan():
    w = tsdecode.BatchDecodePagedTSWrapper()
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(torch.zeros(1), torch.zeros(1))
    with pytest.raises(RuntimeError, match="after plan"):
        w.config


def test_wrapper_kv_layout():
    with pytest.raises(ValueError, match="kv_layout"):
        tsdecode.BatchDecodePagedTSWrapper(kv_layout="NHD")


@pytest.mark.parametrize("what", ["q dtype", "q shape", "cache dtype", "cache geometry", "page range", "out dtype"])
def test_run_checks_against_plan(inp, what):
    w = plan(inp)
    q, cache, out = inp.q, inp.cache, None
    exc, pattern = ValueError, ""
    if what == "q dtype":
        q, exc, pattern = q.half(), TypeError, "q dtype must be"
    elif what == "q shape":
        q, pattern = q[:1], "q must have the planned shape"
    elif what == "cache dtype":
        cache, exc, pattern = cache.half(), TypeError, "paged_kv_cache dtype"
    elif what == "cache geometry":
        cache = torch.zeros(cache.shape[0], 2, 2, 8, 64, dtype=cache.dtype, device=cache.device)
        pattern = r"paged_kv_cache pages must be"
    elif what == "page range":
        cache, pattern = cache[:1], "page ID"
    elif what == "out dtype":
        out, exc, pattern = torch.empty(q.shape, dtype=torch.float16, device=q.device), TypeError, "out dtype"
    with pytest.raises(exc, match=pattern):
        w.run(q, cache, out=out)


def test_cpu_tensors_need_interpreter(inp, monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("checks the CPU path")
    monkeypatch.setattr(tsdecode.api, "interpreter_active", lambda: False)  # as if compiled for a GPU
    with pytest.raises(ValueError, match="CUDA device"):
        plan(inp)


def test_measurement_switches_reject_unknown_values(monkeypatch):
    """TSDECODE_* switches: a value outside the documented ones is an error naming the variable,
    not a silent default (e.g. TSDECODE_DISABLE_PDL=true would otherwise leave PDL on)."""
    from tsdecode.kernels import decode

    monkeypatch.setenv("TSDECODE_DISABLE_PDL", "true")
    with pytest.raises(ValueError, match=r"TSDECODE_DISABLE_PDL='true': expected one of '', '0', '1'"):
        decode.env_choice("TSDECODE_DISABLE_PDL", ("", "0", "1"), "0")
    monkeypatch.setenv("TSDECODE_DISABLE_PDL", "1")
    assert decode.env_choice("TSDECODE_DISABLE_PDL", ("", "0", "1"), "0") == "1"
    monkeypatch.delenv("TSDECODE_DISABLE_PDL")
    assert decode.env_choice("TSDECODE_DISABLE_PDL", ("", "0", "1"), "0") == "0"
    # The switches read at import fail the import with the same message.
    for name, bad in (("TSDECODE_TRANSPOSED", "yes"), ("TSDECODE_FP8_COMPUTE", "fp16")):
        env = dict(os.environ, **{name: bad})
        r = subprocess.run([sys.executable, "-c", "import tsdecode"], capture_output=True, text=True, env=env)
        assert r.returncode != 0 and f"{name}={bad!r}" in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("capability, dtypes, pattern", [
    ((8, 0), (BF16, FP8, BF16), "kv dtype float8_e4m3fn needs a GPU of compute capability >= 8.9"),
    ((8, 6), (FP8, FP8, FP8), "q dtype float8_e4m3fn needs .* this GPU has compute capability 8.6"),
    ((7, 5), (BF16, BF16, BF16), "q dtype bfloat16 needs a GPU of compute capability >= 8.0"),
    ((7, 5), (torch.float16, torch.float16, BF16), "output dtype bfloat16 needs"),
    ((8, 9), (BF16, FP8, BF16), None),
    ((8, 0), (BF16, BF16, torch.float32), None),
    ((7, 5), (torch.float16, torch.float16, torch.float16), None),
])
def test_dtypes_the_gpu_cannot_run(capability, dtypes, pattern):
    """fp8 needs sm89+, bf16 sm80+: a TypeError naming the dtype and the GPU's capability at plan
    time, instead of a triton compile error."""
    from tsdecode.validation import validate_dtypes_on_gpu

    if pattern is None:
        validate_dtypes_on_gpu(capability, *dtypes)
    else:
        with pytest.raises(TypeError, match=pattern):
            validate_dtypes_on_gpu(capability, *dtypes)


def test_plan_checks_the_gpus_capability(monkeypatch):
    if DEVICE.type != "cuda":
        pytest.skip("the capability check runs for CUDA devices only")
    inp = build(Case(lens=(5, 40), kv_dtype=FP8))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(TypeError, match="compute capability >= 8.9"):
        plan(inp, kv_data_type=FP8)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(TypeError, match="bfloat16 needs a GPU of compute capability >= 8.0"):
        plan(build(Case(lens=(5, 40))))


@pytest.mark.parametrize("target", ["cache", "K", "V", "block_tables", "bound seq_lens"])
def test_out_must_not_overlap_any_input(target):
    """run refuses an out whose bytes overlap any tensor the kernels read (checked by byte span:
    combined or separate cache, and the plan's block table and bound lengths), and accepts the
    same buffer's bytes right past that tensor."""
    case = Case(lens=(40, 33), separate=target in ("K", "V"))  # every row: 3 live pages
    inp = build(case)
    q = inp.q
    out_bytes = q.numel() * q.element_size()
    block_tables, seq_lens, cache = inp.block_tables, inp.seq_lens, inp.cache
    # One byte buffer holds the target tensor followed by room for out.
    if target == "cache":
        victim = cache
    elif target in ("K", "V"):
        victim = cache[0 if target == "K" else 1]
    else:
        victim = block_tables if target == "block_tables" else seq_lens
    nbytes = victim.numel() * victim.element_size()
    buf = torch.zeros(nbytes + out_bytes + 64, dtype=torch.uint8, device=q.device)
    moved = buf[:nbytes].view(victim.dtype).view(victim.shape)
    moved.copy_(victim)
    if target == "cache":
        cache = moved
    elif target in ("K", "V"):
        cache = (moved, cache[1]) if target == "K" else (cache[0], moved)
    elif target == "block_tables":
        block_tables = moved
    else:
        seq_lens = moved
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(block_tables, seq_lens, 8, 2, 64, 16, q_data_type=BF16, bind_seq_lens=target == "bound seq_lens")
    overlapping = buf[nbytes - 2 : nbytes - 2 + out_bytes].view(BF16).view(q.shape)
    with pytest.raises(ValueError, match="out must not alias"):
        w.run(q, cache, out=overlapping)
    past = buf[nbytes : nbytes + out_bytes].view(BF16).view(q.shape)
    past.fill_(float("nan"))
    assert w.run(q, cache, out=past) is past
    ref = w.run(q, cache)
    assert torch.isfinite(past.float()).all() and torch.equal(past, ref)


@pytest.mark.parametrize("bind", ["unbound", "bound, max_kv_len", "bound, longest"])
@pytest.mark.parametrize("bad", [-1, 10**6])
@pytest.mark.parametrize("covered", [True, False])
def test_page_ids_are_checked_over_exactly_the_covered_columns(bind, bad, covered):
    """The plan's page-ID range covers each row's live pages (unbound lengths) or the first
    ceil(max_kv_len / P) columns of every row (bound): a bad ID in the last covered column of a
    row is refused, one in the first column past it is never read and accepted."""
    case = Case(lens=(20, 40, 33))  # P=16: 2, 3 and 3 live pages; C = 4
    inp = build(case)
    bt = inp.block_tables
    for row, n in enumerate(case.lens):
        bt[row, -(-n // 16):] = 0  # valid IDs past the live pages
    last = (2 if bind != "unbound" else 1)  # row 0: bound plans cover ceil(40 / 16) = 3 columns
    bt[0, last if covered else last + 1] = bad
    kw = {} if bind == "unbound" else dict(bind_seq_lens=True)
    if bind == "bound, max_kv_len":
        kw["max_kv_len"] = 40

    def plan_and_run():
        w = plan(inp, **kw)
        return w.run(inp.q, inp.cache)

    if covered:
        with pytest.raises(ValueError, match="page ID"):
            plan_and_run()
    else:
        out = plan_and_run()
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
    from tsdecode.validation import overlaps_itself
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


def test_strided_seq_lens_kv_copied_where_the_plan_copies():
    """seq_lens_kv as a strided view: the one-shot op and an unbound plan copy it (and match the
    reference); bind_seq_lens=True reads it in place and so refuses it."""
    case = Case(lens=(5, 40))
    inp = build(case)
    ref = reference(case, inp).float()
    holder = torch.zeros(2 * len(case.lens), dtype=torch.int32, device=inp.q.device)
    holder[::2] = inp.seq_lens
    holder[1::2] = 10**6  # what an accidental stride-1 read would see
    strided = holder[::2]
    torch.testing.assert_close(oneshot(inp, seq_lens_kv=strided).float(), ref, rtol=2e-2, atol=2e-2)
    w = plan(inp, seq_lens_kv=strided)
    torch.testing.assert_close(w.run(inp.q, inp.cache).float(), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="seq_lens_kv must be contiguous with bind_seq_lens=True"):
        plan(inp, seq_lens_kv=strided, bind_seq_lens=True)


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
    w = plan(inp, num_qo_heads=np.int64(8), num_kv_heads=np.int32(2), head_dim=np.int64(64),
             page_size=np.int64(16), max_kv_len=np.int64(40))
    assert type(w.config.kernel_config.num_kv_splits) is int
    torch.testing.assert_close(w.run(inp.q, inp.cache), oneshot(inp), rtol=0, atol=0)
    with pytest.raises(TypeError, match="window_left must be an int"):
        oneshot(inp, mask_type="causal", window_left=True)
