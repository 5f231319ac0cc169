"""Input validation for the public API: the support matrix and one check per concern.

Error classes follow FlashInfer's PrimTS API: ``TypeError`` for the wrong kind of object or an
integer/flag of the wrong type, ``ValueError`` for a wrong value, shape, device or layout, and
``NotImplementedError`` for a valid request this implementation does not support (an NHD cache,
a dtype pair, head dim, page size or GPU it cannot run). Every message names the argument, what
was expected and what was received. Nothing here reads device memory.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

from .config.space import ProblemShape
from .memory import element_extent

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)  # 96 and 192 run padded to 128 and 256
MAX_PAGE_SIZE = 1024
MAX_GROUP_SIZE = 128
# The largest K/V length a plan may cover: int32 less one padded 256-token tile.
MAX_KV_LEN = 2**31 - 1 - 255
INT32_ELEMENTS = 2**31  # q and out are indexed in int32: an element at most this far from the first
KV_LAYOUTS = ("HND",)
MASK_TYPES = ("dense", "causal")
FP8 = torch.float8_e4m3fn
HALF_DTYPES = (torch.float16, torch.bfloat16)
Q_DTYPES = (torch.float16, torch.bfloat16, FP8)
KV_DTYPES = (torch.float16, torch.bfloat16, FP8)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # + fp8 when q is fp8
FP8_MIN_CAPABILITY = (8, 9)  # triton's float8e4nv (Ada, Hopper and newer)
BF16_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class ArgNames:
    """What a public function calls q, the cache, the lengths and the K/V capacity, for its errors:
    the wrapper's (the defaults), the one-shot op's or the capture call's (``oneshot``)."""

    q: str = "q"
    cache: str = "paged_kv_cache"
    lens: str = "seq_lens"
    capacity: str = "max_kv_len"


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_int(name: str, value: object, minimum: int | None = None) -> int:
    """A Python int from any integral scalar (int, numpy.int64, ...); bools and tensors refused."""
    if type(value) is int:  # the common case, without the numbers ABC's isinstance
        if minimum is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        shown = "" if torch.compiler.is_compiling() else f" {value!r}"  # dynamo cannot repr a traced numpy value
        raise TypeError(f"{name} must be an int, got {type(value).__name__}{shown}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def require_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def require_real(name: str, value: object) -> float:
    """A real number (int, float, numpy scalar) as a float; bools and tensors refused."""
    if type(value) is float:  # the common case, without the numbers ABC's isinstance
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number such as a Python float (a tensor would need "
                        f"a device sync), got {type(value).__name__}")
    return float(value)


def validate_kv_layout(kv_layout: object) -> None:
    if not isinstance(kv_layout, str):
        raise TypeError(f"kv_layout must be a str, got {type(kv_layout).__name__}")
    if kv_layout == "NHD":
        raise NotImplementedError("kv_layout='NHD' is not supported: pass the cache as HND "
                                  "([num_pages, 2, Hkv, P, D] or (K, V) of [num_pages, Hkv, P, D])")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be 'HND', got {kv_layout!r}")


def packed_capacity(seq_len_q: int, max_seq_len_q: int | None) -> int | None:
    """Packed mode's query-length capacity, ``max_seq_len_q``: a non-default ``seq_len_q`` is its
    alias and must agree with it when both are given; None when neither gives it."""
    if seq_len_q == 1:
        return max_seq_len_q
    if max_seq_len_q is not None and max_seq_len_q != seq_len_q:
        raise ValueError(f"seq_len_q={seq_len_q} (alias of max_seq_len_q in packed mode) disagrees "
                         f"with max_seq_len_q={max_seq_len_q}")
    return seq_len_q


def validate_mask(mask_type: object, window_left: object) -> tuple[bool, int]:
    """(causal, window_left). A window (window_left >= 0) needs the causal mask."""
    if not isinstance(mask_type, str):
        raise TypeError(f"mask_type must be a str, one of {MASK_TYPES}, got {type(mask_type).__name__} "
                        f"{mask_type!r}")
    if mask_type not in MASK_TYPES:
        raise ValueError(f"mask_type must be one of {MASK_TYPES}, got {mask_type!r}")
    window_left = require_int("window_left", window_left, minimum=-1)
    if window_left > MAX_KV_LEN:  # a window past every K/V length is no window
        raise ValueError(f"window_left must be -1 (no window) or at most {MAX_KV_LEN:,} (the longest K/V "
                         f"length), got {window_left}")
    if window_left >= 0 and mask_type != "causal":
        raise ValueError(f"window_left={window_left} needs mask_type='causal' (a sliding window is "
                         f"defined relative to each row's causal end), got mask_type={mask_type!r}")
    return mask_type == "causal", window_left


# The kernels take bmm1_scale * log2(e) (their softmax is in base 2) and bmm2_scale as float32.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
LOG2_E = 1.4426950408889634
SCALE_LIMITS = {"bmm1_scale": FLOAT32_MAX / LOG2_E, "bmm2_scale": FLOAT32_MAX}


def validate_scales(bmm1_scale: object, bmm2_scale: object, head_dim: int) -> tuple[float, float]:
    """(bmm1_scale, bmm2_scale) as floats the kernels hold finite in float32; bmm1 defaults to
    1/sqrt(D)."""
    bmm1 = 1.0 / math.sqrt(head_dim) if bmm1_scale is None else require_real("bmm1_scale", bmm1_scale)
    bmm2 = require_real("bmm2_scale", bmm2_scale)
    if abs(bmm1) <= SCALE_LIMITS["bmm1_scale"] and abs(bmm2) <= SCALE_LIMITS["bmm2_scale"]:
        return bmm1, bmm2  # (a NaN compares False)
    for name, value in (("bmm1_scale", bmm1), ("bmm2_scale", bmm2)):
        limit = SCALE_LIMITS[name]
        if not (math.isfinite(value) and abs(value) <= limit):
            raise ValueError(f"{name} must be finite and at most {limit:.4g} in magnitude (the kernels hold it "
                             f"{'times log2(e) ' if name == 'bmm1_scale' else ''}as a float32), got {value}")
    return bmm1, bmm2


def validate_sizes(batch_size: object, max_kv_len: object, max_seq_len_q: object, num_qo_heads: int,
                   names: tuple[str, str, str] = ("batch_size", "max_kv_len", "max_seq_len_q"),
                   head_dim: int = 1) -> tuple[int, int, int]:
    """(batch_size, max_kv_len, max_seq_len_q) as ints the kernels index in int32 (q's and out's
    elements too, B*SQ*Hq*D); ``names``: what the caller called them."""
    batch_size = require_int(names[0], batch_size, minimum=1)
    max_kv_len = require_int(names[1], max_kv_len, minimum=1)
    if max_kv_len > MAX_KV_LEN:
        raise NotImplementedError(f"{names[1]} must be <= {MAX_KV_LEN}, got {max_kv_len}")
    max_seq_len_q = require_int(names[2], max_seq_len_q, minimum=1)
    if batch_size * max_seq_len_q * num_qo_heads * head_dim >= INT32_ELEMENTS:
        raise NotImplementedError(f"B*SQ*Hq*D = {batch_size}*{max_seq_len_q}*{num_qo_heads}*{head_dim} must "
                                  f"fit in int32 (the kernels index q and out in int32)")
    return batch_size, max_kv_len, max_seq_len_q


HEAD_NAMES = ("num_qo_heads", "num_kv_heads", "head_dim", "page_size")


def validate_heads(num_qo_heads: object, num_kv_heads: object, head_dim: object, page_size: object,
                   names: tuple[str, str, str, str] = HEAD_NAMES) -> tuple[int, int, int, int]:
    """(num_qo_heads, num_kv_heads, head_dim, page_size) as ints; errors name them as ``names``."""
    hq_name, hkv_name, d_name, p_name = names
    num_qo_heads = require_int(hq_name, num_qo_heads, minimum=1)
    num_kv_heads = require_int(hkv_name, num_kv_heads, minimum=1)
    head_dim = require_int(d_name, head_dim, minimum=1)
    page_size = require_int(p_name, page_size, minimum=1)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"{hq_name} ({num_qo_heads}) must be a multiple of {hkv_name} ({num_kv_heads})")
    if num_qo_heads // num_kv_heads > MAX_GROUP_SIZE:
        raise NotImplementedError(f"group size {hq_name}/{hkv_name} must be <= {MAX_GROUP_SIZE}, "
                                  f"got {num_qo_heads // num_kv_heads}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"{d_name} must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if page_size > MAX_PAGE_SIZE:
        raise NotImplementedError(f"{p_name} must be in [1, {MAX_PAGE_SIZE}], got {page_size}")
    return num_qo_heads, num_kv_heads, head_dim, page_size


def _dtype(name: str, value: object) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(value).__name__} {value!r}")
    return value


def resolve_dtypes(q_dtype: object, kv_dtype: object, o_dtype: object,
                   names: tuple[str, str, str] = ("q_data_type", "kv_data_type", "o_data_type"),
                   ) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """The dtype rules: kv and output default to q's dtype. Supported: a float16/bfloat16 cache
    with q of its dtype; an fp8 cache with float16, bfloat16 or fp8 q; output float16, bfloat16,
    float32, or fp8 for fp8 q. Other pairs raise NotImplementedError."""
    q_dtype = _dtype(names[0], q_dtype)
    kv_dtype = q_dtype if kv_dtype is None else _dtype(names[1], kv_dtype)
    o_dtype = q_dtype if o_dtype is None else _dtype(names[2], o_dtype)
    if q_dtype not in Q_DTYPES:
        raise NotImplementedError(f"{names[0]} {q_dtype} is not supported; expected one of {list(Q_DTYPES)}")
    if kv_dtype not in KV_DTYPES:
        raise NotImplementedError(f"{names[1]} {kv_dtype} is not supported; expected one of {list(KV_DTYPES)}")
    if kv_dtype in HALF_DTYPES and q_dtype != kv_dtype:
        raise NotImplementedError(f"{names[1]} {kv_dtype} (a 16-bit K/V cache) needs a query of the same dtype, "
                                  f"got {names[0]} {q_dtype}")
    if q_dtype == FP8 and kv_dtype != FP8:
        raise NotImplementedError(f"{names[0]} float8_e4m3fn (an fp8 query) needs an fp8 K/V cache, got "
                                  f"{names[1]} {kv_dtype}")
    allowed = OUT_DTYPES + ((FP8,) if q_dtype == FP8 else ())
    if o_dtype not in allowed:
        raise NotImplementedError(f"{names[2]} {o_dtype} is not supported with {names[0]} {q_dtype}; expected "
                                  f"one of {list(allowed)}")
    return q_dtype, kv_dtype, o_dtype


def validate_device(device: object, interpreter: bool, name: str = "device") -> torch.device:
    """The plan's device: a CUDA device, or the CPU under Triton's interpreter; errors call it
    ``name``, the argument the caller passed."""
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(f"{name} must be an int, str or torch.device, got {type(device).__name__}")
    try:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{name} {device!r} is not a device: {e}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {device} is a CUDA device, but torch finds none here; on a CPU pass "
                             f"device='cpu' with TRITON_INTERPRET=1 set before triton is imported")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"{name} {device} does not exist: torch sees {torch.cuda.device_count()} CUDA "
                             f"device(s)")
        return device
    if device.type == "cpu" and interpreter:
        return torch.device("cpu")  # "cpu:0" is the one CPU device tensors report as "cpu"
    raise ValueError(f"{name} must be a CUDA device (or the CPU with TRITON_INTERPRET=1 set before "
                     f"triton is imported), got {device}")


def validate_dtypes_on_gpu(capability: tuple[int, int], dtypes: Sequence[tuple[str, torch.dtype]]) -> None:
    """NotImplementedError, before any compile, for dtypes this GPU cannot run."""
    arch = f"compute capability {capability[0]}.{capability[1]}"
    for name, dtype in dtypes:
        if dtype == FP8 and tuple(capability) < FP8_MIN_CAPABILITY:
            raise NotImplementedError(f"{name} float8_e4m3fn needs a GPU of compute capability >= 8.9 "
                                      f"(Ada, Hopper or newer); this GPU has {arch}")
        if dtype == torch.bfloat16 and tuple(capability) < BF16_MIN_CAPABILITY:
            raise NotImplementedError(f"{name} bfloat16 needs a GPU of compute capability >= 8.0 "
                                      f"(Ampere or newer); this GPU has {arch}")


def validate_block_tables(block_tables: object, batch: int, device: torch.device) -> torch.Tensor:
    """int32 [B, C] on the device, contiguous rows (padded rows allowed)."""
    block_tables = require_tensor("block_tables", block_tables)
    if block_tables.dtype != torch.int32:
        raise TypeError(f"block_tables must be int32, got {block_tables.dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be 2-D [B, C], got shape {_shape(block_tables)}")
    rows, cols = block_tables.shape
    if rows != batch:
        raise ValueError(f"block_tables must have one row per request (B={batch}), got {rows} rows "
                         f"(shape {_shape(block_tables)})")
    if cols < 1:
        raise ValueError(f"block_tables must have C >= 1 columns, got shape {_shape(block_tables)}")
    if cols > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables rows must be contiguous (stride(1) == 1), got strides "
                         f"{block_tables.stride()}")
    if rows > 1 and block_tables.stride(0) < cols:
        raise ValueError(f"block_tables row stride must be >= C={cols} (rows may be padded, not "
                         f"overlap), got stride(0)={block_tables.stride(0)}")
    if block_tables.device != device:
        raise ValueError(f"block_tables must be on {device}, got {block_tables.device}")
    return block_tables


def validate_lengths_tensor(name: str, seq_lens: object, batch: int, device: torch.device) -> torch.Tensor:
    """int32 [B] on the device, contiguous (the kernels read it in place)."""
    seq_lens = require_tensor(name, seq_lens)
    if seq_lens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {seq_lens.dtype}")
    if _shape(seq_lens) != [batch]:
        raise ValueError(f"{name} must have shape [B]=[{batch}] (one length per request), got {_shape(seq_lens)}")
    if batch > 1 and seq_lens.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {seq_lens.stride()}")
    if seq_lens.device != device:
        raise ValueError(f"{name} must be on {device}, got {seq_lens.device}")
    return seq_lens


def validate_host_lengths(seq_lens: object, batch: int, max_kv_len: int) -> tuple[int, ...]:
    """plan's ``seq_lens``: a sequence of ints or a 1-D CPU int32/int64 tensor of B values in [1, max_kv_len]."""
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.device.type != "cpu":
            raise ValueError(f"plan's seq_lens must be host values (a sequence of ints or a CPU "
                             f"tensor), got a tensor on {seq_lens.device}; pass a CUDA tensor to every "
                             f"run() instead")
        if seq_lens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"seq_lens must be int32 or int64, got {seq_lens.dtype}")
        if seq_lens.dim() != 1:
            raise ValueError(f"seq_lens must be 1-D, got shape {_shape(seq_lens)}")
        values = tuple(int(x) for x in seq_lens.tolist())
    elif isinstance(seq_lens, (str, bytes)) or not isinstance(seq_lens, Sequence):
        raise TypeError(f"seq_lens must be a sequence of ints or a CPU tensor, got {type(seq_lens).__name__}")
    else:
        values = tuple(require_int(f"seq_lens[{i}]", v) for i, v in enumerate(seq_lens))
    if len(values) != batch:
        raise ValueError(f"seq_lens must hold B={batch} lengths, got {len(values)}")
    for b, n in enumerate(values):
        if not 1 <= n <= max_kv_len:
            raise ValueError(f"seq_lens[{b}]={n} must be in [1, max_kv_len={max_kv_len}]")
    return values


def validate_qo_indptr(qo_indptr: object, batch: int, device: torch.device) -> torch.Tensor:
    qo_indptr = require_tensor("qo_indptr", qo_indptr)
    if qo_indptr.dtype != torch.int32:
        raise TypeError(f"qo_indptr must be int32, got {qo_indptr.dtype}")
    if _shape(qo_indptr) != [batch + 1]:
        raise ValueError(f"qo_indptr must have shape [B+1]=[{batch + 1}], got {_shape(qo_indptr)}")
    if batch > 0 and qo_indptr.stride(0) != 1:
        raise ValueError(f"qo_indptr must be contiguous, got stride {qo_indptr.stride()}")
    if qo_indptr.device != device:
        raise ValueError(f"qo_indptr must be on {device}, got {qo_indptr.device}")
    return qo_indptr


def validate_qo_indptr_values(indptr: Sequence[int], total_q: int, max_seq_len_q: int) -> list[int]:
    """Per-request query lengths from host values of qo_indptr."""
    if indptr[0] != 0:
        raise ValueError(f"qo_indptr[0] must be 0, got {indptr[0]}")
    lengths = [b - a for a, b in zip(indptr, indptr[1:])]
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"qo_indptr must strictly increase (every request has >= 1 query token), "
                             f"got qo_indptr[{i}]={indptr[i]} and qo_indptr[{i + 1}]={indptr[i + 1]}")
        if n > max_seq_len_q:
            raise ValueError(f"request {i} has {n} query tokens (qo_indptr), more than "
                             f"max_seq_len_q={max_seq_len_q}")
    if indptr[-1] != total_q:
        raise ValueError(f"qo_indptr[-1]={indptr[-1]} must equal total_q={total_q} (q.shape[0])")
    return lengths


def validate_metadata_values(s: ProblemShape, lens, indptr, min_page: int, max_page: int, cols: int, num_pages: int,
                 total_q: int, lens_name: str) -> None:
    """The metadata's values (read on the host) against the plan ``s`` (one-shot: against the bounds
    it planned)."""
    capacity = min(s.max_kv_len, cols * s.page_size)
    for b, n in enumerate(lens):
        if not 1 <= n <= s.max_kv_len:
            raise ValueError(f"{lens_name}[{b}]={n} must be in [1, max_kv_len={s.max_kv_len}]")
        if n > capacity:
            raise ValueError(f"{lens_name}[{b}]={n} needs {-(-n // s.page_size)} pages but block_tables has "
                             f"C={cols} columns of page_size {s.page_size}")
    if min_page < 0:
        raise ValueError(f"block_tables holds a negative page ID ({min_page}) among the live pages")
    if max_page >= num_pages:
        raise ValueError(f"block_tables holds page ID {max_page} among the live pages but paged_kv_cache "
                         f"has only {num_pages} pages")
    q_lens = (validate_qo_indptr_values(indptr, total_q, s.max_seq_len_q) if s.packed
              else [s.max_seq_len_q] * len(lens))
    if s.causal:
        for b, (nq, nk) in enumerate(zip(q_lens, lens)):
            if nq > nk:
                raise ValueError(f"causal mask needs query length <= K/V length; request {b} has {nq} "
                                 f"query tokens and {lens_name}[{b}]={nk}")


def split_cache(paged_kv_cache: object, name: str = "paged_kv_cache") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(combined cache, None) or (K, V): only the container and tensor types are checked; errors
    call the cache ``name``, the argument the caller passed."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"a separate {name} must be (K, V), got {len(paged_kv_cache)} items")
        return (require_tensor(f"{name}[0] (K)", paged_kv_cache[0]),
                require_tensor(f"{name}[1] (V)", paged_kv_cache[1]))
    return require_tensor(name, paged_kv_cache), None


def cache_page_shape(paged_kv_cache: object, name: str = "paged_kv_cache",
                     ) -> tuple[object, tuple[int, int, int, int], torch.dtype, torch.device,
                                tuple[tuple[str, torch.Tensor], ...]]:
    """Check a combined [num_pages, 2, Hkv, P, D] or separate (K, V) HND cache, compact inside a
    page. Return (cache as the launcher takes it, (num_pages, Hkv, P, D), dtype, device, the
    tensors by name for ``validate_out``'s overlap check); errors call the cache ``name``."""
    kv, v = split_cache(paged_kv_cache, name)
    if v is not None:
        for part, t in (("K", kv), ("V", v)):
            if t.dim() != 4:
                raise ValueError(f"{name} {part} must be 4-D [num_pages, Hkv, P, D] (HND), got "
                                 f"shape {_shape(t)}")
        if kv.shape != v.shape:
            raise ValueError(f"{name} K and V shapes differ: {_shape(kv)} vs {_shape(v)}")
        if kv.dtype != v.dtype:
            raise TypeError(f"{name} K and V dtypes differ: {kv.dtype} vs {v.dtype}")
        if kv.device != v.device:
            raise ValueError(f"{name} K and V devices differ: {kv.device} vs {v.device}")
        page_shape = tuple(kv.shape)
        _check_page_dims(page_shape, _shape(kv), f"{name} K and V shape [num_pages, Hkv, P, D]")
        for part, t in (("K", kv), ("V", v)):
            _check_page_strides(f"{name} {part}", page_shape, t.stride())
        return (kv, v), page_shape, kv.dtype, kv.device, ((f"{name} K", kv), (f"{name} V", v))
    shape = tuple(kv.shape)
    if len(shape) != 5 or shape[1] != 2:
        raise ValueError(f"{name} must be [num_pages, 2, Hkv, P, D] (HND) or a (K, V) tuple of "
                         f"[num_pages, Hkv, P, D], got shape {list(shape)}")
    num_pages, _, hkv, p, d = shape
    _check_page_dims((num_pages, hkv, p, d), list(shape), f"{name} shape [num_pages, 2, Hkv, P, D]")
    stride = kv.stride()
    if stride[1] != hkv * p * d:
        raise ValueError(f"{name} must be compact inside a page (stride(1) == Hkv*P*D = "
                         f"{hkv * p * d}), got strides {stride}")
    _check_page_strides(f"{name} K/V", (num_pages, hkv, p, d), (stride[0], *stride[2:]))
    return kv, (num_pages, hkv, p, d), kv.dtype, kv.device, ((name, kv),)


def _check_page_dims(page_shape: tuple[int, int, int, int], shape: object, what: str) -> None:
    """Hkv, P and D of at least one (an empty cache dimension would hold no K/V of any request)."""
    _, hkv, p, d = page_shape
    if min(hkv, p, d) < 1:
        raise ValueError(f"{what} needs Hkv, P and D of at least 1, got {shape}")


def _check_page_strides(what: str, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
    """Pages hold [Hkv, P, D] compactly (a dim of size 1 may have any stride: the kernels never step
    along it, e.g. an NHD cache of one KV head transposed to HND); pages may be padded apart.
    ``what``: the cache tensor, as the errors name it."""
    _, hkv, p, d = shape
    expected = (hkv * p * d, p * d, d, 1)
    inside = all(n == 1 or s == e for n, s, e in zip(shape[1:], stride[1:], expected[1:]))
    if not inside or (shape[0] > 1 and stride[0] < expected[0]):
        raise ValueError(f"{what} needs compact HND strides inside a page (Hkv, P, D "
                         f"strides {expected[1:]}, page stride >= {expected[0]}), got {tuple(stride)}")


def validate_cache_against_plan(page_shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
                                num_kv_heads: int, page_size: int, head_dim: int, kv_dtype: torch.dtype,
                                plan_device: torch.device) -> None:
    _, hkv, p, d = page_shape
    if (hkv, p, d) != (num_kv_heads, page_size, head_dim):
        raise ValueError(f"paged_kv_cache pages must be [Hkv={num_kv_heads}, P={page_size}, D={head_dim}] "
                         f"(HND, as planned), got [{hkv}, {p}, {d}]")
    if dtype != kv_dtype:
        raise TypeError(f"paged_kv_cache dtype must be {kv_dtype} (as planned by kv_data_type, whose default "
                        f"is q_data_type), got {dtype}")
    if device != plan_device:
        raise ValueError(f"paged_kv_cache must be on {plan_device}, got {device}")


def query_shape(packed: bool, batch: int, seq_len_q: int, total_q: int, num_qo_heads: int,
                head_dim: int) -> tuple[int, ...]:
    if packed:
        return (total_q, num_qo_heads, head_dim)
    if seq_len_q == 1:
        return (batch, num_qo_heads, head_dim)
    return (batch, seq_len_q, num_qo_heads, head_dim)


def describe_query_layout(packed: bool, seq_len_q: int) -> str:
    if packed:
        return "packed [total_q, Hq, D]"
    return "[B, Hq, D]" if seq_len_q == 1 else "token-major [B, SQ, Hq, D]"


def validate_io_tensor(name: str, t: object, shape: tuple[int, ...], layout: str, dtype: torch.dtype,
                       device: torch.device, dtype_source: str = "") -> torch.Tensor:
    """Shape, dtype, device and a contiguous head dim for q or out; ``dtype_source`` says where the
    expected dtype came from (e.g. the plan argument that set it)."""
    t = require_tensor(name, t)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {layout} = {list(shape)}, got {_shape(t)}")
    if t.dtype != dtype:
        source = f" ({dtype_source})" if dtype_source else ""
        raise TypeError(f"{name} dtype must be {dtype}{source}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in the head dim (stride(-1) == 1), got {t.stride()}")
    if element_extent(t) >= INT32_ELEMENTS:
        raise NotImplementedError(f"{name}'s last element lies {element_extent(t):,} elements past its first "
                                  f"(shape {_shape(t)}, strides {list(t.stride())}); the kernels index q and out "
                                  f"in int32: at most {INT32_ELEMENTS - 1:,}")
    return t
