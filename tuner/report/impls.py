"""Implementations a report benchmarks: tsdecode (tuned table, heuristic) and baselines/peers.

An implementation is a factory ``factory(spec, inputs) -> callable``: given a ``ShapeSpec`` and
one ``measure.DecodeInputs`` set, it does all setup (planning, index tensors, compilation is
allowed on the first call) and returns a zero-argument callable that computes the attention of
``inputs`` into ``inputs.out``. The callable is captured in a CUDA graph on GPUs, so it must not
sync with the host or change shape between calls. A factory that cannot handle a spec (or whose
library is missing) raises ``Unsupported(reason)``; the report records the reason and moves on.
Return ``Prepared(fn, config=..., config_source=..., note=...)`` to record what was run.

Adding one::

    def my_factory(spec, inputs):
        import mylib  # raises ImportError -> recorded as skipped
        return lambda: mylib.decode(inputs.q, inputs.cache, inputs.block_tables,
                                    inputs.seq_lens, out=inputs.out)

    register_impl("mylib", my_factory, kind="peer")
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tsdecode.config.heuristic import heuristic_config
from tsdecode.config.select import scale_splits_to_raggedness
from tsdecode.device import device_properties

from ..grids import DTYPES, ShapeSpec
from ..measure import DecodeInputs, decode_call, plan_wrapper

KINDS = ("tsdecode", "baseline", "peer")


class Unsupported(Exception):
    """A factory cannot run this spec here; the message is recorded as the skip reason."""


class NoTableEntry(Unsupported):
    """The runtime would use the heuristic here: a "tuned" row would repeat the heuristic row."""


class Prepared:
    """A zero-argument callable plus what the report records about it (all optional)."""

    def __init__(
        self, fn: Callable[[], object], *, config: dict | None = None, config_source: str = "",
        config_note: str = "", note: str = "",
    ) -> None:
        self.fn = fn
        self.config = config
        self.config_source = config_source
        self.config_note = config_note
        self.note = note

    def __call__(self) -> object:
        return self.fn()


Factory = Callable[[ShapeSpec, DecodeInputs], Callable[[], object]]


@dataclass(frozen=True)
class Impl:
    """A registered implementation. kind: "tsdecode" (ours), "baseline" (plain PyTorch, always
    available) or "peer" (optional library). Every non-tsdecode impl gets a speedup_vs_<name>
    column in the report."""

    name: str
    factory: Factory
    kind: str = "baseline"
    description: str = ""


IMPLS: dict[str, Impl] = {}


def register_impl(name: str, factory: Factory, *, kind: str = "baseline", description: str = "") -> Impl:
    """Register (or replace) an implementation under ``name`` (a CSV-friendly identifier)."""
    if not name.isidentifier():
        raise ValueError(f"implementation names must be identifiers (used in CSV columns), got {name!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    impl = Impl(name, factory, kind, description)
    IMPLS[name] = impl
    return impl


def unregister_impl(name: str) -> None:
    IMPLS.pop(name, None)


# ---------------------------------------------------------------------------------------------
# tsdecode


def _wrapper_call(w, inputs: DecodeInputs, source: str) -> Prepared:
    selected = w.config
    notes = list(selected.adjustments)
    if selected.table_path:
        notes.insert(0, f"{selected.table_path} bucket(batch_size, kv_len)={selected.bucket}")
    return Prepared(decode_call(w, inputs), config=selected.kernel_config.to_dict(), config_source=source,
                    config_note="; ".join(notes))


def tuned_factory(spec: ShapeSpec, inputs: DecodeInputs) -> Prepared:
    """What the runtime picks with no explicit config; only a row when a tuned table is used."""
    w = plan_wrapper(spec, inputs, None)
    if w.config.source == "heuristic":
        raise NoTableEntry(
            "no tuned table entry for this shape on this GPU: the runtime uses the heuristic config"
        )
    return _wrapper_call(w, inputs, w.config.source)


def heuristic_factory(spec: ShapeSpec, inputs: DecodeInputs) -> Prepared:
    """tsdecode with the config a plan takes where no table has an entry: the heuristic's, its
    splits scaled to the drawn lengths' spread."""
    props = device_properties(inputs.q.device)
    shape = spec.to_problem_shape(inputs.seq_lens.tolist())
    config, _ = scale_splits_to_raggedness(heuristic_config(shape, props), shape, props)
    return _wrapper_call(plan_wrapper(spec, inputs, config), inputs, "heuristic")


# ---------------------------------------------------------------------------------------------
# Shared helpers for the dense baselines


def _query_4d(spec: ShapeSpec, inputs: DecodeInputs) -> torch.Tensor:
    """q as [B, Hq, SQ, D] (a view)."""
    q = inputs.q
    return q.unsqueeze(2) if q.dim() == 3 else q.transpose(1, 2)


def _write_out(spec: ShapeSpec, inputs: DecodeInputs, o: torch.Tensor) -> None:
    """o [B, Hq, SQ, D] into inputs.out ([B, Hq, D] or [B, SQ, Hq, D])."""
    if inputs.out.dim() == 3:
        inputs.out.copy_(o.squeeze(2))
    else:
        inputs.out.copy_(o.transpose(1, 2))


def _visible_keys(spec: ShapeSpec, lens: list[int], width: int, device) -> torch.Tensor:
    """Boolean [B, 1, SQ, width]: which padded key positions each query row sees."""
    lens_t = torch.tensor(lens, device=device)[:, None, None, None]
    rows = torch.arange(spec.seq_len_q, device=device)[None, None, :, None]
    keys = torch.arange(width, device=device)[None, None, None, :]
    visible = keys < lens_t
    if spec.mask_type == "causal":
        last = lens_t - spec.seq_len_q + rows  # the last key query row i may see
        visible = visible & (keys <= last)
        if spec.window_left >= 0:
            visible = visible & (keys >= last - spec.window_left)
    return visible


def _no_packed(spec: ShapeSpec) -> None:
    if spec.packed:
        raise Unsupported("packed queries (qo_indptr): this adapter handles fixed query lengths only")


# ---------------------------------------------------------------------------------------------
# torch: index_select gather + scaled_dot_product_attention (the naive route)

_GQA_OK: bool | None = None


def _sdpa_has_gqa() -> bool:
    global _GQA_OK
    if _GQA_OK is None:
        try:
            F.scaled_dot_product_attention(
                torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8), enable_gqa=True
            )
            _GQA_OK = True
        except TypeError:  # torch < 2.5
            _GQA_OK = False
    return _GQA_OK


def torch_sdpa_factory(spec: ShapeSpec, inputs: DecodeInputs) -> Prepared:
    """Gather each request's pages into dense [B, Hkv, L, D] K/V (index_select, every call), then
    F.scaled_dot_product_attention; GQA via enable_gqa (repeat_interleave on old torch)."""
    _no_packed(spec)
    P, B = spec.page_size, spec.batch_size
    lens = inputs.seq_lens.tolist()  # setup-time host read
    n = -(-max(lens) // P)
    width = n * P
    # Rows shorter than the longest point at page 0 past their length (make_inputs pads with 0);
    # those keys are masked.
    index = inputs.block_tables[:, :n].reshape(-1).long()
    pools = inputs.cache[:, 0].transpose(0, 1), inputs.cache[:, 1].transpose(0, 1)  # [Hkv, N, P, D]
    q = _query_4d(spec, inputs)
    mask = _visible_keys(spec, lens, width, q.device)
    mask = None if bool(mask.all()) else mask
    group = spec.num_qo_heads // spec.num_kv_heads
    gqa = group > 1 and _sdpa_has_gqa()

    def gather(pool: torch.Tensor) -> torch.Tensor:
        x = pool.index_select(1, index)  # [Hkv, B*n, P, D]
        x = x.view(spec.num_kv_heads, B, width, spec.head_dim).transpose(0, 1)  # [B, Hkv, n*P, D]
        if x.dtype != q.dtype:
            x = x.to(q.dtype)
        if group > 1 and not gqa:
            x = x.repeat_interleave(group, dim=1)
        return x

    def call() -> None:
        k, v = gather(pools[0]), gather(pools[1])
        kwargs = {"enable_gqa": True} if gqa else {}
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
        _write_out(spec, inputs, o)

    how = "enable_gqa" if gqa else ("repeat_interleave" if group > 1 else "MHA")
    return Prepared(call, note=f"gather every call (timed); GQA via {how}; "
                               f"{'masked' if mask is not None else 'no mask'}")


# ---------------------------------------------------------------------------------------------
# torch FlexAttention over the page pool (block mask = page table, like
# torch.nn.attention.experimental._paged_attention)

_FLEX_STATE: dict[int, tuple[weakref.ref, dict]] = {}  # id(cache pool) -> (weakref, state)
_FLEX_COMPILED: dict[str, Callable] = {}
FLEX_Q_BLOCK = 128


def _flex_fn(device: torch.device) -> tuple[Callable, str]:
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        import warnings

        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention, "eager (unfused) on CPU"
    if "cuda" not in _FLEX_COMPILED:
        # Every shape (and pool) recompiles; past dynamo's default limit (8) it would silently
        # fall back to eager flex, which materialises all scores.
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 4096))
        _FLEX_COMPILED["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED["cuda"], "torch.compile"


def _flex_mask_mod(spec: ShapeSpec, page_pos: torch.Tensor, seq_lens: torch.Tensor,
                   page_owner: torch.Tensor | None) -> Callable:
    """mask_mod on physical K/V indices: key = page_pos[page] * P + offset, visible when below the
    request's length (and inside the causal / sliding window). page_owner, when given, also
    requires the page to belong to request b (needed where the block mask is not honoured)."""
    P, sq = spec.page_size, spec.seq_len_q
    causal, window = spec.mask_type == "causal", spec.window_left

    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // P
        pos = page_pos[page] * P + kv_idx % P
        length = seq_lens[b]
        ok = pos < length
        if page_owner is not None:
            ok = ok & (page_owner[page] == b)
        if causal:
            last = length - sq + q_idx
            ok = ok & (pos <= last)
            if window >= 0:
                ok = ok & (pos >= last - window)
        return ok

    return mask_mod


def _flex_pool_state(spec: ShapeSpec, inputs: DecodeInputs) -> dict:
    """Per cache pool, shared by all its input sets: K/V as [1, Hkv, pages*P, D] and a page ->
    position-in-request table (sets own disjoint pages, so one table serves all)."""
    cache = inputs.cache
    for key, (ref, _) in list(_FLEX_STATE.items()):
        if ref() is None:
            del _FLEX_STATE[key]
    hit = _FLEX_STATE.get(id(cache))
    if hit is not None and hit[0]() is cache:
        return hit[1]
    num_pages, _, hkv, P, D = cache.shape
    q_dtype = DTYPES[spec.q_dtype]
    state = {
        "k": cache[:, 0].transpose(0, 1).reshape(1, hkv, num_pages * P, D).to(q_dtype),
        "v": cache[:, 1].transpose(0, 1).reshape(1, hkv, num_pages * P, D).to(q_dtype),
        "page_pos": torch.zeros(num_pages, dtype=torch.int32, device=cache.device),
    }
    # One mask_mod function object per pool: the compiled kernel is then reused by every set.
    # Exactness comes from the block mask (one block per page, each row its own pages).
    state["mask_mod"] = _flex_mask_mod(spec, state["page_pos"], inputs.seq_lens, None)
    _FLEX_STATE[id(cache)] = (weakref.ref(cache), state)
    return state


def flex_attention_factory(spec: ShapeSpec, inputs: DecodeInputs) -> Prepared:
    """torch.nn.attention.flex_attention on the page pool: K/V viewed as one [1, Hkv, pages*P, D]
    sequence (converted once per shape, untimed), one block per page, each request's block-mask
    row = its block-table row, so each request reads only its own pages. Compiled on CUDA; on
    CPU it runs eagerly (unfused) with an exact per-set mask."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError as e:
        raise Unsupported(f"torch {torch.__version__} has no FlexAttention ({e})") from None
    _no_packed(spec)
    if spec.kv_dtype != spec.q_dtype:
        raise Unsupported(f"K/V dtype {spec.kv_dtype} differs from q dtype {spec.q_dtype}")
    device = inputs.q.device
    if device.type == "cpu" and spec.batch_size * spec.kv_len > 1 << 16:
        raise Unsupported("eager FlexAttention on CPU materialises all scores; shape too large")
    fn, how = _flex_fn(device)
    state = _flex_pool_state(spec, inputs)
    P, B = spec.page_size, spec.batch_size
    pages = [-(-n // P) for n in inputs.seq_lens.tolist()]
    num_pages = inputs.cache.shape[0]
    tables = inputs.block_tables
    owner = torch.full((num_pages,), -1, dtype=torch.int32, device=device)
    for b, n in enumerate(pages):
        ids = tables[b, :n].long()
        state["page_pos"][ids] = torch.arange(n, dtype=torch.int32, device=device)
        owner[ids] = b
    if device.type == "cuda":
        mask_mod = state["mask_mod"]
    else:  # eager flex evaluates mask_mod on every key: make ownership explicit
        mask_mod = _flex_mask_mod(spec, state["page_pos"], inputs.seq_lens, owner)
    kv_num_blocks = torch.tensor(pages, dtype=torch.int32, device=device).view(B, 1, 1)
    kv_indices = torch.zeros((B, 1, 1, num_pages), dtype=torch.int32, device=device)
    kv_indices[:, 0, 0, : max(pages)] = tables[:, : max(pages)]
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, BLOCK_SIZE=(FLEX_Q_BLOCK, P), mask_mod=mask_mod,
        seq_lengths=(spec.seq_len_q, num_pages * P),
    )
    q = _query_4d(spec, inputs)
    gqa = spec.num_qo_heads != spec.num_kv_heads
    k, v = state["k"], state["v"]

    def call() -> None:
        o = fn(q, k, v, block_mask=block_mask, enable_gqa=gqa)
        _write_out(spec, inputs, o)

    return Prepared(call, note=f"{how}; K/V pool converted once to [1, Hkv, pages*P, D] (untimed)")


def release() -> None:
    """Drop per-pool state (FlexAttention's converted K/V); the report calls it after each shape."""
    _FLEX_STATE.clear()


# ---------------------------------------------------------------------------------------------
# FlashInfer (optional peer)


def flashinfer_factory(spec: ShapeSpec, inputs: DecodeInputs, *, use_tensor_cores: bool = False) -> Prepared:
    """flashinfer.BatchDecodeWithPagedKVCacheWrapper on the same HND cache (CUDA-graph mode): its
    CUDA-core decode kernel, or with ``use_tensor_cores`` its tensor-core path (FlashInfer's advice
    for grouped-query attention)."""
    try:
        import flashinfer
    except ImportError:
        raise Unsupported("flashinfer is not installed") from None
    if inputs.q.device.type != "cuda":
        raise Unsupported("flashinfer needs a CUDA device")
    _no_packed(spec)
    if spec.seq_len_q != 1:
        raise Unsupported("flashinfer's decode wrapper takes one query token per request")
    device = inputs.q.device
    P = spec.page_size
    lens = inputs.seq_lens.tolist()
    pages = [-(-n // P) for n in lens]
    indices = torch.cat([inputs.block_tables[b, :n] for b, n in enumerate(pages)]).to(torch.int32)
    indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32, device=device)
    last_page_len = torch.tensor([n - (p - 1) * P for n, p in zip(lens, pages)], dtype=torch.int32, device=device)
    workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "HND", use_cuda_graph=True, use_tensor_cores=use_tensor_cores, paged_kv_indptr_buffer=indptr,
        paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last_page_len,
    )
    w.plan(
        indptr, indices, last_page_len, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, P,
        window_left=spec.window_left, q_data_type=DTYPES[spec.q_dtype],
        kv_data_type=DTYPES[spec.kv_dtype],
    )
    return Prepared(lambda: w.run(inputs.q, inputs.cache, out=inputs.out),
                    note=f"flashinfer {getattr(flashinfer, '__version__', '?')}")


register_impl("tuned", tuned_factory, kind="tsdecode",
              description="tsdecode, config from the tuned table (plan with config=None)")
register_impl("heuristic", heuristic_factory, kind="tsdecode",
              description="tsdecode, the heuristic's config (tsdecode.config.heuristic)")
register_impl("torch_sdpa", torch_sdpa_factory, kind="baseline",
              description="index_select gather to dense K/V + F.scaled_dot_product_attention")
register_impl("flex_attention", flex_attention_factory, kind="baseline",
              description="torch FlexAttention over the page pool, block mask = page table")
register_impl("flashinfer", flashinfer_factory, kind="peer",
              description="flashinfer.BatchDecodeWithPagedKVCacheWrapper, CUDA-core kernel (if installed)")
register_impl("flashinfer_tc", functools.partial(flashinfer_factory, use_tensor_cores=True), kind="peer",
              description="flashinfer.BatchDecodeWithPagedKVCacheWrapper, use_tensor_cores=True (if installed)")
