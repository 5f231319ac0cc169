"""The plan's workspace (FlashInfer A's ``workspace_buffer``): its size helper, the caller's buffer
honoured (the split partials live in it) or rejected with the reason, and one allocated when
the caller gives none."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import tsdecode
from tsdecode import KernelConfig, get_prims_ts_batch_decode_workspace_size
from tsdecode import workspace as W
from tsdecode.config.select import select_config
from tsdecode.config.space import ProblemShape
from tsdecode.device import device_properties
from cases import DEVICE, Case, build, check, plan_wrapper, poisoned_out, reference, run_wrapper

pytestmark = pytest.mark.usefixtures("fresh_tables")  # the heuristic's config, whatever tables exist
BF16 = torch.bfloat16
# B=1, Hq=4, Hkv=1, D=64, P=16, max_kv_len 300: the heuristic splits the one request, so the plan
# needs a workspace.
SHAPE = (1, 4, 1, 64, 16, 300)
CASE = Case(lens=(300,), num_qo_heads=4, num_kv_heads=1, lengths="run")


def picked() -> KernelConfig:
    """The config a plan of CASE selects here (what ``size()`` is the workspace of)."""
    config = plan_wrapper(CASE, build(CASE)).config.kernel_config
    assert config.num_kv_splits > 1, config
    return config


def size(*args, **kw) -> int:
    kw.setdefault("q_dtype", BF16)
    kw.setdefault("device", DEVICE)
    return get_prims_ts_batch_decode_workspace_size(*(args or SHAPE), **kw)


def buffer(nbytes: int, dtype=torch.uint8, offset: int = 0) -> torch.Tensor:
    """nbytes of 0xFF (every fp32 partial a NaN until written), starting ``offset`` bytes past a
    256-byte boundary."""
    raw = torch.full((nbytes + offset + 256,), 255, dtype=torch.uint8, device=DEVICE)
    start = -raw.data_ptr() % 256 + offset
    return raw[start:start + nbytes].view(dtype)


def test_size_helper_has_flashinfers_signature():
    """A's signature: the same parameter names, order, kinds and defaults."""
    params = inspect.signature(get_prims_ts_batch_decode_workspace_size).parameters
    positional = ["batch_size", "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "max_seq_len"]
    keywords = {"seq_len_q": 1, "qo_indptr": None, "max_seq_len_q": None, "q_dtype": torch.float16,
                "kv_dtype": None, "out_dtype": None, "mask_type": "dense", "window_left": -1, "kv_layout": "HND",
                "device": None}
    assert list(params) == positional + list(keywords)
    for name in positional:
        assert params[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    for name, default in keywords.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default == default


def test_size_is_what_plan_allocates():
    """Every argument of A's helper given by keyword; the size equals the workspace a plan of the
    same arguments allocates (no buffer given), across query modes and dtypes."""
    for args, kw, plan_kw in [
        (SHAPE, {}, {}),
        (SHAPE, dict(kv_dtype=torch.float8_e4m3fn, out_dtype=torch.float32),
         dict(kv_data_type=torch.float8_e4m3fn, o_data_type=torch.float32)),
        ((2, 8, 2, 64, 16, 512), dict(seq_len_q=3, mask_type="causal", window_left=40),
         dict(max_seq_len_q=3, mask_type="causal", window_left=40)),
        ((2, 8, 2, 64, 16, 512), dict(qo_indptr=torch.tensor([0, 1, 4], dtype=torch.int32), max_seq_len_q=4),
         dict(max_seq_len_q=4, packed_query=True)),
        ((3, 8, 2, 64, 16, 64), {}, {}),  # one split: no partials, 0 bytes
    ]:
        nbytes = get_prims_ts_batch_decode_workspace_size(
            *args, q_dtype=BF16, kv_layout="HND", device=DEVICE, **kw)
        w = tsdecode.BatchDecodePagedTSWrapper()
        w.plan(DEVICE, *args, q_data_type=BF16, **plan_kw)
        assert w._plan.workspace.numel() == nbytes, (args, kw)
        assert w._plan.workspace.dtype in (torch.int8, torch.uint8)
        splits = w.config.kernel_config.num_kv_splits
        assert (nbytes > 0) == (splits > 1), (args, splits)


def test_size_helper_arguments():
    assert size() > 0
    assert size(device=None) == size()  # the current CUDA device, else the CPU
    # packed queries (qo_indptr given) need max_seq_len_q; the size is the partials of that query
    # capacity at the split count its plan selects, more than one query token's at that count
    indptr = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seq_len_q"):
        size(qo_indptr=indptr)
    packed = ProblemShape(batch_size=1, num_qo_heads=4, num_kv_heads=1, head_dim=64, page_size=16, max_kv_len=300,
                          max_seq_len_q=4, packed=True)
    splits = select_config(packed, device_properties(DEVICE)).kernel_config.num_kv_splits
    one_token = dataclasses.replace(packed, max_seq_len_q=1, packed=False)
    assert size(qo_indptr=indptr, max_seq_len_q=4) == W.workspace_bytes(packed, splits) > W.workspace_bytes(
        one_token, splits) > 0
    with pytest.raises(ValueError, match="must equal seq_len_q"):
        size(seq_len_q=2, max_seq_len_q=3)
    # packed: a non-default seq_len_q is max_seq_len_q's alias, as in the one-shot op
    assert size(qo_indptr=indptr, seq_len_q=4) == size(qo_indptr=indptr, max_seq_len_q=4)
    assert size(qo_indptr=indptr, seq_len_q=4, max_seq_len_q=4) == size(qo_indptr=indptr, max_seq_len_q=4)
    with pytest.raises(ValueError, match="seq_len_q=4 .* disagrees with max_seq_len_q=8"):
        size(qo_indptr=indptr, seq_len_q=4, max_seq_len_q=8)
    with pytest.raises(TypeError, match="qo_indptr must be a torch.Tensor"):
        size(qo_indptr=[0, 1], max_seq_len_q=4)
    with pytest.raises(NotImplementedError, match="kv_layout"):
        size(kv_layout="NHD")
    with pytest.raises(NotImplementedError, match="head_dim"):
        size(1, 4, 1, 80, 16, 300)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        size(1.0, 4, 1, 64, 16, 300)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_plan_with_a_buffer_of_exactly_the_size(dtype):
    """A buffer of exactly the helper's size (int8 or uint8) keeps the selected config and the
    plan's workspace is that buffer; the answer is the reference's."""
    nbytes = size()
    ws = buffer(nbytes, dtype)
    inp = build(CASE)
    w = plan_wrapper(CASE, inp, workspace_buffer=ws)
    plain = plan_wrapper(CASE, inp)
    assert w.config.kernel_config == plain.config.kernel_config and w.config.kernel_config.num_kv_splits > 1
    assert not any("workspace_buffer" in a for a in w.config.adjustments)
    assert w._plan.workspace is ws
    out = poisoned_out(CASE, inp)
    run_wrapper(w, CASE, inp, out=out)
    check(CASE, out, reference(CASE, inp))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_a_contiguous_buffer_of_any_shape_is_used_as_flat_bytes(dtype):
    """The docs ask for a contiguous int8/uint8 buffer, not a 1-D one: a 2-D buffer of the
    helper's size holds the selected config's partials and the answer is the reference's."""
    nbytes = size()
    ws = buffer(nbytes, dtype).view(2, nbytes // 2)
    inp = build(CASE)
    w = plan_wrapper(CASE, inp, workspace_buffer=ws)
    assert w.config.kernel_config == picked() and w._plan.workspace is ws
    for validate in (True, False):
        out = poisoned_out(CASE, inp)
        run_wrapper(w, CASE, inp, out=out, validate=validate)
        check(CASE, out, reference(CASE, inp))


def test_partials_live_in_the_callers_buffer():
    """With several splits the kernels write their fp32 partials into the caller's buffer (the
    launcher's partial tensors lie inside it, and the 0xFF poison there is overwritten), and a
    poisoned buffer does not change the answer (every partial is written before it is merged)."""
    inp = build(CASE)
    nbytes = size()
    ws = buffer(nbytes)
    config = picked()
    w = plan_wrapper(CASE, inp, workspace_buffer=ws, config=config)
    lo, hi = ws.data_ptr(), ws.data_ptr() + ws.numel()
    partial_o, partial_lse = w._plan.launch._partials
    for t in (partial_o, partial_lse):
        assert t.dtype == torch.float32 and lo <= t.data_ptr() and t.data_ptr() + t.numel() * 4 <= hi
    assert partial_o.shape[2] == partial_lse.shape[2] == config.num_kv_splits  # [total_q, Hq, splits, (D)]
    assert torch.isnan(partial_o).all() and torch.isnan(partial_lse).all()
    out = poisoned_out(CASE, inp)
    run_wrapper(w, CASE, inp, out=out, validate=False)
    check(CASE, out, reference(CASE, inp))
    assert torch.isfinite(partial_o).all() and torch.isfinite(partial_lse).all()  # every split wrote
    assert int((ws == 255).sum()) < nbytes // 2  # only section padding keeps its poison


def test_plan_allocates_a_workspace_when_none_is_given():
    inp = build(CASE)
    w = plan_wrapper(CASE, inp, config=picked())
    assert w._plan.workspace.numel() == size() and w._plan.workspace.device == inp.q.device
    partial_o, _ = w._plan.launch._partials
    lo = w._plan.workspace.data_ptr()
    assert lo <= partial_o.data_ptr() < lo + w._plan.workspace.numel()


def test_a_small_buffer_makes_the_plan_take_fewer_splits():
    """Without an explicit config, a buffer smaller than the selected config needs makes the plan
    take as many splits as it holds (down to one, which needs none), noted in w.config."""
    inp = build(CASE)
    full, selected = size(), picked().num_kv_splits
    for nbytes, most in ((full // 2, selected - 1), (0, 1)):
        w = plan_wrapper(CASE, inp, workspace_buffer=buffer(nbytes))
        splits = w.config.kernel_config.num_kv_splits
        assert 1 <= splits <= most
        assert any("what workspace_buffer" in a for a in w.config.adjustments), w.config.adjustments
        out = poisoned_out(CASE, inp)
        run_wrapper(w, CASE, inp, out=out)
        check(CASE, out, reference(CASE, inp))


def test_a_buffer_of_exactly_k_splits_gets_k_splits():
    """The most splits a buffer holds, not one fewer: a buffer of exactly what k splits need."""
    inp = build(CASE)
    w = plan_wrapper(CASE, inp)
    shape, selected = w._plan.shape, w.config.kernel_config
    tiles = shape.max_visible_tiles(selected.block_n)
    # k splits that each walk a chain of their own: fit_config keeps them all.
    for k in sorted({2, selected.num_kv_splits - 1} & {-(-tiles // c) for c in range(1, tiles + 1)}):
        w = plan_wrapper(CASE, inp, workspace_buffer=buffer(W.workspace_bytes(shape, k)))
        assert w.config.kernel_config.num_kv_splits == k, w.config.adjustments


def test_the_count_a_buffer_holds_is_fitted_to_the_chains_it_walks():
    """A buffer that holds k splits where k leave some with no tile of the longest request gets
    the fitted count (the same chains in fewer programs), as every config a plan runs does."""
    inp = build(CASE)
    w = plan_wrapper(CASE, inp)
    shape, block_n = w._plan.shape, w.config.kernel_config.block_n
    tiles = shape.max_visible_tiles(block_n)
    k = next(k for k in range(w.config.kernel_config.num_kv_splits - 1, 1, -1)
             if -(-tiles // -(-tiles // k)) < k)  # e.g. 19 tiles: 9 splits walk chains of 3, as 7 do
    w = plan_wrapper(CASE, inp, workspace_buffer=buffer(W.workspace_bytes(shape, k)))
    fitted = -(-tiles // -(-tiles // k))
    assert w.config.kernel_config.num_kv_splits == fitted, w.config.adjustments
    assert any("fill only" in a for a in w.config.adjustments), w.config.adjustments
    out = poisoned_out(CASE, inp)
    run_wrapper(w, CASE, inp, out=out)
    check(CASE, out, reference(CASE, inp))


def test_ragged_plan_owned_lengths_fit_a_buffer_sized_without_them():
    """The helper has no lengths; a plan owning ragged lengths may select more splits than the
    helper assumed, and then fits them to the buffer."""
    case = Case(lens=(300, 3, 17, 40), num_qo_heads=4, num_kv_heads=1)
    inp = build(case)
    nbytes = size(4, 4, 1, 64, 16, 300)
    w = plan_wrapper(case, inp, workspace_buffer=buffer(nbytes))
    assert w._plan.workspace.numel() == nbytes
    out = poisoned_out(case, inp)
    run_wrapper(w, case, inp, out=out)
    check(case, out, reference(case, inp))


def test_wrappers_of_other_shapes_share_one_buffer_run_by_turns():
    """Two wrappers planned for other shapes, dtypes and masks on one buffer, run by turns
    (validated or not), each give the reference's answer: every partial a run merges it wrote."""
    other = Case(lens=(200, 150, 9), num_qo_heads=8, num_kv_heads=2, page_size=8, dtype=torch.float16,
                 mode="fixed", seq_len_q=2, mask_type="causal", lengths="run", seed=2)
    nbytes = max(size(), size(3, 8, 2, 64, 8, 200, seq_len_q=2, q_dtype=torch.float16, mask_type="causal"))
    ws = buffer(nbytes)
    runs = []
    for case in (CASE, other):
        inp = build(case)
        runs.append((plan_wrapper(case, inp, workspace_buffer=ws), case, inp, reference(case, inp)))
    assert runs[0][0].config.kernel_config.num_kv_splits > 1
    for validate in (True, False, True):
        for w, case, inp, ref in runs:
            out = poisoned_out(case, inp)
            run_wrapper(w, case, inp, out=out, validate=validate)
            check(case, out, ref)


def test_an_explicit_config_that_does_not_fit_is_refused():
    inp = build(CASE)
    need = size()  # the bytes the heuristic's pick needs here
    small = buffer(need - 32)
    with pytest.raises(ValueError, match=f"workspace_buffer is too small: requires at least {need} bytes, "
                                         f"got {need - 32}"):
        plan_wrapper(CASE, inp, workspace_buffer=small, config=picked())


def test_a_refused_workspace_keeps_the_previous_plan():
    inp = build(CASE)
    config = picked()
    w = plan_wrapper(CASE, inp, config=config)
    previous = w._plan
    with pytest.raises(ValueError, match="too small"):
        plan_wrapper(CASE, inp, wrapper=w, workspace_buffer=buffer(64), config=config)
    assert w._plan is previous
    out = poisoned_out(CASE, inp)
    run_wrapper(w, CASE, inp, out=out)
    check(CASE, out, reference(CASE, inp))


@pytest.mark.parametrize("what, exc, pattern", [
    ("not a tensor", TypeError, "workspace_buffer must be a torch.Tensor"),
    ("float32", TypeError, "workspace_buffer must be int8 or uint8, got torch.float32"),
    ("int32", TypeError, "workspace_buffer must be int8 or uint8, got torch.int32"),
    ("other device", ValueError, "workspace_buffer must be on"),
    ("non-contiguous", ValueError, "workspace_buffer must be contiguous"),
    ("misaligned", ValueError, "workspace_buffer must be 32-byte aligned"),
    ("too small", ValueError, "workspace_buffer is too small: requires at least"),
])
def test_unusable_buffers_are_rejected_with_the_reason(what, exc, pattern):
    nbytes = size()
    ws = {
        "not a tensor": lambda: bytearray(nbytes),
        "float32": lambda: buffer(nbytes).view(torch.float32),
        "int32": lambda: buffer(nbytes).view(torch.int32),
        "other device": lambda: torch.empty(nbytes, dtype=torch.uint8, device="meta"),
        "non-contiguous": lambda: buffer(2 * nbytes)[::2],
        "misaligned": lambda: buffer(nbytes, offset=16),
        "too small": lambda: buffer(nbytes - 1),
    }[what]()
    inp = build(CASE)
    with pytest.raises(exc, match=pattern):
        plan_wrapper(CASE, inp, workspace_buffer=ws, config=picked())


def test_one_shot_capture_mode_uses_the_callers_buffer():
    """The capturable one-shot keeps its split partials in the given workspace_buffer too, and
    rejects an unusable one with the same reasons."""
    inp = build(CASE)
    nbytes = size()
    ws = buffer(nbytes)
    out = poisoned_out(CASE, inp)
    tsdecode.batch_decode_with_paged_kv_cache(inp.q, inp.cache, inp.block_tables, inp.seq_lens, out=out,
                                              workspace_buffer=ws, max_kv_len=300, validate=False)
    check(CASE, out, reference(CASE, inp))
    assert int((ws == 255).sum()) < nbytes // 2  # partials written there
    with pytest.raises(TypeError, match="int8 or uint8"):
        tsdecode.batch_decode_with_paged_kv_cache(inp.q, inp.cache, inp.block_tables, inp.seq_lens, out=out,
                                                  workspace_buffer=ws.view(torch.float32), max_kv_len=300,
                                                  validate=False)
