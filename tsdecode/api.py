"""Public API: FlashInfer PrimTS-compatible paged decode (one-shot op and reusable wrapper).

Shapes (B requests, Hq/Hkv query/KV heads, D head dim, P page size, C block-table columns):
q and the output are [B, Hq, D] (SQ=1), [B, SQ, Hq, D] (fixed SQ>1) or [total_q, Hq, D]
(packed, with qo_indptr int32 [B+1]); the cache is [num_pages, 2, Hkv, P, D] or (K, V) each
[num_pages, Hkv, P, D]; block_tables int32 [B, C]; seq_lens_kv int32 [B].
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass
from typing import Literal

import torch

from . import validation as V
from .configs import KernelConfig, ProblemShape, SelectedConfig, select_config
from .kernels.decode import DecodeLaunch, LaunchGeometry, allocate_scratch, interpreter_active
from .kernels.plan_metadata import read_plan_metadata

__all__ = ["batch_decode_with_paged_kv_cache", "BatchDecodePagedTSWrapper"]


@dataclass(frozen=True)
class _Plan:
    """Everything ``run`` needs, published at once so a failed re-plan keeps the old plan."""

    geometry: LaunchGeometry
    selected: SelectedConfig
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    o_dtype: torch.dtype
    q_shape: tuple[int, ...]
    device: torch.device
    block_tables: torch.Tensor  # the caller's tensor: live page IDs are read every run
    seq_lens: torch.Tensor  # the caller's tensor (bind_seq_lens) or a plan-owned copy
    qo_indptr: torch.Tensor | None  # plan-owned copy
    scratch: tuple[torch.Tensor, torch.Tensor] | None
    max_page_id: int  # largest page ID validated at plan time
    launch: DecodeLaunch  # the kernels' launches, fixed for this plan
    plan_tensor_spans: tuple[tuple[str, int, int], ...]  # byte spans of block_tables, seq_lens


def _plan_host_values(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, qo_indptr: torch.Tensor | None,
    page_size: int, max_kv_len: int | None, bind_seq_lens: bool,
) -> tuple[list[int], list[int] | None, int, int]:
    """One device-to-host read: (seq_lens, qo_indptr, min page ID, max page ID).

    Page IDs are reduced on the device (one kernel, ``read_plan_metadata``) over the columns the
    plan covers: each row's live pages, or the first ceil(max_kv_len / P) columns when lengths are
    bound. The min and max are only meaningful when every length is in [1, C*P] (the caller
    checks the lengths first).
    """
    covered_cols = None
    if bind_seq_lens and max_kv_len is not None:
        covered_cols = -(-min(max_kv_len, block_tables.shape[1] * page_size) // page_size)
    with _on_device(block_tables.device):  # triton launches on the current GPU
        return read_plan_metadata(block_tables, seq_lens, qo_indptr, page_size, covered_cols,
                                  bind_seq_lens)


class BatchDecodePagedTSWrapper:
    """Plan once, run many; ``run`` is CUDA-graph capturable after ``plan``.

    ``plan`` validates metadata (one host read), picks the kernel config (``config`` argument,
    tuned table or heuristic), allocates scratch and compiles the kernels. ``run`` does no host
    sync and allocates nothing when ``out`` is given. One wrapper owns one scratch buffer: at most
    one run or replay in flight at a time.
    """

    def __init__(self, kv_layout: Literal["HND"] = "HND") -> None:
        V.validate_kv_layout(kv_layout)
        self.kv_layout = kv_layout
        self._plan: _Plan | None = None
        self._handle = _register_wrapper(self)

    def __copy__(self) -> BatchDecodePagedTSWrapper:
        """A wrapper of its own (own handle, re-plannable apart) sharing this one's plan and
        scratch until it re-plans: one run in flight between the two."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin._handle = _register_wrapper(twin)
        return twin

    def __getstate__(self) -> dict:
        if self._plan is not None:  # compiled kernels, scratch and bound caller tensors
            raise TypeError(
                "a planned BatchDecodePagedTSWrapper cannot be deep-copied or pickled; create a "
                "new wrapper and plan it (copy.copy shares the plan)"
            )
        state = self.__dict__.copy()
        del state["_handle"]  # the copy gets its own
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._handle = _register_wrapper(self)

    @property
    def config(self) -> SelectedConfig:
        """The planned ``SelectedConfig``: ``.kernel_config`` and where it came from."""
        if self._plan is None:
            raise RuntimeError("BatchDecodePagedTSWrapper.config is available after plan()")
        return self._plan.selected

    def plan(
        self,
        block_tables: torch.Tensor,
        seq_lens_kv: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        seq_len_q: int = 1,
        qo_indptr: torch.Tensor | None = None,
        max_seq_len_q: int | None = None,
        q_data_type: torch.dtype = torch.float16,
        kv_data_type: torch.dtype | None = None,
        o_data_type: torch.dtype | None = None,
        mask_type: Literal["dense", "causal"] = "dense",
        window_left: int = -1,
        max_kv_len: int | None = None,
        bind_seq_lens: bool = False,
        config: KernelConfig | None = None,
    ) -> None:
        """Validate metadata and fix the launch. See the module docstring for shapes.

        bind_seq_lens=False copies seq_lens_kv (fixed lengths). bind_seq_lens=True keeps the
        caller's tensor; every run reads its live values, which must stay in [1, max_kv_len]
        (default: the planned maximum). block_tables is retained either way and page IDs may be
        remapped in place between runs (new IDs are the caller's responsibility: run cannot check
        them without a sync).
        """
        plan = _make_plan(
            block_tables, seq_lens_kv, num_qo_heads, num_kv_heads, head_dim, page_size,
            seq_len_q=seq_len_q, qo_indptr=qo_indptr, max_seq_len_q=max_seq_len_q,
            q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type,
            mask_type=mask_type, window_left=window_left, max_kv_len=max_kv_len,
            bind_seq_lens=bind_seq_lens, config=config, num_pages=None,
        )
        if plan.device.type == "cuda":
            _warm_up(plan)
        self._plan = plan

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        *,
        bmm1_scale: float | None = None,
        bmm2_scale: float = 1.0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output with q's shape; no host sync, no allocation when ``out`` is given.

        Under ``torch.compile`` the launch is one opaque op (``torch.ops.tsdecode.run_planned``),
        so a compiled graph, ``fullgraph=True`` included, holds it without a break."""
        if self._plan is None:
            raise RuntimeError("BatchDecodePagedTSWrapper.run() called before plan()")
        if torch.compiler.is_compiling():
            return _run_traced(self._handle, self._plan, q, paged_kv_cache, bmm1_scale, bmm2_scale, out)
        return _run_plan(self._plan, q, paged_kv_cache, bmm1_scale, bmm2_scale, out)


# Wrappers by handle, for the compiled path: its op takes the handle and finds the wrapper's
# plan at call time. Weak: the registry keeps no wrapper (or its scratch) alive. The handle is a
# 0-d int64 CPU tensor (read without a device sync), so a compiled graph takes it as an input:
# as a Python int it would be a constant of the graph, and every new wrapper a recompile.
_WRAPPERS: weakref.WeakValueDictionary[int, BatchDecodePagedTSWrapper] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def _register_wrapper(wrapper: BatchDecodePagedTSWrapper) -> torch.Tensor:
    handle = next(_HANDLES)
    _WRAPPERS[handle] = wrapper
    return torch.tensor(handle, dtype=torch.int64)


def _run_traced(handle: torch.Tensor, plan: _Plan, q, paged_kv_cache, bmm1_scale, bmm2_scale,
                out) -> torch.Tensor:
    """``run`` as torch.compile traces it: what needs no tensor data is checked here (the
    errors are the eager ones), the rest in the op at run time (``run_planned_eager``). The plan's
    block table and lengths are the op's inputs, so the graph orders their writes before it."""
    q = V.require_tensor("q", q)
    kv, v = V.split_cache(paged_kv_cache)
    bmm1, bmm2 = _traced_scales(bmm1_scale, bmm2_scale)
    if out is None:  # q's shape, not the plan's: a plan's shape would be a constant of the graph
        out = torch.empty(q.shape, dtype=plan.o_dtype, device=q.device)
    else:
        out = V.require_tensor("out", out)
    torch.ops.tsdecode.run_planned(handle, q, kv, v, plan.block_tables, plan.seq_lens, out, bmm1, bmm2)
    return out


def _traced_scales(bmm1_scale, bmm2_scale) -> tuple[float | None, float]:
    """The scales' types checked while tracing (the eager TypeError); their values (finite, the
    1/sqrt(D) default for None) when the graph runs: traced floats may be symbolic."""
    if bmm1_scale is not None:
        bmm1_scale = float(V.require_real("bmm1_scale", bmm1_scale))
    return bmm1_scale, float(V.require_real("bmm2_scale", bmm2_scale))


def run_planned_eager(
    handle: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, v: torch.Tensor | None,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, bmm1: float | None,
    bmm2: float,
) -> None:
    """Body of ``torch.ops.tsdecode.run_planned``: the eager ``run`` of the wrapper ``handle``
    into ``out``. block_tables / seq_lens must be the plan's own tensors: a compiled graph that
    wrote them before the op may hand over a copy, which the planned launch would not read."""
    wrapper = _WRAPPERS.get(int(handle))
    plan = None if wrapper is None else wrapper._plan
    if plan is None:
        raise RuntimeError(
            "a compiled graph ran BatchDecodePagedTSWrapper.run() for a wrapper that no longer "
            "exists or has no plan"
        )
    for name, given, planned in (("block_tables", block_tables, plan.block_tables),
                                 ("seq_lens_kv", seq_lens, plan.seq_lens)):
        if given.data_ptr() != planned.data_ptr():
            raise RuntimeError(
                f"the compiled graph passed a copy of the plan's {name} to run(): writes to it "
                f"inside the compiled region are not seen by the planned kernels; write {name} "
                f"outside the compiled function (or re-plan)"
            )
    _run_plan(plan, q, kv if v is None else (kv, v), bmm1, bmm2, out)


def _make_plan(
    block_tables, seq_lens_kv, num_qo_heads, num_kv_heads, head_dim, page_size, *,
    seq_len_q, qo_indptr, max_seq_len_q, q_data_type, kv_data_type, o_data_type, mask_type,
    window_left, max_kv_len, bind_seq_lens, config, num_pages: int | None,
) -> _Plan:
    """Validate plan arguments (one host read) and build the plan; num_pages, when the cache is
    known (one-shot op), also bounds the page IDs."""
    num_qo_heads, num_kv_heads, head_dim, page_size = V.validate_heads(
        num_qo_heads, num_kv_heads, head_dim, page_size
    )
    causal, window_left = V.validate_mask(mask_type, window_left)
    q_dtype, kv_dtype, o_dtype = V.resolve_dtypes(q_data_type, kv_data_type, o_data_type)
    if not isinstance(bind_seq_lens, bool):
        raise TypeError(f"bind_seq_lens must be a bool, got {type(bind_seq_lens).__name__}")
    block_tables, seq_lens_kv = V.validate_block_tables(block_tables, seq_lens_kv, bind_seq_lens)
    device = block_tables.device
    V.validate_execution_device(device, interpreter_active())
    if device.type == "cuda":
        with _on_device(device):
            capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            raise RuntimeError(
                "BatchDecodePagedTSWrapper.plan reads seq_lens_kv and the page IDs on the host and "
                "cannot run during CUDA graph capture; plan before the capture and capture run()"
            )
    if device.type == "cuda":
        V.validate_dtypes_on_gpu(torch.cuda.get_device_capability(device), q_dtype, kv_dtype, o_dtype)
    batch, cols = block_tables.shape
    packed, sq_cap = V.resolve_query_mode(seq_len_q, qo_indptr, max_seq_len_q)
    if packed:
        qo_indptr = V.validate_qo_indptr(qo_indptr, batch, device)
    if max_kv_len is not None:
        max_kv_len = V.require_int("max_kv_len", max_kv_len, minimum=1)
        if max_kv_len > cols * page_size:
            raise ValueError(
                f"max_kv_len={max_kv_len} exceeds the block-table capacity "
                f"C*P = {cols}*{page_size} = {cols * page_size}"
            )

    lens, indptr, min_page, max_page = _plan_host_values(
        block_tables, seq_lens_kv, qo_indptr, page_size, max_kv_len, bind_seq_lens
    )
    capacity = cols * page_size
    for b, n in enumerate(lens):
        if not 1 <= n <= capacity:
            raise ValueError(
                f"seq_lens_kv[{b}]={n} must be in [1, C*P] = [1, {capacity}] "
                f"(block_tables has C={cols} columns of page_size {page_size})"
            )
    longest = max(lens)
    if max_kv_len is None:
        max_kv_len = longest
    elif longest > max_kv_len:
        raise ValueError(f"seq_lens_kv holds {longest}, more than max_kv_len={max_kv_len}")
    if min_page < 0:
        raise ValueError(f"block_tables holds a negative page ID ({min_page}) in a live column")
    if num_pages is not None and max_page >= num_pages:
        raise ValueError(
            f"block_tables holds page ID {max_page} but paged_kv_cache has only {num_pages} pages"
        )
    if packed:
        total_q, longest_q = V.validate_qo_indptr_values(indptr)
        if sq_cap is None:
            sq_cap = longest_q
        elif longest_q > sq_cap:
            raise ValueError(
                f"max_seq_len_q={sq_cap} is smaller than the longest packed request "
                f"({longest_q} query tokens)"
            )
        q_lens = [b - a for a, b in zip(indptr, indptr[1:])]
    else:
        total_q = batch * sq_cap
        q_lens = [sq_cap] * batch
    if causal:
        for b, (nq, nk) in enumerate(zip(q_lens, lens)):
            if nq > nk:
                raise ValueError(
                    f"causal mask needs query length <= K/V length; request {b} has "
                    f"{nq} query tokens and seq_lens_kv[{b}]={nk}"
                )

    geometry = LaunchGeometry(
        batch_size=batch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, seq_len_q=sq_cap, packed=packed,
        causal=causal, window_left=window_left, max_kv_len=max_kv_len, total_q=total_q,
    )
    shape = ProblemShape(
        batch_size=batch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, max_kv_len=max_kv_len, max_seq_len_q=sq_cap,
        packed=packed, mask_kind="windowed" if window_left >= 0 else mask_type,
        q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
        kv_len_spread=1.0 if bind_seq_lens else longest * len(lens) / sum(lens),
        window_left=window_left,
    )
    selected = select_config(shape, device, config)
    seq_lens = seq_lens_kv if bind_seq_lens else seq_lens_kv.clone(memory_format=torch.contiguous_format)
    qo_indptr = qo_indptr.clone() if packed else None
    scratch = allocate_scratch(geometry, selected.kernel_config, device)
    spans = tuple(
        (name, *span) for name, t in (("block_tables", block_tables), ("seq_lens_kv", seq_lens))
        if (span := V.byte_span(t)) is not None
    )
    return _Plan(
        geometry=geometry, selected=selected, q_dtype=q_dtype, kv_dtype=kv_dtype,
        o_dtype=o_dtype,
        q_shape=V.expected_q_shape(packed, batch, sq_cap, total_q, num_qo_heads, head_dim),
        device=device, block_tables=block_tables, seq_lens=seq_lens, qo_indptr=qo_indptr,
        scratch=scratch, max_page_id=max_page,
        launch=DecodeLaunch(
            geometry, selected.kernel_config, q_dtype, kv_dtype, block_tables, seq_lens, qo_indptr,
            scratch, device,
        ),
        plan_tensor_spans=spans,
    )


def _on_device(device: torch.device):
    """The plan's GPU made current for a launch: triton launches on the current device and its
    current stream, so tensors on another GPU than the current one need this (torch ops do the
    same); a no-op (no context switch) when it is current already or the device is the CPU."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _run_plan(plan: _Plan, q, paged_kv_cache, bmm1_scale, bmm2_scale, out) -> torch.Tensor:
    """Validate run arguments against the plan (host metadata only) and launch."""
    g = plan.geometry
    q = V.validate_query(q, plan.q_shape, plan.q_dtype, plan.device)
    kv_cache, page_shape, cache_tensors = V.validate_cache_layout(paged_kv_cache)
    V.validate_cache_against_plan(
        page_shape, cache_tensors[0][1], g.num_kv_heads, g.page_size, g.head_dim, plan.kv_dtype,
        plan.device, plan.max_page_id,
    )
    bmm1, bmm2 = V.validate_scales(bmm1_scale, bmm2_scale, g.head_dim)
    if out is None:
        out = torch.empty(plan.q_shape, dtype=plan.o_dtype, device=plan.device)
    else:
        out = V.validate_out(out, plan.q_shape, plan.o_dtype, plan.device, (("q", q), *cache_tensors),
                             plan.plan_tensor_spans)
    with _on_device(plan.device):
        plan.launch(q, kv_cache, out, bmm1, bmm2)
    return out


def _warm_up(plan: _Plan) -> None:
    """Compile the plan's kernels before any capture (``DecodeLaunch.compile``: no launch, no
    allocation)."""
    with _on_device(plan.device):
        plan.launch.compile(plan.q_shape, plan.q_dtype, plan.kv_dtype, plan.o_dtype)


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
) -> torch.Tensor:
    """One-shot fixed or packed-Q paged decode (FlashInfer PrimTS semantics).

    Reads seq_lens_kv (and qo_indptr) on the host to plan exact bounds, so it cannot be captured
    in a CUDA graph (it raises RuntimeError during capture): plan a BatchDecodePagedTSWrapper
    before capture instead. Output dtype: out_dtype, else out.dtype, else q.dtype.
    paged_kv_cache is HND only: [num_pages, 2, Hkv, P, D] or (K, V) each [num_pages, Hkv, P, D];
    Hkv and P are read from its shape, so an NHD cache [.., P, Hkv, D] with Hq % P == 0 passes
    unnoticed (the wrapper's plan, given Hkv and P, refuses it). Under ``torch.compile`` it is one
    opaque op (``torch.ops.tsdecode.decode_oneshot``), which still reads the lengths on the host
    when the graph runs.
    """
    if torch.compiler.is_compiling():
        return _oneshot_traced(
            q, paged_kv_cache, block_tables, seq_lens_kv, seq_len_q, qo_indptr, max_seq_len_q,
            mask_type, window_left, kv_layout, bmm1_scale, bmm2_scale, out, out_dtype,
        )
    q = V.require_tensor("q", q)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "batch_decode_with_paged_kv_cache reads seq_lens_kv on the host and cannot be captured "
            "in a CUDA graph; plan a BatchDecodePagedTSWrapper before capture and capture run()"
        )
    V.validate_kv_layout(kv_layout)
    if out is not None:
        V.require_tensor("out", out)
        if out_dtype is not None and out_dtype != out.dtype:
            raise TypeError(f"out_dtype={out_dtype} disagrees with out.dtype={out.dtype}")
        out_dtype = out.dtype
    _, (num_pages, num_kv_heads, page_size, head_dim), cache_tensors = V.validate_cache_layout(paged_kv_cache)
    kv_dtype = cache_tensors[0][1].dtype
    if q.dim() not in (3, 4):
        raise ValueError(
            f"q must be [B, Hq, D], [B, SQ, Hq, D] or packed [total_q, Hq, D], got shape {list(q.shape)}"
        )
    if q.dim() == 4 and qo_indptr is not None:
        raise ValueError(f"packed q (with qo_indptr) must be 3-D [total_q, Hq, D], got {list(q.shape)}")
    if q.dim() == 4 and seq_len_q != q.shape[1]:
        raise ValueError(f"q is [B, SQ, Hq, D] with SQ={q.shape[1]} but seq_len_q={seq_len_q}")
    if q.dim() == 3 and qo_indptr is None and seq_len_q != 1:
        raise ValueError(
            f"seq_len_q={seq_len_q} > 1 needs q as [B, SQ, Hq, D] (token-major), got {list(q.shape)}"
        )
    if q.shape[-1] != head_dim:
        raise ValueError(f"q head dim {q.shape[-1]} differs from paged_kv_cache head dim {head_dim}")
    plan = _make_plan(
        block_tables, seq_lens_kv, q.shape[-2], num_kv_heads, head_dim, page_size,
        seq_len_q=seq_len_q, qo_indptr=qo_indptr, max_seq_len_q=max_seq_len_q,
        q_data_type=q.dtype, kv_data_type=kv_dtype, o_data_type=out_dtype,
        mask_type=mask_type, window_left=window_left, max_kv_len=None, bind_seq_lens=False,
        config=None, num_pages=num_pages,
    )
    if (plan.device.type == "cuda" and q.is_contiguous() and (out is None or out.is_contiguous())
            and isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.is_contiguous()):
        # The inputs the plan's compile step assumes: it finds the kernels an earlier call or
        # plan compiled (or compiles them), and the launch below skips triton's dispatch.
        _warm_up(plan)
    return _run_plan(plan, q, paged_kv_cache, bmm1_scale, bmm2_scale, out)


def _oneshot_traced(
    q, paged_kv_cache, block_tables, seq_lens_kv, seq_len_q, qo_indptr, max_seq_len_q, mask_type,
    window_left, kv_layout, bmm1_scale, bmm2_scale, out, out_dtype,
) -> torch.Tensor:
    """The one-shot op as torch.compile traces it: checks that need no tensor data here (the
    eager errors), the rest in the op when the graph runs (the eager function, called by it)."""
    q = V.require_tensor("q", q)
    kv, v = V.split_cache(paged_kv_cache)
    block_tables = V.require_tensor("block_tables", block_tables)
    seq_lens_kv = V.require_tensor("seq_lens_kv", seq_lens_kv)
    if qo_indptr is not None:
        qo_indptr = V.require_tensor("qo_indptr", qo_indptr)
    V.resolve_query_mode(seq_len_q, qo_indptr, max_seq_len_q)  # ints, and their agreement
    seq_len_q = int(seq_len_q)
    max_seq_len_q = None if max_seq_len_q is None else int(max_seq_len_q)
    V.validate_kv_layout(kv_layout)
    _, window_left = V.validate_mask(mask_type, window_left)
    bmm1, bmm2 = _traced_scales(bmm1_scale, bmm2_scale)
    if out is not None:
        out = V.require_tensor("out", out)
        if out_dtype is not None and out_dtype != out.dtype:
            raise TypeError(f"out_dtype={out_dtype} disagrees with out.dtype={out.dtype}")
    else:
        if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"out_dtype must be a torch.dtype or None, got {type(out_dtype).__name__}")
        out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    torch.ops.tsdecode.decode_oneshot(
        q, kv, v, block_tables, seq_lens_kv, seq_len_q, qo_indptr, max_seq_len_q, mask_type,
        window_left, bmm1, bmm2, out,
    )
    return out
