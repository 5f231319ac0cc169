"""tsdecode inside Hugging Face transformers' continuous batching (``model.generate_batch``).

Tiny models built from configs with seeded random weights (no download): a Llama (Hq 4, Hkv 2,
D 64, full attention) and a Qwen2 (Hq 8, Hkv 1, D 128, one full and one sliding-window layer).
Each generates greedily through transformers' own paged SDPA and through tsdecode; every
request's tokens must be equal. Random weights give near-ties, where bf16 rounding alone can flip
the argmax. So at a request's first differing token, a float32 copy of the model (a plain forward
over the shared prefix) judges the two candidates: tsdecode's must score no lower than paged
SDPA's by more than TIE_TOL standard deviations of that step's logits, and that request is
compared no further. The judge is one-sided because both paths run the model in bf16: at the
GPU sizes the paged SDPA path itself can pick a token the float32 model ranks well below
tsdecode's, which says nothing against tsdecode. Every decode call tsdecode makes is also checked
against the float64 reference on the same cache, table and lengths. CPU: Triton's interpreter;
GPU-marked: larger sizes.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402

from tsdecode.integrations import transformers as tsdecode_transformers  # noqa: E402
from tsdecode.reference import reference_decode  # noqa: E402

# In units of the step's logit standard deviation. bf16 vs float32 moves these models' logits by
# up to ~4-9% of it; a 1.3x error in the attention scale makes gaps of ~20%.
TIE_TOL = 0.1
# Max |tsdecode - float64 reference| / max |reference| of one decode call: bf16 output rounding
# (2^-8 relative) plus bf16 P in the PV product.
DECODE_TOL = 1e-2
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _paged_sdpa() -> str:
    """transformers' own paged SDPA name (raises, per test, on an unsupported transformers)."""
    return "paged|sdpa" if tsdecode_transformers.transformers_api() == "5.17" else "sdpa"


# scale 1: weights std 0.2, peaked logits (few near-ties); larger: the default 0.02 (a deep model
# with std 0.2 weights is chaotic in bf16).
def _llama(scale: int = 1):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128 * scale, hidden_size=64 * scale, intermediate_size=128 * scale,
                         num_hidden_layers=2 * scale, num_attention_heads=4 * scale, num_key_value_heads=2 * scale,
                         head_dim=64, initializer_range=0.2 if scale == 1 else 0.02)
    return LlamaForCausalLM(config)


def _qwen2(scale: int = 1):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=128 * scale, hidden_size=64 * scale, intermediate_size=128 * scale,
                         num_hidden_layers=2 * scale, num_attention_heads=8, num_key_value_heads=1, head_dim=128,
                         use_sliding_window=True, sliding_window=8 * scale, max_window_layers=scale,
                         initializer_range=0.2 if scale == 1 else 0.02)
    return Qwen2ForCausalLM(config)


def _model(build, scale: int = 1):
    torch.manual_seed(0)
    model = build(scale).to(device=DEVICE, dtype=torch.bfloat16).eval()
    model.set_attn_implementation(_paged_sdpa())
    return model


def _generate(model, prompts, max_new_tokens: int, page_size: int, max_batch_tokens: int) -> list[list[int]]:
    """Greedy tokens of every request, in prompt order."""
    page = {"block_size" if tsdecode_transformers.transformers_api() == "5.17" else "page_size": page_size}
    num_blocks = sum(-(-(len(p) + max_new_tokens) // page_size) + 1 for p in prompts)
    cb_config = ContinuousBatchingConfig(**page, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    generation_config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1,
                                         pad_token_id=0)
    out = model.generate_batch(prompts, generation_config=generation_config, continuous_batching_config=cb_config)
    tokens = [out[r].generated_tokens for r in sorted(out, key=lambda r: int(r.rsplit("_", 1)[1]))]
    # continuous batching logs a failing forward and returns what it has: check every request finished
    assert [len(t) for t in tokens] == [max_new_tokens] * len(prompts)
    return tokens


def _assert_same_greedy(model, prompts, expected, got) -> None:
    """Equal tokens, or a near-tie at a request's first difference (see the module docstring)."""
    judge = None
    for i, (a, b) in enumerate(zip(expected, got)):
        assert len(a) == len(b)
        t = next((t for t in range(len(a)) if a[t] != b[t]), None)
        if t is None:
            continue
        if judge is None:
            judge = copy.deepcopy(model).float()
            judge.set_attn_implementation("sdpa")
        with torch.no_grad():
            logits = judge(torch.tensor([prompts[i] + a[:t]], device=DEVICE)).logits[0, -1]
        # > 0: the float32 model prefers paged SDPA's token
        gap = float(logits[a[t]] - logits[b[t]]) / float(logits.std())
        assert gap <= TIE_TOL, (f"request {i} step {t}: SDPA chose {a[t]}, tsdecode {b[t]}, which the float32 model "
                                f"scores {gap:.3f} standard deviations lower")


def _prompts(lengths, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def _compare(model, prompts, max_new_tokens, page_size, max_batch_tokens, monkeypatch, scales=None):
    """``scales``, if given, collects the scale of every decode call."""
    expected = _generate(model, prompts, max_new_tokens, page_size, max_batch_tokens)
    calls, errors = [], []
    real = tsdecode_transformers._decode

    def checked(q, k_pages, v_pages, seq_lens, block_table, capacity, scale):
        out = real(q, k_pages, v_pages, seq_lens, block_table, capacity, scale)
        calls.append(q.shape[0])
        if scales is not None:
            scales.append(scale)
        ref = reference_decode(q, (k_pages, v_pages), block_table, seq_lens, bmm1_scale=scale)
        errors.append(float((out.double() - ref).abs().max() / ref.abs().max()))
        return out

    monkeypatch.setattr(tsdecode_transformers, "_decode", checked)
    tsdecode_transformers.enable(model)
    try:
        got = _generate(model, prompts, max_new_tokens, page_size, max_batch_tokens)
    finally:
        tsdecode_transformers.disable(model)
    num_layers = model.config.num_hidden_layers
    assert len(calls) >= num_layers * (max_new_tokens - 1), "tsdecode ran fewer decode steps than generated"
    assert max(errors) < DECODE_TOL, f"a decode call's output is {max(errors):.2e} off the float64 reference"
    _assert_same_greedy(model, prompts, expected, got)
    return calls


# Prompts longer than max_batch_tokens (chunked prefill) and than the sliding window; different
# lengths, so requests join the decode batch at different steps and leave it at different steps.
@pytest.mark.parametrize("build", [_llama, _qwen2], ids=["llama", "qwen2-sliding"])
def test_generate_batch_matches_paged_sdpa(build, monkeypatch):
    model = _model(build)
    prompts = _prompts((5, 40, 3, 12), model.config.vocab_size)
    calls = _compare(model, prompts, max_new_tokens=10, page_size=4, max_batch_tokens=32, monkeypatch=monkeypatch)
    assert len(set(calls)) > 1, "the decode batch size never changed"
    assert model.config._attn_implementation == _paged_sdpa()  # disable() restored it


def test_the_attention_modules_scaling_reaches_the_kernel(monkeypatch):
    """A model whose attention scale is not 1/sqrt(head_dim) (set on each attention module, as
    models with a query pre-attention scalar do): tsdecode computes with that scale."""
    model = _model(_llama)
    custom = 1.7 * model.config.head_dim ** -0.5
    for layer in model.model.layers:
        layer.self_attn.scaling = custom
    prompts = _prompts((5, 40, 3, 12), model.config.vocab_size, seed=2)
    scales = []
    _compare(model, prompts, max_new_tokens=6, page_size=4, max_batch_tokens=32, monkeypatch=monkeypatch,
             scales=scales)
    assert scales and all(s == pytest.approx(custom) for s in scales), set(scales)


def test_enable_refuses_what_tsdecode_cannot_run():
    torch.manual_seed(0)
    model = _llama().to(DEVICE).eval()  # float32: tsdecode decodes fp16/bf16 (and fp8 caches)
    with pytest.raises(NotImplementedError, match="tsdecode cannot run this model's decode attention"):
        tsdecode_transformers.enable(model)


def test_enable_refuses_a_module_that_is_no_transformers_model():
    with pytest.raises(TypeError, match="model must be a transformers model .* got Linear"):
        tsdecode_transformers.enable(torch.nn.Linear(2, 2))


def test_enable_refuses_a_model_whose_attention_takes_no_sdpa():
    """Gemma2 (logit softcapping) refuses transformers' sdpa, through which tsdecode's decode runs:
    NotImplementedError naming the model, and the model left as it was."""
    if tsdecode_transformers.transformers_api() == "5.17":
        pytest.skip("5.17 registers tsdecode's own attention implementation")
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=100, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, attn_logit_softcapping=50.0)
    model = Gemma2ForCausalLM(config).to(device=DEVICE, dtype=torch.bfloat16).eval()
    before = model.config._attn_implementation
    with pytest.raises(NotImplementedError, match="Gemma2ForCausalLM's decode attention .* does not support"):
        tsdecode_transformers.enable(model)
    assert model.config._attn_implementation == before
    assert not hasattr(model, tsdecode_transformers._PREVIOUS)


def test_unsupported_transformers_version_names_the_supported_ones(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    with pytest.raises(RuntimeError, match=r"supports transformers 5\.17 and 5\.24.*found transformers 5\.99\.0"):
        tsdecode_transformers.enable(_llama())


def test_importing_tsdecode_does_not_import_transformers():
    code = "import sys, tsdecode, tsdecode.integrations; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("build", [_llama, _qwen2], ids=["llama", "qwen2-sliding"])
def test_generate_batch_matches_paged_sdpa_gpu(build, monkeypatch):
    model = _model(build, scale=8)  # Llama: 16 layers, Hq 32, Hkv 16; Qwen2: 16 layers, window 64
    prompts = _prompts([17 + 37 * i % 300 for i in range(24)], model.config.vocab_size)
    _compare(model, prompts, max_new_tokens=48, page_size=256, max_batch_tokens=512, monkeypatch=monkeypatch)
