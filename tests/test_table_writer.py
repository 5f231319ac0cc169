"""Writing tuned tables (tuner/table_writer.py): the format the runtime reads, merges, moving an
unusable table aside, atomic replacement under concurrent readers, merges from several processes,
refusing another device's table and entries the runtime would skip."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from tsdecode.config import table_format, tables
from tsdecode.config.space import KernelConfig, ProblemShape
from tsdecode.config.tables import TableEntry
from tsdecode.device import DeviceProperties, device_properties
from tuner import table_writer
from tuner.table_writer import merge_entries

REPO = Path(__file__).resolve().parent.parent
H200 = DeviceProperties("NVIDIA H200", 132, (9, 0), 150_754_820_096)
H200_NVL = DeviceProperties("NVIDIA H200 NVL", 132, (9, 0), 150_754_820_096)


def make_shape(batch_size=48, kv_len=6000, **kw) -> ProblemShape:
    args = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    args.update(kw)
    return ProblemShape(batch_size=batch_size, max_kv_len=kv_len, **args)


def make_entry(num_warps=4, **kw) -> TableEntry:
    return TableEntry(KernelConfig(num_warps=num_warps, **kw), 10.0, 3000.0, 0.75, KernelConfig(), 12.5, 2400.0)


KEY = tables.problem_class_key(make_shape())


def write(folder: Path, device=H200, entries=None) -> Path:
    """merge_entries one entry (bucket (64, 8192)) into folder/<device file>."""
    path = table_writer.table_path(device, folder)
    merge_entries(path, device, entries or {KEY: {(64, 8192): make_entry()}}, {"trials": 10})
    return path


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith(("tsdecode", "tuner")) and r.levelno >= logging.WARNING]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch, caplog):
    """No real user cache, shipped tables, env path or leftover parsed tables."""
    monkeypatch.delenv(tables.CONFIG_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(tables, "shipped_config_dir", lambda: None)
    caplog.set_level(logging.WARNING)
    tables.clear_cache()
    yield
    tables.set_config_path(None)
    tables.clear_cache()


def test_written_file_follows_the_format(tmp_path):
    path = write(tmp_path)
    assert path == tmp_path / "NVIDIA_H200.json"
    data = json.loads(path.read_text())
    table_format.validate_table_data(data)
    assert data["format_version"] == table_format.FORMAT_VERSION
    assert data["device"] == {"name": "NVIDIA H200", "sm_count": 132, "compute_capability": [9, 0],
                              "total_memory": 150_754_820_096}
    assert data["kernel_hash"] == tables.kernel_source_hash() and len(data["kernel_hash"]) == 16
    assert data["tuner_settings"] == {"trials": 10}
    assert set(data) >= {"triton_version", "torch_version", "created", "updated", "entries"}
    [(key, [record])] = data["entries"].items()
    assert (record["batch_size"], record["kv_len"]) == (64, 8192)
    fields = {k: v for k, v in record.items() if k not in ("batch_size", "kv_len")}
    assert TableEntry.from_dict(fields) == make_entry()
    assert path.stat().st_mode & 0o777 == 0o644  # readable like any file, not mkstemp's 0600
    assert Path(f"{path}.lock").exists()  # kept: deleting it would let two writers lock apart
    assert not list(tmp_path.glob(".*.tmp"))
    table = tables.load_table(path)
    assert table.device == H200 and table.stale == () and table.skipped == ()
    assert table.entries[key][(64, 8192)] == make_entry()


def test_the_cpu_table_goes_to_the_user_cache_where_cpu_plans_find_it(tmp_path):
    cpu = device_properties("cpu")
    path = table_writer.table_path(cpu)
    assert path == tables.user_tables_dir() / "cpu_Triton_interpreter.json"
    assert str(path).startswith(str(tmp_path / "xdg"))
    merge_entries(path, cpu, {KEY: {(64, 8192): make_entry(8)}}, {})
    hit = tables.lookup(make_shape(), cpu)
    assert hit is not None and hit.table_path == str(path) and hit.kernel_config.num_warps == 8


def test_merge_entries_merges(tmp_path, caplog):
    k2 = tables.problem_class_key(make_shape(head_dim=64))
    path = tmp_path / "NVIDIA_H200.json"
    merge_entries(path, H200, {KEY: {(1, 64): make_entry(1), (2, 64): make_entry(1)}}, {"a": 1})
    created = json.loads(path.read_text())["created"]
    merge_entries(path, H200, {KEY: {(2, 64): make_entry(8)}, k2: {(4, 64): make_entry(2)}}, {"a": 2})
    table = tables.load_table(path)
    warps = {k: {b: e.kernel_config.num_warps for b, e in v.items()} for k, v in table.entries.items()}
    assert warps == {KEY: {(1, 64): 1, (2, 64): 8}, k2: {(4, 64): 2}}
    assert table.tuner_settings == {"a": 2} and table.created == created
    before = path.read_bytes()
    with pytest.raises(ValueError, match="holds the table of 'NVIDIA H200', not of 'NVIDIA H200 NVL'"):
        merge_entries(path, H200_NVL, {KEY: {(1, 64): make_entry()}}, {})
    with pytest.raises(ValueError, match="power of two"):
        merge_entries(path, H200, {KEY: {(3, 64): make_entry()}}, {})
    with pytest.raises(ValueError, match="not a problem class key"):
        merge_entries(path, H200, {"d=128": {(1, 64): make_entry()}}, {})
    with pytest.raises(TypeError, match="expected a TableEntry"):
        merge_entries(path, H200, {KEY: {(1, 64): make_entry().to_dict()}}, {})
    with pytest.raises(ValueError, match="outside|must be one of"):  # not in today's config space
        merge_entries(path, H200, {KEY: {(1, 64): dataclasses.replace(
            make_entry(), kernel_config=dataclasses.replace(KernelConfig(), block_n=48))}}, {})
    with pytest.raises(TypeError, match="DeviceProperties"):
        merge_entries(path, "NVIDIA H200", {KEY: {(1, 64): make_entry()}}, {})
    assert path.read_bytes() == before  # nothing written by a refused merge
    assert messages(caplog) == []


@pytest.mark.parametrize("tuned_batch_size", [10**309, 10**6, 32, 65], ids=["1e309", "1e6", "32", "65"])
def test_merge_refuses_a_tuned_batch_size_outside_its_bucket(tuned_batch_size, tmp_path):
    """Bucket 64 holds batch sizes 33..64: the reader would skip anything else, so the writer
    never writes it; the edges are fine."""
    good = dataclasses.replace(make_entry(num_kv_splits=4), tuned_batch_size=48)
    path = write(tmp_path, entries={KEY: {(64, 8192): good}})
    bad = dataclasses.replace(good, tuned_batch_size=tuned_batch_size)
    with pytest.raises(ValueError, match=r"tuned_batch_size .* bucket \(64, 8192\)"):
        merge_entries(path, H200, {KEY: {(64, 8192): bad}}, {})
    for bucket, b in (((64, 8192), 33), ((64, 8192), 64), ((1, 64), 1)):
        merge_entries(path, H200, {KEY: {bucket: dataclasses.replace(good, tuned_batch_size=b)}}, {})
    assert tables.load_table(path).entries[KEY][(64, 8192)].tuned_batch_size == 64


def test_merge_moves_aside_a_table_holding_a_number_no_float_can_hold(tmp_path, caplog):
    path = write(tmp_path)
    path.write_text(path.read_text().replace('"time_us": 10.0', '"time_us": 1' + "0" * 400))
    assert tables.load_table(path) is None
    merge_entries(path, H200, {KEY: {(1, 64): make_entry(8)}}, {})
    assert set(tables.load_table(path).entries[KEY]) == {(1, 64)}
    [aside] = tmp_path.glob("NVIDIA_H200.json.corrupt-*")
    msgs = messages(caplog)
    assert len(msgs) == 2 and "is unusable" in msgs[0] and str(aside) in msgs[1]


@pytest.mark.parametrize("damage", ["corrupt", "stale"])
def test_merge_moves_an_unusable_table_aside(damage, tmp_path, caplog):
    path = write(tmp_path)
    if damage == "corrupt":
        path.write_text(path.read_text()[:100])
    else:  # tuned for another kernel source: its timings do not hold for today's kernel
        path.write_text(path.read_text().replace(tables.kernel_source_hash(), "0" * 16))
    merge_entries(path, H200, {KEY: {(1, 64): make_entry(8)}}, {})
    assert set(tables.load_table(path).entries[KEY]) == {(1, 64)}
    [aside] = tmp_path.glob(f"NVIDIA_H200.json.{damage}-*")
    assert aside.stat().st_size > 0
    [msg] = messages(caplog)
    assert str(aside) in msg


def test_a_merge_keeps_a_copy_of_entries_this_tsdecode_skips(tmp_path, caplog):
    """An entry outside today's config space (another tsdecode sharing the folder wrote it) is not
    merged, but the table as it was stays beside it, and one warning says so."""
    path = write(tmp_path, entries={KEY: {(64, 8192): make_entry(), (4, 256): make_entry(8)}})
    data = json.loads(path.read_text())
    [foreign] = [r for r in data["entries"][KEY] if r["batch_size"] == 4]
    foreign["kernel_config"]["block_n"] = 512  # outside today's space: the runtime skips it
    path.write_text(json.dumps(data))
    tables.clear_cache()
    assert tables.load_table(path).skipped
    caplog.clear()
    merge_entries(path, H200, {KEY: {(1, 64): make_entry(8)}}, {})
    assert set(tables.load_table(path).entries[KEY]) == {(64, 8192), (1, 64)}
    [kept] = tmp_path.glob("NVIDIA_H200.json.skipped-*")
    assert json.loads(kept.read_text()) == data
    [msg] = messages(caplog)
    assert "the entries this tsdecode skips (1) are not merged" in msg and str(kept) in msg


def test_merge_moves_aside_a_fifo_named_like_the_table(tmp_path, caplog):
    """Reading a FIFO would block the tuner's last step for ever: it is no table."""
    path = tmp_path / tables.table_filename(H200.name)
    os.mkfifo(path)
    done = threading.Event()

    def merge():
        merge_entries(path, H200, {KEY: {(1, 64): make_entry(8)}}, {})
        done.set()

    threading.Thread(target=merge, daemon=True).start()
    assert done.wait(30), "merge_entries blocked on the FIFO"
    assert set(tables.load_table(path).entries[KEY]) == {(1, 64)}
    [aside] = tmp_path.glob(f"{path.name}.corrupt-*")
    assert not aside.is_file()
    [msg] = messages(caplog)
    assert "not a regular file" in msg and str(aside) in msg


def test_a_failed_write_leaves_the_old_table_and_no_temp_file(tmp_path, monkeypatch):
    path = write(tmp_path)
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(table_writer.os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space left"):
        merge_entries(path, H200, {KEY: {(1, 64): make_entry(8)}}, {})
    assert path.read_bytes() == before and not list(tmp_path.glob(".*.tmp"))


def test_readers_never_see_a_partial_table(tmp_path, caplog):
    buckets = {(1 << i, 1 << j): None for i in range(7) for j in range(6, 14)}  # (64, 8192) among them
    versions = [{KEY: {b: make_entry(w) for b in buckets}} for w in (2, 8)]
    path = tmp_path / "NVIDIA_H200.json"
    merge_entries(path, H200, versions[0], {})
    done = threading.Event()
    seen, errors = set(), []

    def reader():
        while not done.is_set():
            try:
                hit = tables.lookup(make_shape(), H200, config_dir=tmp_path)
                table = tables.load_table(path)
                assert len(table.entries[KEY]) == len(buckets)
                seen.add(hit.kernel_config.num_warps)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(40):
            merge_entries(path, H200, versions[i % 2], {"i": i})
    finally:
        done.set()
        for t in threads:
            t.join()
    assert errors == [] and seen <= {2, 8} and seen
    assert messages(caplog) == []
    # the last write is what a lookup sees now, even if it landed within one timestamp tick
    assert tables.lookup(make_shape(), H200, config_dir=tmp_path).kernel_config.num_warps == 8


MERGER = textwrap.dedent("""
    import sys, time, pathlib
    from tsdecode.config.space import KernelConfig
    from tsdecode.config.tables import TableEntry
    from tsdecode.device import DeviceProperties
    from tuner.table_writer import merge_entries
    path, start, worker = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3])
    device = DeviceProperties("NVIDIA H200", 132, (9, 0), 1)
    key = "q=bfloat16,kv=bfloat16,o=bfloat16,d=128,g=4,hkv=8,p=16,sq=1,mask=dense"
    cfg = KernelConfig()
    pathlib.Path(f"{start}.ready{worker}").touch()
    while not start.exists():
        time.sleep(0.01)
    for i in range(25):
        entry = TableEntry(cfg, 1.0 + i, 1.0, None, cfg, 2.0, 1.0)
        merge_entries(path, device, {key: {(1 << worker, 1 << i): entry}}, {"w": worker})
""")


def test_concurrent_merges_from_two_processes_lose_nothing(tmp_path):
    path, start = tmp_path / "NVIDIA_H200.json", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", MERGER, str(path), str(start), str(w)],
                              env=env, stderr=subprocess.PIPE, text=True) for w in (0, 1)]
    deadline = time.time() + 120
    while not all((tmp_path / f"go.ready{w}").exists() for w in (0, 1)) and time.time() < deadline:
        time.sleep(0.02)
    start.touch()
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    table = tables.load_table(path)
    [buckets] = table.entries.values()
    assert set(buckets) == {(1 << w, 1 << i) for w in (0, 1) for i in range(25)}


def test_tables_of_other_dtypes_and_devices_stay_apart(tmp_path):
    """One file per device; a float16 class is its own key (the reader's twin lookup is the
    reader's business, the writer stores what was tuned)."""
    fp16 = tables.problem_class_key(make_shape(q_dtype=torch.float16, kv_dtype=torch.float16,
                                               o_dtype=torch.float16))
    write(tmp_path, entries={fp16: {(64, 8192): make_entry(2)}})
    write(tmp_path, device=H200_NVL, entries={KEY: {(64, 8192): make_entry(8)}})
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["NVIDIA_H200.json", "NVIDIA_H200_NVL.json"]
    assert set(tables.load_table(tmp_path / "NVIDIA_H200.json").entries) == {fp16}
