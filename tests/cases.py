"""Random decode problems with every layout feature, and the check against the reference.

A ``Case`` describes one problem; ``build`` makes its tensors (a paged cache with pages in random
order, a block table whose rows are padded and hold garbage or -1 past each request's live
pages, lengths, packed offsets); ``plan_wrapper`` / ``run_wrapper`` call the wrapper in
FlashInfer's call form, ``run_oneshot`` the one-shot op; ``check`` compares an output with the
float64 reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import tsdecode
from tsdecode.reference import reference_decode

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn


@dataclass
class Case:
    """One problem. lens: K/V lengths; q_lens: packed query lengths (mode 'packed').

    lengths: who owns the K/V lengths in the wrapper, "plan" (host values given to plan, run
    passes seq_lens=None) or "run" (a device tensor passed to every run). max_kv_len: the plan's
    K/V capacity (default: the longest length). seq_len_q: the fixed query length; in packed
    mode, when larger than every q_len, the plan's query capacity (max_seq_len_q).
    """

    lens: tuple[int, ...] = (1, 17, 40)
    num_qo_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16  # q dtype
    kv_dtype: torch.dtype | None = None
    out_dtype: torch.dtype | None = None
    mode: str = "sq1"  # sq1 | fixed | packed
    seq_len_q: int = 1
    q_lens: tuple[int, ...] | None = None
    mask_type: str = "dense"
    window_left: int = -1
    separate: bool = False
    page_stride_pad: int = 0  # extra elements between pages
    table_pad: int = 0  # extra columns between block-table rows
    extra_cols: int = 1  # unused columns at the end of each row (garbage, or pad_value)
    pad_value: int | None = None  # what fills each row past its live pages (None: random garbage)
    shared_pages: bool = False  # requests share their first page
    bmm1_scale: float | None = None
    bmm2_scale: float = 1.0
    seed: int = 0
    config: tsdecode.KernelConfig | None = None
    lengths: str = "plan"  # plan | run
    max_kv_len: int | None = None

    def __post_init__(self):
        self.kv_dtype = self.kv_dtype or self.dtype

    @property
    def batch_size(self) -> int:
        return len(self.lens)

    @property
    def max_seq_len_q(self) -> int:
        if self.mode == "packed":
            return max(self.seq_len_q, *self.q_lens)
        return self.seq_len_q

    @property
    def capacity(self) -> int:
        return self.max_kv_len or max(self.lens)


@dataclass
class Inputs:
    q: torch.Tensor
    cache: object
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    qo_indptr: torch.Tensor | None
    num_pages: int
    extras: dict = field(default_factory=dict)


def _rand(shape, dtype, gen, device):
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def build(case: Case, device=DEVICE) -> Inputs:
    gen = torch.Generator().manual_seed(case.seed)
    B, P, D, hkv, hq = len(case.lens), case.page_size, case.head_dim, case.num_kv_heads, case.num_qo_heads
    pages_per_req = [math.ceil(n / P) for n in case.lens]
    cols = max(pages_per_req) + case.extra_cols
    num_pages = sum(pages_per_req) + 3
    page_elems = 2 * hkv * P * D
    stride = page_elems + case.page_stride_pad
    flat = _rand((num_pages * stride,), case.kv_dtype, gen, device)
    combined = flat.as_strided((num_pages, 2, hkv, P, D), (stride, hkv * P * D, P * D, D, 1))
    if case.separate:
        k = _rand((num_pages, hkv, P, D), case.kv_dtype, gen, device)
        v = _rand((num_pages, hkv, P, D), case.kv_dtype, gen, device)
        cache = (k, v)
    else:
        cache = combined
    perm = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.randint(0, 2**30, (B, cols + case.table_pad), generator=gen, dtype=torch.int32)
    if case.pad_value is not None:
        table.fill_(case.pad_value)
    at = 0
    for b, n in enumerate(pages_per_req):
        ids = perm[at : at + n]
        at += n
        if case.shared_pages and b > 0:
            ids[0] = perm[0]
        table[b, :n] = torch.tensor(ids, dtype=torch.int32)
    block_tables = table.to(device)[:, :cols]  # padded row stride, garbage past live pages
    seq_lens = torch.tensor(case.lens, dtype=torch.int32, device=device)
    qo_indptr = None
    if case.mode == "packed":
        q_lens = case.q_lens
        qo_indptr = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        q = _rand((sum(q_lens), hq, D), case.dtype, gen, device)
    elif case.mode == "fixed":
        q = _rand((B, case.seq_len_q, hq, D), case.dtype, gen, device)
    else:
        q = _rand((B, hq, D), case.dtype, gen, device)
    return Inputs(q, cache, block_tables, seq_lens, qo_indptr, num_pages)


def tolerance(case: Case) -> tuple[float, float]:
    """(relative L2 error, max abs error) bounds vs the float64 reference."""
    out = case.out_dtype or case.dtype
    if FP8 in (case.dtype, out):
        return 8e-2, 0.25
    if case.kv_dtype == FP8:
        return 2e-2, 0.06
    return 1.2e-2, 0.05


def reference(case: Case, inp: Inputs) -> torch.Tensor:
    return reference_decode(
        inp.q, inp.cache, inp.block_tables, inp.seq_lens, seq_len_q=case.seq_len_q,
        qo_indptr=inp.qo_indptr, mask_type=case.mask_type, window_left=case.window_left,
        bmm1_scale=case.bmm1_scale, bmm2_scale=case.bmm2_scale,
    )


def run_oneshot(case: Case, inp: Inputs, out: torch.Tensor | None = None, **kw) -> torch.Tensor:
    return tsdecode.batch_decode_with_paged_kv_cache(
        inp.q, inp.cache, inp.block_tables, inp.seq_lens, seq_len_q=case.seq_len_q,
        qo_indptr=inp.qo_indptr, mask_type=case.mask_type, window_left=case.window_left,
        bmm1_scale=case.bmm1_scale, bmm2_scale=case.bmm2_scale, out=out,
        out_dtype=None if out is not None else case.out_dtype, **kw,
    )


def plan_wrapper(case: Case, inp: Inputs | None = None, wrapper: tsdecode.BatchDecodePagedTSWrapper | None = None,
                 device=None, **kw) -> tsdecode.BatchDecodePagedTSWrapper:
    """Plan ``wrapper`` (a new one by default) for ``case`` in FlashInfer's call form; with
    ``case.lengths == "plan"`` the plan owns ``case.lens``. ``kw`` overrides plan arguments
    (max_kv_len included)."""
    w = wrapper or tsdecode.BatchDecodePagedTSWrapper()
    if device is None:
        device = inp.q.device if inp is not None else DEVICE
    args = dict(
        max_seq_len_q=case.max_seq_len_q, packed_query=case.mode == "packed", q_data_type=case.dtype,
        kv_data_type=case.kv_dtype, o_data_type=case.out_dtype, mask_type=case.mask_type,
        window_left=case.window_left, seq_lens=list(case.lens) if case.lengths == "plan" else None,
        config=case.config,
    )
    args.update(kw)
    max_kv_len = args.pop("max_kv_len", case.capacity)
    w.plan(device, case.batch_size, case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size,
           max_kv_len, **args)
    return w


def run_wrapper(w: tsdecode.BatchDecodePagedTSWrapper, case: Case, inp: Inputs, **kw) -> torch.Tensor:
    """``w.run`` in FlashInfer's call form: lengths passed iff the plan does not own them, the block
    table (and packed offsets) every run. ``kw``: out, validate, scales, or overrides."""
    args = dict(qo_indptr=inp.qo_indptr, bmm1_scale=case.bmm1_scale, bmm2_scale=case.bmm2_scale)
    args.update(kw)
    seq_lens = None if case.lengths == "plan" else inp.seq_lens
    return w.run(inp.q, inp.cache, seq_lens, inp.block_tables, **args)


def poisoned_out(case: Case, inp: Inputs) -> torch.Tensor:
    dtype = case.out_dtype or case.dtype
    return torch.full(inp.q.shape, float("nan"), dtype=torch.float32, device=inp.q.device).to(dtype)


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error, max abs error) of out against ref, in float64."""
    o = out.to(torch.float64).cpu()
    r = ref.to(torch.float64).cpu()
    return float((o - r).norm() / r.norm()), float((o - r).abs().max())


def request_rows(case: Case) -> list[slice]:
    """Each request's rows of the output's first dimension (its query tokens, packed)."""
    if case.mode != "packed":
        return [slice(b, b + 1) for b in range(case.batch_size)]
    ends = [sum(case.q_lens[:b + 1]) for b in range(case.batch_size)]
    return [slice(end - q, end) for end, q in zip(ends, case.q_lens)]


def check(case: Case, out: torch.Tensor, ref: torch.Tensor) -> None:
    """The whole output, then each request's rows on their own (a wrong key of one request in
    many hides in the norm of the whole)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out.to(torch.float64)).all(), "output has NaN/inf (unwritten or overflowed elements)"
    rel, mx = errors(out, ref)
    rel_tol, abs_tol = tolerance(case)
    scale = max(1.0, abs(case.bmm2_scale))
    assert rel < rel_tol and mx < abs_tol * scale, f"rel err {rel:.3e} (tol {rel_tol}), max abs {mx:.3e}"
    rows = request_rows(case)
    if rows[-1].stop != out.shape[0]:  # a slice of the output: checked as a whole only
        return
    for b, span in enumerate(rows):
        if ref[span].to(torch.float64).norm() > 0:
            rel, _ = errors(out[span], ref[span])
            assert rel < rel_tol, f"request {b} (K/V length {case.lens[b]}): rel err {rel:.3e} (tol {rel_tol})"


def run_and_check(case: Case, via: str = "wrapper", validate: bool = True) -> tsdecode.BatchDecodePagedTSWrapper | None:
    """Run ``case`` into a NaN-poisoned out (wrapper or one-shot) and check it against the
    reference; return the wrapper."""
    inp = build(case)
    ref = reference(case, inp)
    out = poisoned_out(case, inp)
    w = None
    if via == "oneshot" and case.config is None:
        result = run_oneshot(case, inp, out=out)
    else:
        w = plan_wrapper(case, inp)
        result = run_wrapper(w, case, inp, out=out, validate=validate)
    assert result is out
    check(case, out, ref)
    return w
