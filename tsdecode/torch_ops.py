"""The public API as torch ops, so ``torch.compile`` keeps each call as one opaque node.

``BatchDecodePagedTSWrapper.run``, ``batch_decode_with_paged_kv_cache`` and
``prims_ts_batch_decode_with_kv_cache`` (``decode_oneshot`` with ``capture_call``) call these ops only
while torch.compile traces them (``torch.compiler.is_compiling()``); eager calls skip the
dispatcher. Each op writes ``out`` (declared mutated, so the graph orders it) and returns
nothing; its fake (meta) implementation does nothing, the output's shape being q's. The bodies
are the eager functions, run with real tensors when the graph runs.

Defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: the latter's
Python wrapper costs a call many times the dispatcher's own path (docs/perf-notes.md).
"""

import torch

from . import api, oneshot

# Inductor's CUDA graphs (mode="reduce-overhead") leave these ops out of their captures: a
# capture would keep a plan's kernels and split partials past a re-plan, and the one-shot op reads the
# lengths on the host. run() itself stays capturable with torch.cuda.graph after plan(). The tag
# exists from torch 2.9; before it, run_planned refuses a capture instead (a stale replay would
# be silent).
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()

# handle: the wrapper's 0-d int64 CPU tensor; kv: a combined cache, or K with V in v.
_RUN_PLANNED = (
    "run_planned(Tensor handle, Tensor q, Tensor kv, Tensor? v, Tensor seq_lens, Tensor block_tables, "
    "Tensor? qo_indptr, Tensor(a!) out, float? bmm1_scale, float bmm2_scale, bool validate) -> ()"
)
_DECODE_ONESHOT = (
    "decode_oneshot(Tensor q, Tensor kv, Tensor? v, Tensor block_tables, Tensor seq_lens_kv, "
    "int seq_len_q, Tensor? qo_indptr, int? max_seq_len_q, str mask_type, int window_left, "
    "float? bmm1_scale, float bmm2_scale, Tensor(a!) out, Tensor? workspace_buffer, int? max_kv_len, "
    "bool validate, ScalarType? out_dtype=None, bool capture_call=False) -> ()"
)


def _run_planned(handle, q, kv, v, seq_lens, block_tables, qo_indptr, out, bmm1_scale, bmm2_scale,
                 validate) -> None:
    """run() of the wrapper ``handle`` into out."""
    if not _TAGS and q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"torch {torch.__version__} has no cudagraph_unsafe tag, so a CUDA graph captured "
            "around a compiled call could replay run() past a re-plan: compile without "
            'mode="reduce-overhead", or capture run() itself with torch.cuda.graph after plan()'
        )
    api.run_planned_eager(handle, q, kv, v, seq_lens, block_tables, qo_indptr, out, bmm1_scale, bmm2_scale,
                          validate)


def _decode_oneshot(q, kv, v, block_tables, seq_lens_kv, seq_len_q, qo_indptr, max_seq_len_q,
                    mask_type, window_left, bmm1_scale, bmm2_scale, out, workspace_buffer, max_kv_len,
                    validate, out_dtype=None, capture_call=False) -> None:
    """batch_decode_with_paged_kv_cache into out (out_dtype: the caller's, if it gave one), or with
    ``capture_call`` prims_ts_batch_decode_with_kv_cache, whose errors name its own arguments."""
    if capture_call:
        oneshot.prims_ts_batch_decode_with_kv_cache(
            q, kv if v is None else (kv, v), workspace_buffer, block_tables, seq_lens_kv, max_kv_len,
            seq_len_q=seq_len_q, qo_indptr=qo_indptr, max_seq_len_q=max_seq_len_q, bmm1_scale=bmm1_scale,
            bmm2_scale=bmm2_scale, out=out, out_dtype=out_dtype, mask_type=mask_type, window_left=window_left,
        )
        return
    oneshot.batch_decode_with_paged_kv_cache(
        q, kv if v is None else (kv, v), block_tables, seq_lens_kv, seq_len_q=seq_len_q,
        qo_indptr=qo_indptr, max_seq_len_q=max_seq_len_q, mask_type=mask_type,
        window_left=window_left, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, out=out,
        workspace_buffer=workspace_buffer, max_kv_len=max_kv_len, validate=validate, out_dtype=out_dtype,
    )


def _no_output(*args) -> None:
    """The ops' fake implementation: they only write ``out``."""
    return None


# Registered once per process: a module reload (e.g. IPython's autoreload) runs this file again
# in the same namespace, where _LIB (whose lifetime is the ops' registration) already exists.
if "_LIB" not in globals():
    _LIB = torch.library.Library("tsdecode", "DEF")
    for _schema, _impl in ((_RUN_PLANNED, _run_planned), (_DECODE_ONESHOT, _decode_oneshot)):
        _name = _schema.split("(", 1)[0]
        _LIB.define(_schema, tags=_TAGS)
        _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"tsdecode::{_name}", _no_output, lib=_LIB)
