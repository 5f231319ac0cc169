"""Split-KV paged decode attention: the two Triton kernels.

Math (per request b, query row i, visible keys j; fp32 accumulation):
    out[i] = bmm2_scale * sum_j softmax_j(bmm1_scale * q_i . k_j) v_j

Pass 1 (``_split_kv_kernel``): one program per (request, KV head, block of query rows, KV
split). The program's rows are the G query heads of its KV head times the request's query
tokens ("packed rows", row r = token * G + head), so each K/V byte is read once per KV head, not
once per query head. ``_attend_split`` walks the split's K/V tiles through the block table with
an online softmax in base 2 (s_j = bmm1_scale * log2(e) * q . k_j, running max m, running sum
l = sum_j 2^(s_j - m), accumulator acc = sum_j 2^(s_j - m) v_j). The program then writes either
the final output bmm2_scale * acc / l (one split) or the normalised partial o = acc / l and its
log2-sum-exp lse = m + log2(l) to the fp32 split partials. The products take one of two forms, and the
launcher chooses which: S = Q K^T and O = P V (``_tile_update``: rows on the MMA's M side, or
FMA reductions below 16 rows), or, with tl.dot and at most 8 rows, S^T = K Q^T and
O^T = V^T P^T (``_tile_update_transposed``: tokens on M, rows on N). Over an fp8 cache the
operands are float16; a bfloat16 q's rows are first scaled into float16's range by powers of two,
and the score scale by their inverses, one per row (``_q_rows_in_float16_range``).

Pass 2 (``_merge_kernel``, only when num_kv_splits > 1): one program per (query token, query
head, head-dim slice) combines the splits' partials weighted by exp2(lse - max lse).

Grids: pass 1 (B * Hkv * NUM_M_BLOCKS, num_kv_splits, 1); pass 2 (total query tokens, Hq,
head-dim slices). They depend only on plan-time values (batch size, heads, packed-row capacity,
split count), never on the live lengths, so a captured graph replays with new lengths: each
program reads its request's length, divides the visible tile range evenly among the splits at
run time, and a split with no tiles writes lse = -inf (weight zero in the merge).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _q_rows_in_float16_range(q, qk_scale_log2, TRANSPOSED: tl.constexpr):
    """Each row of q (fp32 [BLOCK_M, BLOCK_D], bfloat16 values) times the power of two that puts
    its largest magnitude in [2^13, 2^14), and the score scale times its inverse, one per row
    ([BLOCK_M, 1], or [1, BLOCK_M] for S^T): float16 products then hold any bfloat16 row, where
    float16 alone overflows past 65504 and drops bits under 2^-14.

    Both powers are built from exponent bits, so they are exact and the scores keep their values
    up to the rounding of the product itself. The exponent is bounded below so that both stay
    normal floats: a row of zeros is scaled by 2^126 (never inf) and stays zero."""
    amax_bits = tl.max(tl.abs(q), axis=1).to(tl.int32, bitcast=True)
    exponent = tl.maximum(amax_bits >> 23, 14)  # biased: the max lies in [2^(e-127), 2^(e-126))
    up = ((127 + 13 + 127 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(13 - (e - 127))
    down = ((exponent - 13) << 23).to(tl.float32, bitcast=True)  # 2^((e - 127) - 13), its inverse
    if TRANSPOSED:
        row_scale = qk_scale_log2 * down[None, :]
    else:
        row_scale = qk_scale_log2 * down[:, None]
    return q * up[:, None], row_scale


@triton.jit
def _tile_update(q, k, v, n, row_lo, row_end, m_i, l_i, acc, qk_scale_log2,
                 USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, COMPUTE_DTYPE: tl.constexpr):
    """One online-softmax step in the standard form: S = Q K^T, O = P V, rows on the MMA's M side
    (tl.dot), or broadcast-multiply-and-sum FMA reductions when there are too few rows for it."""
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
    return m_new, l_i, acc


@triton.jit
def _tile_update_transposed(q_t, k, v_t, n, row_lo, row_end, m_i, l_i, acc_t, qk_scale_log2,
                            DOT_FP32: tl.constexpr, COMPUTE_DTYPE: tl.constexpr):
    """The same step in the transposed form: S^T = K Q^T, O^T = V^T P^T (tl.dot only).

    Tokens sit on the MMA's M side (16 of them, no padding) and query rows on N (padded to 8, not
    16): half the MMAs and half the accumulator registers of the standard form at <= 8 rows."""
    s_t = tl.dot(k, q_t, out_dtype=tl.float32) * qk_scale_log2  # [BLOCK_N, BLOCK_M]
    visible_t = (n[:, None] < row_end[None, :]) & (n[:, None] >= row_lo[None, :])
    s_t = tl.where(visible_t, s_t, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # as in _tile_update: no inf - inf
    alpha = tl.exp2(m_i - m_safe)
    p_t = tl.exp2(s_t - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(p_t, axis=0)
    if DOT_FP32:
        pv_t = tl.dot(v_t, p_t, out_dtype=tl.float32)
    else:
        pv_t = tl.dot(v_t, p_t.to(COMPUTE_DTYPE), out_dtype=tl.float32)
    acc_t = acc_t * alpha[None, :] + pv_t
    return m_new, l_i, acc_t


@triton.jit
def _tile_product(q, k, v, n, row_lo, row_end, m_i, l_i, acc, qk_scale_log2,
                  USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
                  TRANSPOSED: tl.constexpr):
    """The online-softmax step in the product form the launcher chose."""
    if TRANSPOSED:
        return _tile_update_transposed(q, k, v, n, row_lo, row_end, m_i, l_i, acc, qk_scale_log2,
                                       DOT_FP32, COMPUTE_DTYPE)
    else:
        return _tile_update(q, k, v, n, row_lo, row_end, m_i, l_i, acc, qk_scale_log2,
                            USE_DOT, DOT_FP32, COMPUTE_DTYPE)


@triton.jit
def _value_mask(kv_mask, n, prog_lo, WINDOW: tl.constexpr):
    """Which V elements to load: with a window, not those of keys before the program's first
    visible key either, whose slots may hold anything (their weight is 0, but 0 * NaN is NaN).
    Their K needs no mask: a NaN logit is replaced by -inf where the key is not visible."""
    if WINDOW:
        return kv_mask & (n >= prog_lo)[:, None]
    else:
        return kv_mask


@triton.jit
def _attend_tile(q, m_i, l_i, acc, tile, k_head, v_head, bt_row, offs_n, offs_d, d_valid, kv_len,
                 prog_lo, row_lo, row_end, qk_scale_log2, stride_k_page, stride_v_page,
                 HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 WINDOW: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
                 COMPUTE_DTYPE: tl.constexpr, TRANSPOSED: tl.constexpr):
    """K/V tile ``tile`` read through the block table, then one online-softmax step with it.
    Tokens past kv_len and head-dim columns past HEAD_DIM read as zero, and so do the values of
    keys before prog_lo, the program's first visible key (WINDOW only)."""
    n = tile * BLOCK_N + offs_n
    n_valid = n < kv_len
    if PAGE_SIZE % BLOCK_N == 0:
        # The whole tile lies in one page: one page-ID load, one contiguous K/V tile.
        page = tl.load(bt_row + (tile * BLOCK_N) // PAGE_SIZE).to(tl.int64)
        tok_off = ((tile * BLOCK_N) % PAGE_SIZE + offs_n) * HEAD_DIM
    else:
        # The tile spans pages: gather each token's page ID.
        page = tl.load(bt_row + n // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
        tok_off = (n % PAGE_SIZE) * HEAD_DIM
    k_off = page * stride_k_page + tok_off
    v_off = page * stride_v_page + tok_off
    kv_mask = n_valid[:, None] & d_valid[None, :]
    k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v_mask = _value_mask(kv_mask, n, prog_lo, WINDOW)
    if TRANSPOSED:
        # V^T [BLOCK_D, BLOCK_N], the A operand of O^T = V^T P^T, read in place.
        v = tl.load(v_head + v_off[None, :] + offs_d[:, None], mask=tl.trans(v_mask), other=0.0)
    else:
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(COMPUTE_DTYPE)
        v = v.to(COMPUTE_DTYPE)
    return _tile_product(q, k, v, n, row_lo, row_end, m_i, l_i, acc, qk_scale_log2,
                         USE_DOT, DOT_FP32, COMPUTE_DTYPE, TRANSPOSED)


@triton.jit
def _attend_split(q, m_i, k_head, v_head, bt_row, tile_begin, tile_end, kv_len, prog_lo, row_lo,
                  row_end, offs_d, d_valid, qk_scale_log2, stride_k_page, stride_v_page,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                  USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
                  NUM_STAGES: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The online softmax over tiles [tile_begin, tile_end) from running max m_i: returns m_i, the
    running sum l_i [BLOCK_M] and the unnormalised accumulator ([BLOCK_M, BLOCK_D], or its
    transpose when TRANSPOSED)."""
    l_i = tl.zeros_like(m_i)
    if TRANSPOSED:
        acc = tl.full([BLOCK_D, BLOCK_M], 0.0, dtype=tl.float32)
    else:
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    # Software-pipelined over NUM_STAGES stages: later tiles' K/V loads are issued while this
    # tile's products run, which hides the memory latency of a loop that does little else.
    for tile in tl.range(tile_begin, tile_end, num_stages=NUM_STAGES):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, tile, k_head, v_head, bt_row, offs_n, offs_d,
                                     d_valid, kv_len, prog_lo, row_lo, row_end, qk_scale_log2,
                                     stride_k_page, stride_v_page, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                                     WINDOW, USE_DOT, DOT_FP32, COMPUTE_DTYPE, TRANSPOSED)
    return m_i, l_i, acc


@triton.jit
def _store_output(acc, m_i, l_i, out_ptr, partial_o_ptr, partial_lse_ptr, bmm2_scale, b, split,
                  qo_start, tok_base, tok, head, row_valid, offs_d, d_valid,
                  stride_o_batch, stride_o_tok, stride_o_head, stride_po_tok, stride_po_head,
                  stride_po_split, stride_lse_tok, stride_lse_head,
                  DIRECT_OUT: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The final output bmm2_scale * acc / l (one split), or the partial acc / l and its lse."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if TRANSPOSED:
        o = tl.trans(acc / l_safe[None, :])
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


# max_kv_len changes with every decode step's longest request: not specialised, so plans of other
# lengths share one compiled variant.
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
    DOT_FP32: tl.constexpr,  # interpreter's tl.dot forms: it computes 16-bit tl.dot wrongly, so upcast
    COMPUTE_DTYPE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (sm90+)
    TRANSPOSED: tl.constexpr = False,  # S^T = K Q^T, O^T = V^T P^T: rows on the MMA's N side
    SCALE_Q_ROWS: tl.constexpr = False,  # a bfloat16 q with float16 products (an fp8 cache)
):
    if USE_PDL:
        # Inputs may come from the previous kernel in the stream: wait for it before any load,
        # then let the merge kernel launch early (it waits for this grid before reading).
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    # -- This program's request b, KV head, block of packed rows and split.
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

    # -- Packed rows of this program: row = token * G + head-in-group.
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP_SIZE
    head = kv_head * GROUP_SIZE + rows % GROUP_SIZE
    row_valid = (rows < GROUP_SIZE * SEQ_LEN_Q) & (tok < qo_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM

    # -- Visible keys of each row, [row_lo, row_end), and this split's share of the tiles.
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

    # -- Q of the packed rows, [BLOCK_M, BLOCK_D], in the products' dtype.
    q_ptrs = (
        q_ptr + b * stride_q_batch + (qo_start + tok)[:, None] * stride_q_tok
        + head[:, None] * stride_q_head + offs_d[None, :]
    )
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if SCALE_Q_ROWS:
        # From here qk_scale_log2 is one value per row: it undoes that row's scale.
        q, qk_scale_log2 = _q_rows_in_float16_range(q.to(tl.float32), qk_scale_log2, TRANSPOSED)
    if DOT_FP32:
        q = q.to(tl.float32)
    else:
        q = q.to(COMPUTE_DTYPE)
    if TRANSPOSED:
        q = tl.trans(q)  # Q^T, the B operand of S^T = K Q^T

    # -- Online softmax over the split's K/V tiles, from a running max of -inf.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt_row
    k_head = k_ptr + kv_head.to(tl.int64) * stride_k_head
    v_head = v_ptr + kv_head.to(tl.int64) * stride_v_head
    m_i, l_i, acc = _attend_split(q, m_i, k_head, v_head, bt_row, tile_begin, tile_end, kv_len,
                                  prog_lo, row_lo, row_end, offs_d, d_valid, qk_scale_log2,
                                  stride_k_page, stride_v_page, HEAD_DIM, BLOCK_D, PAGE_SIZE,
                                  BLOCK_M, BLOCK_N, WINDOW, USE_DOT, DOT_FP32, COMPUTE_DTYPE,
                                  NUM_STAGES, TRANSPOSED)

    # -- Epilogue: the final output (one split), or the partial output and its lse.
    _store_output(acc, m_i, l_i, out_ptr, partial_o_ptr, partial_lse_ptr, bmm2_scale, b, split,
                  qo_start, tok_base, tok, head, row_valid, offs_d, d_valid,
                  stride_o_batch, stride_o_tok, stride_o_head, stride_po_tok, stride_po_head,
                  stride_po_split, stride_lse_tok, stride_lse_head, DIRECT_OUT, TRANSPOSED)


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

    # -- Online softmax over the splits' lse, BLOCK_S splits at a time.
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
