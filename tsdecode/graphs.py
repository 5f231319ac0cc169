"""Decode at any batch size through CUDA graphs captured per padded batch size.

An engine's decode batch changes size every few steps as requests join and leave, while a CUDA
graph replays fixed shapes and addresses. The usual answer (vLLM, SGLang) is one graph per padded
batch size: ``DecodeGraphs`` plans one ``BatchDecodePagedTSWrapper`` per size, with static q,
lengths, block-table and output tensors, and captures its ``run(validate=False)``. Each step
copies the live q, lengths and block table into the smallest size that holds the batch (rows past
it: length 1 on ``pad_page``, so every row reads real memory) and replays that graph.

    graphs = DecodeGraphs(cache, num_qo_heads=32, max_kv_len=8192, q_data_type=torch.bfloat16)
    out = graphs(q, seq_lens, block_tables)  # [B, Hq, D]: a view of the static output

The cache is captured by address: keep using the same tensor(s), writing new K/V into them in
place. ``capture=False`` runs the same wrappers without graphs (the CPU, or to compare).

Each step's tensors are checked on the host (shapes, dtypes, devices: no sync), as
``run(validate=False)`` checks them; ``validate=True`` also reads the lengths and the live page IDs
back and checks their values, as ``run(validate=True)`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import validation as V
from .api import BatchDecodePagedTSWrapper, on_device
from .kernels.metadata import read_metadata

__all__ = ["DEFAULT_BATCH_SIZES", "DecodeGraphs", "StaticBatch"]

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class StaticBatch:
    """One padded batch size: its planned wrapper, the tensors its graph reads and writes, the graph."""

    batch_size: int
    wrapper: BatchDecodePagedTSWrapper
    q: torch.Tensor  # [batch_size, Hq, D]
    seq_lens: torch.Tensor  # int32 [batch_size]
    block_tables: torch.Tensor  # int32 [batch_size, ceil(max_kv_len / P)]
    out: torch.Tensor  # [batch_size, Hq, D]
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Single-token decode over one paged HND cache at any batch size up to ``max(batch_sizes)``.

    Parameters
    ----------
    paged_kv_cache : the HND cache every step reads, [num_pages, 2, Hkv, P, D] or (K, V).
    num_qo_heads, max_kv_len : Hq, and the longest K/V length any request will reach.
    batch_sizes : the padded batch sizes, one plan and one graph each (captured on first use,
        or all at once by ``capture_all``).
    q_data_type : q's dtype (default: the cache's dtype for a 16-bit cache, bfloat16 for fp8).
    o_data_type : as in ``BatchDecodePagedTSWrapper.plan`` (default: q_data_type).
    pad_page : the page that padding rows read (any valid page ID).
    capture : capture CUDA graphs (default: when the cache is on a GPU).
    """

    def __init__(self, paged_kv_cache, num_qo_heads: int, max_kv_len: int, *,
                 batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, q_data_type: torch.dtype | None = None,
                 o_data_type: torch.dtype | None = None, pad_page: int = 0, capture: bool | None = None) -> None:
        k = paged_kv_cache[0] if isinstance(paged_kv_cache, (tuple, list)) else paged_kv_cache[:, 0]
        _, self.num_kv_heads, self.page_size, self.head_dim = k.shape
        self.cache = paged_kv_cache
        self.kv_dtype, self.device = k.dtype, k.device
        self.num_qo_heads, self.max_kv_len = num_qo_heads, max_kv_len
        self.max_pages = -(-max_kv_len // self.page_size)
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.num_pages = k.shape[0]
        if not 0 <= V.require_int("pad_page", pad_page) < self.num_pages:
            raise ValueError(f"pad_page={pad_page} must be a page ID of the cache, in [0, {self.num_pages})")
        if q_data_type is None:
            q_data_type = k.dtype if k.element_size() == 2 else torch.bfloat16
        self.q_dtype, self.o_dtype, self.pad_page = q_data_type, o_data_type or q_data_type, pad_page
        self.capture = self.device.type == "cuda" if capture is None else capture
        self._static: dict[int, StaticBatch] = {}

    def padded_batch_size(self, batch: int) -> int:
        for size in self.batch_sizes:
            if size >= batch:
                return size
        raise ValueError(f"batch of {batch} requests exceeds the largest captured batch size {self.batch_sizes[-1]}")

    def __call__(self, q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, *,
                 validate: bool = False) -> torch.Tensor:
        """Decode q [B, Hq, D] with lengths int32 [B] and block table int32 [B, C <= ceil(max_kv_len / P)]:
        the output [B, Hq, D], a view of the static output (overwritten by the next call of that size).
        ``validate=True`` also checks the lengths and live page IDs (one host sync)."""
        static = self.stage(q, seq_lens, block_tables, validate=validate)
        if static.graph is not None:
            static.graph.replay()
        else:
            self._run(static)
        return static.out[:q.shape[0]]

    def stage(self, q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, *,
              validate: bool = False) -> StaticBatch:
        """Check a step's q, lengths and block table, then write them in place into its padded batch
        size's tensors (columns past the step's C point at ``pad_page``)."""
        q = V.require_tensor("q", q)
        if q.dim() != 3 or q.shape[0] < 1:
            raise ValueError(f"q must be [B, Hq, D] = [B, {self.num_qo_heads}, {self.head_dim}] with B >= 1, "
                             f"got shape {list(q.shape)}")
        batch = q.shape[0]
        if tuple(q.shape[1:]) != (self.num_qo_heads, self.head_dim):
            raise ValueError(f"q must be [B, Hq, D] = [{batch}, {self.num_qo_heads}, {self.head_dim}] "
                             f"(num_qo_heads and the cache's head dim), got shape {list(q.shape)}")
        if q.dtype != self.q_dtype:
            raise TypeError(f"q dtype must be {self.q_dtype} (DecodeGraphs' q_data_type), got {q.dtype}")
        if q.device != self.device:
            raise ValueError(f"q must be on {self.device} (the cache's device), got {q.device}")
        seq_lens = V.validate_lengths_tensor("seq_lens", seq_lens, batch, self.device)
        block_tables = V.validate_block_tables(block_tables, batch, self.device)
        cols = block_tables.shape[1]
        if cols > self.max_pages:
            raise ValueError(f"block_tables has {cols} columns; max_kv_len={self.max_kv_len} "
                             f"allows {self.max_pages}")
        static = self._get(self.padded_batch_size(batch))
        if V.require_bool("validate", validate):
            with on_device(self.device):
                lens, _, min_page, max_page = read_metadata(block_tables, seq_lens, None, self.page_size)
            V.validate_metadata_values(static.wrapper._plan.shape, lens, None, min_page, max_page, cols,
                                       self.num_pages, batch, "seq_lens")
        static.q[:batch].copy_(q)
        static.seq_lens[:batch].copy_(seq_lens)
        static.seq_lens[batch:].fill_(1)
        static.block_tables[:batch, :cols].copy_(block_tables)
        if cols < self.max_pages:  # no page ID of an earlier, wider step is left to read
            static.block_tables[:batch, cols:].fill_(self.pad_page)
        static.block_tables[batch:, 0].fill_(self.pad_page)
        return static

    def capture_all(self) -> list[StaticBatch]:
        """Plan (and capture) every batch size now, as an engine does at startup."""
        return [self._get(size) for size in self.batch_sizes]

    def _get(self, size: int) -> StaticBatch:
        static = self._static.get(size)
        if static is None:
            static = self._static[size] = self._make(size)
        return static

    def _make(self, size: int) -> StaticBatch:
        wrapper = BatchDecodePagedTSWrapper()
        wrapper.plan(self.device, size, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                     self.max_kv_len, q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, o_data_type=self.o_dtype)
        static = StaticBatch(
            size, wrapper,
            q=torch.zeros(size, self.num_qo_heads, self.head_dim, dtype=self.q_dtype, device=self.device),
            seq_lens=torch.ones(size, dtype=torch.int32, device=self.device),
            block_tables=torch.full((size, self.max_pages), self.pad_page, dtype=torch.int32, device=self.device),
            out=torch.empty(size, self.num_qo_heads, self.head_dim, dtype=self.o_dtype, device=self.device))
        # One checked run (the padding rows' metadata is valid), which also warms the kernels up.
        wrapper.run(static.q, self.cache, static.seq_lens, static.block_tables, out=static.out, validate=True)
        if self.capture:
            with torch.cuda.device(self.device):
                # Captured after a warm-up on a side stream, as torch.cuda.graph recommends.
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._run(static)
                torch.cuda.current_stream().wait_stream(side)
                static.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(static.graph):
                    self._run(static)
        return static

    def _run(self, static: StaticBatch) -> None:
        static.wrapper.run(static.q, self.cache, static.seq_lens, static.block_tables, out=static.out, validate=False)
