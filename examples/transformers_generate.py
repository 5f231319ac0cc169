"""Generate with Hugging Face transformers' continuous batching, tsdecode running the decode steps.

    python examples/transformers_generate.py                      # a small random Llama, no download
    python examples/transformers_generate.py --model Qwen/Qwen2.5-0.5B-Instruct   # a real checkpoint

transformers 5.17 or 5.24; a CUDA GPU (without one, Triton's interpreter runs it on the CPU,
slowly). Compares the tokens with transformers' own paged SDPA unless --no-compare.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402
except ImportError as e:
    print(f"transformers_generate.py: error: needs transformers 5.17 or 5.24 "
          f"(pip install 'tsdecode[transformers]'): {e}", file=sys.stderr)
    sys.exit(2)

from tsdecode.integrations import transformers as tsdecode_transformers  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Paged attention stores the KV cache in",
           "Once upon a time"]


def load(args, device):
    """(model, prompts as token lists, decode: token list -> str)."""
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(device)
        return model.eval(), [tokenizer.encode(p) for p in PROMPTS], tokenizer.decode
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.1)
    model = LlamaForCausalLM(config).to(device, torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in (5, 23, 9, 40)]
    return model, prompts, str


def generate(model, prompts, max_new_tokens: int) -> list[list[int]]:
    api = tsdecode_transformers.transformers_api()
    cb = ContinuousBatchingConfig(**({"auto_switch_to_flash": False} if api == "5.24" else {}))
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    results = [out[r] for r in sorted(out, key=lambda r: int(r.rsplit("_", 1)[1]))]
    # generate_batch logs an exception inside a forward and returns the request as failed
    failed = [f"request {i}: {getattr(r, 'error', None)}" for i, r in enumerate(results)
              if getattr(r, "error", None) is not None or getattr(r.status, "name", "") == "FAILED"]
    if failed:
        raise SystemExit("generation failed:\n" + "\n".join(failed))
    return [r.generated_tokens for r in results]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a Hugging Face checkpoint (default: a random tiny Llama)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=32)
    p.add_argument("--no-compare", action="store_true")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        api = tsdecode_transformers.transformers_api()
    except RuntimeError as e:  # a transformers version tsdecode does not support
        p.error(f"tsdecode cannot run this model: {_one_line(e)}")
    if device.type == "cpu" and api == "5.17" and importlib.util.find_spec("psutil") is None:
        p.error("transformers 5.17 on the CPU needs psutil (pip install psutil): without it its continuous "
                "batching finds no free memory for the cache")
    try:
        model, prompts, decode = load(args, device)
    except (OSError, ValueError) as e:  # no such checkpoint, no network, an unknown model type
        p.error(f"--model {args.model}: cannot load it: {_one_line(e)}")

    try:
        tsdecode_transformers.enable(model)  # the one call
    except (NotImplementedError, RuntimeError) as e:  # a model or transformers version tsdecode cannot run
        p.error(f"tsdecode cannot run this model: {_one_line(e)}")
    tokens = generate(model, prompts, args.max_new_tokens)
    tsdecode_transformers.disable(model)
    for prompt, t in zip(prompts, tokens):
        print(f"{decode(prompt)!r} -> {decode(t)!r}")

    if not args.no_compare:
        model.set_attn_implementation("paged|sdpa" if tsdecode_transformers.transformers_api() == "5.17" else "sdpa")
        expected = generate(model, prompts, args.max_new_tokens)
        same = sum(a == b for a, b in zip(expected, tokens))
        print(f"{same} of {len(tokens)} requests generate the same tokens as transformers' paged SDPA "
              "(bf16 near-ties can flip a token)")


if __name__ == "__main__":
    main()
