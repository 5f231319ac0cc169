"""The one-shot op: FlashInfer's ``batch_decode_with_paged_kv_cache`` (PrimTS), a plan and a run
in one call.

By default it reads the lengths on the host and plans exact bounds (a fresh plan per call; the
compiled kernels are shared). Its capturable form (workspace, capacity and ``out`` given,
``validate=False``) plans from host values only, like the wrapper's ``run``. FlashInfer's
``prims_ts_batch_decode_with_kv_cache`` is that form as a function of its own, the workspace and
capacity required, ``out`` optional; its errors name its own arguments.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import api
from . import validation as V
from .device import INTERPRETER
from .kernels.metadata import read_metadata

# What each function calls q, the cache, the lengths and the K/V capacity, for its errors.
ONESHOT_NAMES = V.ArgNames(lens="seq_lens_kv")
CAPTURE_CALL_NAMES = V.ArgNames(q="query", cache="kv_cache", lens="seq_lens", capacity="max_seq_len")

__all__ = ["batch_decode_with_paged_kv_cache", "prims_ts_batch_decode_with_kv_cache"]


def batch_decode_with_paged_kv_cache(
    q: torch.Tensor,
    paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens_kv: torch.Tensor,
    *,
    seq_len_q: int = 1,
    qo_indptr: torch.Tensor | None = None,
    max_seq_len_q: int | None = None,
    mask_type: Literal["dense", "causal"] = "dense",
    window_left: int = -1,
    kv_layout: Literal["HND"] = "HND",
    bmm1_scale: float | None = None,
    bmm2_scale: float = 1.0,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    workspace_buffer: torch.Tensor | None = None,
    max_kv_len: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """One-shot fixed or packed-Q paged decode (FlashInfer PrimTS semantics).

    By default it reads ``seq_lens_kv`` (and ``qo_indptr``) on the host to plan exact bounds, so
    it cannot be captured in a CUDA graph (RuntimeError during capture). With
    ``workspace_buffer``, ``max_kv_len`` and ``out`` given and ``validate=False`` (packed queries
    also ``max_seq_len_q``) it reads nothing on the host and can be captured after one call
    outside the capture. Hkv, P and D come from the cache, which is HND. Output dtype:
    ``out_dtype``, else ``out.dtype``, else q's. Under ``torch.compile`` it is one opaque op
    (``torch.ops.tsdecode.decode_oneshot``).
    """
    if torch.compiler.is_compiling():
        return _oneshot_traced(q, paged_kv_cache, block_tables, seq_lens_kv, seq_len_q, qo_indptr,
                               max_seq_len_q, mask_type, window_left, kv_layout, bmm1_scale, bmm2_scale,
                               out, out_dtype, workspace_buffer, max_kv_len, validate, ONESHOT_NAMES)
    q = V.require_tensor("q", q)
    validate = V.require_bool("validate", validate)
    capture_mode = workspace_buffer is not None and max_kv_len is not None and out is not None and not validate
    if not capture_mode:
        if api.capturing(q.device):
            raise RuntimeError("batch_decode_with_paged_kv_cache reads seq_lens_kv on the host unless given "
                               "workspace_buffer, max_kv_len and out with validate=False; " + api.CAPTURE_HINT)
        if not validate:
            raise ValueError("validate=False reads nothing on the host only with workspace_buffer, "
                             "max_kv_len and out all given")
    return _decode(q, paged_kv_cache, block_tables, seq_lens_kv, seq_len_q, qo_indptr, max_seq_len_q, mask_type,
                   window_left, kv_layout, bmm1_scale, bmm2_scale, out, out_dtype, workspace_buffer, max_kv_len,
                   capture_mode, ONESHOT_NAMES)


def prims_ts_batch_decode_with_kv_cache(
    query: torch.Tensor,
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    workspace_buffer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    *,
    seq_len_q: int = 1,
    qo_indptr: torch.Tensor | None = None,
    max_seq_len_q: int | None = None,
    bmm1_scale: float | None = None,
    bmm2_scale: float = 1.0,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    mask_type: Literal["dense", "causal"] = "dense",
    window_left: int = -1,
    kv_layout: Literal["HND"] = "HND",
) -> torch.Tensor:
    """Fixed or packed-Q paged decode with the caller's scratch: the capturable one-shot op.

    Parameters
    ----------
    query : [B, Hq, D] (SQ = 1), token-major [B, SQ, Hq, D], or packed [total_q, Hq, D] with
        ``qo_indptr`` int32 [B+1].
    kv_cache : HND, [num_pages, 2, Hkv, P, D] or (K, V) of [num_pages, Hkv, P, D].
    workspace_buffer : int8/uint8, contiguous, 32-byte aligned, on query's device, sized by
        ``get_prims_ts_batch_decode_workspace_size`` (a smaller one runs fewer KV splits). The
        caller owns it: one launch or graph replay in flight at a time, overlapping no other tensor.
    block_tables : int32 [B, C]; seq_lens : int32 [B] on query's device, read where the kernels run.
    max_seq_len : the static K/V capacity, which picks the kernel config and its compiled kernels
        (the wrapper's ``max_kv_len``).
    seq_len_q, max_seq_len_q : the fixed SQ; packed queries need the per-request cap
        ``max_seq_len_q`` (or its alias, a ``seq_len_q`` other than 1; both given, they agree).
    out : written in place, of query's shape; allocated when omitted. Output dtype: ``out_dtype``,
        else ``out.dtype``, else query's.

    Nothing is read back to the host: the caller guarantees lengths in [1, ``max_seq_len``],
    enough block-table columns, page IDs inside the cache and valid packed offsets (the checks of
    ``run(validate=False)``, on the host, still apply). Capturable in a CUDA graph, with ``out``
    given, after one call outside the capture. Under ``torch.compile`` it is one opaque op
    (``torch.ops.tsdecode.decode_oneshot``).
    """
    V.require_tensor("workspace_buffer", workspace_buffer)  # never allocated here, unlike the one-shot op's
    max_seq_len = V.require_int("max_seq_len", max_seq_len, minimum=1)
    if torch.compiler.is_compiling():
        return _oneshot_traced(query, kv_cache, block_tables, seq_lens, seq_len_q, qo_indptr, max_seq_len_q,
                               mask_type, window_left, kv_layout, bmm1_scale, bmm2_scale, out, out_dtype,
                               workspace_buffer, max_seq_len, False, CAPTURE_CALL_NAMES)
    query = V.require_tensor("query", query)
    return _decode(query, kv_cache, block_tables, seq_lens, seq_len_q, qo_indptr, max_seq_len_q, mask_type,
                   window_left, kv_layout, bmm1_scale, bmm2_scale, out, out_dtype, workspace_buffer, max_seq_len,
                   True, CAPTURE_CALL_NAMES)


def _decode(q, paged_kv_cache, block_tables, seq_lens_kv, seq_len_q, qo_indptr, max_seq_len_q, mask_type,
            window_left, kv_layout, bmm1_scale, bmm2_scale, out, out_dtype, workspace_buffer, max_kv_len,
            capture_mode: bool, names: V.ArgNames) -> torch.Tensor:
    """Both functions' eager body: the default form (host read, exact plan) or, with ``capture_mode``,
    the capturable one (host values only; ``out`` allocated only when omitted). Errors name q, the
    cache, the lengths and the capacity as ``names`` does."""
    V.validate_kv_layout(kv_layout)
    kv, (num_pages, num_kv_heads, page_size, head_dim), kv_dtype, cache_device, _ = V.cache_page_shape(
        paged_kv_cache, names.cache)
    out_name = "out.dtype" if out_dtype is None and out is not None else "out_dtype"  # what a dtype error names
    if out is not None:
        out = V.require_tensor("out", out)
        if out_dtype is not None and out_dtype != out.dtype:
            raise TypeError(f"out_dtype={out_dtype} disagrees with out.dtype={out.dtype}")
        out_dtype = out.dtype
    packed, sq = _oneshot_query_mode(q, seq_len_q, qo_indptr, max_seq_len_q, capture_mode, names)
    batch = _oneshot_batch_size(q, block_tables, seq_lens_kv, qo_indptr, packed, names)
    num_qo_heads = q.shape[-2]
    if q.shape[-1] != head_dim:
        raise ValueError(f"{names.q}'s head dim is {q.shape[-1]} but {names.cache}'s is {head_dim} "
                         f"({names.q} {list(q.shape)}, cache read as HND with D={head_dim})")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"{names.q} has Hq={num_qo_heads} query heads, not a multiple of the cache's "
                         f"Hkv={num_kv_heads}: {names.cache} "
                         f"{list(kv.shape) if isinstance(kv, torch.Tensor) else list(kv[0].shape)} "
                         f"is read as HND ([num_pages, 2, Hkv, P, D] or (K, V) of [num_pages, Hkv, P, D]); "
                         f"an NHD cache ([.., P, Hkv, D]) must be transposed to HND")
    V.validate_heads(num_qo_heads, num_kv_heads, head_dim, page_size, _head_names(names))
    device = q.device
    if cache_device != device:
        raise ValueError(f"{names.q} is on {device} but {names.cache} is on {cache_device}: the op runs on "
                         f"{names.q}'s device and needs every tensor there")
    dtype_names, device_name = (names.q, names.cache, out_name), f"{names.q}.device"
    if capture_mode:  # a plan of run-owned lengths, made here (plan() refuses a capture) from host values only
        device, shape = api.plan_problem(device, batch, num_qo_heads, num_kv_heads, head_dim, page_size,
                                         max_kv_len, sq, packed, q.dtype, kv_dtype, out_dtype, mask_type,
                                         window_left, dtype_names, _size_names(packed, max_kv_len, names),
                                         device_name)
        plan = api.make_plan(device, shape, None, workspace_buffer, None)
        if device.type == "cuda":
            with api.on_device(device):  # finds the kernels the call outside the capture compiled
                table_2d = isinstance(block_tables, torch.Tensor) and block_tables.dim() == 2
                stride = block_tables.stride(0) if table_2d else 16
                plan.launch.compile(plan.q_shape(plan.query_capacity), stride)
        return api.run_plan(plan, q, paged_kv_cache, seq_lens_kv, block_tables, qo_indptr, bmm1_scale,
                            bmm2_scale, out, validate=False, names=names)
    device = V.validate_device(device, INTERPRETER, device_name)
    # Host-only checks the traced call makes too, before the metadata read: where dynamo falls
    # back to this function after one of them fails, the caller gets that error, not a launch.
    V.validate_mask(mask_type, window_left)
    V.validate_scales(bmm1_scale, bmm2_scale, head_dim)
    V.resolve_dtypes(q.dtype, kv_dtype, out_dtype, dtype_names)
    block_tables = V.validate_block_tables(block_tables, batch, device)
    if isinstance(seq_lens_kv, torch.Tensor) and seq_lens_kv.dim() == 1:
        seq_lens_kv = seq_lens_kv.contiguous()  # read once on the host; the plan keeps its own copy
    seq_lens_kv = V.validate_lengths_tensor(names.lens, seq_lens_kv, batch, device)
    if packed:
        qo_indptr = V.validate_qo_indptr(qo_indptr, batch, device)
    with api.on_device(device):
        lens, indptr, min_page, max_page = read_metadata(block_tables, seq_lens_kv, qo_indptr, page_size)
    cols = block_tables.shape[1]
    for b, n in enumerate(lens):
        if n < 1:
            raise ValueError(f"{names.lens}[{b}]={n} must be >= 1")
        if max_kv_len is None and n > cols * page_size:  # here, not as the capacity planned from max(lens)
            raise ValueError(f"{names.lens}[{b}]={n} needs {-(-n // page_size)} pages but block_tables has "
                             f"C={cols} columns of page_size {page_size}")
    if packed:  # the offsets before they size the plan (garbage would overflow it); the capacity checked below
        q_lens = V.validate_qo_indptr_values(indptr, q.shape[0], V.INT32_ELEMENTS if sq is None else sq)
        sq = max(q_lens) if sq is None else sq  # derived: the longest request
    if max_kv_len is not None:
        max_kv_len = V.require_int(names.capacity, max_kv_len, minimum=1)
    device, shape = api.plan_problem(device, batch, num_qo_heads, num_kv_heads, head_dim, page_size,
                                     max(lens) if max_kv_len is None else max_kv_len, sq, packed, q.dtype,
                                     kv_dtype, out_dtype, mask_type, window_left, dtype_names,
                                     _size_names(packed, max_kv_len, names), device_name)
    V.validate_metadata_values(shape, lens, indptr, min_page, max_page, block_tables.shape[1], num_pages,
                               q.shape[0] if packed else batch * sq, names.lens)
    plan = api.make_plan(device, shape, tuple(lens), workspace_buffer, None)
    if device.type == "cuda" and q.is_contiguous() and (out is None or out.is_contiguous()) \
            and isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.is_contiguous():
        with api.on_device(device):  # finds the kernels an earlier call compiled; launches skip the dispatch
            plan.launch.compile(tuple(q.shape), block_tables.stride(0))
    return api.run_plan(plan, q, paged_kv_cache, plan.seq_lens, block_tables, qo_indptr, bmm1_scale,
                        bmm2_scale, out, validate=True, values_checked=True, names=names)


def _oneshot_batch_size(q, block_tables, seq_lens_kv, qo_indptr, packed: bool, names: V.ArgNames) -> int:
    """B as q (or packed qo_indptr), block_tables and the lengths each give it; a ValueError naming
    every one of them when they disagree (so the caller sees which argument is off)."""
    if packed:
        if qo_indptr.dim() != 1:
            raise ValueError(f"qo_indptr must be 1-D [B+1] (each request's first query token, then total_q), "
                             f"got shape {list(qo_indptr.shape)}")
        counts = [(qo_indptr.shape[0] - 1, f"qo_indptr has {qo_indptr.shape[0]} offsets (B+1)")]
    else:
        counts = [(q.shape[0], f"{names.q} has {q.shape[0]} requests (shape {list(q.shape)})")]
    if isinstance(block_tables, torch.Tensor) and block_tables.dim() == 2:
        counts.append((block_tables.shape[0], f"block_tables has {block_tables.shape[0]} rows"))
    if isinstance(seq_lens_kv, torch.Tensor) and seq_lens_kv.dim() == 1:
        counts.append((seq_lens_kv.shape[0], f"{names.lens} has {seq_lens_kv.shape[0]} lengths"))
    if len({n for n, _ in counts}) > 1:
        raise ValueError("the arguments disagree on the batch size B: " + ", ".join(text for _, text in counts))
    if counts[0][0] < 1:
        raise ValueError(f"the batch must hold at least one request: {counts[0][1]}")
    return counts[0][0]


def _size_names(packed: bool, max_kv_len, names: V.ArgNames) -> tuple[str, str, str]:
    """What the op's errors call the batch size and the two capacities: the arguments they came from."""
    return ("the batch size (block_tables' rows)", f"max({names.lens})" if max_kv_len is None else names.capacity,
            "max_seq_len_q" if packed else "seq_len_q")


def _head_names(names: V.ArgNames) -> tuple[str, str, str, str]:
    """The op takes no head counts: it reads them from its tensors' shapes, and its errors say so."""
    return (f"{names.q}.shape[-2] (query heads Hq)", f"{names.cache}'s KV heads Hkv",
            f"{names.cache}'s head dim D (and {names.q}.shape[-1])", f"{names.cache}'s page size P")


def _oneshot_query_mode(q: torch.Tensor, seq_len_q, qo_indptr, max_seq_len_q, capture_mode: bool,
                        names: V.ArgNames):
    """(packed, query-length capacity; None: derive it from qo_indptr) from the one-shot's
    arguments and q's rank."""
    seq_len_q = V.require_int("seq_len_q", seq_len_q, minimum=1)
    if max_seq_len_q is not None:
        max_seq_len_q = V.require_int("max_seq_len_q", max_seq_len_q, minimum=1)
    if qo_indptr is not None:
        V.require_tensor("qo_indptr", qo_indptr)
        if q.dim() != 3:
            raise ValueError(f"packed {names.q} (with qo_indptr) must be [total_q, Hq, D], got shape "
                             f"{list(q.shape)}")
        max_seq_len_q = V.packed_capacity(seq_len_q, max_seq_len_q)
        if capture_mode and max_seq_len_q is None:
            raise ValueError("packed queries (qo_indptr given) need max_seq_len_q (or its alias, a seq_len_q other "
                             "than 1) in the capturable form: it reads nothing on the host")
        return True, max_seq_len_q
    if max_seq_len_q is not None and max_seq_len_q != seq_len_q:
        raise ValueError(f"in fixed-query mode max_seq_len_q must equal seq_len_q={seq_len_q}, got {max_seq_len_q}")
    if q.dim() == 4:
        if q.shape[1] != seq_len_q:
            raise ValueError(f"{names.q} is [B, SQ, Hq, D] with SQ={q.shape[1]} but seq_len_q={seq_len_q}")
    elif q.dim() == 3:
        if seq_len_q != 1:
            raise ValueError(f"seq_len_q={seq_len_q} > 1 needs {names.q} as token-major [B, SQ, Hq, D], got shape "
                             f"{list(q.shape)}")
    else:
        raise ValueError(f"{names.q} must be [B, Hq, D], [B, SQ, Hq, D] or packed [total_q, Hq, D], got shape "
                         f"{list(q.shape)}")
    return False, seq_len_q


def _oneshot_traced(q, paged_kv_cache, block_tables, seq_lens_kv, seq_len_q, qo_indptr, max_seq_len_q,
                    mask_type, window_left, kv_layout, bmm1_scale, bmm2_scale, out, out_dtype,
                    workspace_buffer, max_kv_len, validate, names: V.ArgNames) -> torch.Tensor:
    """The one-shot op (or the capture call, by ``names``) as torch.compile traces it: checks that
    need no tensor data here, the rest when the graph runs (the eager function, called by the op)."""
    q = V.require_tensor(names.q, q)
    kv, v = V.split_cache(paged_kv_cache, names.cache)
    for name, t in (("block_tables", block_tables), (names.lens, seq_lens_kv)):
        V.require_tensor(name, t)
    V.validate_kv_layout(kv_layout)
    V.validate_mask(mask_type, window_left)
    _oneshot_query_mode(q, seq_len_q, qo_indptr, max_seq_len_q, False, names)
    bmm1, bmm2 = api.traced_scales(bmm1_scale, bmm2_scale)
    if max_kv_len is not None:  # int() below would take a float, a str or a bool
        max_kv_len = V.require_int(names.capacity, max_kv_len, minimum=1)
    if out is not None:
        out = V.require_tensor("out", out)
        if out_dtype is not None and out_dtype != out.dtype:
            raise TypeError(f"out_dtype={out_dtype} disagrees with out.dtype={out.dtype}")
    else:
        if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"out_dtype must be a torch.dtype or None, got {type(out_dtype).__name__}")
        out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    torch.ops.tsdecode.decode_oneshot(
        q, kv, v, block_tables, seq_lens_kv, int(seq_len_q), qo_indptr,
        None if max_seq_len_q is None else int(max_seq_len_q), mask_type, int(window_left), bmm1, bmm2, out,
        workspace_buffer, max_kv_len, V.require_bool("validate", validate),
        out_dtype, names == CAPTURE_CALL_NAMES)
    return out
