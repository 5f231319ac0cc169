"""The benchmark script's pure parts (its timings need a GPU; these do not)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import bench_decode  # noqa: E402
from tuner.grids import PRESETS  # noqa: E402
from tuner.measure import bytes_moved, make_inputs  # noqa: E402


def test_heldout_shapes_are_ragged_and_off_the_tuning_grid():
    grid_points = {(s.batch_size, s.kv_len) for s in PRESETS["llama3-8b"]}
    shapes = bench_decode.heldout_suite()
    assert len(shapes) == 10 and len({s.name for s in shapes}) == 10
    for s in shapes:
        assert s.ragged and (s.num_qo_heads, s.num_kv_heads, s.head_dim) == (32, 8, 128)
        assert (s.batch_size, s.kv_len) not in grid_points


def test_set_bytes_counts_the_actual_ragged_lengths():
    spec = bench_decode.heldout_suite()[1]  # B=2, L=3000, ragged
    inputs = make_inputs(spec, "cpu", copies=1, seed=2)[0]
    lens = inputs.seq_lens.tolist()
    assert max(lens) == spec.kv_len and min(lens) >= spec.kv_len // 2
    assert bench_decode.set_bytes(spec, inputs) == bytes_moved(spec, lens)
    if sum(lens) < spec.batch_size * spec.kv_len:
        assert bench_decode.set_bytes(spec, inputs) < bytes_moved(spec)
    assert inputs.cache.dtype == torch.bfloat16


def test_only_filter_takes_comma_separated_names():
    assert bench_decode.selected_by(None, "B8_L8192")
    assert bench_decode.selected_by("B1_,B8_L8192", "B8_L8192_H32x8")
    assert not bench_decode.selected_by("B1_,B32_", "B8_L8192_H32x8")


def test_sass_count_compiles_for_sm90_without_a_gpu_and_compares_copies():
    """scripts/sass_count.py: the split kernel compiles for sm90 with triton's bundled ptxas on a
    CPU machine, and a copy of decode.py compares identical to itself (TTIR, TTGIR, SASS)."""
    import subprocess

    import pytest
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton has no bundled ptxas")
    root = os.path.join(os.path.dirname(__file__), "..")
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "sass_count.py"), "--kv-dtype", "bf16",
         "--block-n", "16", "--warps", "1", "--stages", "3", "--splits", "4",
         "--compare", os.path.join(root, "tsdecode", "kernels", "decode.py")],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SASS instructions" in out.stdout and "HMMA" in out.stdout
    for ir in ("ttir", "ttgir", "sass"):
        assert f"{ir}: identical" in out.stdout
