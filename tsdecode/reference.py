"""Plain PyTorch reference of the contract in float64 (or float32), one request at a time.

Independent of the kernel: it gathers each request's pages into a dense [Hkv, L, D] K/V,
builds the visible-key mask explicitly and calls softmax. Slow; for tests and the tuner's
correctness check only.
"""

from __future__ import annotations

import math

import torch


def reference_decode(
    q: torch.Tensor,
    paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens_kv: torch.Tensor,
    *,
    seq_len_q: int = 1,
    qo_indptr: torch.Tensor | None = None,
    mask_type: str = "dense",
    window_left: int = -1,
    bmm1_scale: float | None = None,
    bmm2_scale: float = 1.0,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Attention output in ``compute_dtype`` with q's shape ([B,Hq,D], [B,SQ,Hq,D] or packed).

    The query layout comes from q's rank and ``qo_indptr``; ``seq_len_q`` must agree with it (a
    4-D q's SQ, 1 for a 3-D q without ``qo_indptr``). Inputs are otherwise taken as given (no
    validation beyond what indexing enforces).
    """
    if qo_indptr is None and seq_len_q != (q.shape[1] if q.dim() == 4 else 1):
        raise ValueError(f"seq_len_q={seq_len_q} disagrees with q's shape {list(q.shape)} "
                         f"([B, SQ, Hq, D] carries SQ; [B, Hq, D] is one query token)")
    if isinstance(paged_kv_cache, (tuple, list)):
        k_cache, v_cache = paged_kv_cache
    else:
        k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    page_size, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_kv_heads = k_cache.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if bmm1_scale is None else bmm1_scale
    lens = [int(x) for x in seq_lens_kv.cpu()]
    batch = len(lens)
    if qo_indptr is not None:
        bounds = [int(x) for x in qo_indptr.cpu()]
        q_rows = [q[bounds[b]:bounds[b + 1]] for b in range(batch)]  # [SQ_b, Hq, D]
    elif q.dim() == 4:
        q_rows = [q[b] for b in range(batch)]
    else:
        q_rows = [q[b : b + 1] for b in range(batch)]
    outs = []
    for b in range(batch):
        L = lens[b]
        n_pages = -(-L // page_size)
        pages = block_tables[b, :n_pages].long().cpu()
        k = k_cache[pages.to(k_cache.device)].to(compute_dtype)  # [n, Hkv, P, D]
        v = v_cache[pages.to(v_cache.device)].to(compute_dtype)
        k = k.permute(1, 0, 2, 3).reshape(num_kv_heads, n_pages * page_size, head_dim)[:, :L]
        v = v.permute(1, 0, 2, 3).reshape(num_kv_heads, n_pages * page_size, head_dim)[:, :L]
        qb = q_rows[b].to(compute_dtype).to(k.device)  # [SQ, Hq, D]
        sq, num_qo_heads = qb.shape[0], qb.shape[1]
        group = num_qo_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=0)  # [Hq, L, D]
        v = v.repeat_interleave(group, dim=0)
        logits = scale * torch.einsum("shd,hld->hsl", qb, k)  # [Hq, SQ, L]
        keys = torch.arange(L, device=k.device)
        rows = torch.arange(sq, device=k.device)
        if mask_type == "causal":
            end = L - sq + rows + 1
        else:
            end = torch.full((sq,), L, device=k.device)
        lo = torch.clamp(end - window_left - 1, min=0) if window_left >= 0 else torch.zeros_like(end)
        visible = (keys[None, :] < end[:, None]) & (keys[None, :] >= lo[:, None])  # [SQ, L]
        logits = logits.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        o = bmm2_scale * torch.einsum("hsl,hld->shd", probs, v)  # [SQ, Hq, D]
        outs.append(o)
    if qo_indptr is not None:
        return torch.cat(outs, dim=0)
    if q.dim() == 4:
        return torch.stack(outs, dim=0)
    return torch.cat(outs, dim=0)
