"""Input validation for the public API: the support matrix and one ``_validate_*`` per concern.

Every function raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong
value, shape, device or layout) with a message naming the argument, what was expected and what
was received. Nothing here reads device memory; plan-time value checks take host values.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
MAX_PAGE_SIZE = 1024
MAX_GROUP_SIZE = 128
KV_LAYOUTS = ("HND",)
MASK_TYPES = ("dense", "causal")
FP8 = torch.float8_e4m3fn
HALF_DTYPES = (torch.float16, torch.bfloat16)
KV_DTYPES = (torch.float16, torch.bfloat16, FP8)
Q_DTYPES = (torch.float16, torch.bfloat16, FP8)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # + fp8 when q is fp8


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_int(name: str, value: object, minimum: int | None = None) -> int:
    """A Python int from any integral scalar (int, numpy.int64, ...); bools and tensors refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def require_dtype(name: str, value: object, allowed: Sequence[torch.dtype]) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(value).__name__} {value!r}")
    if value not in allowed:
        raise TypeError(f"{name} must be one of {list(allowed)}, got {value}")
    return value


def validate_kv_layout(kv_layout: object) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")


def validate_mask(mask_type: object, window_left: object) -> tuple[bool, int]:
    """Return (causal, window_left). A window (window_left >= 0) needs the causal mask."""
    if mask_type not in MASK_TYPES:
        raise ValueError(f"mask_type must be one of {MASK_TYPES}, got {mask_type!r}")
    window_left = require_int("window_left", window_left, minimum=-1)
    if window_left >= 0 and mask_type != "causal":
        raise ValueError(
            f"window_left={window_left} needs mask_type='causal' (a sliding window is defined "
            f"relative to each row's causal end), got mask_type={mask_type!r}"
        )
    return mask_type == "causal", window_left


def require_real(name: str, value: object) -> object:
    """A real number (int, float, numpy scalar); bools and tensors refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number such as a Python float (a tensor would need a "
            f"device sync), got {type(value).__name__}"
        )
    return value


def validate_scales(bmm1_scale: object, bmm2_scale: object, head_dim: int) -> tuple[float, float]:
    """Return (bmm1_scale, bmm2_scale) as finite Python floats; bmm1 defaults to 1/sqrt(D)."""
    out = []
    for name, value in (("bmm1_scale", bmm1_scale), ("bmm2_scale", bmm2_scale)):
        if name == "bmm1_scale" and value is None:
            value = 1.0 / math.sqrt(head_dim)
        value = float(require_real(name, value))
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
        out.append(float(value))
    return out[0], out[1]


def validate_heads(
    num_qo_heads: object, num_kv_heads: object, head_dim: object, page_size: object
) -> tuple[int, int, int, int]:
    """Return (num_qo_heads, num_kv_heads, head_dim, page_size) as Python ints."""
    num_qo_heads = require_int("num_qo_heads", num_qo_heads, minimum=1)
    num_kv_heads = require_int("num_kv_heads", num_kv_heads, minimum=1)
    head_dim = require_int("head_dim", head_dim)
    page_size = require_int("page_size", page_size, minimum=1)
    if num_qo_heads % num_kv_heads:
        raise ValueError(
            f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if num_qo_heads // num_kv_heads > MAX_GROUP_SIZE:
        raise ValueError(
            f"group size num_qo_heads/num_kv_heads must be <= {MAX_GROUP_SIZE}, "
            f"got {num_qo_heads // num_kv_heads}"
        )
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if page_size > MAX_PAGE_SIZE:
        raise ValueError(f"page_size must be in [1, {MAX_PAGE_SIZE}], got {page_size}")
    return num_qo_heads, num_kv_heads, head_dim, page_size


def resolve_dtypes(
    q_dtype: object, kv_dtype: object, o_dtype: object
) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """Apply the contract's dtype rules; kv defaults to q's dtype, output to q's dtype."""
    q_dtype = require_dtype("q dtype", q_dtype, Q_DTYPES)
    kv_dtype = q_dtype if kv_dtype is None else require_dtype("kv dtype", kv_dtype, KV_DTYPES)
    if kv_dtype in HALF_DTYPES and q_dtype != kv_dtype:
        raise TypeError(f"a {kv_dtype} K/V cache needs q of the same dtype, got q {q_dtype}")
    if q_dtype == FP8 and kv_dtype != FP8:
        raise TypeError(f"an fp8 (float8_e4m3fn) query needs an fp8 K/V cache, got {kv_dtype}")
    if o_dtype is None:
        o_dtype = q_dtype
    allowed = OUT_DTYPES + ((FP8,) if q_dtype == FP8 else ())
    o_dtype = require_dtype("output dtype", o_dtype, allowed)
    return q_dtype, kv_dtype, o_dtype


def validate_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (like block_tables), got {t.device}")


# Triton's float8e4nv (torch.float8_e4m3fn) needs sm89+ (Ada, Hopper and newer); bf16 needs sm80+.
FP8_MIN_CAPABILITY = (8, 9)
BF16_MIN_CAPABILITY = (8, 0)


def validate_dtypes_on_gpu(
    capability: tuple[int, int], q_dtype: torch.dtype, kv_dtype: torch.dtype, o_dtype: torch.dtype
) -> None:
    """A TypeError, before any compile, for dtypes the GPU (compute capability) cannot run."""
    arch = f"compute capability {capability[0]}.{capability[1]}"
    for name, dtype in (("q dtype", q_dtype), ("kv dtype", kv_dtype), ("output dtype", o_dtype)):
        if dtype == FP8 and tuple(capability) < FP8_MIN_CAPABILITY:
            raise TypeError(
                f"{name} float8_e4m3fn needs a GPU of compute capability >= 8.9 (Ada, Hopper or "
                f"newer: triton's fp8e4nv); this GPU has {arch}. Use a bfloat16/float16 cache here"
            )
        if dtype == torch.bfloat16 and tuple(capability) < BF16_MIN_CAPABILITY:
            raise TypeError(
                f"{name} bfloat16 needs a GPU of compute capability >= 8.0 (Ampere or newer); "
                f"this GPU has {arch}. Use float16 here"
            )


def validate_execution_device(device: torch.device, interpret: bool) -> None:
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpret:
        return
    raise ValueError(
        f"tensors must be on a CUDA device (or on the CPU with TRITON_INTERPRET=1 set before "
        f"triton is imported), got {device}"
    )


def validate_block_tables(
    block_tables: object, seq_lens_kv: object, bind_seq_lens: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """block_tables int32 [B, C] with contiguous rows; seq_lens_kv int32 [B] on its device,
    contiguous only where the kernels read it in place (bind_seq_lens; a plan copies it else)."""
    block_tables = require_tensor("block_tables", block_tables)
    seq_lens_kv = require_tensor("seq_lens_kv", seq_lens_kv)
    if block_tables.dtype != torch.int32:
        raise TypeError(f"block_tables must be int32, got {block_tables.dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be 2-D [B, C], got shape {_shape(block_tables)}")
    batch, cols = block_tables.shape
    if batch < 1 or cols < 1:
        raise ValueError(f"block_tables must have B >= 1 rows and C >= 1 columns, got {_shape(block_tables)}")
    if cols > 1 and block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables rows must be contiguous (stride(1) == 1), got strides {block_tables.stride()}"
        )
    if batch > 1 and block_tables.stride(0) < cols:
        raise ValueError(
            f"block_tables row stride must be >= C={cols} (rows may be padded, not overlap), "
            f"got stride(0)={block_tables.stride(0)}"
        )
    if seq_lens_kv.dtype != torch.int32:
        raise TypeError(f"seq_lens_kv must be int32, got {seq_lens_kv.dtype}")
    if _shape(seq_lens_kv) != (batch,):
        raise ValueError(f"seq_lens_kv must have shape [B]=[{batch}], got {_shape(seq_lens_kv)}")
    if bind_seq_lens and batch > 1 and seq_lens_kv.stride(0) != 1:
        raise ValueError(
            f"seq_lens_kv must be contiguous with bind_seq_lens=True (the kernels read it in "
            f"place), got stride {seq_lens_kv.stride()}"
        )
    validate_device("seq_lens_kv", seq_lens_kv, block_tables.device)
    return block_tables, seq_lens_kv


def validate_qo_indptr(qo_indptr: object, batch: int, device: torch.device) -> torch.Tensor:
    qo_indptr = require_tensor("qo_indptr", qo_indptr)
    if qo_indptr.dtype != torch.int32:
        raise TypeError(f"qo_indptr must be int32, got {qo_indptr.dtype}")
    if _shape(qo_indptr) != (batch + 1,):
        raise ValueError(f"qo_indptr must have shape [B+1]=[{batch + 1}], got {_shape(qo_indptr)}")
    validate_device("qo_indptr", qo_indptr, device)
    return qo_indptr


def validate_qo_indptr_values(indptr: list[int]) -> tuple[int, int]:
    """Return (total_q, longest request) from host values of qo_indptr."""
    if indptr[0] != 0:
        raise ValueError(f"qo_indptr[0] must be 0, got {indptr[0]}")
    lengths = [b - a for a, b in zip(indptr, indptr[1:])]
    bad = [i for i, n in enumerate(lengths) if n < 1]
    if bad:
        i = bad[0]
        raise ValueError(
            f"qo_indptr must strictly increase (every request has >= 1 query token), got "
            f"qo_indptr[{i}]={indptr[i]} and qo_indptr[{i + 1}]={indptr[i + 1]}"
        )
    return indptr[-1], max(lengths)


def resolve_query_mode(
    seq_len_q: object, qo_indptr: torch.Tensor | None, max_seq_len_q: object
) -> tuple[bool, int | None]:
    """Return (packed, query-length capacity or None to derive it from qo_indptr)."""
    seq_len_q = require_int("seq_len_q", seq_len_q, minimum=1)
    if max_seq_len_q is not None:
        max_seq_len_q = require_int("max_seq_len_q", max_seq_len_q, minimum=1)
    if qo_indptr is None:
        if max_seq_len_q is not None and max_seq_len_q != seq_len_q:
            raise ValueError(
                f"in fixed-query mode max_seq_len_q must equal seq_len_q={seq_len_q}, "
                f"got {max_seq_len_q}"
            )
        return False, seq_len_q
    if seq_len_q != 1:  # a non-default seq_len_q is an alias for max_seq_len_q
        if max_seq_len_q is not None and max_seq_len_q != seq_len_q:
            raise ValueError(
                f"seq_len_q={seq_len_q} (alias of max_seq_len_q in packed mode) disagrees with "
                f"max_seq_len_q={max_seq_len_q}"
            )
        max_seq_len_q = seq_len_q
    return True, max_seq_len_q


def split_cache(paged_kv_cache: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(combined cache, None) or (K, V): only the container and tensor types are checked."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"a separate paged_kv_cache must be (K, V), got {len(paged_kv_cache)} items")
        return (require_tensor("paged_kv_cache[0] (K)", paged_kv_cache[0]),
                require_tensor("paged_kv_cache[1] (V)", paged_kv_cache[1]))
    return require_tensor("paged_kv_cache", paged_kv_cache), None


def validate_cache_layout(
    paged_kv_cache: object,
) -> tuple[
    torch.Tensor | tuple[torch.Tensor, torch.Tensor], tuple[int, int, int, int],
    tuple[tuple[str, torch.Tensor], ...],
]:
    """Check a combined [num_pages, 2, Hkv, P, D] or separate (K, V) HND cache, each compact
    inside a page. Return (kv, (num_pages, Hkv, P, D), tensors): kv as the kernels' launcher takes
    it (the combined tensor or the (K, V) tuple; no views are made), and the cache tensor(s) by
    name (for ``validate_out``'s overlap check)."""
    kv, v = split_cache(paged_kv_cache)
    if v is not None:
        k = kv
        for name, t in (("K", k), ("V", v)):
            if t.dim() != 4:
                raise ValueError(f"paged_kv_cache {name} must be 4-D [num_pages, Hkv, P, D], got {_shape(t)}")
        if _shape(k) != _shape(v):
            raise ValueError(f"paged_kv_cache K and V shapes differ: {_shape(k)} vs {_shape(v)}")
        if k.dtype != v.dtype:
            raise TypeError(f"paged_kv_cache K and V dtypes differ: {k.dtype} vs {v.dtype}")
        if k.device != v.device:
            raise ValueError(f"paged_kv_cache K and V devices differ: {k.device} vs {v.device}")
        page_shape = tuple(k.shape)
        for name, t in (("K", k), ("V", v)):
            _check_page_strides(name, page_shape, t.stride())
        return (k, v), page_shape, (("paged_kv_cache K", k), ("paged_kv_cache V", v))
    cache = kv
    shape = tuple(cache.shape)
    if len(shape) != 5 or shape[1] != 2:
        raise ValueError(
            f"paged_kv_cache must be [num_pages, 2, Hkv, P, D] or a (K, V) tuple of "
            f"[num_pages, Hkv, P, D], got shape {shape}"
        )
    num_pages, _, hkv, p, d = shape
    stride = cache.stride()
    if stride[1] != hkv * p * d:
        raise ValueError(
            f"paged_kv_cache must be compact inside a page (stride(1) == Hkv*P*D = {hkv * p * d}); "
            f"got strides {stride}"
        )
    view_shape, view_stride = (num_pages, hkv, p, d), (stride[0], *stride[2:])
    for name in ("K", "V"):  # both views have the same shape and strides
        _check_page_strides(name, view_shape, view_stride)
    return cache, view_shape, (("paged_kv_cache", cache),)


def _check_page_strides(name: str, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
    """A K or V view [num_pages, Hkv, P, D] must be compact inside a page."""
    _, hkv, p, d = shape
    expected = (hkv * p * d, p * d, d, 1)
    if stride[1:] != expected[1:] or (shape[0] > 1 and stride[0] < expected[0]):
        raise ValueError(
            f"paged_kv_cache {name} needs compact HND strides inside a page "
            f"(Hkv, P, D strides {expected[1:]}, page stride >= {expected[0]}), got {stride}"
        )


def validate_cache_against_plan(
    page_shape: tuple[int, int, int, int], cache: torch.Tensor, num_kv_heads: int, page_size: int,
    head_dim: int, kv_dtype: torch.dtype, device: torch.device, max_page_id: int,
) -> None:
    """page_shape: (num_pages, Hkv, P, D) from ``validate_cache_layout``; cache: one of its
    tensors (K and V share dtype and device)."""
    num_pages, hkv, p, d = page_shape
    if (hkv, p, d) != (num_kv_heads, page_size, head_dim):
        raise ValueError(
            f"paged_kv_cache pages must be [Hkv={num_kv_heads}, P={page_size}, D={head_dim}], "
            f"got [{hkv}, {p}, {d}]"
        )
    if cache.dtype != kv_dtype:
        raise TypeError(f"paged_kv_cache dtype must be {kv_dtype} (as planned), got {cache.dtype}")
    if cache.device != device:
        raise ValueError(f"paged_kv_cache must be on {device}, got {cache.device}")
    if max_page_id >= num_pages:
        raise ValueError(
            f"block_tables holds page ID {max_page_id} but paged_kv_cache has only {num_pages} pages"
        )


def expected_q_shape(
    packed: bool, batch: int, seq_len_q: int, total_q: int, num_qo_heads: int, head_dim: int
) -> tuple[int, ...]:
    if packed:
        return (total_q, num_qo_heads, head_dim)
    if seq_len_q == 1:
        return (batch, num_qo_heads, head_dim)
    return (batch, seq_len_q, num_qo_heads, head_dim)


def _validate_io_tensor(
    name: str, t: object, shape: tuple[int, ...], shape_desc: str, dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Shape, dtype, device and a contiguous head dim for q or out."""
    t = require_tensor(name, t)
    if _shape(t) != shape:
        raise ValueError(f"{name} must have {shape_desc} {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} dtype must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in the head dim (stride(-1) == 1), got {t.stride()}")
    return t


def validate_query(
    q: object, shape: tuple[int, ...], q_dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return _validate_io_tensor("q", q, shape, "the planned shape", q_dtype, device)


def byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, last byte] a tensor's elements occupy; None for an empty tensor."""
    numel = t.numel()
    if numel == 0:
        return None
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + numel * t.element_size() - 1
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (extent + 1) * t.element_size() - 1


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (a stride-0 or interleaved view); from
    shape and strides only. Dims of size > 1 in stride order: each stride must pass the last
    element the inner dims reach (exotic non-overlapping interleavings also count as overlap)."""
    if t.numel() == 0:
        return False
    reach = 0
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def validate_out(
    out: object, shape: tuple[int, ...], o_dtype: torch.dtype, device: torch.device,
    inputs: tuple[tuple[str, torch.Tensor], ...], input_spans: tuple[tuple[str, int, int], ...] = (),
) -> torch.Tensor:
    """out: q's shape, the planned dtype and device, no element sharing memory with another and
    no byte range overlapping any input's (first to last byte).

    inputs: (name, tensor) pairs; input_spans: (name, first byte, last byte) of inputs whose
    spans were taken once (the plan's own tensors)."""
    out = _validate_io_tensor("out", out, shape, "q's shape", o_dtype, device)
    if overlaps_itself(out):
        raise ValueError(
            f"out must not overlap itself (a stride-0 or interleaved view would have requests or "
            f"heads overwrite each other), got shape {list(out.shape)} strides {out.stride()}"
        )
    span = byte_span(out)
    if span is None:
        return out
    lo, hi = span
    for name, t in inputs:
        span = byte_span(t)
        if span is not None and lo <= span[1] and span[0] <= hi:
            raise ValueError(f"out must not alias {name} (their memory overlaps)")
    for name, a, b in input_spans:
        if lo <= b and a <= hi:
            raise ValueError(f"out must not alias {name} (their memory overlaps)")
    return out
