"""A minimal paged decode loop in plain torch: what a serving engine does around tsdecode.

    python examples/decode_loop.py               # a GPU: eager, CUDA graphs and torch.compile
    python examples/decode_loop.py --steps 40    # no GPU: Triton's interpreter, small sizes,
                                                 # eager and compiled only (CUDA graphs need a GPU)

- A page allocator hands out pages of one shared HND cache [num_pages, 2, Hkv, P, D] as
  sequences grow and takes them back when they end.
- Requests join (their prompt's K/V written into fresh pages) and leave after their own number
  of steps, so the batch changes size and every step's block table is re-mapped.
- Each step appends one token per live request (its K/V written in place into the cache) and runs
  decode attention three ways, one ``BatchDecodePagedTSWrapper`` per padded batch size each:
  eager (``run(validate=False)``), graphed (``tsdecode.graphs.DecodeGraphs``: each wrapper's run
  captured in a CUDA graph, replayed after the live lengths and block table are written into the
  tensors it captured) and compiled (``run`` under ``torch.compile(fullgraph=True)``).
- Every step's output is compared with the float64 reference (exit status 1 past REL_TOL or
  ABS_TOL); attention steps/s are printed.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by tsdecode)

from tsdecode.graphs import DecodeGraphs  # noqa: E402
from tsdecode.reference import reference_decode  # noqa: E402
from tsdecode.validation import validate_heads  # noqa: E402

PAD_PAGE = 0  # never handed out: padding rows of a padded batch read it
# What every step must meet against the float64 reference: bf16 output rounding (2^-8 relative)
# and bf16 probabilities in the P @ V product, with room (the bounds of the tests' bf16 cases).
REL_TOL, ABS_TOL = 1.2e-2, 0.05


class PageAllocator:
    """Pages of the shared cache, handed out in shuffled order (the pages of a sequence are scattered)."""

    def __init__(self, num_pages: int, seed: int) -> None:
        self.free = [p for p in range(num_pages) if p != PAD_PAGE]
        random.Random(seed).shuffle(self.free)

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("out of cache pages: raise --num-pages")
        return self.free.pop()

    def give_back(self, pages: list[int]) -> None:
        self.free.extend(pages)


@dataclass
class Request:
    pages: list[int]
    length: int  # tokens in the cache
    steps_left: int


@dataclass
class Result:
    steps: int  # steps with at least one live request
    seconds: float  # in the attention calls
    max_err: float  # max |out - float64 reference| over all steps
    max_rel_err: float  # max over steps of ||out - reference|| / ||reference||
    batch_sizes: set
    joined: int
    left: int
    graph_breaks: int = 0
    compiled_graphs: int = 0
    batch_sizes_planned: tuple = ()


def decode_loop(args, make_attention, device: torch.device) -> Result:
    """The loop, with ``make_attention(cache)``'s ``attend(q, seq_lens, block_tables) -> out`` as
    its attention. Seeded: every call sees the same requests, tokens and queries."""
    rng = random.Random(args.seed)
    gen = torch.Generator(device).manual_seed(args.seed)
    P, max_pages = args.page_size, -(-args.max_kv_len // args.page_size)
    cache = torch.zeros(args.num_pages, 2, args.kv_heads, P, args.head_dim, dtype=torch.bfloat16, device=device)
    attend = make_attention(cache)  # captures the cache by address (graphs)
    pages = PageAllocator(args.num_pages, args.seed)
    live: list[Request] = []
    steps, seconds, max_err, max_rel, sizes, joined, left = 0, 0.0, 0.0, 0.0, set(), 0, 0

    def new_kv(n: int) -> torch.Tensor:  # [2, Hkv, n, D]
        return torch.randn(2, args.kv_heads, n, args.head_dim, generator=gen, device=device).to(torch.bfloat16)

    for _ in range(args.steps):
        # Join: a prompt's K/V into fresh pages (what prefill would write).
        while len(live) < args.max_batch and rng.random() < args.join_rate:
            prompt = rng.randint(1, args.max_prompt)
            request = Request([pages.take() for _ in range(-(-prompt // P))], prompt, rng.randint(1, args.max_new))
            kv = new_kv(prompt)
            for i, page in enumerate(request.pages):
                chunk = kv[:, :, i * P:(i + 1) * P]
                cache[page, :, :, :chunk.shape[2]] = chunk
            live.append(request)
            joined += 1
        if not live:
            continue
        # Grow: one new token per request, a new page when the last one is full.
        for r in live:
            if r.length % P == 0:
                r.pages.append(pages.take())
        page_ids = torch.tensor([r.pages[r.length // P] for r in live], device=device)
        slots = torch.tensor([r.length % P for r in live], device=device)
        cache[page_ids, :, :, slots] = new_kv(len(live)).permute(2, 0, 1, 3)  # [B, 2, Hkv, D]
        for r in live:
            r.length += 1
        # The step's metadata: live lengths and each request's pages (rows padded with PAD_PAGE).
        seq_lens = torch.tensor([r.length for r in live], dtype=torch.int32, device=device)
        table = torch.tensor([r.pages + [PAD_PAGE] * (max_pages - len(r.pages)) for r in live], dtype=torch.int32,
                             device=device)
        q = torch.randn(len(live), args.qo_heads, args.head_dim, generator=gen, device=device).to(torch.bfloat16)
        _sync(device)
        start = time.perf_counter()
        out = attend(q, seq_lens, table)
        _sync(device)
        seconds += time.perf_counter() - start
        steps += 1
        sizes.add(len(live))
        ref = reference_decode(q, cache, table, seq_lens)
        max_err = max(max_err, (out.double() - ref).abs().max().item())
        max_rel = max(max_rel, ((out.double() - ref).norm() / ref.norm()).item())
        # Leave: finished requests give their pages back.
        for r in live:
            r.steps_left -= 1
            if r.steps_left == 0:
                pages.give_back(r.pages)
                left += 1
        live = [r for r in live if r.steps_left > 0]
    return Result(steps, seconds, max_err, max_rel, sizes, joined, left)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_compiled(wrapper, q, cache, seq_lens, block_tables, out):
    return wrapper.run(q, cache, seq_lens, block_tables, out=out, validate=False)


def padded_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Powers of two up to the batch cap (at most 8 for max_batch <= 128: torch.compile's default
    limit of compiled variants of one function)."""
    return tuple(2**i for i in range((max_batch - 1).bit_length() + 1))


def attention(mode: str, args, compile_backend: str):
    """``make_attention`` for one mode: one planned wrapper per padded batch size (DecodeGraphs),
    run directly (eager), replayed from CUDA graphs (graphed) or compiled per batch size. Every
    size is planned, captured or compiled before the loop, as an engine does at startup."""
    sizes = padded_batch_sizes(args.max_batch)

    def make(cache):
        graphs = DecodeGraphs(cache, args.qo_heads, args.max_kv_len, batch_sizes=sizes, capture=mode == "graphed")
        statics = graphs.capture_all()
        if mode != "compiled":
            return graphs
        compiled = {}
        for static in statics:
            compiled[static.batch_size] = torch.compile(functools.partial(_run_compiled, static.wrapper),
                                                        fullgraph=True, backend=compile_backend)
            compiled[static.batch_size](static.q, cache, static.seq_lens, static.block_tables, static.out)

        def attend(q, seq_lens, block_tables):
            static = graphs.stage(q, seq_lens, block_tables)  # in place into the padded size's tensors
            compiled[static.batch_size](static.q, cache, static.seq_lens, static.block_tables, static.out)
            return static.out[:q.shape[0]]
        return attend
    return make


def run_all(args) -> dict[str, Result]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    modes = ["eager", "graphed", "compiled"] if device.type == "cuda" else ["eager", "compiled"]
    compile_backend = "inductor" if device.type == "cuda" else "aot_eager"  # no C++ codegen on the CPU
    results = {}
    for mode in modes:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        results[mode] = decode_loop(args, attention(mode, args, compile_backend), device)
        counters = torch._dynamo.utils.counters
        results[mode].graph_breaks = sum(counters["graph_break"].values())
        results[mode].compiled_graphs = counters["stats"]["unique_graphs"]
        results[mode].batch_sizes_planned = padded_batch_sizes(args.max_batch)
    return results


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    return parse


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a probability in (0, 1], got {text!r}")
    return value


def pages_needed(args) -> int:
    """Cache pages the loop can hold at once: every request at its longest, plus PAD_PAGE."""
    return args.max_batch * -(-args.max_kv_len // args.page_size) + 1


def main(argv=None) -> dict[str, Result]:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    positive = _at_least(1)
    p.add_argument("--steps", type=positive, default=300 if on_gpu else 40)
    p.add_argument("--max-batch", type=positive, default=48 if on_gpu else 4)
    p.add_argument("--join-rate", type=_rate, default=0.5)
    p.add_argument("--max-prompt", type=positive, default=900 if on_gpu else 20)
    p.add_argument("--max-new", type=positive, default=200 if on_gpu else 12)
    p.add_argument("--qo-heads", type=positive, default=32 if on_gpu else 4)
    p.add_argument("--kv-heads", type=positive, default=8 if on_gpu else 2)
    p.add_argument("--head-dim", type=positive, default=128 if on_gpu else 64)
    p.add_argument("--page-size", type=positive, default=16 if on_gpu else 4)
    p.add_argument("--num-pages", type=positive, default=4096 if on_gpu else 64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.max_kv_len = args.max_prompt + args.max_new
    try:
        validate_heads(args.qo_heads, args.kv_heads, args.head_dim, args.page_size)
    except (ValueError, NotImplementedError) as e:
        p.error(f"--qo-heads/--kv-heads/--head-dim/--page-size: {e}")
    if args.num_pages < pages_needed(args):
        p.error(f"--num-pages {args.num_pages}: the loop may hold up to {pages_needed(args)} pages at once "
                "(--max-batch x ceil((--max-prompt + --max-new) / --page-size), plus the padding page)")
    results = run_all(args)
    r = next(iter(results.values()))
    if r.steps == 0:
        p.error(f"no request joined in {args.steps} steps (seed {args.seed}): nothing was measured; "
                "raise --steps or --join-rate")
    print(f"{args.steps} steps ({r.steps} with a live request), {r.joined} requests joined, {r.left} left, "
          f"batch sizes {min(r.batch_sizes)}..{max(r.batch_sizes)}")
    print(f"{'mode':<9} {'steps/s':>9} {'max abs err':>12} {'max rel err':>12}  (attention only, vs float64 reference)")
    for mode, r in results.items():
        print(f"{mode:<9} {r.steps / r.seconds:>9.1f} {r.max_err:>12.2e} {r.max_rel_err:>12.2e}")
    if "compiled" in results:
        r = results["compiled"]
        print(f"compiled: fullgraph, {r.graph_breaks} graph breaks, {r.compiled_graphs} graphs for "
              f"{len(r.batch_sizes_planned)} padded batch sizes (the wrapper is a graph input: sizes share graphs)")
    if not on_gpu:
        print("(CPU: Triton's interpreter; CUDA graphs skipped, compiled with the aot_eager backend)")
    bad = failures(results)
    print("\n".join(f"FAILED {line}" for line in bad) if bad else
          f"every step of every mode within {REL_TOL} relative and {ABS_TOL} absolute of the reference")
    return results


def failures(results: dict[str, Result]) -> list[str]:
    """The modes whose worst step is off the float64 reference by more than the tolerances."""
    return [f"{mode}: max rel err {r.max_rel_err:.2e} (at most {REL_TOL}), max abs err {r.max_err:.2e} "
            f"(at most {ABS_TOL})" for mode, r in results.items()
            if not (r.max_rel_err < REL_TOL and r.max_err < ABS_TOL)]


if __name__ == "__main__":
    sys.exit(1 if failures(main()) else 0)
