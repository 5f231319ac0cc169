"""What a split count costs beyond its K/V bytes: the fp32 partial outputs each split writes and
the merge pass that reads them back (``merge_cost``), and the most splits an fp8 cache's partials
are worth (``partials_bound``). The heuristic's time model adds ``merge_cost`` to a count's waves;
``select`` bounds the ragged scaling of splits by ``partials_bound``."""

from __future__ import annotations

import math

from .space import ProblemShape, merge_block_d

# Each split of a request's KV head writes its query rows' fp32 partial outputs, which the merge
# reads back; PARTIAL_COST weighs a partial byte against a K/V byte, fitted to H200 timings of fp8
# caches (docs/perf-notes.md, "Config model").
PARTIAL_COST = 8
# The merge pass is a second kernel of one program per query row and head (a slice of the head
# dim each at small batch, ``merge_block_d``): its start and drain cost about the time an SM takes
# to stream MERGE_PASS_BYTES_PER_SM, and each of its programs on the busiest SM MERGE_ROW_BYTES (a
# short chain of dependent loads; both fitted to H200 timings of short problems).
MERGE_PASS_BYTES_PER_SM = 128 * 1024
MERGE_ROW_BYTES = 16 * 1024


def merge_cost(shape: ProblemShape, programs: int, splits: int, sms: int) -> float:
    """What ``splits`` > 1 splits of ``programs`` split programs add, in bytes an SM streams
    meanwhile: the merge pass (its start, and the busiest SM's share of its query rows), the partial
    outputs the split pass's busiest SM writes, and those the merge pass's busiest SM reads."""
    written = -(-programs // sms) * shape.rows_per_kv_head * shape.head_dim * 4
    merge_rows = -(-shape.batch_size * shape.max_seq_len_q * shape.num_qo_heads // sms)
    return MERGE_PASS_BYTES_PER_SM + merge_rows * MERGE_ROW_BYTES + written + merge_read_bytes(shape, splits, sms)


def merge_read_bytes(shape: ProblemShape, splits: int, sms: int) -> float:
    """The partial outputs the merge pass's busiest SM reads: each of its programs (a query row's
    slice of the head dim) reads every split's fp32 partials of that slice, so few query rows
    meeting many splits pull them through few SMs."""
    rows = shape.batch_size * shape.max_seq_len_q * shape.num_qo_heads
    columns = merge_block_d(rows, shape.block_d, sms)
    programs_per_sm = -(-rows * (shape.block_d // columns) // sms)
    return programs_per_sm * splits * columns * 4


def partials_bound(shape: ProblemShape, target_splits: int) -> int:
    """The most splits worth their partials for an fp8 cache (any count for a 16-bit one).

    A request's KV head holds ``kv`` K/V bytes; split ``s`` ways its programs reach s / S of the
    bandwidth that the target's ``S`` splits reach, and each split adds ``p`` bytes of partials
    (query rows x head dim x 4) at PARTIAL_COST. Time ~ kv * S / s + PARTIAL_COST * p * s is least
    at s = sqrt(kv * S / (PARTIAL_COST * p)). An fp8 cache's K/V bytes are half a 16-bit one's for
    the same partials, so the bound decides fp8 counts; the H200 timings do not yet decide it for
    16-bit caches. The one wave rule applies it to one-warp tiles inside pages, and to the splits
    a page-crossing fp8 issue target adds: the targets of page-crossing and four-warp tiles are
    already capped by what fits, and their tunes wanted every split of them."""
    if shape.kv_dtype.itemsize != 1:
        return target_splits
    mean_tokens = shape.max_visible_tiles(1) / max(1.0, shape.kv_len_spread)
    kv = 2 * mean_tokens * shape.head_dim * shape.kv_dtype.itemsize
    partials = shape.rows_per_kv_head * shape.head_dim * 4
    return max(1, math.ceil(math.sqrt(kv * target_splits / (PARTIAL_COST * partials))))


__all__ = ["merge_cost", "merge_read_bytes", "partials_bound"]
