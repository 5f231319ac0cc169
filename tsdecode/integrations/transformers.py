"""tsdecode as the decode attention of Hugging Face transformers' continuous batching.

    from tsdecode.integrations import transformers as tsdecode_transformers

    tsdecode_transformers.enable(model)   # a bfloat16/float16 PreTrainedModel on a CUDA device
    outputs = model.generate_batch(prompts, generation_config=generation_config)
    tsdecode_transformers.disable(model)  # back to transformers' own paged SDPA

Decode steps (every request in the batch with one new token) run tsdecode; prefill and chunked
prefill stay on transformers' paged SDPA. transformers 5.17 and 5.24 are supported (their
continuous batching hands the cache to attention differently; other versions raise):

- 5.17: the attention function receives the paged cache and writes the new K/V itself.
  tsdecode registers ``"paged|tsdecode"`` (and ``"tsdecode"``, which continuous batching
  prefixes). A layer's cache is [slots, Hkv, D] (token-major inside each block); viewed as
  one-token pages, [slots, Hkv, 1, D], it is HND with compact pages: the decode reads
  transformers' cache in place, through the per-token slot indices transformers computes for
  every step (``read_index``) as the block table.
- 5.24: the model gathers every request's K/V out of the cache (an ``index_select`` copy) before
  it calls attention, and continuous batching only accepts ``"sdpa"``, ``"paged|eager"`` and
  flash implementations. ``enable`` keeps the model on ``"sdpa"``, whose registered function
  tsdecode wraps: decode steps of enabled models read the gathered K/V as one-token pages (a view
  of transformers' copy), everything else goes to the original function. Where a flash-attention
  package is installed, pass ``ContinuousBatchingConfig(auto_switch_to_flash=False)``.
"""

from __future__ import annotations

import torch
import transformers
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import BatchDecodePagedTSWrapper, get_prims_ts_batch_decode_workspace_size

__all__ = ["ATTN_IMPLEMENTATION", "SUPPORTED_VERSIONS", "disable", "enable", "register", "transformers_api"]

SUPPORTED_VERSIONS = ("5.17", "5.24")
ATTN_IMPLEMENTATION = "paged|tsdecode"  # transformers 5.17's name for it
# One workspace (the split partials) per device, shared by every plan: the layers run one at a
# time on one stream. 128 MiB holds B * Hq * num_kv_splits up to ~250k at D = 128; a plan that
# would need more fits its split count to it.
WORKSPACE_BYTES = 128 << 20
# Plans are cached per (batch size, K/V capacity); capacities are powers of two from this one,
# so a growing batch re-plans once per doubling, not once per token.
MIN_CAPACITY = 16
_ENABLED = "_tsdecode_decode"  # 5.24: the flag on an enabled model's modules
_PREVIOUS = "_tsdecode_previous_attn_implementation"


def transformers_api() -> str:
    """``"5.17"`` or ``"5.24"``: which continuous-batching interface the installed transformers has."""
    minor = ".".join(transformers.__version__.split(".")[:2])
    if minor not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"tsdecode.integrations.transformers supports transformers {' and '.join(SUPPORTED_VERSIONS)} "
            f"(each hands the paged cache to attention its own way); found transformers {transformers.__version__}")
    return minor


def register() -> str:
    """Register tsdecode's attention with transformers (idempotent); return the API in use.

    5.17: ``attn_implementation="paged|tsdecode"`` (or ``"tsdecode"``) then selects it. 5.24:
    wraps ``"sdpa"``, which stays transformers' own path for every model not ``enable``-d.
    """
    api = transformers_api()
    if api == "5.17":
        for name in (ATTN_IMPLEMENTATION, "tsdecode"):
            AttentionInterface.register(name, paged_attention_forward)
    else:
        current = ALL_ATTENTION_FUNCTIONS["sdpa"]
        if not hasattr(current, "wrapped_sdpa"):
            AttentionInterface.register("sdpa", _sdpa_with_tsdecode_decode(current))
    return api


def enable(model: torch.nn.Module) -> None:
    """Run the decode steps of ``model.generate_batch`` (continuous batching) through tsdecode.

    Raises TypeError for a module that is no transformers model, NotImplementedError where
    tsdecode cannot run the model's attention (head dim, dtype, device), RuntimeError on an
    unsupported transformers version.
    """
    if not hasattr(model, "config") or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers model (a PreTrainedModel, with .config), got "
                        f"{type(model).__name__}")
    api = register()
    _check_geometry(model)
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION if api == "5.17" else "sdpa")
    except ValueError as e:  # the model's own attention refuses that implementation
        needed = ATTN_IMPLEMENTATION if api == "5.17" else "sdpa (whose decode steps tsdecode replaces)"
        raise NotImplementedError(f"tsdecode runs {type(model).__name__}'s decode attention through "
                                  f"transformers {transformers.__version__}'s {needed}, which this model does not "
                                  f"support: {e}") from e
    if not hasattr(model, _PREVIOUS):
        setattr(model, _PREVIOUS, previous)
    if api != "5.17":
        for module in model.modules():
            setattr(module, _ENABLED, True)


def disable(model: torch.nn.Module) -> None:
    """Undo ``enable``: the model's attention implementation from before it."""
    for module in model.modules():
        if hasattr(module, _ENABLED):
            delattr(module, _ENABLED)
    previous = model.__dict__.pop(_PREVIOUS, None)
    if previous is not None:
        model.set_attn_implementation(previous)


def _check_geometry(model: torch.nn.Module) -> None:
    """Fail at enable() rather than at the first decode step, inside continuous batching's thread."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    try:
        get_prims_ts_batch_decode_workspace_size(1, heads, kv_heads, head_dim, 1, MIN_CAPACITY,
                                                 q_dtype=model.dtype, device=model.device)
    except (NotImplementedError, ValueError, TypeError) as e:
        raise NotImplementedError(f"tsdecode cannot run this model's decode attention (Hq={heads}, Hkv={kv_heads}, "
                                  f"D={head_dim}, {model.dtype} on {model.device}): {e}") from e


# --- the decode --------------------------------------------------------------------------------

_WRAPPERS: dict[tuple, BatchDecodePagedTSWrapper] = {}
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def _decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, seq_lens: torch.Tensor,
            block_table: torch.Tensor, capacity: int, scale: float | None) -> torch.Tensor:
    """Decode of q [B, Hq, D] over one-token pages k/v [slots, Hkv, 1, D]; block_table int32
    [B, capacity] of slots, seq_lens int32 [B]. No host sync (the plan is cached)."""
    batch, num_qo_heads, head_dim = q.shape
    key = (q.device, batch, num_qo_heads, k_pages.shape[1], head_dim, q.dtype, k_pages.dtype, capacity)
    wrapper = _WRAPPERS.get(key)
    if wrapper is None:
        workspace = _WORKSPACES.get(q.device)
        if workspace is None:
            workspace = _WORKSPACES[q.device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
        wrapper = BatchDecodePagedTSWrapper()
        wrapper.plan(q.device, batch, num_qo_heads, k_pages.shape[1], head_dim, 1, capacity, q_data_type=q.dtype,
                     kv_data_type=k_pages.dtype, workspace_buffer=workspace)
        _WRAPPERS[key] = wrapper
    return wrapper.run(q, (k_pages, v_pages), seq_lens, block_table, bmm1_scale=scale, validate=False)


def _capacity(max_kv_len: int) -> int:
    return max(MIN_CAPACITY, 1 << (int(max_kv_len) - 1).bit_length())


def _rows(cu_seq_lens_k: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, capacity] int64 key indices: each request's first key + 0..capacity-1, lengths int32 [B])."""
    starts = cu_seq_lens_k[:-1].long()
    lens = (cu_seq_lens_k[1:] - cu_seq_lens_k[:-1]).to(torch.int32)
    return starts[:, None] + torch.arange(capacity, device=starts.device), lens


def _is_decode(query: torch.Tensor, cu_seq_lens_q: torch.Tensor, max_len_q: int) -> bool:
    """Every request has one query token (an unpadded batch: padding raises max_len_q)."""
    return max_len_q == 1 and query.shape[2] == cu_seq_lens_q.shape[0] - 1


def _check_features(module: torch.nn.Module, kwargs: dict) -> None:
    if kwargs.get("softcap") is not None or hasattr(module, "sinks"):
        raise NotImplementedError("tsdecode's decode has no logit softcap or attention sinks")


def _as_tokens(x: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] (transformers' attention layout) as [T, H, D]: a view when token-major."""
    return x[0].transpose(0, 1).contiguous()


# --- transformers 5.17: "paged|tsdecode" ----------------------------------------------------------

def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers 5.17's paged attention function: decode steps through tsdecode, reading the
    cache in place; the rest through transformers' paged SDPA with a mask built here (5.17 builds
    one only for its own paged implementations). query [1, Hq, T, D], key/value [1, Hkv, T, D]:
    the new tokens, packed."""
    cache = kwargs.pop("cache", None)
    if cache is None:
        raise ValueError("paged|tsdecode runs inside continuous batching (model.generate_batch), which passes the "
                         "paged cache; use 'sdpa' for a standard forward")
    window = cache.sliding_windows[module.layer_idx]  # 1: full attention
    layer_type = "sliding_attention" if window > 1 else "full_attention"
    cu_q = kwargs["cu_seq_lens_q"]
    cu_k, max_k = (x[layer_type] if isinstance(x, dict) else x  # a dict when the model mixes layer types
                   for x in (kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]))
    group, index_in_group = cache.layer_index_to_group_indices[module.layer_idx]
    read_index, write_index = kwargs["read_index"][group], kwargs["write_index"][group]
    if not _is_decode(query, cu_q, kwargs["max_seqlen_q"]) or dropout:
        from transformers.integrations.sdpa_paged import sdpa_attention_paged_forward

        k_len = read_index.numel() or query.shape[2]  # no cache read: attention over the new tokens only
        mask = _varlen_causal_mask(cu_q, cu_k, query.shape[2], k_len, window, query.dtype)
        return sdpa_attention_paged_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                            cache=cache, **kwargs)
    _check_features(module, kwargs)
    k_cache, v_cache = cache.key_cache[index_in_group], cache.value_cache[index_in_group]
    # cache.update's write: each new token's K/V into its slot
    k_cache.index_copy_(0, write_index, _as_tokens(key))
    v_cache.index_copy_(0, write_index, _as_tokens(value))
    capacity = _capacity(max_k)
    rows, lens = _rows(cu_k, capacity)
    table = read_index[rows.clamp_(max=read_index.numel() - 1)]
    # A sliding-window layer reads a sentinel for the new token: point it at the token's slot
    # (a full-attention layer's last read slot is that one already).
    table.scatter_(1, (lens.long() - 1)[:, None], write_index[:, None])
    out = _decode(_as_tokens(query), k_cache.unsqueeze(2), v_cache.unsqueeze(2), lens, table.to(torch.int32),
                  capacity, scaling)
    return out.unsqueeze(0), None


def _varlen_causal_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, q_len: int, k_len: int, window: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, q_len, k_len] mask of a packed batch: query token i of request r sees
    request r's keys up to its own position, and only the last ``window`` of them on a
    sliding-window layer (window 1: none). The queries are each request's last keys."""
    cu_q, cu_k = cu_q.long(), cu_k.long()
    last = cu_q.numel() - 2
    iq = torch.arange(q_len, device=cu_q.device)
    jk = torch.arange(k_len, device=cu_k.device)
    req_q = torch.searchsorted(cu_q[1:], iq, right=True).clamp_(max=last)  # padding joins the last request
    req_k = torch.searchsorted(cu_k[1:], jk, right=True).clamp_(max=last)
    pos_q = iq - cu_q[req_q] + (cu_k[req_q + 1] - cu_k[req_q]) - (cu_q[req_q + 1] - cu_q[req_q])
    pos_k = jk - cu_k[req_k]
    seen = (req_q[:, None] == req_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])
    if window > 1:
        seen &= pos_k[None, :] > pos_q[:, None] - window
    mask = torch.zeros(q_len, k_len, dtype=dtype, device=cu_q.device)
    return mask.masked_fill_(~seen, torch.finfo(dtype).min)[None, None]


# --- transformers 5.24: "sdpa", wrapped -------------------------------------------------------------

def _sdpa_with_tsdecode_decode(sdpa):
    def sdpa_or_tsdecode(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """transformers 5.24's "sdpa", except decode steps of continuous batching on enabled
        models: key/value [1, Hkv, total_k, D] are then the requests' K/V, gathered in order by the
        cache's update, which tsdecode reads as one-token pages."""
        if (getattr(module, _ENABLED, False) and "read_index" in kwargs and kwargs.get("block_table") is None
                and not dropout and _is_decode(query, kwargs["cu_seq_lens_q"], kwargs["max_length_q"])):
            _check_features(module, kwargs)
            capacity = _capacity(kwargs["max_length_k"])
            rows, lens = _rows(kwargs["cu_seq_lens_k"], capacity)
            k_pages, v_pages = (_as_tokens(x).unsqueeze(2) for x in (key, value))
            out = _decode(_as_tokens(query), k_pages, v_pages, lens, rows.to(torch.int32), capacity, scaling)
            return out.unsqueeze(0), None
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    sdpa_or_tsdecode.wrapped_sdpa = sdpa
    return sdpa_or_tsdecode
