"""The public API as torch ops, so ``torch.compile`` keeps each call as one opaque node.

``BatchDecodePagedTSWrapper.run`` and ``batch_decode_with_paged_kv_cache`` call these ops only
while torch.compile traces them (``torch.compiler.is_compiling()``); eager calls skip the
dispatcher. Each op writes ``out`` (declared mutated, so the graph orders it) and returns
nothing; its fake (meta) implementation does nothing, the output's shape being q's. The bodies
are the eager functions, run with real tensors when the graph runs.

Defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: the latter's
Python wrapper costs ~50 us a call on a 2-core CPU host, the dispatcher's own path ~3 us.
"""

import torch

from . import api

# Inductor's CUDA graphs (mode="reduce-overhead") leave these ops out of their captures: a
# capture would keep a plan's kernels and scratch past a re-plan, and the one-shot op reads the
# lengths on the host. run() itself stays capturable with torch.cuda.graph after plan().
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()

_LIB = torch.library.Library("tsdecode", "DEF")

# run() of the wrapper `handle` into out: a combined cache kv, or K = kv and V = v.
_LIB.define(
    "run_planned(int handle, Tensor q, Tensor kv, Tensor? v, Tensor block_tables, Tensor seq_lens, "
    "Tensor(a!) out, float? bmm1_scale, float bmm2_scale) -> ()",
    tags=_TAGS,
)
_LIB.impl("run_planned", api.run_planned_eager, "CompositeExplicitAutograd")

# batch_decode_with_paged_kv_cache into out (reads the lengths on the host).
_LIB.define(
    "decode_oneshot(Tensor q, Tensor kv, Tensor? v, Tensor block_tables, Tensor seq_lens_kv, "
    "int seq_len_q, Tensor? qo_indptr, int? max_seq_len_q, str mask_type, int window_left, "
    "float? bmm1_scale, float bmm2_scale, Tensor(a!) out) -> ()",
    tags=_TAGS,
)


def _decode_oneshot(q, kv, v, block_tables, seq_lens_kv, seq_len_q, qo_indptr, max_seq_len_q,
                    mask_type, window_left, bmm1_scale, bmm2_scale, out) -> None:
    api.batch_decode_with_paged_kv_cache(
        q, kv if v is None else (kv, v), block_tables, seq_lens_kv, seq_len_q=seq_len_q,
        qo_indptr=qo_indptr, max_seq_len_q=max_seq_len_q, mask_type=mask_type,
        window_left=window_left, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, out=out,
    )


_LIB.impl("decode_oneshot", _decode_oneshot, "CompositeExplicitAutograd")


@torch.library.register_fake("tsdecode::run_planned", lib=_LIB)
def _run_planned_fake(handle, q, kv, v, block_tables, seq_lens, out, bmm1_scale, bmm2_scale) -> None:
    return None


@torch.library.register_fake("tsdecode::decode_oneshot", lib=_LIB)
def _decode_oneshot_fake(q, kv, v, block_tables, seq_lens_kv, seq_len_q, qo_indptr, max_seq_len_q,
                         mask_type, window_left, bmm1_scale, bmm2_scale, out) -> None:
    return None
