"""The benchmark scripts' helpers (suites, byte counts, explicit launch arguments, the probes'
kernels, offline SASS counts) and tuner.measure's byte counts: timings need a GPU, these do not."""

import argparse
import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import tsdecode  # noqa: E402
from tsdecode import KernelConfig  # noqa: E402
from tuner.grids import PRESETS, ShapeSpec  # noqa: E402
from tuner.measure import bytes_moved, make_inputs  # noqa: E402


@pytest.fixture
def bench_decode():
    """scripts/bench_decode.py (the suites and helpers other scripts import)."""
    import bench_decode

    return bench_decode


def test_heldout_shapes_are_ragged_and_off_the_tuning_grid(bench_decode):
    grid_points = {(s.batch_size, s.kv_len) for s in PRESETS["llama3-8b"]}
    shapes = bench_decode.heldout_suite()
    assert len(shapes) == 10 and len({s.name for s in shapes}) == 10
    for s in shapes:
        assert s.ragged and (s.num_qo_heads, s.num_kv_heads, s.head_dim) == (32, 8, 128)
        assert (s.batch_size, s.kv_len) not in grid_points


def test_set_bytes_counts_the_actual_ragged_lengths(bench_decode):
    spec = bench_decode.heldout_suite()[1]  # B=2, L=3000, ragged
    inputs = make_inputs(spec, "cpu", copies=1, seed=2)[0]
    lens = inputs.seq_lens.tolist()
    assert max(lens) == spec.kv_len and min(lens) >= spec.kv_len // 2
    assert bench_decode.set_bytes(spec, inputs) == bytes_moved(spec, lens)
    if sum(lens) < spec.batch_size * spec.kv_len:
        assert bench_decode.set_bytes(spec, inputs) < bytes_moved(spec)
    assert inputs.cache.dtype == torch.bfloat16


def test_sliding_window_bytes_count_the_visible_keys_and_copies_flush_l2_with_them():
    """A sliding window reads the last SQ + window_left keys of a request: bytes (and so % copy)
    count those, and the copies rotated through a replay read 256 MiB of them (a whole-cache
    count left a B=1 L=32k window-4095 shape at 2 copies, 32 MiB read a replay: L2-resident)."""
    from tuner.measure import L2_FLUSH_BYTES, POOL_BUDGET_BYTES, input_q_lens, kv_bytes, num_copies

    mistral = next(s for s in PRESETS["mistral-7b"] if (s.batch_size, s.kv_len) == (1, 32768))
    assert mistral.window_left == 4095 and mistral.mask_type == "causal"
    per_token = 2 * mistral.num_kv_heads * mistral.head_dim * 2
    assert kv_bytes(mistral) == 4096 * per_token  # 1 + 4095 keys
    dense = ShapeSpec(1, 32768, num_qo_heads=32, num_kv_heads=8)
    assert kv_bytes(dense) == 32768 * per_token and num_copies(dense) == 2
    assert num_copies(mistral) == 16 and num_copies(mistral) * kv_bytes(mistral) == L2_FLUSH_BYTES
    short = next(s for s in PRESETS["mistral-7b"] if (s.batch_size, s.kv_len) == (8, 1024))
    assert kv_bytes(short) == 8 * 1024 * per_token  # window longer than the request
    # packed queries: each request's own query length widens its window
    packed = ShapeSpec(3, 100, num_qo_heads=4, num_kv_heads=2, head_dim=64, seq_len_q=4, packed=True,
                       mask_type="causal", window_left=10)
    inputs = make_inputs(packed, "cpu", copies=1, seed=3)[0]
    q_lens = input_q_lens(inputs)
    assert len(q_lens) == 3 and sum(q_lens) == inputs.q.shape[0]
    assert kv_bytes(packed, inputs.seq_lens.tolist(), q_lens) == sum(
        min(n, q + 10) for n, q in zip(inputs.seq_lens.tolist(), q_lens)) * 2 * 2 * 64 * 2
    # whole caches of all copies stay within the pool budget, however small the window
    huge = ShapeSpec(1, 1 << 20, num_qo_heads=32, num_kv_heads=8, mask_type="causal", window_left=4095)
    assert num_copies(huge) == POOL_BUDGET_BYTES // (2**20 * per_token) == 4


def test_set_bytes_of_packed_windowed_queries_counts_each_request_s_window(bench_decode):
    from tuner.measure import input_q_lens

    packed = ShapeSpec(3, 100, num_qo_heads=4, num_kv_heads=2, head_dim=64, seq_len_q=4, packed=True,
                       mask_type="causal", window_left=10)
    inputs = make_inputs(packed, "cpu", copies=1, seed=3)[0]
    assert bench_decode.set_bytes(packed, inputs) == bytes_moved(
        packed, inputs.seq_lens.tolist(), inputs.q.shape[0], input_q_lens(inputs))


def test_make_inputs_pads_block_table_rows_to_a_multiple_of_16():
    """The row stride a plan compiles for (so precompiled kernels are the ones launched); only
    each request's live pages are distinct pages of the pool."""
    spec = ShapeSpec(3, 70, num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=8, ragged=True)
    sets = make_inputs(spec, "cpu", copies=2, seed=1)
    pages = [-(-n // 8) for n in sets[0].seq_lens.tolist()]
    live = []
    for s in sets:
        assert s.block_tables.shape == (3, 16) and s.block_tables.is_contiguous()
        live += [int(p) for b, n in enumerate(pages) for p in s.block_tables[b, :n]]
    assert len(set(live)) == len(live) == 2 * sum(pages) == s.cache.shape[0]


def test_only_filter_takes_comma_separated_names(bench_decode):
    assert bench_decode.selected_by(None, "B8_L8192")
    assert bench_decode.selected_by("B1_,B8_L8192", "B8_L8192_H32x8")
    assert not bench_decode.selected_by("B1_,B32_", "B8_L8192_H32x8")


def test_target_suites_are_what_the_tree_a_b_imports(bench_decode):
    """scripts/ab_trees.py times bench_decode's target and held-out suites."""
    targets = bench_decode.target_suite()
    assert len(targets) > 30 and all(isinstance(t.spec, ShapeSpec) for t in targets)
    assert {t.metric for t in targets} == {"pct_copy", "us", "rel_bw"}
    assert sum(t.regime == "geometry base" for t in targets) == 1


def test_tree_a_b_refuses_a_tuned_table_it_cannot_read(tmp_path, monkeypatch, capsys):
    """ab_trees.py --tuned-table PATH that is missing or not a table stops before timing anything,
    rather than running without the tune's column."""
    import ab_trees

    corrupt = tmp_path / "NVIDIA_H200.json"
    corrupt.write_text("{not json")
    for path in (tmp_path / "missing" / "NVIDIA_H200.json", corrupt):
        monkeypatch.setattr(sys, "argv", ["ab_trees.py", "--other", str(tmp_path), "--tuned-table", str(path)])
        with pytest.raises(SystemExit) as exc:
            ab_trees.main()
        assert exc.value.code == 2
        assert f"--tuned-table {path}: no readable config table there" in capsys.readouterr().err


def test_tree_a_b_takes_a_tuner_presets_grid_as_a_suite():
    """ab_trees.py --suites preset:NAME: the preset's shapes (sliding-window ones for mistral-7b)."""
    import ab_trees

    shapes = ab_trees.suite_shapes(["targets", "preset:mistral-7b"], 4, 0)
    windowed = [s for name, s in shapes if name == "preset:mistral-7b"]
    assert windowed == PRESETS["mistral-7b"] and all(s.window_left == 4095 for s in windowed)
    with pytest.raises(SystemExit, match="preset:NAME, NAME one of smoke, llama3-8b"):
        ab_trees.suite_shapes(["preset:nope"], 4, 0)


@pytest.mark.parametrize("launch", [{"transposed": False}, {"transposed": True}, {"pdl": False}])
def test_relaunch_passes_explicit_launch_arguments_and_keeps_the_output(bench_decode, launch):
    """An A/B's explicit launch arguments (product form, PDL) swap the plan's launcher and compute
    the same attention."""
    from tuner.measure import decode_call, plan_wrapper

    spec = ShapeSpec(3, 70, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=8, kv_dtype="float8_e4m3fn",
                     ragged=True)
    s = make_inputs(spec, _device(), copies=1, seed=1)[0]
    config = KernelConfig(block_n=16, block_m=16, num_kv_splits=3, num_warps=1, num_stages=2)
    s.out.fill_(float("nan"))
    decode_call(plan_wrapper(spec, s, config), s, validate=True)()
    want = s.out.clone()
    w = bench_decode.relaunch(plan_wrapper(spec, s, config), **launch)
    if "transposed" in launch:  # (the launcher's constexprs are its own business: checked where present)
        constexprs = getattr(w._plan.launch, "_split_constexprs", {})
        assert constexprs.get("TRANSPOSED", launch["transposed"]) is launch["transposed"]
    s.out.fill_(float("nan"))
    decode_call(w, s, validate=True)()
    torch.testing.assert_close(s.out.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert bench_decode.check_correct(spec, s, config, launch=launch) < 6e-2


def test_relaunch_refuses_the_transposed_form_without_tl_dot(bench_decode):
    from tuner.measure import plan_wrapper

    spec = ShapeSpec(2, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    s = make_inputs(spec, _device(), copies=1, seed=1)[0]
    fma = KernelConfig(block_n=16, block_m=2, num_kv_splits=1, num_warps=1, num_stages=2)
    with pytest.raises(ValueError, match="transposed"):
        bench_decode.relaunch(plan_wrapper(spec, s, fma), transposed=True)


def test_method_probe_split_pass_only_writes_partials_not_the_output(bench_decode):
    import method_probe
    from tuner.measure import decode_call, plan_wrapper

    spec = ShapeSpec(2, 70, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    s = make_inputs(spec, _device(), copies=1, seed=1)[0]
    config = KernelConfig(block_n=16, block_m=16, num_kv_splits=3, num_warps=1, num_stages=2)
    w = bench_decode.relaunch(plan_wrapper(spec, s, config), method_probe.SplitPassOnly)
    s.out.fill_(float("nan"))
    decode_call(w, s)()
    assert torch.isnan(s.out).all()


def test_ab_configs_reads_shape_flags():
    import ab_configs

    spec = ab_configs.parse_shape("8:4096:32:8:r:fp8:d64:p32:q4")
    assert (spec.batch_size, spec.kv_len, spec.num_qo_heads, spec.num_kv_heads) == (8, 4096, 32, 8)
    assert spec.ragged and spec.kv_dtype == "float8_e4m3fn" and spec.q_dtype == "bfloat16"
    assert (spec.head_dim, spec.page_size, spec.seq_len_q, spec.mask_type) == (64, 32, 4, "causal")
    f16 = ab_configs.parse_shape("1:1024:8:8:f16")
    assert (f16.q_dtype, f16.kv_dtype, f16.o_dtype, f16.page_size) == ("float16",) * 3 + (16,)


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


def test_sass_count_lists_the_variants_a_kernel_change_reaches(tmp_path):
    """scripts/sass_count.py --compare-tree: against a copy of this tree whose window start is one
    key later, the windowed variant's SASS differs and the dense and causal ones are identical."""
    import shutil
    import subprocess

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton has no bundled ptxas")
    root = os.path.join(os.path.dirname(__file__), "..")
    shutil.copytree(os.path.join(root, "tsdecode"), tmp_path / "tsdecode")
    kernel = tmp_path / "tsdecode" / "kernels" / "decode.py"
    source = kernel.read_text()
    assert source.count("row_end - window_left - 1") == 1
    kernel.write_text(source.replace("row_end - window_left - 1", "row_end - window_left"))
    out = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "sass_count.py"), "--compare-tree", str(tmp_path),
         "--grid-filter", "kv bf16 q bf16", "--grid-filter", "G 4 D 128"],
        capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="0"), timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if "G 4 D 128" in line]
    assert len(lines) == 3 and [line.split()[0] for line in lines] == ["identical", "identical", "DIFFERS"], lines
    assert "windowed" in lines[2] and "1 of 3 variants' SASS differs" in out.stdout


def test_sass_count_takes_the_page_size_and_a_forced_product_form():
    import subprocess

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton has no bundled ptxas")
    root = os.path.join(os.path.dirname(__file__), "..")
    out = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "sass_count.py"), "--kv-dtype", "fp8e4nv", "--block-n", "32",
         "--warps", "1", "--stages", "2", "--splits", "1", "--page-size", "8", "--transposed"],
        capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="0"), timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "P 8," in out.stdout and "transposed product form" in out.stdout and "SASS instructions" in out.stdout


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("block_n,splits,page_size", [(16, 3, 16), (8, 7, 16), (32, 2, 16), (4, 5, 1)])
def test_method_probe_gather_floor_reads_every_visible_k_and_v_element(block_n, splits, page_size):
    """The floor kernel behind perf-notes' gather floors must read each visible K and V element
    once (ragged lengths, tiles within a page and across pages, empty splits): its partial sums
    equal a float64 sum over the block table."""
    import method_probe

    spec = ShapeSpec(batch_size=3, kv_len=70, num_qo_heads=4, num_kv_heads=2, page_size=page_size, ragged=True)
    s = make_inputs(spec, _device(), copies=1, seed=3)[0]
    calls, sink = method_probe.gather_calls(spec, [s], block_n, splits, 1, 2, _device())
    sink.fill_(float("nan"))
    calls[0]()
    cache = s.cache.double().cpu()
    want = 0.0
    for b, n in enumerate(s.seq_lens.tolist()):
        for t in range(n):
            page = int(s.block_tables[b, t // page_size])
            want += float(cache[page, :, :, t % page_size].sum())
    assert torch.isfinite(sink).all()
    assert abs(float(sink.double().sum()) - want) < 1e-3 * max(1.0, abs(want)) + 1e-2


def test_method_probe_contiguous_read_sums_every_word():
    import method_probe

    programs, per_program = 3, 4096
    buf = torch.randint(-5, 7, (programs * per_program,), dtype=torch.int32, device=_device())
    sink = torch.full((programs,), -1, dtype=torch.int32, device=_device())
    method_probe._read_sum_kernel[(programs,)](buf, sink, per_program, BLOCK=1024)
    assert sink.tolist() == [int(c.sum()) for c in buf.view(programs, per_program).cpu()]


def test_tree_a_b_draws_the_random_suite_once_per_seed():
    """ab_trees.py --seed 300-302: three random sets of COUNT shapes, each named after its seed, in
    the order the suites were named; one seed keeps the shapes' own names."""
    import ab_trees

    assert ab_trees.parse_seeds("300-302,7") == [300, 301, 302, 7]
    for bad in ("3-1", "x", "1,,2"):
        with pytest.raises(argparse.ArgumentTypeError, match="--seed"):
            ab_trees.parse_seeds(bad)
    shapes = ab_trees.named_shapes(["random", "heldout"], 3, [300, 301, 302])
    drawn = [(name, spec) for suite, name, spec in shapes if suite == "random"]
    assert [n.split("/")[0] for n, _ in drawn] == ["seed300"] * 3 + ["seed301"] * 3 + ["seed302"] * 3
    assert [s for _, s in drawn[3:6]] == ab_trees.random_shapes(3, 301)
    assert [suite for suite, _, _ in shapes][-1] == "heldout" and shapes[0][0] == "random"
    one = ab_trees.named_shapes(["random"], 3, [301])
    assert [name for _, name, _ in one] == [s.name for s in ab_trees.random_shapes(3, 301)]


def test_tree_a_b_plans_a_pick_from_the_lengths_alone():
    """--moved-only compares the two trees' picks before making any input: the pick it plans from
    metadata is the one the timed wrapper gets from the inputs (ragged lengths included)."""
    import ab_trees

    from tuner.measure import make_inputs

    for spec in (ShapeSpec(batch_size=5, kv_len=700, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                           ragged=True),
                 ShapeSpec(batch_size=3, kv_len=300, num_qo_heads=4, num_kv_heads=4, head_dim=64, page_size=8,
                           kv_dtype="float8_e4m3fn")):
        sets = make_inputs(spec, "cpu", seed=1)
        picked = ab_trees.plan_calls(tsdecode, spec, sets)[1].kernel_config.to_dict()
        assert ab_trees.metadata_pick(tsdecode, spec, torch.device("cpu")) == picked
        if spec.ragged:  # the shape's lengths decide: equal ones would be picked otherwise
            equal = ab_trees.metadata_pick(tsdecode, dataclasses.replace(spec, ragged=False), torch.device("cpu"))
            assert equal != picked


def test_tree_a_b_rotates_the_order_and_pairs_each_round(monkeypatch):
    """A GPU at its power limit slows whatever runs later: every side must lead equally often,
    and a ratio compares the two sides within one round (a B slowed in the rounds it trailed
    does not count as slower)."""
    import ab_trees

    order = []
    clock = iter(range(1000))

    def fake_time(calls, replay_ms):  # each window 1% slower than the one before it
        order.append(calls)
        return 100.0 * 1.01 ** next(clock)

    monkeypatch.setattr(ab_trees, "graph_time_us", fake_time)
    monkeypatch.setattr(ab_trees, "sm_clock_mhz", lambda: None)
    for names in (("A", "B"), ("A", "B", "B2")):
        order.clear()
        sides = {k: (k, None) for k in names}
        times, clocks = {k: [] for k in names}, {k: [] for k in names}
        rounds = 2 * len(names)
        ab_trees.time_rounds(sides, times, clocks, rounds, 60.0)
        firsts = [order[i] for i in range(0, len(order), len(names))]
        assert all(firsts.count(k) == 2 for k in names) and all(len(v) == rounds for v in times.values())
        ratio, spread = ab_trees.paired_ratio(times, "A", "B")
        assert abs(ratio - 1) < 1e-9 and spread > 0  # a fixed order would give 0.99 every round
    times = {"A": [100.0, 110.0, 90.0], "B": [50.0, 100.0, 100.0]}
    assert ab_trees.paired_ratio(times, "A", "B")[0] == pytest.approx((2.0 * 1.1 * 0.9) ** (1 / 3))


def test_tree_a_b_counts_the_configs_the_tune_timed(tmp_path):
    """A shape whose tune ran out of time after a trial or two compares the model with itself:
    the A/B reads each bucket's timed configs from the trials CSV beside the table."""
    import ab_trees

    assert ab_trees.tune_trials(None) == {} and ab_trees.tune_trials(str(tmp_path / "NVIDIA_H200.json")) == {}
    fields = "kind,study,class_key,bucket_batch_size,bucket_kv_len,trial,state,block_n\n"
    rows = ["trial,s,k1,64,4096,0,COMPLETE,64", "trial,s,k1,64,4096,1,COMPLETE,32",
            "trial,s,k1,64,4096,2,PRUNED,16", "retime,s,k1,64,4096,,RETIME,64", "trial,s,k2,1,128,0,COMPLETE,32"]
    (tmp_path / "NVIDIA_H200_trials.csv").write_text(fields + "\n".join(rows) + "\n")
    counts = ab_trees.tune_trials(str(tmp_path / "NVIDIA_H200.json"))
    assert counts == {("k1", (64, 4096)): 2, ("k2", (1, 128)): 1}
    assert ab_trees.tuned_summary([1.0, 1.04, 1.08, 1.3]) == (
        "within 5% at 2 of 4, within 10% at 3, worst 1.300, median 1.060")


def test_sweep_narrows_to_the_given_tiles_and_split_counts():
    import sweep_configs

    assert sweep_configs.parse_counts("1-4,8,3,12") == [1, 2, 3, 4, 8, 12]
    assert sweep_configs.parse_tiles("64/4/2,32/1/5") == ((64, 4, 2), (32, 1, 5))
    with pytest.raises(Exception, match="block_n/num_warps/num_stages"):
        sweep_configs.parse_tiles("64/4")
    spec = ShapeSpec(batch_size=34, kv_len=2836, num_qo_heads=24, num_kv_heads=8, head_dim=256, page_size=3,
                     kv_dtype="float8_e4m3fn")
    configs = sweep_configs.candidates(spec, 132, ((64, 4, 2),), [1, 5, 12, 99])
    assert {(c.block_n, c.num_warps, c.num_stages) for c in configs} == {(64, 4, 2)}
    assert sorted(c.num_kv_splits for c in configs) == [1, 5, 12]  # 45 tiles: 99 splits is too many
    full = sweep_configs.candidates(spec, 132)
    assert len({(c.block_n, c.num_warps, c.num_stages) for c in full}) > 1


def test_ragged_lengths_span_half_to_kv_len_and_causal_ones_cover_the_query():
    """Ragged lengths are drawn in [kv_len // 2, kv_len] with the longest exactly kv_len (the
    spread the plans and the reports see); a causal request is never shorter than its query."""
    from tuner.measure import seq_lens_for

    spec = ShapeSpec(64, 1000, num_qo_heads=4, num_kv_heads=2, head_dim=64, ragged=True)
    for seed in range(5):
        lens = seq_lens_for(spec, torch.Generator().manual_seed(seed))
        assert len(lens) == 64 and max(lens) == 1000 and min(lens) >= 500
        assert min(lens) < 600  # the draw spans the range, not just its top
    causal = ShapeSpec(16, 8, num_qo_heads=4, num_kv_heads=2, head_dim=64, seq_len_q=6, mask_type="causal",
                       ragged=True)
    for seed in range(5):
        assert min(seq_lens_for(causal, torch.Generator().manual_seed(seed))) >= 6


def test_bytes_moved_counts_q_read_and_the_output_written_in_their_own_dtypes():
    """q read once in its dtype plus the output written once in its own (a float32 output costs
    4 bytes an element), for every query token of every request (SQ > 1 by default)."""
    from tuner.measure import kv_bytes

    spec = ShapeSpec(3, 100, num_qo_heads=4, num_kv_heads=2, head_dim=64, o_dtype="float32")
    assert bytes_moved(spec) == kv_bytes(spec) + 3 * 4 * 64 * (2 + 4)
    sq = ShapeSpec(3, 100, num_qo_heads=4, num_kv_heads=2, head_dim=64, seq_len_q=4)
    assert bytes_moved(sq) == kv_bytes(sq) + 3 * 4 * 4 * 64 * (2 + 2)


def test_copies_read_at_least_the_l2_flush_and_whole_pages_fit_the_pool():
    """R rounds up (a replay reads at least 256 MiB of K/V), and the pool budget counts whole
    pages (a partly used last page is allocated all the same)."""
    from tuner.measure import L2_FLUSH_BYTES, POOL_BUDGET_BYTES, kv_bytes, num_copies

    odd = ShapeSpec(1, 24576)  # 96 MiB of K/V: 2 copies read 192 MiB, 3 read 288 MiB
    assert num_copies(odd) == 3 and num_copies(odd) * kv_bytes(odd) >= L2_FLUSH_BYTES
    per_token = 2 * 8 * 128 * 2
    paged = ShapeSpec(1, 2**20 - 1, page_size=1000, mask_type="causal", window_left=4095)
    pool_tokens = -(-paged.kv_len // 1000) * 1000  # 1049 pages of 1000 > 2**20 tokens
    assert num_copies(paged) == 3 and num_copies(paged) * pool_tokens * per_token <= POOL_BUDGET_BYTES


def test_geomean_skips_missing_non_positive_and_non_finite_values():
    from tuner.measure import geomean

    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([2.0, None, 0.0, -1.0, float("inf"), float("nan"), 8.0]) == pytest.approx(4.0)
    assert geomean([None, float("inf")]) is None


def test_relative_error_is_relative_to_the_reference_and_tolerance_is_looser_for_fp8():
    from tuner.measure import relative_error, tolerance

    ref = torch.ones(4, 8, dtype=torch.float64)
    assert relative_error(2 * ref, ref) == pytest.approx(1.0)
    assert relative_error(ref.to(torch.bfloat16), ref) == 0.0
    assert relative_error(torch.full((4, 8), float("nan")), ref) == float("inf")
    bf16 = ShapeSpec(1, 64)
    fp8 = ShapeSpec(1, 64, q_dtype="float8_e4m3fn", kv_dtype="float8_e4m3fn")
    assert tolerance(fp8) > tolerance(bf16) == 2e-2


def test_reference_rows_covers_the_rows_of_the_first_requests():
    """At least one request, at most B; a packed set's rows end at qo_indptr[k], and the
    reference there matches the reference of the whole batch."""
    from tsdecode.reference import reference_decode
    from tuner.measure import reference_rows

    spec = ShapeSpec(3, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    inputs = make_inputs(spec, "cpu", seed=1)[0]
    for count, want in ((0, 1), (2, 2), (9, 3)):
        ref, stop, k = reference_rows(spec, inputs, count)
        assert (k, stop, ref.shape[0]) == (want, want, want)
    packed = ShapeSpec(3, 40, num_qo_heads=4, num_kv_heads=2, head_dim=64, seq_len_q=4, packed=True,
                       mask_type="causal")
    inputs = make_inputs(packed, "cpu", seed=1)[0]
    ref, stop, k = reference_rows(packed, inputs, 2)
    assert k == 2 and stop == int(inputs.qo_indptr[2]) == ref.shape[0]
    whole = reference_decode(inputs.q, inputs.cache, inputs.block_tables, inputs.seq_lens, seq_len_q=4,
                             qo_indptr=inputs.qo_indptr, mask_type="causal", compute_dtype=torch.float64)
    torch.testing.assert_close(ref, whole[:stop])


def test_packed_query_lengths_span_one_to_seq_len_q():
    from tuner.measure import q_lens_for

    spec = ShapeSpec(64, 100, num_qo_heads=4, num_kv_heads=2, head_dim=64, seq_len_q=4, packed=True)
    lens = q_lens_for(spec, torch.Generator().manual_seed(0))
    assert len(lens) == 64 and set(lens) == {1, 2, 3, 4}
    assert q_lens_for(ShapeSpec(3, 100, seq_len_q=4), torch.Generator()) == [4, 4, 4]


def test_host_overhead_times_the_plan_rows_asked_for_as_another_gpu(tmp_path, capsys):
    """``host_overhead.py --rows`` times only the rows its expression finds; ``--as-device`` plans
    as the table's GPU (its shipped table found), against another tree in the same rounds."""
    import host_overhead

    from tsdecode.device import set_override

    table = os.path.join(os.path.dirname(__file__), "..", "tuned_configs", "NVIDIA_H200.json")
    root = os.path.join(os.path.dirname(__file__), "..")
    try:
        assert host_overhead.main(["--device", "cpu", "--rows", r"^plan, config selected|validate=False, out=\), checks",
                                   "--calls", "10", "--repeats", "1", "--as-device", table, "--other", root]) == 0
    finally:
        set_override(None)
        for name in [n for n in sys.modules if n.split(".")[0] == "tsdecode_other"]:  # the other tree
            del sys.modules[name]
    out = capsys.readouterr().out
    assert "described as NVIDIA H200 (132 SMs" in out
    rows = [line.split("  ")[1] for line in out.splitlines() if line.startswith("  ")]
    assert rows == ["run(validate=False, out=), checks only (S=1)", "plan, config selected",
                    "run(validate=False, out=), checks only (S=4)"]
    for row in ("plan, config selected (S=1)", "run(validate=False, out=), checks only (S=1)",
                "run(validate=False, out=), checks only (S=4)"):
        assert f"other: {row}" in out


def test_add_timings_refuses_a_missing_or_foreign_csv_and_writes_nothing(tmp_path, capsys):
    import add_timings

    before = add_timings.DATA.read_bytes()
    foreign = tmp_path / "foreign.csv"
    foreign.write_text("a,b\n1,2\n")
    for path, message in ((tmp_path / "none.csv", "cannot be read"),
                          (foreign, "not a sweep_configs.py CSV nor a tuner trials CSV (columns ['shape',")):
        with pytest.raises(SystemExit) as e:
            add_timings.main(["--src", "ZZ", str(path)])
        assert e.value.code == 2
        assert f"add_timings.py: error: {path}: {message}" in capsys.readouterr().err
    assert add_timings.DATA.read_bytes() == before


def test_storage_bench_refuses_a_bad_storage_and_no_processes(capsys):
    import storage_bench

    for argv, message in ((["--storage", "bogus"], "--storage bogus: study storage 'bogus': not a storage URL"),
                          (["--processes", "0"], "argument --processes: expected positive integers, got '0'"),
                          (["--trials", "0"], "argument --trials: expected an integer >= 1")):
        with pytest.raises(SystemExit) as e:
            storage_bench.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_multi_gpu_tuning_checks_its_step_before_it_writes(tmp_path):
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "multi_gpu_tuning.sh")
    out = tmp_path / "out"
    done = subprocess.run(["bash", script, "--bogus", str(out)], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown step '--bogus'" in done.stderr and not out.exists()
    done = subprocess.run(["bash", script, "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "Multi-GPU tuning measurements" in done.stdout
    # a known step where torch finds no GPU: refused before OUT is made or a tuner starts
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PRESETS="--preset nope", TRIALS="1")
    done = subprocess.run(["bash", script, "ab1", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "needs CUDA GPUs" in done.stderr and not out.exists()
