"""examples/decode_loop.py: a paged decode loop with requests joining and leaving matches the
float64 reference at every step, in every mode (CPU: eager and compiled through Triton's
interpreter; GPU-marked: eager, CUDA graphs and inductor, at larger sizes).
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest
import torch

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "decode_loop.py"
_spec = importlib.util.spec_from_file_location("decode_loop", _PATH)
decode_loop = sys.modules["decode_loop"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_loop)

def _check(results, modes):
    assert list(results) == modes
    first = results[modes[0]]
    assert first.joined > first.left >= 1, "requests must join and leave during the run"
    assert len(first.batch_sizes) >= 2
    for mode, r in results.items():
        assert (r.steps, r.joined, r.left, r.batch_sizes) == (first.steps, first.joined, first.left, first.batch_sizes)
        assert r.max_rel_err < decode_loop.REL_TOL and r.max_err < decode_loop.ABS_TOL, (mode, r)
    assert decode_loop.failures(results) == []
    compiled = results["compiled"]
    assert compiled.graph_breaks == 0 and 1 <= compiled.compiled_graphs <= len(compiled.batch_sizes_planned)


def test_decode_loop_cpu():
    if torch.cuda.is_available():
        pytest.skip("the GPU variant below runs the loop on this machine")
    results = decode_loop.main(["--steps", "16", "--join-rate", "0.6", "--max-new", "6"])
    _check(results, ["eager", "compiled"])


@pytest.mark.gpu
def test_decode_loop_gpu():
    results = decode_loop.main(["--steps", "120"])
    _check(results, ["eager", "graphed", "compiled"])


def test_the_example_fails_a_step_off_the_reference():
    """The example's exit status: a mode past either tolerance is named (exit 1), none is 0."""
    good = decode_loop.Result(10, 1.0, 0.01, 0.005, {1, 2}, 3, 2)
    off = decode_loop.Result(10, 1.0, 0.01, 0.5, {1, 2}, 3, 2)
    assert decode_loop.failures({"eager": good}) == []
    [line] = decode_loop.failures({"eager": good, "compiled": off})
    assert line.startswith("compiled: max rel err 5.00e-01")


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
    (["--max-prompt", "0"], "argument --max-prompt: expected an integer >= 1"),
    (["--join-rate", "0"], "argument --join-rate: expected a probability in (0, 1]"),
    (["--head-dim", "100"], "head_dim must be one of"),
    (["--qo-heads", "3"], "must be a multiple of num_kv_heads"),
    (["--num-pages", "2"], r"--num-pages 2: the loop may hold up to \d+ pages at once"),  # the count: the device's defaults
    # valid flags, but no request joins in the run: nothing to measure (was: min() of an empty set)
    (["--steps", "3", "--seed", "5"], "no request joined in 3 steps (seed 5): nothing was measured"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
    """Bad flags (and a run in which no request joins) exit 2 with one line, not a traceback."""
    with pytest.raises(SystemExit) as e:
        decode_loop.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message if message.startswith("--num-pages") else re.escape(message), err)
    assert "Traceback" not in err
