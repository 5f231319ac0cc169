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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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


@triton.jit
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
    if t.dim() == 4:  # [B, SQ, H, D]
        return t.stride(0), t.stride(1), t.stride(2)
    if packed:  # [total_q, H, D]
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), 0, t.stride(1)  # [B, H, D], SQ = 1


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
    merge_total_q: int | None = None,
) -> None:
    """Launch pass 1 (and the merge when config.num_kv_splits > 1). No host sync, no allocation.

    merge_total_q: the query-token count the merge's tiling is chosen for (default
    geometry.total_q); a warm-up launch on a smaller grid passes the plan's so it compiles the
    same merge kernel the plan's runs use.

    q/out: [B, Hq, D], [B, SQ, Hq, D] or packed [total_q, Hq, D]; k_cache/v_cache: views
    [num_pages, Hkv, P, D] with compact inner strides (the page stride may be padded).
    """
    g = geometry
    rows = g.group_size * g.seq_len_q
    num_m_blocks = -(-rows // config.block_m)
    transposed = transposed_products(k_cache.dtype, rows, config)
    kernel_block_m = triton.next_power_of_2(rows) if transposed else config.block_m
    block_d = triton.next_power_of_2(g.head_dim)
    interp = interpreter_active()
    sq_b, sq_t, sq_h = _q_strides(q, g.packed)
    so_b, so_t, so_h = _q_strides(out, g.packed)
    splits = config.num_kv_splits
    if splits > 1:
        partial_o, partial_lse = scratch
        po_strides = (partial_o.stride(0), partial_o.stride(1), partial_o.stride(2))
        lse_strides = (partial_lse.stride(0), partial_lse.stride(1))
    else:
        partial_o = partial_lse = out  # unused by the kernel when DIRECT_OUT
        po_strides, lse_strides = (0, 0, 0), (0, 0)
    indptr = qo_indptr if qo_indptr is not None else seq_lens  # unused unless PACKED
    pdl = pdl_enabled(q.device)
    grid = (g.batch_size * g.num_kv_heads * num_m_blocks, splits)
    _split_kv_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, indptr,
        out, partial_o, partial_lse,
        float(bmm1_scale) * LOG2E, float(bmm2_scale), int(g.window_left), int(g.max_kv_len),
        g.num_kv_heads, splits,
        sq_b, sq_t, sq_h,
        so_b, so_t, so_h,
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0),
        *po_strides, *lse_strides,
        GROUP_SIZE=g.group_size, HEAD_DIM=g.head_dim, BLOCK_D=block_d, PAGE_SIZE=g.page_size,
        SEQ_LEN_Q=g.seq_len_q, PACKED=g.packed, CAUSAL=g.causal, WINDOW=g.window_left >= 0,
        NUM_M_BLOCKS=num_m_blocks, BLOCK_M=kernel_block_m, BLOCK_N=config.block_n, TRANSPOSED=transposed,
        DIRECT_OUT=splits == 1, USE_DOT=config.uses_dot, DOT_FP32=interp,
        COMPUTE_DTYPE=compute_dtype(q.dtype, k_cache.dtype), NUM_STAGES=config.num_stages, USE_PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, **({"launch_pdl": True} if pdl else {}),
    )
    if splits > 1:
        # Slice the head dim (down to 32 columns) until ~2 programs per SM share the partials:
        # at B=1 one program per head would pull all splits' bytes through 32 SMs.
        merge_rows = (merge_total_q if merge_total_q is not None else g.total_q) * g.num_qo_heads
        merge_block_d = block_d
        while merge_block_d > 32 and merge_rows * (block_d // merge_block_d) < 2 * _num_sms(q.device):
            merge_block_d //= 2
        # One [BLOCK_S, BLOCK_D] fp32 tile of partials per program: all splits at once up to
        # 8192 elements (64 registers a thread at 4 warps), one warp per 2048 elements.
        merge_block_s = min(triton.next_power_of_2(splits), max(8192 // merge_block_d, 1))
        merge_warps = max(1, min(4, merge_block_s * merge_block_d // 2048))
        merge_grid = (g.total_q, g.num_qo_heads, block_d // merge_block_d)
        _merge_kernel[merge_grid](
            partial_o, partial_lse, out, float(bmm2_scale), splits,
            *po_strides, *lse_strides,
            so_b, so_t, so_h,
            HEAD_DIM=g.head_dim, BLOCK_D=merge_block_d, SEQ_LEN_Q=g.seq_len_q, PACKED=g.packed,
            BLOCK_S=merge_block_s, USE_PDL=pdl,
            num_warps=merge_warps, **({"launch_pdl": True} if pdl else {}),
        )
