"""The launcher: a plan's grids and constexprs, its split partials, and fast launches of the kernels.

``DecodeLaunch`` fixes everything a plan decides (grid, constexprs, split partials) and launches
the split kernel and, with more than one split, the merge kernel. Its first call with a given
specialisation (pointer alignments, strides) goes through triton's dispatch; later calls launch
the compiled kernels directly (``CompiledKernel[grid](...)``), which skips triton's per-call
argument binding. ``compile`` builds a plan's kernels without launching anything, so a plan's
first run launches directly too and a CUDA graph can capture it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ..config.space import KernelConfig, ProblemShape, merge_block_d, merge_splits_per_pass
from ..device import INTERPRETER, device_properties, interpreted_launch
from .decode import LOG2E, _merge_kernel, _split_kv_kernel

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def compute_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> tl.dtype:
    """The tl.dot operand dtype (fp32 accumulation either way): q's for 16-bit caches; float16
    for fp8 caches, because e4m3 -> fp16 is one native conversion per two values on sm89+, every
    e4m3 value is exact in fp16, and fp16 keeps more mantissa than bf16 for P @ V."""
    if kv_dtype == torch.float8_e4m3fn:
        return tl.float16
    return _TL_DTYPES.get(q_dtype, tl.float16)


def scales_q_rows(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the split kernel scales each packed row of q by a power of two (and the scores by
    its inverse) before converting it to the float16 products: a bfloat16 q over an fp8 cache,
    whose values may lie past float16's range."""
    return q_dtype == torch.bfloat16 and compute_dtype(q_dtype, kv_dtype) == tl.float16


def transposed_products(kv_dtype: torch.dtype, rows: int, config: KernelConfig) -> bool:
    """Whether the split kernel computes S^T = K Q^T and O^T = V^T P^T: the MMA's M side holds 16
    tokens instead of rows padded to 16, so at <= 8 rows it issues half the MMAs and holds half
    the accumulator. Taken for 8-bit caches, whose per-tile instruction chain limits them; 16-bit
    caches are bandwidth-bound and gain nothing from it."""
    return config.uses_dot and rows <= 8 and kv_dtype.itemsize == 1


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (sm90+): the merge kernel, and this op after the previous
    kernel, launch while the prior grid drains; each kernel waits before its first load."""
    return device.type == "cuda" and not INTERPRETER and device_properties(device).compute_capability[0] >= 9


def partials_shape(query_capacity: int, num_qo_heads: int, num_kv_splits: int,
                   head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the fp32 split partials: outputs [query_capacity, Hq, S, D] and log2-sum-exps
    [query_capacity, Hq, S] (query_capacity: the query tokens a plan holds, B x max_seq_len_q)."""
    return ((query_capacity, num_qo_heads, num_kv_splits, head_dim),
            (query_capacity, num_qo_heads, num_kv_splits))


def allocate_partials(shape: ProblemShape, config: KernelConfig, query_capacity: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The split partials (None with one split: the kernel writes the output directly)."""
    if config.num_kv_splits == 1:
        return None
    o_shape, lse_shape = partials_shape(query_capacity, shape.num_qo_heads, config.num_kv_splits, shape.head_dim)
    return (torch.empty(o_shape, dtype=torch.float32, device=device),
            torch.empty(lse_shape, dtype=torch.float32, device=device))


def _io_strides(stride: tuple[int, ...], packed: bool) -> tuple[int, int, int]:
    """(batch, token, head) strides of q or out in any of the three query layouts."""
    if len(stride) == 4:  # [B, SQ, H, D]
        return stride[0], stride[1], stride[2]
    if packed:  # [total_q, H, D]
        return 0, stride[0], stride[1]
    return stride[0], 0, stride[1]  # [B, H, D], SQ = 1


def _int_class(value: int) -> tuple[bool, bool, bool]:
    """What triton specialises an integer argument on: == 1, divisible by 16, and 64-bit."""
    return value == 1, value % 16 == 0, not -(2**31) <= value < 2**31


def _cache_pointers(kv_cache) -> tuple[int, int, tuple[int, int, int, int]]:
    """(K pointer, V pointer, (K page, K head, V page, V head) strides) of a combined
    [num_pages, 2, Hkv, P, D] cache or a (K, V) pair of [num_pages, Hkv, P, D]."""
    if isinstance(kv_cache, torch.Tensor):  # K and V of page i: [i, 0] and [i, 1]
        s = kv_cache.stride()
        k_ptr = kv_cache.data_ptr()
        return k_ptr, k_ptr + s[1] * kv_cache.element_size(), (s[0], s[2]) * 2
    k, v = kv_cache
    return k.data_ptr(), v.data_ptr(), (k.stride(0), k.stride(1), v.stride(0), v.stride(1))


class DecodeLaunch:
    """One plan's launches of the split kernel (and the merge with more than one split).

    Fixed here: the grid, every constexpr, the split partials. A call passes q, the cache, out,
    the metadata tensors (block table, lengths, packed offsets) and the scales; it neither syncs
    nor allocates. ``transposed`` and ``pdl`` override the product form and programmatic
    dependent launch (None: ``transposed_products`` and ``pdl_supported``), for scripts that
    compare the two forms or launch modes.
    """

    _MAX_ENTRIES = 16  # specialisations remembered per plan (triton's cache keeps the rest)

    def __init__(self, shape: ProblemShape, config: KernelConfig, query_capacity: int, device: torch.device,
                 partials: tuple[torch.Tensor, torch.Tensor] | None, *, transposed: bool | None = None,
                 pdl: bool | None = None) -> None:
        self.shape, self.config, self.device = shape, config, device
        rows = shape.rows_per_kv_head
        num_m_blocks = -(-rows // config.block_m)
        if transposed is None:
            transposed = transposed_products(shape.kv_dtype, rows, config)
        self.pdl = pdl_supported(device) if pdl is None else bool(pdl) and pdl_supported(device)
        block_d = triton.next_power_of_2(shape.head_dim)
        splits = config.num_kv_splits
        if splits > 1:
            partial_o, partial_lse = partials
            po_strides = partial_o.stride()[:3]
            lse_strides = partial_lse.stride()[:2]
        else:
            partial_o = partial_lse = None  # the kernel takes ``out`` there, unused when DIRECT_OUT
            po_strides, lse_strides = (0, 0, 0), (0, 0)
        self._partials = (partial_o, partial_lse)
        self._partial_ptrs = (partial_o.data_ptr(), partial_lse.data_ptr()) if splits > 1 else None
        self._scalars = (int(shape.window_left), int(shape.max_kv_len), shape.num_kv_heads, splits)
        self._po_lse_strides = (*po_strides, *lse_strides)
        self._grid = (shape.batch_size * shape.num_kv_heads * num_m_blocks, splits, 1)
        self._split_constexprs = dict(
            GROUP_SIZE=shape.group_size, HEAD_DIM=shape.head_dim, BLOCK_D=block_d,
            PAGE_SIZE=shape.page_size, SEQ_LEN_Q=shape.max_seq_len_q, PACKED=shape.packed,
            CAUSAL=shape.causal, WINDOW=shape.window_left >= 0, NUM_M_BLOCKS=num_m_blocks,
            BLOCK_M=triton.next_power_of_2(rows) if transposed else config.block_m,
            BLOCK_N=config.block_n, TRANSPOSED=transposed, DIRECT_OUT=splits == 1,
            # The interpreter computes 16-bit tl.dot wrongly, so its dot forms take fp32 operands;
            # its FMA form converts the operands as a GPU does.
            USE_DOT=config.uses_dot, DOT_FP32=INTERPRETER and config.uses_dot,
            COMPUTE_DTYPE=compute_dtype(shape.q_dtype, shape.kv_dtype), NUM_STAGES=config.num_stages,
            USE_PDL=self.pdl, SCALE_Q_ROWS=scales_q_rows(shape.q_dtype, shape.kv_dtype),
        )
        self._split_options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        self._merge_grid, self._merge_constexprs, self._merge_options = None, {}, {}
        if splits > 1:
            sms = device_properties(device).sm_count
            merge_rows = query_capacity * shape.num_qo_heads
            merge_columns = merge_block_d(merge_rows, block_d, sms)  # head-dim slice
            # One [BLOCK_S, BLOCK_D] fp32 tile of partials per program: all splits at once up to
            # MERGE_BLOCK_ELEMENTS (64 registers a thread at 4 warps), one warp per 2048 elements.
            merge_block_s = min(triton.next_power_of_2(splits), merge_splits_per_pass(merge_rows, block_d, sms))
            self._merge_grid = (query_capacity, shape.num_qo_heads, block_d // merge_columns)
            self._merge_constexprs = dict(HEAD_DIM=shape.head_dim, BLOCK_D=merge_columns,
                                          SEQ_LEN_Q=shape.max_seq_len_q, PACKED=shape.packed,
                                          BLOCK_S=merge_block_s, USE_PDL=self.pdl)
            self._merge_options = dict(num_warps=max(1, min(4, merge_block_s * merge_columns // 2048)))
        self._launch_options = {"launch_pdl": True} if self.pdl else {}
        self._direct: dict[tuple, _DirectLaunch] = {}
        self._direct_broken = INTERPRETER or device.type != "cuda"

    def __call__(self, q: torch.Tensor, kv_cache, out: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, qo_indptr: torch.Tensor | None, bmm1_scale: float,
                 bmm2_scale: float) -> None:
        """q/out: [B, Hq, D], [B, SQ, Hq, D] or packed [total_q, Hq, D]; kv_cache compact inside a
        page (the page stride may be padded); block_tables [B, C] with contiguous rows; seq_lens
        [B] and qo_indptr [B+1] contiguous."""
        if INTERPRETER and out.dtype.itemsize == 1:  # the interpreter mis-rounds fp32 -> fp8 stores:
            staged = torch.empty_strided(out.shape, out.stride(), dtype=torch.float32, device=out.device)
            self(q, kv_cache, staged, block_tables, seq_lens, qo_indptr, bmm1_scale, bmm2_scale)
            out.copy_(staged)  # torch rounds to nearest
            return
        k_ptr, v_ptr, kv_strides = _cache_pointers(kv_cache)
        packed = self.shape.packed
        indptr = qo_indptr if qo_indptr is not None else seq_lens  # unused unless PACKED
        varying = (*_io_strides(q.stride(), packed), *_io_strides(out.stride(), packed), *kv_strides)
        q_ptr, out_ptr = q.data_ptr(), out.data_ptr()
        meta_ptrs = (block_tables.data_ptr(), seq_lens.data_ptr(), indptr.data_ptr())
        bt_stride = block_tables.stride(0)
        scales = (float(bmm1_scale) * LOG2E, float(bmm2_scale))
        key = (q_ptr % 16, k_ptr % 16, v_ptr % 16, out_ptr % 16, *(p % 16 for p in meta_ptrs),
               *map(_int_class, (bt_stride, *varying)))
        merge_grid = self._merge_grid
        if merge_grid is not None and packed:  # one merge program row per query token of this call
            merge_grid = (q.shape[0], *merge_grid[1:])
        direct = self._direct.get(key)
        if direct is not None:
            partials = self._partial_ptrs or (out_ptr, out_ptr)
            try:
                direct((q_ptr, k_ptr, v_ptr, *meta_ptrs, out_ptr, *partials, *scales, *self._scalars,
                        *varying, bt_stride, *self._po_lse_strides),
                       (*partials, out_ptr, scales[1], self.config.num_kv_splits, *self._po_lse_strides,
                        *varying[3:6]) if merge_grid is not None else None, merge_grid)
                return
            except TypeError:  # a triton whose compiled-kernel launcher takes other arguments:
                self._direct_broken = True  # from now on through triton's dispatch
                self._direct.clear()
        k_cache, v_cache = kv_cache.unbind(1) if isinstance(kv_cache, torch.Tensor) else kv_cache
        partial_o, partial_lse = self._partials
        if partial_o is None:
            partial_o = partial_lse = out
        split_args = (q, k_cache, v_cache, block_tables, seq_lens, indptr, out, partial_o, partial_lse,
                      *scales, *self._scalars, *varying, bt_stride, *self._po_lse_strides)
        merge_args = None
        if self._merge_grid is not None:
            merge_args = (partial_o, partial_lse, out, scales[1], self.config.num_kv_splits,
                          *self._po_lse_strides, *varying[3:6])
        with interpreted_launch():
            split_compiled = _split_kv_kernel[self._grid](
                *split_args, **self._split_constexprs, **self._split_options, **self._launch_options)
            merge_compiled = None
            if merge_args is not None:
                merge_compiled = _merge_kernel[merge_grid](
                    *merge_args, **self._merge_constexprs, **self._merge_options, **self._launch_options)
        self._remember(key, split_compiled, len(split_args), merge_compiled,
                       None if merge_args is None else len(merge_args))

    def _remember(self, key, split_compiled, num_split_args, merge_compiled, num_merge_args) -> None:
        """Keep a specialisation's compiled kernels for direct launches."""
        if self._direct_broken or not _finished(split_compiled):
            return
        if num_merge_args is not None and not _finished(merge_compiled):
            return
        if len(self._direct) >= self._MAX_ENTRIES:
            self._direct.clear()
        try:
            self._direct[key] = _DirectLaunch(
                split_compiled, self._grid, num_split_args, self._split_constexprs, merge_compiled,
                self._merge_grid, num_merge_args, self._merge_constexprs, self.device)
        except (AttributeError, KeyError, TypeError):  # a triton without these interfaces
            self._direct_broken = True

    def compile(self, q_shape: tuple[int, ...], block_table_stride: int = 16) -> None:
        """Compile, without launching, the kernels of a call with contiguous q and out of
        ``q_shape``, a compact combined cache and contiguous metadata, every pointer 16-byte
        aligned and a block-table row stride of ``block_table_stride``'s class (divisible by 16 by
        default); keep them for direct launches. Kernels an earlier plan of this process compiled
        for the same specialisation are reused without triton's warm-up."""
        s = self.shape
        contiguous = [1]
        for size in reversed(q_shape[1:]):
            contiguous.insert(0, contiguous[0] * size)
        io_strides = _io_strides(tuple(contiguous), s.packed)
        page_elems = s.num_kv_heads * s.page_size * s.head_dim
        kv_strides = (2 * page_elems, s.page_size * s.head_dim) * 2
        partial_o, partial_lse = self._partials
        if partial_o is None:
            partial_o = partial_lse = s.o_dtype
        bt_stride = block_table_stride
        meta = torch.int32  # block table, lengths, offsets: dtypes stand for aligned tensors
        split_args = (s.q_dtype, s.kv_dtype, s.kv_dtype, meta, meta, meta, s.o_dtype,
                      partial_o, partial_lse, 1.0, 1.0, *self._scalars, *io_strides, *io_strides,
                      *kv_strides, bt_stride, *self._po_lse_strides)
        merge_args = None
        if self._merge_grid is not None:
            merge_args = (partial_o, partial_lse, s.o_dtype, 1.0, self.config.num_kv_splits,
                          *self._po_lse_strides, *io_strides)
        shared_key = None
        split_key = _specialization_key(_split_kv_kernel, split_args)
        merge_key = None if merge_args is None else _specialization_key(_merge_kernel, merge_args)
        if split_key is not None and (merge_args is None or merge_key is not None):
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            shared_key = (index, split_key, _frozen(self._split_constexprs), _frozen(self._split_options),
                          None if merge_args is None else (merge_key, _frozen(self._merge_constexprs),
                                                           _frozen(self._merge_options)))
        compiled = _shared_kernels(shared_key) if shared_key is not None else None
        if compiled is not None:
            split_compiled, merge_compiled = compiled
        else:
            split_compiled = _split_kv_kernel.warmup(*split_args, grid=self._grid, **self._split_constexprs,
                                                     **self._split_options, **self._launch_options)
            merge_compiled = None
            if merge_args is not None:
                merge_compiled = _merge_kernel.warmup(*merge_args, grid=self._merge_grid,
                                                      **self._merge_constexprs, **self._merge_options,
                                                      **self._launch_options)
            if shared_key is not None and _finished(split_compiled) and (
                    merge_args is None or _finished(merge_compiled)):
                _share_kernels(shared_key, (split_compiled, merge_compiled))
        # The key a call computes for such tensors (V = K + Hkv*P*D elements into the page).
        v_offset = page_elems * s.kv_dtype.itemsize
        key = (0, 0, v_offset % 16, 0, 0, 0, 0,
               *map(_int_class, (bt_stride, *io_strides, *io_strides, *kv_strides)))
        self._remember(key, split_compiled, len(split_args), merge_compiled,
                       None if merge_args is None else len(merge_args))


# Compiled kernels shared by every plan of this process, least recently used first: a plan whose
# kernels an earlier plan compiled (the usual decode step: same config, new lengths) skips
# triton's warm-up.
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
    """A key at least as fine as triton's specialisation of ``args`` (tensors given as tensors or
    as their dtype): every argument's type, a tensor's dtype and address mod 16, an integer's
    value (only its width where the kernel does not specialise it), not a float's value. Equal
    keys run the same compiled variant; None for an argument of another type."""
    names = kernel.arg_names
    unspecialised = {n if isinstance(n, int) else names.index(n)
                     for n in getattr(kernel, "do_not_specialize", None) or () if isinstance(n, int) or n in names}
    values = list(args)
    for index, value in enumerate(args):
        if type(value) is int:
            if index in unspecialised:
                values[index] = "i32" if -(2**31) <= value < 2**31 else "i64" if -(2**63) <= value < 2**63 else "u64"
        elif type(value) is float:
            values[index] = None
        elif type(value) is bool or isinstance(value, torch.dtype) or value is None:
            pass  # a dtype stands for a 16-byte aligned tensor in ``warmup``
        elif isinstance(value, torch.Tensor):
            values[index] = (value.dtype, value.data_ptr() % 16)
        else:
            return None
    return tuple(map(type, args)), tuple(values)


class _DirectLaunch:
    """Compiled kernels of one specialisation, launched without triton's dispatch.

    ``CompiledKernel[grid]`` takes every kernel parameter in signature order, constexprs included
    (their values are baked into the binary), and the stream."""

    def __init__(self, split_compiled, grid, num_split_args, split_constexprs, merge_compiled, merge_grid,
                 num_merge_args, merge_constexprs, device):
        self._split = split_compiled[grid]
        self._split_tail = tuple(split_constexprs[n] for n in _split_kv_kernel.arg_names[num_split_args:])
        self._merge, self._merge_compiled, self._merge_grid = None, merge_compiled, merge_grid
        if num_merge_args is not None:
            self._merge = merge_compiled[merge_grid]
            self._merge_tail = tuple(merge_constexprs[n] for n in _merge_kernel.arg_names[num_merge_args:])
        self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        self._stream = triton.runtime.driver.active.get_current_stream

    def __call__(self, split_args: tuple, merge_args: tuple | None, merge_grid: tuple | None) -> None:
        stream = self._stream(self._device_index)
        self._split(*split_args, *self._split_tail, stream=stream)
        if self._merge is not None:
            if merge_grid != self._merge_grid:  # packed queries: this call's token count
                self._merge, self._merge_grid = self._merge_compiled[merge_grid], merge_grid
            self._merge(*merge_args, *self._merge_tail, stream=stream)
