"""examples/transformers_generate.py: runs end to end on the CPU (Triton's interpreter), and a bad
flag, a checkpoint that cannot be loaded, a model tsdecode refuses or a missing transformers is one
line and exit status 2 (not a traceback).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

pytest.importorskip("transformers")

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "transformers_generate.py"


def _load(name: str = "transformers_generate"):
    spec = importlib.util.spec_from_file_location(name, _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load()


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        example.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_the_example_generates_and_compares(capsys):
    example.main(["--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert " requests generate the same tokens as transformers' paged SDPA" in out
    assert out.count(" -> ") == len(example.PROMPTS)


def test_max_new_tokens_must_be_positive(capsys):
    line = _refused(["--max-new-tokens", "0"], capsys)
    assert line.endswith("argument --max-new-tokens: expected an integer >= 1, got '0'")


def test_a_checkpoint_that_cannot_be_loaded_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = _refused(["--model", str(tmp_path), "--no-compare"], capsys)
    assert f": error: --model {tmp_path}: cannot load it: " in line


def test_a_model_tsdecode_refuses_is_one_line(monkeypatch, capsys):
    def refuse(model):
        raise NotImplementedError("tsdecode cannot run this model's decode attention (D=80)\nsecond line")

    monkeypatch.setattr(example.tsdecode_transformers, "enable", refuse)
    line = _refused(["--no-compare"], capsys)
    assert line.endswith(": error: tsdecode cannot run this model: "
                         "tsdecode cannot run this model's decode attention (D=80) second line")


def test_without_transformers_the_example_says_what_it_needs(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(SystemExit) as e:
        _load("transformers_generate_without_transformers")
    assert e.value.code == 2  # as docs/transformers.md says
    assert capsys.readouterr().err.startswith("transformers_generate.py: error: needs transformers 5.17 or 5.24")


def test_transformers_5_17_on_the_cpu_without_psutil_is_one_line(monkeypatch, capsys):
    """5.17's continuous batching reads the free memory through psutil: without it, none (a
    MemoryError deep in generate_batch)."""
    monkeypatch.setattr(example.tsdecode_transformers, "transformers_api", lambda: "5.17")
    monkeypatch.setattr(example.torch.cuda, "is_available", lambda: False)
    real = example.importlib.util.find_spec
    monkeypatch.setattr(example.importlib.util, "find_spec", lambda name: None if name == "psutil" else real(name))
    line = _refused(["--no-compare"], capsys)
    assert line.endswith(": error: transformers 5.17 on the CPU needs psutil (pip install psutil): without it its "
                         "continuous batching finds no free memory for the cache")


def test_an_unsupported_transformers_version_is_one_line(monkeypatch, capsys):
    """transformers_api() raises RuntimeError for a version other than 5.17 and 5.24: one line and
    status 2, as docs/transformers.md says, on the CPU too (where the psutil check asks for it
    before enable does)."""
    def unsupported():
        raise RuntimeError("tsdecode.integrations.transformers supports transformers 5.17 and 5.24; "
                           "found transformers 5.20.0")

    monkeypatch.setattr(example.tsdecode_transformers, "transformers_api", unsupported)
    monkeypatch.setattr(example.torch.cuda, "is_available", lambda: False)
    line = _refused(["--no-compare"], capsys)
    assert line.endswith(": error: tsdecode cannot run this model: tsdecode.integrations.transformers supports "
                         "transformers 5.17 and 5.24; found transformers 5.20.0")
