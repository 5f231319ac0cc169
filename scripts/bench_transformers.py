"""Throughput of transformers' continuous batching (``generate_batch``) with tsdecode as the decode
attention, against transformers' own paged SDPA (and flash-attention where importable).

A Llama model built from a config with seeded random weights (no download; default: Llama-3-8B's
attention geometry, Hq 32, Hkv 8, D 128, with 8 layers instead of 32), a batch of requests with
prompts of mixed lengths, greedy, a fixed number of new tokens per request (no EOS). Each backend:
one untimed warm-up run (Triton compiles, CUDA caches), then one timed run, in the same process.
The timed run also records CUDA events around every attention call: the decode steps' attention
time and its share of the run. Then, per layer of one decode step at the run's mid-point lengths,
what reaching transformers' cache costs each way (``layout:`` rows): the K/V gather the paged SDPA
path (and tsdecode under 5.24) pays, the block table tsdecode builds under 5.17, tsdecode over the
cache viewed as one-token pages, over the gathered copy, and over a native HND cache of
--page-size pages. Prints tables; writes one long-format CSV.

    python scripts/bench_transformers.py --csv reports/nvidia-h200/transformers_generate_batch.csv
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import itertools
import os
import random
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

if not torch.cuda.is_available():  # a smoke run of the script on Triton's interpreter (--model tiny)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface, ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from tsdecode.integrations import transformers as tsdecode_transformers  # noqa: E402

API = tsdecode_transformers.transformers_api()  # "5.17" or "5.24"
PAGED = "paged|" if API == "5.17" else ""  # 5.24 dropped the prefix (except paged|eager)
MODELS = {
    # Llama-3-8B's attention and MLP geometry, 8 of its 32 layers, a 32k vocabulary.
    "llama3-8b-8l": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=32000),
    # Llama-3.2-1B's geometry (D 64), 32k vocabulary.
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=64, vocab_size=32000),
    # A smoke test of this script (runs on the CPU, through Triton's interpreter).
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1024),
}
CSV_FIELDS = ["device", "transformers", "torch", "model", "backend", "attn_implementation", "requests",
              "prompt_tokens", "new_tokens", "run_s", "tokens_per_s", "speedup_vs_sdpa", "decode_attn_s",
              "decode_attn_share", "attn_s", "same_tokens_as_sdpa", "per_layer_us", "status"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(name: str, device: torch.device) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**MODELS[name], max_position_embeddings=8192)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


class AttentionTimer:
    """Time every call of the attention function registered as ``name`` (CUDA events on a GPU)."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name, self.fn, self.device, self.calls = name, ALL_ATTENTION_FUNCTIONS[name], device, []

    def _mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def __enter__(self):
        fn, calls, mark = self.fn, self.calls, self._mark

        def timed(module, query, *args, **kwargs):
            max_q = kwargs.get("max_seqlen_q", kwargs.get("max_length_q"))
            cu_q = kwargs.get("cu_seq_lens_q")
            decode = max_q == 1 and cu_q is not None and query.shape[2] == cu_q.shape[0] - 1
            start = mark()
            result = fn(module, query, *args, **kwargs)
            calls.append((decode, start, mark()))
            return result

        AttentionInterface.register(self.name, timed)
        return self

    def __exit__(self, *exc):
        AttentionInterface.register(self.name, self.fn)

    def seconds(self) -> tuple[float, float]:
        """(decode steps' attention, all attention) seconds."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            spans = [(d, s.elapsed_time(e) / 1e3) for d, s, e in self.calls]
        else:
            spans = [(d, e - s) for d, s, e in self.calls]
        return sum(t for d, t in spans if d), sum(t for _, t in spans)


def generate(model, prompts, new_tokens: int, args) -> list[list[int]]:
    page = {"block_size" if API == "5.17" else "page_size": args.page_size}
    num_blocks = sum(-(-(len(p) + new_tokens) // args.page_size) + 1 for p in prompts) + 16
    cb_config = ContinuousBatchingConfig(**page, num_blocks=num_blocks, max_batch_tokens=args.max_batch_tokens,
                                         **({"auto_switch_to_flash": False} if API == "5.24" else {}))
    generation_config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch(prompts, generation_config=generation_config, continuous_batching_config=cb_config)
    tokens = [out[r].generated_tokens for r in sorted(out, key=lambda r: int(r.rsplit("_", 1)[1]))]
    short = sum(len(t) != new_tokens for t in tokens) + len(prompts) - len(tokens)
    if short:  # continuous batching logs a failing forward and returns what it has
        raise RuntimeError(f"{short} of {len(prompts)} requests did not generate {new_tokens} tokens (see the log)")
    return tokens


def time_us(fn, device: torch.device, reps: int = 50) -> float:
    """Mean microseconds of fn() over reps back-to-back calls (after one warm-up call)."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / reps * 1e6


def layout_costs(config, lens: list[int], page_size: int, device: torch.device,
                 reps: int) -> list[tuple[str, str, float]]:
    """Per layer of one decode step at these K/V lengths: (key, what, microseconds)."""
    from tsdecode import BatchDecodePagedTSWrapper

    hq, hkv, d, bf16 = config.num_attention_heads, config.num_key_value_heads, config.head_dim, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    blocks = [-(-n // page_size) for n in lens]
    perm = torch.randperm(sum(blocks) + 2, generator=g)
    num_slots = (sum(blocks) + 2) * page_size
    k_cache, v_cache = (torch.randn(num_slots, hkv, d, generator=g).to(device, bf16) for _ in range(2))
    starts = list(itertools.accumulate(blocks, initial=0))
    # transformers' read_index: each request's token slots, its blocks scattered over the cache
    read_index = torch.cat([(perm[a:a + nb, None] * page_size + torch.arange(page_size)).flatten()[:n]
                            for a, nb, n in zip(starts, blocks, lens)]).to(device)
    cu_k = torch.tensor(list(itertools.accumulate(lens, initial=0)), dtype=torch.int32, device=device)
    write_index = read_index[cu_k[1:].long() - 1]
    q = torch.randn(len(lens), hq, d, generator=g).to(device, bf16)
    capacity = tsdecode_transformers._capacity(max(lens))
    rows, seq_lens = tsdecode_transformers._rows(cu_k, capacity)

    def table():  # what the 5.17 integration builds per layer
        t = read_index[rows.clamp(max=read_index.numel() - 1)]
        t.scatter_(1, (seq_lens.long() - 1)[:, None], write_index[:, None])
        return t.to(torch.int32)

    def wrapper(p, max_kv_len):
        w = BatchDecodePagedTSWrapper()
        w.plan(device, len(lens), hq, hkv, d, p, max_kv_len, q_data_type=bf16)
        return w

    w1 = wrapper(1, capacity)
    view = (k_cache.unsqueeze(2), v_cache.unsqueeze(2))
    view_table = table()
    k_gathered, v_gathered = k_cache[read_index], v_cache[read_index]
    gathered = (k_gathered.unsqueeze(2), v_gathered.unsqueeze(2))
    gathered_table = rows.to(torch.int32)
    # a native HND cache of the same pages: [blocks, 2, Hkv, P, D]
    hnd = torch.stack([x.view(-1, page_size, hkv, d).transpose(1, 2) for x in (k_cache, v_cache)], 1).contiguous()
    hnd_table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for b, (a, nb) in enumerate(zip(starts, blocks)):
        hnd_table[b, :nb] = perm[a:a + nb]
    hnd_table = hnd_table.to(device)
    wp = wrapper(page_size, max(lens))
    # transformers' paged SDPA after the gather: K/V repeated to Hq heads, a block-diagonal mask
    req_k = torch.searchsorted(cu_k[1:].long(), torch.arange(sum(lens), device=device), right=True)
    mask = torch.zeros(len(lens), sum(lens), dtype=bf16, device=device)
    mask.masked_fill_(req_k[None, :] != torch.arange(len(lens), device=device)[:, None], torch.finfo(bf16).min)

    def sdpa():
        k, v = (x.transpose(0, 1)[None].repeat_interleave(hq // hkv, 1) for x in (k_gathered, v_gathered))
        return torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v,
                                                                attn_mask=mask[None, None])

    expected = sdpa()[0].transpose(0, 1).float()
    for name, out in (("view", w1.run(q, view, seq_lens, view_table)),
                      ("gathered", w1.run(q, gathered, seq_lens, gathered_table)),
                      ("hnd", wp.run(q, hnd, seq_lens, hnd_table))):
        err = (out.float() - expected).abs().max().item()
        log(f"layout check: tsdecode ({name}) vs SDPA max |diff| {err:.2e}")
        if err > 0.05:
            raise AssertionError(f"tsdecode ({name}) disagrees with SDPA: max |diff| {err}")
    return [
        ("gather_kv", "K/V gather (index_select): the paged SDPA path, and tsdecode under 5.24", time_us(
            lambda: (torch.index_select(k_cache, 0, read_index), torch.index_select(v_cache, 0, read_index)),
            device, reps)),
        ("sdpa_masked", "SDPA over the gathered K/V (repeat_kv, block-diagonal mask)", time_us(sdpa, device, reps)),
        ("block_table", "block table from read_index: tsdecode under 5.17", time_us(table, device, reps)),
        ("tsdecode_view", "tsdecode, the cache viewed as one-token pages (5.17)", time_us(
            lambda: w1.run(q, view, seq_lens, view_table, validate=False), device, reps)),
        ("tsdecode_gathered", "tsdecode, the gathered copy as one-token pages (5.24)", time_us(
            lambda: w1.run(q, gathered, seq_lens, gathered_table, validate=False), device, reps)),
        ("tsdecode_hnd", f"tsdecode, a native HND cache of {page_size}-token pages (for scale)", time_us(
            lambda: wp.run(q, hnd, seq_lens, hnd_table, validate=False), device, reps)),
    ]


def backends() -> list[tuple[str, callable]]:
    """(name, set the model up for it) in run order; the paged SDPA baseline first."""
    def attn(name):
        def setup(model):
            tsdecode_transformers.disable(model)
            model.set_attn_implementation(name)
        return setup

    rows = [("paged_sdpa", attn(f"{PAGED}sdpa")), ("tsdecode", tsdecode_transformers.enable)]
    for version, package in ((3, "flash_attn_interface"), (2, "flash_attn")):
        if importlib.util.find_spec(package) is not None:
            rows.append((f"flash_attention_{version}", attn(f"{PAGED}flash_attention_{version}")))
            break
    else:
        log("flash-attention: neither flash_attn nor flash_attn_interface importable, skipped")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--csv", required=True, help="where to write the results (long-format CSV)")
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-8b-8l")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=4096)
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="new tokens of the warm-up run (default: --new-tokens)")
    p.add_argument("--reps", type=int, default=50, help="repetitions of each layout-cost measurement")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and args.model != "tiny":
        p.error(f"--model {args.model} on the CPU would take hours in Triton's interpreter: without a GPU "
                "only a smoke run makes sense, e.g. --model tiny --requests 2 --new-tokens 8")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    log(f"{gpu}, transformers {transformers.__version__}, torch {torch.__version__}, model {args.model}")

    model = build_model(args.model, device)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, model.config.vocab_size) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.requests)]
    prompt_tokens = sum(map(len, prompts))
    log(f"{args.requests} requests, prompts {min(map(len, prompts))}..{max(map(len, prompts))} tokens "
        f"({prompt_tokens} in all), {args.new_tokens} new tokens each")

    rows, baseline = [], {}
    for name, setup in backends():
        row = dict(device=gpu, transformers=transformers.__version__, torch=torch.__version__, model=args.model,
                   backend=name, requests=args.requests, prompt_tokens=prompt_tokens,
                   new_tokens=args.requests * args.new_tokens, status="ok")
        try:
            setup(model)
            row["attn_implementation"] = model.config._attn_implementation
            log(f"{name}: warm-up run")
            generate(model, prompts, args.warmup_tokens or args.new_tokens, args)
            log(f"{name}: timed run")
            with AttentionTimer(model.config._attn_implementation, device) as timer:
                sync(device)
                start = time.perf_counter()
                tokens = generate(model, prompts, args.new_tokens, args)
                sync(device)
                run_s = time.perf_counter() - start
            decode_s, attn_s = timer.seconds()
            if name == "paged_sdpa":
                baseline = dict(run_s=run_s, tokens=tokens)
            row.update(run_s=round(run_s, 3), tokens_per_s=round(row["new_tokens"] / run_s, 1),
                       decode_attn_s=round(decode_s, 3), decode_attn_share=round(decode_s / run_s, 3),
                       attn_s=round(attn_s, 3))
            if baseline:
                row["speedup_vs_sdpa"] = round(baseline["run_s"] / run_s, 2)
                row["same_tokens_as_sdpa"] = f"{sum(a == b for a, b in zip(tokens, baseline['tokens']))}/{len(tokens)}"
            log(f"{name}: {row['tokens_per_s']} tokens/s, decode attention {decode_s:.2f} s of {run_s:.2f} s")
        except Exception as e:  # keep going: one broken backend must not cost the others' numbers
            traceback.print_exc()
            row["status"] = f"error: {type(e).__name__}: {e}"[:300]
            log(f"{name}: FAILED ({row['status']})")
        finally:
            tsdecode_transformers.disable(model)
        rows.append(row)

    print()
    print(f"{'backend':<18} {'tokens/s':>9} {'run s':>7} {'vs sdpa':>8} {'decode attn s':>14} {'share':>6} "
          f"{'same tokens':>12}  status")
    for r in rows:
        print(f"{r['backend']:<18} {r.get('tokens_per_s', ''):>9} {r.get('run_s', ''):>7} "
              f"{r.get('speedup_vs_sdpa', ''):>8} {r.get('decode_attn_s', ''):>14} {r.get('decode_attn_share', ''):>6} "
              f"{r.get('same_tokens_as_sdpa', ''):>12}  {r['status']}")
    base = dict(device=gpu, transformers=transformers.__version__, torch=torch.__version__, model=args.model,
                requests=args.requests, status="ok")
    try:
        lens = [len(p) + args.new_tokens // 2 for p in prompts]
        log(f"layout costs: one decode step at the run's mid-point lengths ({sum(lens)} K/V tokens), per layer")
        for key, what, us in layout_costs(model.config, lens, args.page_size, device, args.reps):
            print(f"  {us:9.1f} us  {key:<18} {what}")
            rows.append(dict(base, backend=f"layout:{key}", per_layer_us=round(us, 1)))
    except Exception as e:
        traceback.print_exc()
        rows.append(dict(base, backend="layout", status=f"error: {type(e).__name__}: {e}"[:300]))
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    log(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
