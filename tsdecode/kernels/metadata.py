"""The metadata read behind validated runs: one Triton kernel gathers what the host checks.

A validated ``run`` (and the one-shot op) checks the lengths, the packed query offsets and the
page IDs its kernels will read: one launch of this kernel (launched directly after its first
compile, like the decode kernels) and one device-to-host copy, instead of a chain of torch
operations.

Output (int32, one device-to-host copy): ``[lens (B) | qo_indptr (B+1, packed only) | per-program
minimum page ID (R) | per-program maximum page ID (R)]`` with R = cdiv(B, BLOCK_ROWS). The host
reduces the R minima and maxima. Row b's live columns are ``[0, min(C, cdiv(len_b, P)))``; a
program whose rows have none writes the empty reduction's values (INT32_MAX, INT32_MIN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import INTERPRETER, interpreted_launch

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
BLOCK_ROWS = 8  # block-table rows per program
BLOCK_COLS = 256  # block-table columns per step of a program's loop
NUM_WARPS = 4


# Every integer argument unspecialised: one compiled variant serves every batch size, table
# width and page-ID range (a new specialisation would cost a compile inside a validated run).
@triton.jit(do_not_specialize=["batch_size", "num_cols", "stride_bt_row", "stride_seq_lens",
                               "stride_qo_indptr"])
def _metadata_kernel(
    # pointers (int32)
    block_tables_ptr, seq_lens_ptr, qo_indptr_ptr, out_ptr,
    # sizes and strides (elements)
    batch_size, num_cols, stride_bt_row, stride_seq_lens, stride_qo_indptr,
    # meta-parameters
    PAGE_SIZE: tl.constexpr,
    HAS_QO_INDPTR: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """Program p: rows [p * BLOCK_ROWS, (p + 1) * BLOCK_ROWS) of the block table. Copies their
    lengths (and offsets) into ``out`` and writes the min and max page ID over their live columns
    into ``out[B + indptr + p]`` and ``out[B + indptr + R + p]``."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_valid = rows < batch_size
    lens = tl.load(seq_lens_ptr + rows.to(tl.int64) * stride_seq_lens, mask=row_valid, other=0)
    tl.store(out_ptr + rows, lens, mask=row_valid)
    meta_base = batch_size
    if HAS_QO_INDPTR:
        offs = tl.load(qo_indptr_ptr + rows.to(tl.int64) * stride_qo_indptr, mask=row_valid, other=0)
        tl.store(out_ptr + batch_size + rows, offs, mask=row_valid)
        if pid == num_programs - 1:  # the closing offset qo_indptr[B]
            last = tl.load(qo_indptr_ptr + batch_size.to(tl.int64) * stride_qo_indptr)
            tl.store(out_ptr + 2 * batch_size, last)
        meta_base = 2 * batch_size + 1

    # Live columns of each row: its pages, at most the table's width (a length past C*P is
    # reported by the host from the lengths).
    row_cols = tl.minimum((tl.maximum(lens, 0) + (PAGE_SIZE - 1)) // PAGE_SIZE, num_cols)
    row_cols = tl.where(row_valid, row_cols, 0)
    lo = tl.full([BLOCK_ROWS, BLOCK_COLS], 2147483647, dtype=tl.int32)
    hi = tl.full([BLOCK_ROWS, BLOCK_COLS], -2147483648, dtype=tl.int32)
    row_ptrs = block_tables_ptr + rows.to(tl.int64) * stride_bt_row
    widest = tl.max(row_cols, axis=0)
    for start in range(0, widest, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        live = cols[None, :] < row_cols[:, None]
        ids = tl.load(row_ptrs[:, None] + cols[None, :], mask=live, other=0)
        lo = tl.where(live, tl.minimum(lo, ids), lo)
        hi = tl.where(live, tl.maximum(hi, ids), hi)
    tl.store(out_ptr + meta_base + pid, tl.min(tl.min(lo, axis=1), axis=0))
    tl.store(out_ptr + meta_base + num_programs + pid, tl.max(tl.max(hi, axis=1), axis=0))


# Compiled variants by (device index, constexprs, pointer alignments): validated runs and the
# one-shot op launch them directly, as the decode launcher does, instead of through triton's dispatch.
_COMPILED: dict[tuple, object] = {}
_direct_broken = False  # a triton whose compiled-kernel launcher takes other arguments


def _output_buffer(numel: int, device: torch.device) -> torch.Tensor:
    """The kernel's int32 output, uninitialised (every element is written; tests poison it)."""
    return torch.empty(numel, dtype=torch.int32, device=device)


def read_metadata(block_tables: torch.Tensor, seq_lens: torch.Tensor, qo_indptr: torch.Tensor | None,
                  page_size: int) -> tuple[list[int], list[int] | None, int, int]:
    """(lens, qo_indptr values or None, min page ID, max page ID over each row's live pages) with
    one device-to-host copy. block_tables int32 [B, C] (contiguous rows), seq_lens int32 [B],
    qo_indptr int32 [B+1] or None."""
    global _direct_broken
    batch, cols = block_tables.shape
    programs = triton.cdiv(batch, BLOCK_ROWS)
    has_indptr = qo_indptr is not None
    indptr_len = batch + 1 if has_indptr else 0
    out = _output_buffer(batch + indptr_len + 2 * programs, block_tables.device)
    indptr = qo_indptr if has_indptr else seq_lens  # an unread stand-in without offsets
    scalars = (batch, cols, block_tables.stride(0), seq_lens.stride(0), indptr.stride(0))
    constexprs = dict(PAGE_SIZE=page_size, HAS_QO_INDPTR=has_indptr, BLOCK_ROWS=BLOCK_ROWS,
                      BLOCK_COLS=BLOCK_COLS)
    tensors = (block_tables, seq_lens, indptr, out)
    device = block_tables.device
    if device.type != "cuda" or INTERPRETER:
        with interpreted_launch():
            _metadata_kernel[(programs,)](*tensors, *scalars, **constexprs, num_warps=NUM_WARPS)
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, tuple(sorted(constexprs.items())), *(t.data_ptr() % 16 for t in tensors))
        compiled = _COMPILED.get(key)
        launched = False
        if compiled is not None and not _direct_broken:
            stream = triton.runtime.driver.active.get_current_stream(index)
            try:
                # Every parameter in signature order, constexprs included (the launcher ignores
                # their values: they are baked into the binary), pointers as integers.
                tail = tuple(constexprs[n] for n in _metadata_kernel.arg_names[len(tensors) + len(scalars):])
                compiled[(programs, 1, 1)](*(t.data_ptr() for t in tensors), *scalars, *tail, stream=stream)
                launched = True
            except TypeError:
                _direct_broken = True
        if not launched:
            compiled = _metadata_kernel[(programs,)](*tensors, *scalars, **constexprs, num_warps=NUM_WARPS)
            if compiled is not None and not hasattr(compiled, "result") and not _direct_broken:
                _COMPILED[key] = compiled
    host = out.tolist()  # the single host sync
    lens = host[:batch]
    indptr_host = host[batch:batch + indptr_len] if has_indptr else None
    base = batch + indptr_len
    return lens, indptr_host, min(host[base:base + programs]), max(host[base + programs:])
