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
