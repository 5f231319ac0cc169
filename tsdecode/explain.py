"""``explain``: which tuned table, bucket and config a plan of a given shape gets, and why."""

from __future__ import annotations

import os

import torch

from . import validation as V
from .config import tables
from .config.select import select_config
from .config.space import ProblemShape
from .device import device_properties


def explain(batch_size: int, kv_len: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
            page_size: int = 16, *, seq_len_q: int = 1, packed: bool = False, mask_type: str = "dense",
            window_left: int = -1, q_dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None,
            o_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
            config_dir: str | os.PathLike | None = None) -> str:
    """Which table, bucket and config a plan of this shape gets (equal lengths), and why.

    ``seq_len_q`` is the fixed SQ, or the packed capacity (max_seq_len_q) when ``packed``.
    """
    V.require_int("batch_size", batch_size, minimum=1)
    num_qo_heads, num_kv_heads, head_dim, page_size = V.validate_heads(num_qo_heads, num_kv_heads, head_dim,
                                                                       page_size)
    batch_size, kv_len, seq_len_q = V.validate_sizes(batch_size, kv_len, seq_len_q, num_qo_heads,
                                                     ("batch_size", "kv_len", "seq_len_q"), head_dim)
    packed = V.require_bool("packed", packed)
    _, window_left = V.validate_mask(mask_type, window_left)
    q_dtype, kv_dtype, o_dtype = V.resolve_dtypes(q_dtype, kv_dtype, o_dtype, ("q_dtype", "kv_dtype", "o_dtype"))
    if device is not None:  # any CPU will do: only its properties are described
        device = V.validate_device(device, interpreter=True)
    props = device_properties(device)
    shape = ProblemShape(
        batch_size=batch_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, max_kv_len=kv_len, max_seq_len_q=seq_len_q, packed=packed,
        mask_kind="windowed" if window_left >= 0 else mask_type, q_dtype=q_dtype, kv_dtype=kv_dtype,
        o_dtype=o_dtype, window_left=window_left)
    trace: list[str] = []
    selected = select_config(shape, props, config_dir=config_dir, trace=trace)
    lines = [
        f"shape: batch_size={batch_size} kv_len={kv_len} Hq={num_qo_heads} Hkv={num_kv_heads} "
        f"D={head_dim} P={page_size} SQ={seq_len_q}{' packed' if packed else ''} {shape.mask_kind}",
        f"class: {tables.problem_class_key(shape)}",
        f"bucket: {tables.bucket_of(batch_size, kv_len)}",
        f"device: {props.describe()}",
        "search:", *trace,
        f"source: {selected.source}" + (f" {selected.table_path} bucket {selected.bucket}"
                                         if selected.table_path else ""),
        f"config: {selected.kernel_config}",
        *(f"note: {n}" for n in selected.adjustments),
    ]
    return "\n".join(lines)
