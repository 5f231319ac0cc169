"""Public API: FlashInfer PrimTS paged decode, the plan/run wrapper (the one-shot op is in
``oneshot``, which plans through the functions here).

Shapes (B requests, Hq/Hkv query/KV heads, D head dim, P page size, C block-table columns): q and
the output are [B, Hq, D] (SQ = 1), token-major [B, SQ, Hq, D] (fixed SQ > 1) or packed
[total_q, Hq, D] with qo_indptr int32 [B+1]; the cache is HND, [num_pages, 2, Hkv, P, D] or a
(K, V) pair of [num_pages, Hkv, P, D]; block_tables int32 [B, C]; lengths int32 [B].

A call flows: the arguments are validated (``validation``), the plan picks a ``KernelConfig``
(``config.select_config``: explicit, tuned table or the heuristic) and builds the launcher
(``kernels.launch.DecodeLaunch``), and ``run`` launches it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import weakref
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from . import memory as M
from . import validation as V
from . import workspace as W
from .config.select import SelectedConfig, select_config
from .config.space import KernelConfig, ProblemShape
from .device import INTERPRETER, device_properties
from .kernels.launch import DecodeLaunch
from .kernels.metadata import read_metadata

__all__ = ["BatchDecodePagedTSWrapper", "get_prims_ts_batch_decode_workspace_size"]

CAPTURE_HINT = ("to capture a decode step in a CUDA graph, plan a BatchDecodePagedTSWrapper before the "
                "capture and capture run(..., out=..., validate=False), or call "
                "batch_decode_with_paged_kv_cache(..., workspace_buffer=..., max_kv_len=..., out=..., "
                "validate=False) after one call outside the capture")


@dataclass(frozen=True)
class _Plan:
    """Everything ``run`` needs, published at once so a failed re-plan keeps the old plan."""

    shape: ProblemShape  # max_kv_len is the plan's K/V capacity
    device: torch.device
    selected: SelectedConfig
    query_capacity: int  # query tokens the workspace holds: B * max_seq_len_q
    host_lens: tuple[int, ...] | None  # plan-owned lengths, else None (each run passes them)
    seq_lens: torch.Tensor | None  # the plan's own device copy of host_lens
    workspace: torch.Tensor
    launch: DecodeLaunch

    def q_shape(self, total_q: int) -> tuple[int, ...]:
        s = self.shape
        return V.query_shape(s.packed, s.batch_size, s.max_seq_len_q, total_q, s.num_qo_heads, s.head_dim)

    def matches(self, q, paged_kv_cache, out, block_tables, seq_lens, qo_indptr=None) -> bool:
        """Host-only, cheap: do the tensors' shapes, dtypes and devices, and the strides the kernels
        assume rather than take, fit this plan, and is out apart from itself and the inputs? (What
        an unvalidated run checks: a tensor of another shape or dtype would be read or written out
        of bounds, one of other strides read wrongly, one on another device through a pointer the
        kernels cannot use, and an overlapping out would overwrite what they read.) A False only
        sends the run through the full tensor checks, which say what is wrong."""
        s, device = self.shape, self.device
        q_shape, q_row, combined_page, page, lens_shape, kv_inner, indptr_shape = self._expected_shapes
        try:
            if q.dtype != s.q_dtype or q.device != device:
                return False
            if q_shape is not None and q.shape != q_shape:
                return False
            if q_shape is None and (q.dim() != 3 or not s.batch_size <= q.shape[0] <= self.query_capacity
                                    or q.shape[1:] != q_row):
                return False  # packed: at least one token a request, at most the capacity
            if not q.is_contiguous() and (q.stride(-1) != 1 or M.element_extent(q) >= V.INT32_ELEMENTS):
                return False  # (contiguous, D > 1: stride(-1) is 1) the kernels index q in int32
            if out is not None and (out.shape != q.shape or out.dtype != s.o_dtype or out.device != device):
                return False
            if isinstance(paged_kv_cache, torch.Tensor):
                if paged_kv_cache.dtype != s.kv_dtype or paged_kv_cache.shape[1:] != combined_page:
                    return False
                if paged_kv_cache.device != device or (not paged_kv_cache.is_contiguous()
                                                        and paged_kv_cache.stride()[-len(kv_inner):] != kv_inner):
                    return False
            else:
                k, v = paged_kv_cache
                if k.dtype != s.kv_dtype or v.dtype != s.kv_dtype or k.shape[1:] != page or v.shape != k.shape:
                    return False
                if k.stride()[-len(kv_inner):] != kv_inner or v.stride()[-len(kv_inner):] != kv_inner \
                        or k.device != device or v.device != device:
                    return False
            if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != s.batch_size:
                return False
            if block_tables.device != device or (not block_tables.is_contiguous() and block_tables.stride(1) != 1
                                                 and block_tables.shape[1] > 1):
                return False  # a row is read with unit stride
            if seq_lens.dtype != torch.int32 or seq_lens.shape != lens_shape:
                return False
            if (s.batch_size > 1 and seq_lens.stride(0) != 1) or seq_lens.device != device:
                return False
            if qo_indptr is not None and not (qo_indptr.dtype == torch.int32 and qo_indptr.shape == indptr_shape
                                              and qo_indptr.stride(0) == 1 and qo_indptr.device == device):
                return False
            if out is None:
                return True
            # out apart from itself and the inputs; a shared storage only sends the run to the full
            # checks, which compare byte spans (out may lie beside an input in one buffer)
            if not out.is_contiguous() and (out.stride(-1) != 1 or M.overlaps_itself(out) or
                                            M.element_extent(out) >= V.INT32_ELEMENTS):
                return False
            base = out.untyped_storage().data_ptr()
            if base == self._workspace_memory[0]:
                return False
            kv = (paged_kv_cache,) if isinstance(paged_kv_cache, torch.Tensor) else paged_kv_cache
            for t in (q, *kv, block_tables, seq_lens, qo_indptr):
                if t is not None and t.untyped_storage().data_ptr() == base:
                    return False
            return True
        except (AttributeError, IndexError, TypeError, ValueError):  # not tensors, 0-d ones, or not a (K, V) pair
            return False

    @functools.cached_property
    def _workspace_memory(self) -> tuple:  # the run checks' view of the workspace: W.workspace_memory
        return W.workspace_memory(self.workspace, self.shape, self.selected.kernel_config.num_kv_splits)

    @functools.cached_property
    def _expected_shapes(self) -> tuple:
        """(q's shape, None when packed; a packed q's [Hq, D]; a combined cache's [2, Hkv, P, D];
        a page [Hkv, P, D]; the lengths' [B]; the cache's last strides, which the kernels assume
        (token stride D, head-dim stride 1; the token stride is never stepped with one-token pages);
        the packed offsets' [B+1]) for ``matches``."""
        s = self.shape
        page = (s.num_kv_heads, s.page_size, s.head_dim)
        q_shape = None if s.packed else torch.Size(self.q_shape(self.query_capacity))
        kv_inner = (s.head_dim, 1) if s.page_size > 1 else (1,)
        return (q_shape, torch.Size((s.num_qo_heads, s.head_dim)), torch.Size((2, *page)), torch.Size(page),
                torch.Size((s.batch_size,)), kv_inner, torch.Size((s.batch_size + 1,)))


def on_device(device: torch.device):
    """The plan's GPU made current for a launch (triton launches on the current device)."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def capturing(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    with on_device(device):
        return torch.cuda.is_current_stream_capturing()


# --- plan ----------------------------------------------------------------------------------------

def plan_problem(device, batch_size, num_qo_heads, num_kv_heads, head_dim, page_size, max_kv_len,
                 max_seq_len_q, packed_query, q_data_type, kv_data_type, o_data_type, mask_type, window_left,
                 names=("q_data_type", "kv_data_type", "o_data_type"),
                 size_names=("batch_size", "max_kv_len", "max_seq_len_q"),
                 device_name="device") -> tuple[torch.device, ProblemShape]:
    """Validate the plan arguments into a device and a ProblemShape (kv_len_spread 1); ``names``
    (the dtypes), ``size_names`` (batch size, K/V and query capacities) and ``device_name``: what
    the caller called them, for the errors."""
    device = V.validate_device(device, INTERPRETER, device_name)
    V.require_int("batch_size", batch_size, minimum=1)
    num_qo_heads, num_kv_heads, head_dim, page_size = V.validate_heads(num_qo_heads, num_kv_heads,
                                                                       head_dim, page_size)
    batch_size, max_kv_len, max_seq_len_q = V.validate_sizes(batch_size, max_kv_len, max_seq_len_q, num_qo_heads,
                                                             size_names, head_dim=head_dim)
    packed = V.require_bool("packed_query", packed_query)
    causal, window_left = V.validate_mask(mask_type, window_left)
    q_dtype, kv_dtype, o_dtype = V.resolve_dtypes(q_data_type, kv_data_type, o_data_type, names)
    if device.type == "cuda":
        V.validate_dtypes_on_gpu(device_properties(device).compute_capability,
                                 tuple(zip(names, (q_dtype, kv_dtype, o_dtype))))
    shape = ProblemShape(
        batch_size=batch_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, max_kv_len=max_kv_len, max_seq_len_q=max_seq_len_q, packed=packed,
        mask_kind="windowed" if window_left >= 0 else mask_type, q_dtype=q_dtype, kv_dtype=kv_dtype,
        o_dtype=o_dtype, window_left=window_left)
    return device, shape


def make_plan(device, shape: ProblemShape, host_lens: tuple[int, ...] | None, workspace_buffer,
              config: KernelConfig | None) -> _Plan:
    props = device_properties(device)
    if host_lens is not None:
        shape = dataclasses.replace(shape, kv_len_spread=max(host_lens) * len(host_lens) / sum(host_lens))
    selected = select_config(shape, props, config)
    if workspace_buffer is not None:
        workspace_buffer = V.require_tensor("workspace_buffer", workspace_buffer)
        need = W.workspace_bytes(shape, selected.kernel_config.num_kv_splits)
        if config is None and workspace_buffer.numel() < need:
            selected = W.fit_to_workspace(shape, selected, workspace_buffer.numel())
            need = W.workspace_bytes(shape, selected.kernel_config.num_kv_splits)
        workspace = W.validate_workspace(workspace_buffer, device, need)
    else:
        workspace = torch.empty(W.workspace_bytes(shape, selected.kernel_config.num_kv_splits),
                                dtype=torch.uint8, device=device)
    seq_lens = None
    if host_lens is not None:
        seq_lens = torch.tensor(host_lens, dtype=torch.int32).to(device)
    partials = W.partials_views(workspace, shape, selected.kernel_config.num_kv_splits)
    launch = DecodeLaunch(shape, selected.kernel_config, shape.batch_size * shape.max_seq_len_q, device, partials)
    return _Plan(shape, device, selected, shape.batch_size * shape.max_seq_len_q, host_lens, seq_lens,
                 workspace, launch)


def get_prims_ts_batch_decode_workspace_size(
    batch_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, max_seq_len: int,
    *, seq_len_q: int = 1, qo_indptr: torch.Tensor | None = None, max_seq_len_q: int | None = None,
    q_dtype: torch.dtype = torch.float16, kv_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
    mask_type: Literal["dense", "causal"] = "dense", window_left: int = -1, kv_layout: Literal["HND"] = "HND",
    device: int | str | torch.device | None = None,
) -> int:
    """Bytes of ``workspace_buffer`` a plan of these arguments needs (the split partials), from
    the same config selection as ``plan`` without compiling anything. ``max_seq_len`` is the K/V
    capacity (plan's ``max_kv_len``); packed queries (``qo_indptr`` given) need ``max_seq_len_q``.
    A plan given a buffer of this size fits its split count to it."""
    V.validate_kv_layout(kv_layout)
    seq_len_q = V.require_int("seq_len_q", seq_len_q, minimum=1)
    if max_seq_len_q is not None:
        max_seq_len_q = V.require_int("max_seq_len_q", max_seq_len_q, minimum=1)
    packed = qo_indptr is not None
    if packed:
        V.require_tensor("qo_indptr", qo_indptr)
        sq = V.packed_capacity(seq_len_q, max_seq_len_q)
        if sq is None:
            raise ValueError("packed queries (qo_indptr given) need max_seq_len_q (or its alias, a seq_len_q "
                             "other than 1) to size the workspace")
    else:
        sq = seq_len_q
        if max_seq_len_q is not None and max_seq_len_q != sq:
            raise ValueError(f"in fixed-query mode max_seq_len_q must equal seq_len_q={sq}, got {max_seq_len_q}")
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    device, shape = plan_problem(device, batch_size, num_qo_heads, num_kv_heads, head_dim, page_size,
                                 max_seq_len, sq, packed, q_dtype, kv_dtype, out_dtype, mask_type, window_left,
                                 ("q_dtype", "kv_dtype", "out_dtype"),
                                 ("batch_size", "max_seq_len", "max_seq_len_q" if packed else "seq_len_q"))
    selected = select_config(shape, device_properties(device))
    return W.workspace_bytes(shape, selected.kernel_config.num_kv_splits)


# --- the wrapper ---------------------------------------------------------------------------------

class BatchDecodePagedTSWrapper:
    """Plan once, run many (FlashInfer's ``BatchDecodePagedTSWrapper`` call form).

    ``plan`` fixes the device, batch size, head geometry, page size, dtypes, query layout and K/V
    capacity, picks the kernel config (``config=``, a tuned table or the heuristic) and compiles
    the kernels. Lengths are owned by the plan (``seq_lens`` given to ``plan``; ``run`` then takes
    ``seq_lens=None``) or passed to every ``run`` as a CUDA int32 tensor. The block table (and
    packed ``qo_indptr``) go to every ``run``; only each request's live pages are read.
    ``run(validate=True)`` checks everything against the plan, reading the metadata back to the
    host; ``run(validate=False)`` trusts it: no host sync, and no allocation when ``out`` is given,
    so it can be captured in a CUDA graph (after one run outside the capture). One wrapper is one
    ordered lane: at most one run or replay in flight (its workspace holds the split partials).
    """

    def __init__(self, kv_layout: Literal["HND"] = "HND") -> None:
        V.validate_kv_layout(kv_layout)
        self.kv_layout = kv_layout
        self._plan: _Plan | None = None
        self._handle = _register_wrapper(self)

    def __copy__(self) -> BatchDecodePagedTSWrapper:
        """A wrapper of its own (own handle, re-plannable apart) sharing this one's plan and
        workspace until it re-plans: one run in flight between the two."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin._handle = _register_wrapper(twin)
        return twin

    def __getstate__(self) -> dict:
        if self._plan is not None:
            raise TypeError("a planned BatchDecodePagedTSWrapper cannot be deep-copied or pickled; create a "
                            "new wrapper and plan it (copy.copy shares the plan)")
        state = self.__dict__.copy()
        del state["_handle"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._handle = _register_wrapper(self)

    @property
    def config(self) -> SelectedConfig:
        """The planned ``SelectedConfig``: ``.kernel_config`` and where it came from (tsdecode)."""
        if self._plan is None:
            raise RuntimeError("BatchDecodePagedTSWrapper.config is available after plan()")
        return self._plan.selected

    def plan(
        self, device: int | str | torch.device, batch_size: int, num_qo_heads: int, num_kv_heads: int,
        head_dim: int, page_size: int, max_kv_len: int, *, max_seq_len_q: int = 1, packed_query: bool = False,
        q_data_type: torch.dtype = torch.float16, kv_data_type: torch.dtype | None = None,
        o_data_type: torch.dtype | None = None, mask_type: Literal["dense", "causal"] = "dense",
        window_left: int = -1, seq_lens: Sequence[int] | torch.Tensor | None = None,
        workspace_buffer: torch.Tensor | None = None, config: KernelConfig | None = None,
    ) -> None:
        """Fix the launch for runs of this geometry.

        Parameters
        ----------
        device : the CUDA device to compile for and launch on (the CPU under TRITON_INTERPRET=1).
        batch_size : B of every run. num_qo_heads, num_kv_heads : Hq % Hkv == 0.
        head_dim : 64, 96, 128, 192 or 256. page_size : tokens per page, 1..1024.
        max_kv_len : the K/V length capacity; runs' lengths lie in [1, max_kv_len].
        max_seq_len_q : the exact SQ (fixed query) or the per-request cap (``packed_query``).
        packed_query : q/out are [total_q, Hq, D] and each run passes ``qo_indptr``.
        q_data_type, kv_data_type, o_data_type : kv and o default to q's dtype.
        mask_type, window_left : "dense" or "causal"; a window (>= 0) needs causal.
        seq_lens : host lengths (a sequence or a CPU tensor of B values): the plan owns them and
            every run passes ``seq_lens=None``. None: each run passes a CUDA int32 tensor.
        workspace_buffer : int8/uint8 memory on ``device``, 32-byte aligned, at least
            ``get_prims_ts_batch_decode_workspace_size`` bytes; allocated here if omitted.
        config : (tsdecode) an explicit ``KernelConfig`` instead of the table or heuristic.

        Refuses a CUDA graph capture (RuntimeError) and keeps the previous plan on any error.
        """
        device, shape = plan_problem(device, batch_size, num_qo_heads, num_kv_heads, head_dim, page_size,
                                 max_kv_len, max_seq_len_q, packed_query, q_data_type, kv_data_type,
                                 o_data_type, mask_type, window_left)
        if capturing(device):
            raise RuntimeError("BatchDecodePagedTSWrapper.plan cannot run during CUDA graph capture "
                               "(it compiles kernels and may allocate); " + CAPTURE_HINT)
        host_lens = None
        if seq_lens is not None:
            host_lens = V.validate_host_lengths(seq_lens, shape.batch_size, shape.max_kv_len)
            if shape.causal and not shape.packed:
                for b, n in enumerate(host_lens):
                    if shape.max_seq_len_q > n:
                        raise ValueError(f"causal mask needs query length <= K/V length; request {b} has "
                                         f"{shape.max_seq_len_q} query tokens and seq_lens[{b}]={n}")
        plan = make_plan(device, shape, host_lens, workspace_buffer, config)
        if device.type == "cuda":
            with on_device(device):
                plan.launch.compile(plan.q_shape(plan.query_capacity))
        self._plan = plan

    def run(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        seq_lens: torch.Tensor | None, block_tables: torch.Tensor, *, qo_indptr: torch.Tensor | None = None,
        bmm1_scale: float | None = None, bmm2_scale: float = 1.0, out: torch.Tensor | None = None,
        validate: bool = True,
    ) -> torch.Tensor:
        """The attention output, laid out like ``q``, in the plan's output dtype (``out`` if given).

        ``seq_lens`` is required iff the plan does not own the lengths (CUDA int32 [B]);
        ``block_tables`` int32 [B, C] with contiguous rows (row stride >= C), of which only each
        request's first ceil(len / P) entries are read; ``qo_indptr`` int32 [B+1] for a packed
        plan. ``validate=False`` checks only the tensors' shapes, dtypes, devices and strides, on the
        host: no sync, nothing allocated when ``out`` is given (CUDA-graph capturable).
        Under ``torch.compile`` it is one opaque op (``torch.ops.tsdecode.run_planned``).
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("BatchDecodePagedTSWrapper.run() called before plan()")
        seq_lens = _lengths_owner(plan, seq_lens)
        _indptr_owner(plan, qo_indptr)
        if torch.compiler.is_compiling():
            return _run_traced(self._handle, plan, q, paged_kv_cache, seq_lens, block_tables, qo_indptr,
                               bmm1_scale, bmm2_scale, out, validate)
        return run_plan(plan, q, paged_kv_cache, seq_lens, block_tables, qo_indptr, bmm1_scale, bmm2_scale,
                        out, V.require_bool("validate", validate))


def _lengths_owner(plan: _Plan, seq_lens):
    # plan.seq_lens, not host_lens: torch.compile guards a tuple on its length (a recompile per B)
    if plan.seq_lens is not None:
        if seq_lens is not None:
            raise ValueError("this plan owns the lengths (seq_lens was given to plan()): pass seq_lens=None to run()")
        return plan.seq_lens
    if seq_lens is None:
        raise ValueError("seq_lens is required: the plan does not own the lengths (no seq_lens given to plan()); "
                         "pass a CUDA int32 tensor of B lengths")
    return seq_lens


def _indptr_owner(plan: _Plan, qo_indptr) -> None:
    if plan.shape.packed and qo_indptr is None:
        raise ValueError("qo_indptr is required: the plan is packed (packed_query=True)")
    if not plan.shape.packed and qo_indptr is not None:
        raise ValueError("qo_indptr was given but the plan is not packed (plan with packed_query=True)")


def run_plan(plan: _Plan, q, paged_kv_cache, seq_lens, block_tables, qo_indptr, bmm1_scale, bmm2_scale, out,
             validate: bool, values_checked: bool = False, names: V.ArgNames = V.ArgNames()) -> torch.Tensor:
    """Validate (unless told not to) and launch. ``values_checked``: the metadata's values were read and
    checked already (the one-shot op), so only tensor layouts are checked here. Unvalidated, the tensors'
    shapes and dtypes are still matched against the plan on the host; where they do not match, the tensor
    checks run (never the metadata read) and say what is wrong, calling q, the cache and the lengths as
    ``names`` does."""
    s = plan.shape
    if validate or not plan.matches(q, paged_kv_cache, out, block_tables, seq_lens, qo_indptr):
        q = V.require_tensor(names.q, q)
        kv, page_shape, kv_dtype, kv_device, cache_tensors = V.cache_page_shape(paged_kv_cache, names.cache)
        V.validate_cache_against_plan(page_shape, kv_dtype, kv_device, s.num_kv_heads, s.page_size,
                                      s.head_dim, s.kv_dtype, plan.device)
        block_tables = V.validate_block_tables(block_tables, s.batch_size, plan.device)
        seq_lens = V.validate_lengths_tensor(names.lens, seq_lens, s.batch_size, plan.device)
        if s.packed:
            qo_indptr = V.validate_qo_indptr(qo_indptr, s.batch_size, plan.device)
        if s.packed and q.dim() != 3:
            raise ValueError(f"{names.q} must be packed [total_q, Hq, D] (the plan is packed), with total_q at most "
                             f"B*max_seq_len_q = {plan.query_capacity}; got shape {list(q.shape)}")
        total_q = q.shape[0] if s.packed and q.dim() == 3 else plan.query_capacity
        q = V.validate_io_tensor(names.q, q, plan.q_shape(total_q), V.describe_query_layout(s.packed, s.max_seq_len_q),
                                 s.q_dtype, plan.device, "as planned by q_data_type, whose default is torch.float16")
        if s.packed and not s.batch_size <= total_q <= plan.query_capacity:
            raise ValueError(f"{names.q} holds {total_q} query tokens; packed, it holds at least one token a "
                             f"request and at most B*max_seq_len_q: from B={s.batch_size} to {plan.query_capacity}")
        spans = M.byte_spans(((names.q, q), *cache_tensors, ("block_tables", block_tables), (names.lens, seq_lens),
                              *((("qo_indptr", qo_indptr),) if qo_indptr is not None else ())))  # what is read
        if out is not None:
            out = V.validate_io_tensor("out", out, tuple(q.shape), f"{names.q}'s shape", s.o_dtype, plan.device,
                                      "as planned by o_data_type, whose default is q_data_type")
            M.validate_out(out, spans + plan._workspace_memory[1])
        M.validate_workspace_apart(plan._workspace_memory[2], spans)
        bmm1, bmm2 = V.validate_scales(bmm1_scale, bmm2_scale, s.head_dim)
        if validate and not values_checked:
            _check_metadata_values(plan, block_tables, seq_lens, qo_indptr, page_shape[0], total_q)
    else:
        kv = paged_kv_cache
        bmm1, bmm2 = V.validate_scales(bmm1_scale, bmm2_scale, s.head_dim)
    if out is None:
        out = torch.empty(q.shape, dtype=s.o_dtype, device=plan.device)
    with on_device(plan.device):
        plan.launch(q, kv, out, block_tables, seq_lens, qo_indptr, bmm1, bmm2)
    return out


def _check_metadata_values(plan: _Plan, block_tables, seq_lens, qo_indptr, num_pages: int, total_q: int) -> None:
    """One device read of the lengths, packed offsets and live page-ID range, checked on the host."""
    s = plan.shape
    with on_device(plan.device):
        lens, indptr, min_page, max_page = read_metadata(block_tables, seq_lens, qo_indptr, s.page_size)
    V.validate_metadata_values(s, lens, indptr, min_page, max_page, block_tables.shape[1], num_pages, total_q,
                               "seq_lens")


# --- torch.compile -------------------------------------------------------------------------------

# Wrappers by handle, for the compiled path: its op takes the handle and finds the wrapper's plan
# when the graph runs. Weak: the registry keeps no wrapper alive. The handle is a 0-d int64 CPU
# tensor, so a compiled graph takes it as an input (an int would be a constant of the graph).
_WRAPPERS: weakref.WeakValueDictionary[int, BatchDecodePagedTSWrapper] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def _register_wrapper(wrapper: BatchDecodePagedTSWrapper) -> torch.Tensor:
    handle = next(_HANDLES)
    _WRAPPERS[handle] = wrapper
    return torch.tensor(handle, dtype=torch.int64)


def traced_scales(bmm1_scale, bmm2_scale) -> tuple[float | None, float]:
    """The scales' types checked while tracing (the eager TypeError); their values when the graph
    runs (traced floats may be symbolic)."""
    bmm1 = None if bmm1_scale is None else V.require_real("bmm1_scale", bmm1_scale)
    return bmm1, V.require_real("bmm2_scale", bmm2_scale)


def _run_traced(handle, plan: _Plan, q, paged_kv_cache, seq_lens, block_tables, qo_indptr, bmm1_scale,
                bmm2_scale, out, validate) -> torch.Tensor:
    """``run`` as torch.compile traces it: checks that need no tensor data here (the eager
    errors), the rest in the op when the graph runs. The metadata tensors are the op's inputs, so
    the graph orders writes to them before it and a new block table needs no recompile."""
    q = V.require_tensor("q", q)
    kv, v = V.split_cache(paged_kv_cache)
    bmm1, bmm2 = traced_scales(bmm1_scale, bmm2_scale)
    if out is None:  # q's shape, not the plan's: a plan's shape would be a constant of the graph
        out = torch.empty(q.shape, dtype=plan.shape.o_dtype, device=q.device)
    else:
        out = V.require_tensor("out", out)
    torch.ops.tsdecode.run_planned(handle, q, kv, v, seq_lens, block_tables, qo_indptr, out, bmm1, bmm2,
                                   V.require_bool("validate", validate))
    return out


def run_planned_eager(handle, q, kv, v, seq_lens, block_tables, qo_indptr, out, bmm1, bmm2, validate) -> None:
    """Body of ``torch.ops.tsdecode.run_planned``: the eager ``run`` of wrapper ``handle`` into out."""
    wrapper = _WRAPPERS.get(int(handle))
    plan = None if wrapper is None else wrapper._plan
    if plan is None:
        raise RuntimeError("a compiled graph ran BatchDecodePagedTSWrapper.run() for a wrapper that no "
                           "longer exists or has no plan")
    run_plan(plan, q, kv if v is None else (kv, v), seq_lens, block_tables, qo_indptr, bmm1, bmm2, out, validate)
