"""The README's usage snippets run as written (CPU: the interpreter) and give the contract's
result: each block is executed in order in one namespace, as a reader pastes them."""

import re
from pathlib import Path

import torch

from tsdecode.reference import reference_decode

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_usage_snippets_run_and_match_the_reference():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 2, "the one-shot op and the wrapper"
    scope: dict = {}
    exec(compile(blocks[0], "README.md (one-shot)", "exec"), scope)
    one_shot = scope["out"]
    exec(compile(blocks[1], "README.md (wrapper)", "exec"), scope)
    want = reference_decode(scope["q"], scope["kv_cache"], scope["block_tables"], scope["seq_lens"])
    for got in (one_shot, scope["out"]):
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=2e-2, atol=2e-2)
