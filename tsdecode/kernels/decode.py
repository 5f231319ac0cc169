"""Split-KV paged decode attention: the Triton kernels and their launcher.

Math (per request b, query row i, visible keys j; fp32 accumulation):
    out[i] = bmm2_scale * sum_j softmax_j(bmm1_scale * q_i . k_j) v_j

Pass 1 (``_split_kv_kernel``): one program per (request, KV head, block of query rows, KV
split). The program's rows are the G query heads of its KV head times the request's query
tokens ("packed rows", row r = token * G + head), so each K/V byte is read once per KV head, not
once per query head. It walks its split's K/V tiles through the block table with an online
softmax (base 2, scale folded in) and writes either the final output (one split) or a
normalised partial output and its log2-sum-exp to fp32 scratch. With tl.dot and at most 8 rows,
the products take one of two forms (``transposed_products``): S = Q K^T and O = P V (rows on
the MMA's M side), or S^T = K Q^T and O^T = V^T P^T (tokens on M, rows on N).

Pass 2 (``_merge_kernel``, only when num_kv_splits > 1): one program per (query token, query
head, head-dim slice) combines the splits' partials weighted by exp2(lse - max).

The grid depends only on plan-time values (batch size, heads, packed-row capacity, split count),
so a captured graph replays with live lengths: each request's visible tile range is divided
evenly among the splits at run time, and splits with no tiles write lse = -inf.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ..configs import KernelConfig

LOG2E = 1.4426950408889634
# Whether @triton.jit below made interpreted kernels: triton reads TRITON_INTERPRET when a
# kernel is decorated, so the value at import is the truth; a later change of the variable in
# this process does not switch modes. (The interpreter computes tl.dot on bf16/fp16 inputs
# wrongly, so kernels upcast dot operands to fp32 there only.)
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_active() -> bool:
    return _INTERPRETING


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """A measurement switch's value from the environment; ValueError naming it if not in choices."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"environment variable {name}={value!r}: expected one of "
                         f"{', '.join(repr(c) for c in choices)}")
    return value


_PDL_CACHE: dict[int, bool] = {}


_SM_CACHE: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    """SM count (cached; the launcher must not query the driver per call); 132 off CUDA."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_CACHE:
        _SM_CACHE[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_CACHE[index]


def pdl_enabled(device: torch.device) -> bool:
    """Programmatic dependent launch: on for sm90+ CUDA devices unless TSDECODE_DISABLE_PDL=1.

    It lets the merge kernel (and this op after the previous kernel) launch while the prior
    grid drains; each kernel waits (gdc_wait) before its first load, so results are unchanged.
    """
    if device.type != "cuda" or interpreter_active():
        return False
    if env_choice("TSDECODE_DISABLE_PDL", ("", "0", "1"), "0") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PDL_CACHE:
        _PDL_CACHE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _PDL_CACHE[index]


# max_kv_len changes with every decode step's longest request: unspecialised (its divisibility
# never changed the binary: same SASS with and without, triton 3.6 for sm90), so plans of other
# lengths share one compiled variant (``DecodeLaunch.compile``).
@triton.jit(do_not_specialize=["max_kv_len"])
def _split_kv_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, qo_indptr_ptr,
    out_ptr, partial_o_ptr, partial_lse_ptr,
    # scalars
    qk_scale_log2,  # bmm1_scale * log2(e)
    bmm2_scale,
    window_left,
    max_kv_len,  # live lengths are clamped to this (plan-validated block-table columns)
    num_kv_heads,
    num_kv_splits,  # runtime value: changing it does not recompile this kernel
    # strides (elements); q/out token strides apply within a request, batch strides across
    stride_q_batch, stride_q_tok, stride_q_head,
    stride_o_batch, stride_o_tok, stride_o_head,
    stride_k_page, stride_k_head,
    stride_v_page, stride_v_head,
    stride_bt_row,
    stride_po_tok, stride_po_head, stride_po_split,
    stride_lse_tok, stride_lse_head,
    # meta-parameters
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SEQ_LEN_Q: tl.constexpr,  # fixed SQ, or packed capacity (max_seq_len_q)
    PACKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    NUM_M_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr,  # num_kv_splits == 1: write the final output, no merge
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (sm90+)
    TRANSPOSED: tl.constexpr = False,  # S^T = K Q^T, O^T = V^T P^T: rows on the MMA's N side
):
    if USE_PDL:
        # Inputs may come from the previous kernel in the stream: wait for it before any load,
        # then let the merge kernel launch early (it waits for this grid before reading).
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    split = tl.program_id(1)
    m_block = pid % NUM_M_BLOCKS
    bh = pid // NUM_M_BLOCKS
    kv_head = bh % num_kv_heads
    b = bh // num_kv_heads

    kv_len = tl.minimum(tl.load(seq_lens_ptr + b), max_kv_len)
    if PACKED:
        qo_start = tl.load(qo_indptr_ptr + b)
        qo_len = tl.load(qo_indptr_ptr + b + 1) - qo_start
        tok_base = qo_start  # global token index of this request's first query token
    else:
        qo_start = 0
        qo_len = SEQ_LEN_Q
        tok_base = b * SEQ_LEN_Q

    # Packed rows of this program: row = token * G + head-in-group.
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP_SIZE
    head = kv_head * GROUP_SIZE + rows % GROUP_SIZE
    row_valid = (rows < GROUP_SIZE * SEQ_LEN_Q) & (tok < qo_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM

    # Visible keys of each row: [row_lo, row_end).
    if CAUSAL:
        row_end = kv_len - qo_len + tok + 1
    else:
        row_end = tl.zeros([BLOCK_M], dtype=tl.int32) + kv_len
    if WINDOW:
        row_lo = tl.maximum(row_end - window_left - 1, 0)
    else:
        row_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
    # Key range of the whole program: the first row's window starts earliest, keys end at kv_len.
    first_tok = tl.minimum((m_block * BLOCK_M) // GROUP_SIZE, qo_len - 1)
    if WINDOW:  # validation allows a window only with the causal mask
        prog_lo = tl.maximum(kv_len - qo_len + first_tok - window_left, 0)
    else:
        prog_lo = 0
    tile_lo = prog_lo // BLOCK_N
    tile_hi = tl.cdiv(kv_len, BLOCK_N)
    tiles_per_split = tl.cdiv(tile_hi - tile_lo, num_kv_splits)
    tile_begin = tile_lo + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tile_hi)

    q_ptrs = (
        q_ptr + b * stride_q_batch + (qo_start + tok)[:, None] * stride_q_tok
        + head[:, None] * stride_q_head + offs_d[None, :]
    )
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    else:
        q = q.to(COMPUTE_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if TRANSPOSED:
        q_t = tl.trans(q)
        acc_t = tl.zeros([BLOCK_D, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt_row
    k_head = k_ptr + kv_head.to(tl.int64) * stride_k_head
    v_head = v_ptr + kv_head.to(tl.int64) * stride_v_head
    offs_n = tl.arange(0, BLOCK_N)
    for tile in tl.range(tile_begin, tile_end, num_stages=NUM_STAGES):
        n = tile * BLOCK_N + offs_n
        n_valid = n < kv_len
        if PAGE_SIZE % BLOCK_N == 0:
            # The whole tile lies in one page: one page-ID load, one contiguous K/V tile.
            page = tl.load(bt_row + (tile * BLOCK_N) // PAGE_SIZE).to(tl.int64)
            tok_off = ((tile * BLOCK_N) % PAGE_SIZE + offs_n) * HEAD_DIM
        else:
            page = tl.load(bt_row + n // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
            tok_off = (n % PAGE_SIZE) * HEAD_DIM
        k_off = page * stride_k_page + tok_off
        v_off = page * stride_v_page + tok_off
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if TRANSPOSED:
            # V^T [BLOCK_D, BLOCK_N], the A operand of O^T = V^T P^T, read in place.
            v = tl.load(v_head + v_off[None, :] + offs_d[:, None], mask=tl.trans(kv_mask), other=0.0)
        else:
            v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(COMPUTE_DTYPE)
            v = v.to(COMPUTE_DTYPE)

        if TRANSPOSED:
            # Tokens on the MMA's M side (16 rows, no padding), query rows on N (padded to 8, not
            # 16): half the MMAs, half the accumulator registers of the M = 16 form at G <= 8.
            s_t = tl.dot(k, q_t, out_dtype=tl.float32) * qk_scale_log2  # [BLOCK_N, BLOCK_M]
            visible_t = (n[:, None] < row_end[None, :]) & (n[:, None] >= row_lo[None, :])
            s_t = tl.where(visible_t, s_t, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # as below: no inf - inf
            alpha = tl.exp2(m_i - m_safe)
            p_t = tl.exp2(s_t - m_safe[None, :])
            l_i = l_i * alpha + tl.sum(p_t, axis=0)
            if DOT_FP32:
                pv_t = tl.dot(v, p_t, out_dtype=tl.float32)
            else:
                pv_t = tl.dot(v, p_t.to(COMPUTE_DTYPE), out_dtype=tl.float32)
            acc_t = acc_t * alpha[None, :] + pv_t
            m_i = m_new
        else:
            if USE_DOT:
                s = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
            else:
                s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            s = s * qk_scale_log2
            visible = (n[None, :] < row_end[:, None]) & (n[None, :] >= row_lo[:, None])
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # Rows with nothing visible yet keep m = -inf; subtract 0 instead to avoid inf - inf.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if USE_DOT:
                if DOT_FP32:
                    pv = tl.dot(p, v, out_dtype=tl.float32)
                else:
                    pv = tl.dot(p.to(COMPUTE_DTYPE), v, out_dtype=tl.float32)
            else:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if TRANSPOSED:
        o = tl.trans(acc_t / l_safe[None, :])
    else:
        o = acc / l_safe[:, None]
    out_mask = row_valid[:, None] & d_valid[None, :]
    if DIRECT_OUT:
        o_ptrs = (
            out_ptr + b * stride_o_batch + (qo_start + tok)[:, None] * stride_o_tok
            + head[:, None] * stride_o_head + offs_d[None, :]
        )
        tl.store(o_ptrs, (o * bmm2_scale).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        gtok = (tok_base + tok).to(tl.int64)
        po_ptrs = (
            partial_o_ptr + gtok[:, None] * stride_po_tok + head[:, None] * stride_po_head
            + split * stride_po_split + offs_d[None, :]
        )
        tl.store(po_ptrs, o, mask=out_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        lse_ptrs = partial_lse_ptr + gtok * stride_lse_tok + head * stride_lse_head + split
        tl.store(lse_ptrs, lse, mask=row_valid)


@triton.jit
def _merge_kernel(
    partial_o_ptr, partial_lse_ptr, out_ptr,
    bmm2_scale,
    num_kv_splits,
    stride_po_tok, stride_po_head, stride_po_split,
    stride_lse_tok, stride_lse_head,
    stride_o_batch, stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head-dim columns per program (a slice of the padded head dim)
    SEQ_LEN_Q: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[tok, head] = bmm2_scale * sum_s w_s o_s / sum_s w_s, w_s = exp2(lse_s - max lse).

    Grid: (query tokens, query heads, head-dim slices). BLOCK_S covers all splits in one pass
    up to 8192 / BLOCK_D of them (the launcher's choice), so at most one dependent round trip to
    the partials: the o loads do not wait for the lse loads (every split < num_kv_splits wrote
    its partial; empty splits wrote o = 0, lse = -inf). At small batch the head dim is sliced
    so that more programs (SMs) share the partials' bytes.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the split pass's partials are complete and visible
        # The next kernel in the stream may launch now; it waits for this grid before loading.
        tl.extra.cuda.gdc_launch_dependents()
    gtok = tl.program_id(0)
    head = tl.program_id(1)
    d_block = tl.program_id(2)
    if PACKED:
        # Output of a packed query is [total_q, Hq, D]; its batch stride is unused.
        b = 0
        tok = gtok
    else:
        b = gtok // SEQ_LEN_Q
        tok = gtok % SEQ_LEN_Q
    offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    lse_row = partial_lse_ptr + gtok.to(tl.int64) * stride_lse_tok + head * stride_lse_head
    po_row = partial_o_ptr + gtok.to(tl.int64) * stride_po_tok + head * stride_po_head

    m_run = tl.max(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), axis=0)
    w_sum = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in tl.range(0, num_kv_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_valid = offs_s < num_kv_splits
        lse = tl.load(lse_row + offs_s, mask=s_valid, other=float("-inf"))
        o = tl.load(
            po_row + offs_s[:, None] * stride_po_split + offs_d[None, :],
            mask=s_valid[:, None] & d_valid[None, :], other=0.0,
        )
        live = lse > float("-inf")
        m_new = tl.maximum(m_run, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.where(live, tl.exp2(lse - m_safe), 0.0)
        alpha = tl.exp2(m_run - m_safe)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        w_sum = w_sum * alpha + tl.sum(w, axis=0)
        m_run = m_new
    # A row with no visible key (only possible if a bound length breaks the causal contract)
    # gets zeros rather than NaN.
    res = tl.where(w_sum > 0.0, acc / tl.where(w_sum > 0.0, w_sum, 1.0), 0.0) * bmm2_scale
    o_ptrs = out_ptr + b * stride_o_batch + tok * stride_o_tok + head * stride_o_head + offs_d
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=d_valid)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def compute_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> tl.dtype:
    """dtype the tl.dot operands are converted to (fp32 accumulation either way).

    fp16/bf16 caches: q's dtype. fp8 caches: fp16, because e4m3 -> fp16 is one native
    conversion per two values on sm89+ while e4m3 -> bf16 is not, and every e4m3 value is exact
    in fp16; a bf16 query is converted to fp16 too (exact for |q| in [6.1e-5, 65504]), and fp16
    keeps more mantissa than bf16 for the probabilities in P @ V.
    """
    if kv_dtype == torch.float8_e4m3fn and _FP8_COMPUTE == "float16":
        return tl.float16
    return _TL_DTYPES.get(q_dtype, tl.float16)


# Measurement switch (TSDECODE_TRANSPOSED=1 / 0 forces the transposed / standard product form on
# every tl.dot launch with <= 8 rows; default "auto": ``transposed_products``'s rule).
_TRANSPOSED_MODE = env_choice("TSDECODE_TRANSPOSED", ("auto", "0", "1"), "auto")


def transposed_products(kv_dtype: torch.dtype, rows: int, config: KernelConfig) -> bool:
    """Whether the split kernel computes S^T = K Q^T and O^T = V^T P^T (the TRANSPOSED form).

    rows: packed query rows per KV head (G * SQ). The MMA's M side is at least 16: the standard
    form puts the rows there (G = 4 pads 4 rows to 16), the transposed form puts the 16 tokens
    of a tile there and the rows on N (padded to 8), so at rows <= 8 it issues half the MMAs
    and holds half the accumulator. Taken for 8-bit caches, whose per-tile instruction chain
    limits them: fp8 rows 8-10% faster on the H200; 16-bit caches, bandwidth-bound, moved
    -2.5% to +2.5% (docs/perf-notes.md, "Ninth lease").
    """
    if not config.uses_dot or rows > 8:
        return False
    if _TRANSPOSED_MODE in ("0", "1"):
        return _TRANSPOSED_MODE == "1"
    return kv_dtype.itemsize == 1


# Measurement switch (TSDECODE_FP8_COMPUTE=bfloat16 keeps a bf16 query's dtype for fp8 caches).
_FP8_COMPUTE = env_choice("TSDECODE_FP8_COMPUTE", ("float16", "bfloat16"), "float16")


@dataclass(frozen=True)
class LaunchGeometry:
    """Plan-time constants of one launch (everything that fixes the grid and the constexprs)."""

    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    seq_len_q: int  # fixed SQ, or packed capacity
    packed: bool
    causal: bool
    window_left: int
    max_kv_len: int
    total_q: int  # query tokens in all requests (B * SQ fixed; qo_indptr[-1] packed)

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads


def allocate_scratch(
    geometry: LaunchGeometry, config: KernelConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """fp32 partial outputs [total_q, Hq, S, D] and log2-sum-exps [total_q, Hq, S]; None if S=1."""
    splits = config.num_kv_splits
    if splits == 1:
        return None
    g = geometry
    partial_o = torch.empty(
        (g.total_q, g.num_qo_heads, splits, g.head_dim), dtype=torch.float32, device=device
    )
    partial_lse = torch.empty((g.total_q, g.num_qo_heads, splits), dtype=torch.float32, device=device)
    return partial_o, partial_lse


def _q_strides(t: torch.Tensor, packed: bool) -> tuple[int, int, int]:
    """(batch, token, head) strides of a q/out tensor in any of the three query layouts."""
    return _io_strides(t.stride(), packed)


def _io_strides(stride: tuple[int, ...], packed: bool) -> tuple[int, int, int]:
    if len(stride) == 4:  # [B, SQ, H, D]
        return stride[0], stride[1], stride[2]
    if packed:  # [total_q, H, D]
        return 0, stride[0], stride[1]
    return stride[0], 0, stride[1]  # [B, H, D], SQ = 1


class DecodeLaunch:
    """One plan's launches of pass 1 (and the merge when config.num_kv_splits > 1).

    The grid, the plan's tensors (block table, lengths, qo_indptr, scratch) and every constexpr
    are fixed here; a call passes q, K, V, out and the scales. No host sync, no allocation.

    A call goes through triton's jit dispatch (``kernel[grid](...)``) the first time it sees a
    specialization key (PDL on/off, each varying pointer's address mod 16, every varying stride:
    a superset of what triton compiles separate variants for) and from then on straight to the
    compiled kernels (``CompiledKernel[grid](..., stream=)``), which skips triton's per-call
    argument binding and cache lookup (35-43 us a kernel on the H200 machine's host;
    scripts/host_overhead.py). The direct path is taken only while the module's kernels are the
    ``JITFunction`` objects the entry was built from (scripts substitute them to measure variants)
    and never under the interpreter. ``compile`` builds the kernels a plan's runs need without
    launching anything and keeps them under the key of contiguous q/out and a compact combined
    cache, so such runs launch directly from the first.
    """

    _MAX_ENTRIES = 16  # keys remembered per plan; past it they are dropped (triton's cache keeps the kernels)

    def __init__(
        self,
        geometry: LaunchGeometry,
        config: KernelConfig,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        qo_indptr: torch.Tensor | None,
        scratch: tuple[torch.Tensor, torch.Tensor] | None,
        device: torch.device,
    ) -> None:
        g = geometry
        self.geometry, self.config, self.device = g, config, device
        rows = g.group_size * g.seq_len_q
        num_m_blocks = -(-rows // config.block_m)
        transposed = transposed_products(kv_dtype, rows, config)
        kernel_block_m = triton.next_power_of_2(rows) if transposed else config.block_m
        block_d = triton.next_power_of_2(g.head_dim)
        splits = config.num_kv_splits
        if splits > 1:
            partial_o, partial_lse = scratch
            po_strides = (partial_o.stride(0), partial_o.stride(1), partial_o.stride(2))
            lse_strides = (partial_lse.stride(0), partial_lse.stride(1))
        else:
            partial_o = partial_lse = None  # the kernel takes ``out`` there, unused when DIRECT_OUT
            po_strides, lse_strides = (0, 0, 0), (0, 0)
        self._partials = (partial_o, partial_lse)
        self._partial_ptrs = (partial_o.data_ptr(), partial_lse.data_ptr()) if splits > 1 else None
        indptr = qo_indptr if qo_indptr is not None else seq_lens  # unused unless PACKED
        self._plan_tensors = (block_tables, seq_lens, indptr)
        self._plan_ptrs = tuple(t.data_ptr() for t in self._plan_tensors)
        self._scalars = (int(g.window_left), int(g.max_kv_len), g.num_kv_heads, splits)
        self._tail_strides = (block_tables.stride(0), *po_strides, *lse_strides)
        self._po_lse_strides = (*po_strides, *lse_strides)
        self._grid = (g.batch_size * g.num_kv_heads * num_m_blocks, splits, 1)
        self._split_constexprs = dict(
            GROUP_SIZE=g.group_size, HEAD_DIM=g.head_dim, BLOCK_D=block_d, PAGE_SIZE=g.page_size,
            SEQ_LEN_Q=g.seq_len_q, PACKED=g.packed, CAUSAL=g.causal, WINDOW=g.window_left >= 0,
            NUM_M_BLOCKS=num_m_blocks, BLOCK_M=kernel_block_m, BLOCK_N=config.block_n,
            TRANSPOSED=transposed, DIRECT_OUT=splits == 1, USE_DOT=config.uses_dot,
            DOT_FP32=interpreter_active(), COMPUTE_DTYPE=compute_dtype(q_dtype, kv_dtype),
            NUM_STAGES=config.num_stages,
        )
        self._split_options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        self._merge_grid, self._merge_constexprs = None, {}
        if splits > 1:
            # Slice the head dim (down to 32 columns) until ~2 programs per SM share the partials:
            # at B=1 one program per head would pull all splits' bytes through 32 SMs.
            merge_rows = g.total_q * g.num_qo_heads
            merge_block_d = block_d
            while merge_block_d > 32 and merge_rows * (block_d // merge_block_d) < 2 * _num_sms(device):
                merge_block_d //= 2
            # One [BLOCK_S, BLOCK_D] fp32 tile of partials per program: all splits at once up to
            # 8192 elements (64 registers a thread at 4 warps), one warp per 2048 elements.
            merge_block_s = min(triton.next_power_of_2(splits), max(8192 // merge_block_d, 1))
            self._merge_grid = (g.total_q, g.num_qo_heads, block_d // merge_block_d)
            self._merge_constexprs = dict(
                HEAD_DIM=g.head_dim, BLOCK_D=merge_block_d, SEQ_LEN_Q=g.seq_len_q, PACKED=g.packed,
                BLOCK_S=merge_block_s,
            )
            self._merge_options = dict(num_warps=max(1, min(4, merge_block_s * merge_block_d // 2048)))
        self._direct: dict[tuple, _DirectLaunch] = {}
        self._direct_broken = False

    def __call__(
        self, q: torch.Tensor, kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        out: torch.Tensor, bmm1_scale: float, bmm2_scale: float,
    ) -> None:
        """q/out: [B, Hq, D], [B, SQ, Hq, D] or packed [total_q, Hq, D]; kv_cache: a combined
        [num_pages, 2, Hkv, P, D] cache or a (K, V) pair of [num_pages, Hkv, P, D], compact inside
        a page (the page stride may be padded)."""
        if isinstance(kv_cache, torch.Tensor):  # K and V of page i: [i, 0] and [i, 1]
            cache_strides = kv_cache.stride()
            k_ptr = kv_cache.data_ptr()
            v_ptr = k_ptr + cache_strides[1] * kv_cache.element_size()
            kv_strides = (cache_strides[0], cache_strides[2]) * 2
        else:
            k_cache, v_cache = kv_cache
            k_ptr, v_ptr = k_cache.data_ptr(), v_cache.data_ptr()
            kv_strides = (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
        packed = self.geometry.packed
        varying = (*_q_strides(q, packed), *_q_strides(out, packed), *kv_strides)
        q_ptr, out_ptr = q.data_ptr(), out.data_ptr()
        scales = (float(bmm1_scale) * LOG2E, float(bmm2_scale))
        pdl = pdl_enabled(self.device)
        split_kernel, merge_kernel = _split_kv_kernel, _merge_kernel  # looked up per call: see above
        key = (pdl, q_ptr % 16, k_ptr % 16, v_ptr % 16, out_ptr % 16, *varying)
        direct = self._direct.get(key)
        if direct is not None and direct.split_kernel is split_kernel and direct.merge_kernel is merge_kernel:
            # Pointers as integers: the launcher takes them as they are (no data_ptr() call and
            # no driver query per tensor); the plan's tensors' addresses were taken at plan time.
            partials = self._partial_ptrs or (out_ptr, out_ptr)
            try:
                direct(
                    (q_ptr, k_ptr, v_ptr, *self._plan_ptrs, out_ptr, *partials, *scales, *self._scalars,
                     *varying, *self._tail_strides),
                    (*partials, out_ptr, scales[1], self.config.num_kv_splits, *self._po_lse_strides,
                     *varying[3:6]) if self._merge_grid is not None else None,
                )
                return
            except TypeError:  # a triton whose compiled-kernel launcher takes other arguments:
                self._direct_broken = True  # from now on the dispatch below (which relaunches both)
                self._direct.clear()
        k_cache, v_cache = kv_cache.unbind(1) if isinstance(kv_cache, torch.Tensor) else kv_cache
        partial_o, partial_lse = self._partials
        if partial_o is None:
            partial_o = partial_lse = out
        split_args = (q, k_cache, v_cache, *self._plan_tensors, out, partial_o, partial_lse, *scales,
                      *self._scalars, *varying, *self._tail_strides)
        merge_args = None
        if self._merge_grid is not None:
            merge_args = (partial_o, partial_lse, out, scales[1], self.config.num_kv_splits,
                          *self._po_lse_strides, *varying[3:6])
        launch_pdl = {"launch_pdl": True} if pdl else {}
        split_compiled = split_kernel[self._grid](
            *split_args, **self._split_constexprs, USE_PDL=pdl, **self._split_options, **launch_pdl,
        )
        merge_compiled = None
        if merge_args is not None:
            merge_compiled = merge_kernel[self._merge_grid](
                *merge_args, **self._merge_constexprs, USE_PDL=pdl, **self._merge_options, **launch_pdl,
            )
        self._remember(key, pdl, split_kernel, split_compiled, len(split_args), merge_kernel, merge_compiled,
                       None if merge_args is None else len(merge_args))

    def _remember(self, key, pdl, split_kernel, split_compiled, num_split_args, merge_kernel, merge_compiled,
                  num_merge_args) -> None:
        """Keep the compiled kernels of ``key`` for direct launches (when they are plain compiled
        ``JITFunction`` kernels: not substitutes, not the interpreter's, not pending compiles)."""
        def usable(kernel, compiled):
            return isinstance(kernel, JITFunction) and _finished(compiled)

        if self._direct_broken or not usable(split_kernel, split_compiled):
            return
        if num_merge_args is not None and not usable(merge_kernel, merge_compiled):
            return
        if len(self._direct) >= self._MAX_ENTRIES:
            self._direct.clear()
        try:
            self._direct[key] = _DirectLaunch(
                split_kernel, split_compiled, self._grid, num_split_args,
                {**self._split_constexprs, "USE_PDL": pdl}, merge_kernel, merge_compiled,
                self._merge_grid, num_merge_args, {**self._merge_constexprs, "USE_PDL": pdl}, self.device,
            )
        except (AttributeError, KeyError, TypeError):  # a triton without these interfaces
            self._direct_broken = True

    def compile(self, q_shape: tuple[int, ...], q_dtype: torch.dtype, kv_dtype: torch.dtype,
                o_dtype: torch.dtype) -> None:
        """Compile (without launching) the kernels a call with contiguous q and out of q_shape and a
        compact cache at 16-byte aligned addresses runs: ``kernel.warmup`` with dtypes standing in
        for those four tensors, and the plan's own tensors, scalars and constexprs. The compiled
        kernels are kept for such calls with a compact combined cache (the usual case), so even a
        plan's first run of that kind launches directly. Kernels an earlier plan of this process
        compiled for an equal ``_specialization_key`` (same config and shapes, any lengths) are
        taken from ``_COMPILED`` without calling ``warmup``."""
        g = self.geometry
        contiguous = [1]
        for size in reversed(q_shape[1:]):
            contiguous.insert(0, contiguous[0] * size)
        io_strides = _io_strides(tuple(contiguous), g.packed)
        page_elems = g.num_kv_heads * g.page_size * g.head_dim
        kv_strides = (2 * page_elems, g.page_size * g.head_dim) * 2  # combined [num_pages, 2, Hkv, P, D]
        partial_o, partial_lse = self._partials
        if partial_o is None:
            partial_o = partial_lse = o_dtype
        pdl = pdl_enabled(self.device)
        launch_pdl = {"launch_pdl": True} if pdl else {}
        split_kernel, merge_kernel = _split_kv_kernel, _merge_kernel
        split_args = (q_dtype, kv_dtype, kv_dtype, *self._plan_tensors, o_dtype, partial_o, partial_lse,
                      1.0, 1.0, *self._scalars, *io_strides, *io_strides, *kv_strides, *self._tail_strides)
        merge_args = None
        if self._merge_grid is not None:
            merge_args = (partial_o, partial_lse, o_dtype, 1.0, self.config.num_kv_splits,
                          *self._po_lse_strides, *io_strides)
        shared_key = None
        if isinstance(split_kernel, JITFunction) and isinstance(merge_kernel, JITFunction):
            split_key = _specialization_key(split_kernel, split_args)
            merge_key = None if merge_args is None else _specialization_key(merge_kernel, merge_args)
            if split_key is not None and (merge_args is None or merge_key is not None):
                device_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                shared_key = (
                    device_index, pdl, split_kernel, merge_kernel, split_key, _frozen(self._split_constexprs),
                    _frozen(self._split_options),
                    None if merge_args is None else (
                        merge_key, _frozen(self._merge_constexprs), _frozen(self._merge_options)),
                )
        compiled = _shared_kernels(shared_key) if shared_key is not None else None
        if compiled is not None:
            split_compiled, merge_compiled = compiled
        else:
            split_compiled = split_kernel.warmup(
                *split_args, grid=self._grid, **self._split_constexprs, USE_PDL=pdl, **self._split_options,
                **launch_pdl,
            )
            merge_compiled = None
            if merge_args is not None:
                merge_compiled = merge_kernel.warmup(
                    *merge_args, grid=self._merge_grid, **self._merge_constexprs, USE_PDL=pdl,
                    **self._merge_options, **launch_pdl,
                )
            if shared_key is not None and _finished(split_compiled) and (
                    merge_args is None or _finished(merge_compiled)):
                _share_kernels(shared_key, (split_compiled, merge_compiled))
        # The key a call computes for those tensors (addresses 0 mod 16; V = K + Hkv*P*D elements).
        v_offset = g.num_kv_heads * g.page_size * g.head_dim * kv_dtype.itemsize
        key = (pdl, 0, 0, v_offset % 16, 0, *io_strides, *io_strides, *kv_strides)
        self._remember(key, pdl, split_kernel, split_compiled, len(split_args), merge_kernel, merge_compiled,
                       None if merge_args is None else len(merge_args))


# Compiled kernels shared by every plan of this process (``DecodeLaunch.compile``), least recently
# used first: a plan whose kernels an earlier plan compiled (the usual decode step: same config,
# new lengths) skips triton's warm-up, its argument binding and cache lookup (31-89 us on the H200
# machine's host, a hit 18-47 us: reports/nvidia-h200/2026-11-30/plan_sharing.txt).
_COMPILED: OrderedDict[tuple, tuple] = OrderedDict()
_COMPILED_LOCK = threading.Lock()  # plans may come from several threads
_COMPILED_MAX_ENTRIES = 256


def clear_compiled_cache() -> None:
    """Forget the compiled kernels plans share (triton's own caches are not touched)."""
    with _COMPILED_LOCK:
        _COMPILED.clear()


def _shared_kernels(key: tuple) -> tuple | None:
    with _COMPILED_LOCK:
        found = _COMPILED.get(key)
        if found is not None:
            _COMPILED.move_to_end(key)
        return found


def _share_kernels(key: tuple, compiled: tuple) -> None:
    with _COMPILED_LOCK:
        _COMPILED[key] = compiled
        if len(_COMPILED) > _COMPILED_MAX_ENTRIES:
            _COMPILED.popitem(last=False)


def _finished(compiled) -> bool:
    """A compiled kernel ready to launch (not None, not an asynchronous compile's pending result)."""
    return compiled is not None and not hasattr(compiled, "result")


def _frozen(d: dict) -> tuple:
    return tuple(sorted(d.items()))


def _specialization_key(kernel: JITFunction, args: tuple) -> tuple | None:
    """A key at least as fine as triton's specialisation of ``args`` (the kernel's leading
    arguments, tensors given as tensors or as their dtype): every argument's type, a tensor's dtype
    and address mod 16, an integer's exact value (only its 32/64-bit width where the kernel does
    not specialise it), not a float's value. Two argument lists with equal keys run the same
    compiled variant. None for an argument of another type (no sharing then)."""
    names = kernel.arg_names
    unspecialised = {n if isinstance(n, int) else names.index(n)
                     for n in getattr(kernel, "do_not_specialize", None) or () if isinstance(n, int) or n in names}
    types = tuple(map(type, args))
    values = list(args)  # integers, bools, None and dtypes stand for themselves
    for index, kind in enumerate(types):
        if kind is int:
            if index in unspecialised:
                value = values[index]
                values[index] = "i32" if -(2**31) <= value < 2**31 else "i64" if -(2**63) <= value < 2**63 else "u64"
        elif kind is float:
            values[index] = None
        elif kind is bool or kind is torch.dtype or values[index] is None:
            pass  # a dtype stands for a 16-byte aligned tensor in ``warmup``
        elif isinstance(values[index], torch.Tensor):
            values[index] = (values[index].dtype, values[index].data_ptr() % 16)
        else:
            return None
    return types, tuple(values)


class _DirectLaunch:
    """A plan's compiled kernels for one specialization key, launched without triton's dispatch.

    ``CompiledKernel[grid]`` takes every kernel parameter in signature order, constexprs included
    (their values are ignored by the launcher: they are baked into the binary), and the stream.
    """

    def __init__(self, split_kernel, split_compiled, grid, num_split_args, split_constexprs,
                 merge_kernel, merge_compiled, merge_grid, num_merge_args, merge_constexprs, device):
        self.split_kernel, self.merge_kernel = split_kernel, merge_kernel
        self._split = split_compiled[grid]
        self._split_tail = tuple(split_constexprs[n] for n in split_kernel.arg_names[num_split_args:])
        self._merge = None
        if num_merge_args is not None:
            self._merge = merge_compiled[merge_grid]
            self._merge_tail = tuple(merge_constexprs[n] for n in merge_kernel.arg_names[num_merge_args:])
        self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        self._stream = triton.runtime.driver.active.get_current_stream

    def __call__(self, split_args: tuple, merge_args: tuple | None) -> None:
        stream = self._stream(self._device_index)
        self._split(*split_args, *self._split_tail, stream=stream)
        if self._merge is not None:
            self._merge(*merge_args, *self._merge_tail, stream=stream)


def launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor | None,
    out: torch.Tensor,
    scratch: tuple[torch.Tensor, torch.Tensor] | None,
    geometry: LaunchGeometry,
    config: KernelConfig,
    bmm1_scale: float,
    bmm2_scale: float,
) -> None:
    """One launch through triton's dispatch (no plan to cache compiled kernels in); see
    ``DecodeLaunch`` for the arguments."""
    DecodeLaunch(
        geometry, config, q.dtype, k_cache.dtype, block_tables, seq_lens, qo_indptr, scratch,
        q.device,
    )(q, (k_cache, v_cache), out, bmm1_scale, bmm2_scale)
