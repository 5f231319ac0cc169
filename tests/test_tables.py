"""Tuned config tables: format, search order, matching, bad files, warn-once, atomic writes,
concurrent merges, packaging, and a plan that picks a table entry end to end (CPU interpreter)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tsdecode
from tsdecode import tables
from tsdecode.configs import KernelConfig, ProblemShape, select_config
from tsdecode.kernels.decode import interpreter_active
from tsdecode.reference import reference_decode
from tsdecode.tables import DeviceInfo, TableEntry

REPO = Path(__file__).resolve().parent.parent
H200 = DeviceInfo("NVIDIA H200", 132, (9, 0), 150_754_820_096)
H200_NVL = DeviceInfo("NVIDIA H200 NVL", 132, (9, 0), 150_754_820_096)
H100_PCIE = DeviceInfo("NVIDIA H100 PCIe", 114, (9, 0), 85_029_158_912)
CPU = torch.device("cpu")


def make_shape(batch_size=48, kv_len=6000, **kw) -> ProblemShape:
    args = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    args.update(kw)
    return ProblemShape(batch_size=batch_size, max_kv_len=kv_len, **args)


def make_entry(num_warps=4, **kw) -> TableEntry:
    return TableEntry(
        KernelConfig(num_warps=num_warps, **kw), 10.0, 3000.0, 0.75, KernelConfig(), 12.5, 2400.0
    )


def kept_default(entry: TableEntry) -> TableEntry:
    """The entry as if tuning kept the heuristic default (its config is its default)."""
    return dataclasses.replace(entry, default_config=entry.kernel_config,
                               default_time_us=entry.time_us, default_bandwidth_gbs=entry.bandwidth_gbs)


def write(folder: Path, device=H200, entries=None, shape=None, num_warps=4) -> Path:
    """merge_entries one entry (the bucket of ``shape``) into folder/<device file>."""
    shape = shape or make_shape()
    if entries is None:
        bucket = tables.bucket_of(shape.batch_size, shape.max_kv_len)
        entries = {tables.problem_class_key(shape): {bucket: make_entry(num_warps)}}
    path = Path(folder) / tables.table_filename(device.name)
    tables.merge_entries(path, device, entries, {"trials": 10})
    return path


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("tsdecode") and r.levelno >= logging.WARNING]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch, caplog):
    """No real user cache, shipped tables, env path or leftover process state."""
    monkeypatch.delenv(tables.CONFIG_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(tables, "shipped_config_dir", lambda: shipped)
    caplog.set_level(logging.WARNING, logger="tsdecode")
    tables.clear_cache()
    yield
    tables.set_config_path(None)
    tables.set_device_info_override(None)
    tables.clear_cache()


@pytest.fixture
def user_dir(tmp_path) -> Path:
    return tmp_path / "xdg" / "tsdecode" / "tuned_configs"


# ------------------------------------------------------------------------------------------------
# Keys, buckets, format
# ------------------------------------------------------------------------------------------------


def test_problem_class_key_and_buckets():
    assert tables.problem_class_key(make_shape()) == (
        "q=bfloat16,kv=bfloat16,o=bfloat16,d=128,g=4,hkv=8,p=16,sq=1,mask=dense"
    )
    fp8 = make_shape(q_dtype=torch.float16, kv_dtype=torch.float8_e4m3fn, o_dtype=torch.float32,
                     mask_kind="windowed", max_seq_len_q=3)
    assert tables.problem_class_key(fp8) == (
        "q=float16,kv=float8_e4m3fn,o=float32,d=128,g=4,hkv=8,p=16,sq=4,mask=windowed"
    )
    modes = {sq: tables.query_mode(make_shape(max_seq_len_q=sq)) for sq in (1, 2, 3, 8, 9, 16, 40)}
    assert modes == {1: "1", 2: "2", 3: "4", 8: "8", 9: "16+", 16: "16+", 40: "16+"}
    assert tables.query_mode(make_shape(max_seq_len_q=5, packed=True)) == "packed"
    assert tables.bucket_of(48, 6000) == (64, 8192)
    assert tables.bucket_of(1, 1) == (1, 1)
    assert tables.bucket_of(64, 8192) == (64, 8192)
    assert tables.table_filename("NVIDIA H200") == "NVIDIA_H200.json"
    assert tables.table_filename("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"


def test_written_file_follows_the_format(tmp_path):
    path = write(tmp_path)
    data = json.loads(path.read_text())
    tables.validate_table_data(data)
    assert data["format_version"] == tables.FORMAT_VERSION
    assert data["device"] == {"name": "NVIDIA H200", "sm_count": 132,
                              "compute_capability": [9, 0], "total_memory": 150_754_820_096}
    assert data["kernel_hash"] == tables.kernel_source_hash()
    assert len(data["kernel_hash"]) == 16
    assert data["tuner_settings"] == {"trials": 10}
    assert set(data) >= {"triton_version", "torch_version", "created", "updated", "entries"}
    [(key, [record])] = data["entries"].items()
    assert (record["batch_size"], record["kv_len"]) == (64, 8192)
    fields = {k: v for k, v in record.items() if k not in ("batch_size", "kv_len")}
    assert TableEntry.from_dict(fields) == make_entry()
    assert TableEntry.from_dict(make_entry().to_dict()).speedup == pytest.approx(1.25)
    table = tables.load_table(path)
    assert table.device == H200 and table.stale == () and table.skipped == ()
    assert table.entries[key][(64, 8192)] == make_entry()
    past = time.time() - 60
    os.utime(path, (past, past))  # a file modified within the last second is re-read
    table = tables.load_table(path)
    assert tables.load_table(path) is table  # parsed once


# ------------------------------------------------------------------------------------------------
# Search order and matching
# ------------------------------------------------------------------------------------------------


def test_search_order(tmp_path, user_dir, monkeypatch):
    shape = make_shape()
    shipped = tables.shipped_config_dir()
    folders = {name: tmp_path / name for name in ("arg", "setpath", "env")}
    for warps, folder in zip((1, 2, 4), (folders["arg"], folders["setpath"], folders["env"])):
        write(folder, num_warps=warps)
    write(user_dir, num_warps=8)
    write(shipped, num_warps=8, shape=make_shape(head_dim=64))  # only the shipped table has d=64
    tables.set_config_path(folders["setpath"])
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(folders["env"]))

    def hit(**kw):
        return tables.lookup(kw.pop("shape", shape), CPU, device_info=H200, **kw)

    assert hit(config_dir=folders["arg"]).kernel_config.num_warps == 1
    assert hit().kernel_config.num_warps == 2  # set_config_path beats the env variable
    tables.set_config_path(None)
    assert hit().kernel_config.num_warps == 4
    assert hit().table_path == str(folders["env"] / "NVIDIA_H200.json")
    monkeypatch.delenv(tables.CONFIG_DIR_ENV)
    assert hit().table_path == str(user_dir / "NVIDIA_H200.json")
    # first table *with an entry for the class* wins: d=64 falls through to the shipped table
    assert hit(shape=make_shape(head_dim=64)).table_path == str(shipped / "NVIDIA_H200.json")
    # an explicit path may name one file
    one = write(tmp_path / "one", num_warps=1)
    assert hit(config_dir=one).table_path == str(one)


def test_exact_and_nearest_bucket(tmp_path):
    key = tables.problem_class_key(make_shape())
    entries = {key: {(64, 8192): make_entry(1), (1, 128): make_entry(2),
                     (256, 65536): make_entry(8)}}
    write(tmp_path, entries=entries)

    def hit(b, n):
        return tables.lookup(make_shape(b, n), CPU, config_dir=tmp_path, device_info=H200)

    exact = hit(48, 6000)
    assert (exact.bucket, exact.kernel_config.num_warps, exact.notes) == ((64, 8192), 1, ())
    near = hit(40, 3000)  # bucket (64, 4096): one octave from (64, 8192)
    assert (near.bucket, near.kernel_config.num_warps) == ((64, 8192), 1)
    assert near.notes == ("nearest bucket (64, 8192) for (40, 3000)",)
    assert hit(2, 100).bucket == (1, 128)
    assert hit(1000, 100_000).bucket == (256, 65536)
    assert near.entry == make_entry(1)


def test_no_entry_for_the_class_uses_the_heuristic(tmp_path, caplog):
    write(tmp_path)
    tables.set_config_path(tmp_path)
    tables.set_device_info_override(H200)
    other = make_shape(head_dim=64)
    assert tables.lookup(other, CPU) is None
    selected = select_config(other, CPU)
    assert selected.source == "heuristic" and selected.table_path is None
    assert select_config(make_shape(), CPU).source == "table"
    assert messages(caplog) == []  # the GPU has a table: a missing class is not worth a warning


def test_the_other_16bit_dtype_class_stands_in_for_a_missing_class(tmp_path, user_dir):
    """float16 and bfloat16 run the same kernel and configs: a class absent from every matching
    table takes the other 16-bit dtype's entries (noted), after every table's own class."""
    fp16 = dict(q_dtype=torch.float16, kv_dtype=torch.float16, o_dtype=torch.float16)
    write(user_dir, num_warps=2)  # bfloat16 only
    hit = tables.lookup(make_shape(**fp16), CPU, device_info=H200)
    assert hit.kernel_config.num_warps == 2 and hit.bucket == (64, 8192)
    assert hit.notes == ("entries of class q=bfloat16,kv=bfloat16,o=bfloat16,d=128,g=4,hkv=8,p=16,"
                         "sq=1,mask=dense (float16 and bfloat16 share kernel and configs)",)
    # a plan of a float16 problem takes it end to end
    tables.set_device_info_override(H200)
    selected = select_config(make_shape(**fp16), CPU)
    assert selected.source == "table" and selected.kernel_config.num_warps == 2
    assert any("share kernel and configs" in a for a in selected.adjustments)
    # the class itself in a later table (shipped) beats the sibling in an earlier one (user)
    write(tables.shipped_config_dir(), num_warps=8, shape=make_shape(**fp16))
    hit = tables.lookup(make_shape(**fp16), CPU, device_info=H200)
    assert hit.kernel_config.num_warps == 8 and hit.notes == ()
    # and the other way round: a bfloat16 shape with only float16 entries (fp8 cache, fp32 out)
    fp8 = dict(kv_dtype=torch.float8_e4m3fn, o_dtype=torch.float32)
    write(tmp_path / "fp8", num_warps=1, shape=make_shape(q_dtype=torch.float16, **fp8))
    hit = tables.lookup(make_shape(**fp8), CPU, config_dir=tmp_path / "fp8", device_info=H200)
    assert hit.kernel_config.num_warps == 1 and "q=float16,kv=float8_e4m3fn,o=float32" in hit.notes[0]
    # no 16-bit dtype in the key (fp8 query, fp32 output): no stand-in
    assert tables.sibling_class_key(tables.problem_class_key(make_shape(
        q_dtype=torch.float8_e4m3fn, kv_dtype=torch.float8_e4m3fn, o_dtype=torch.float32))) is None


def test_device_name_variants(user_dir, caplog):
    write(user_dir, num_warps=2)  # NVIDIA H200
    hit = tables.lookup(make_shape(), CPU, device_info=H200_NVL)
    assert hit.kernel_config.num_warps == 2
    assert hit.notes == ("table for 'NVIDIA H200' used for 'NVIDIA H200 NVL' "
                         "(same compute capability 9.0 and 132 SMs)",)
    tables.lookup(make_shape(), CPU, device_info=H200_NVL)
    [msg] = messages(caplog)
    assert "NVIDIA_H200.json" in msg and "NVIDIA H200 NVL" in msg
    # an exact-name table beats a variant, and the variant's own table does not break H200
    write(user_dir, device=H200_NVL, num_warps=8)
    assert tables.lookup(make_shape(), CPU, device_info=H200_NVL).kernel_config.num_warps == 8
    assert tables.lookup(make_shape(), CPU, device_info=H200).kernel_config.num_warps == 2
    # a different SM count is another chip: no match, one "missing table" warning
    caplog.clear()
    assert tables.lookup(make_shape(), CPU, device_info=H100_PCIE) is None
    [msg] = messages(caplog)
    assert "NVIDIA H100 PCIe" in msg and "tsdecode-tune --preset llama3-8b" in msg


def test_exact_name_with_other_sm_count_is_used_with_a_note(user_dir, caplog):
    write(user_dir)
    sliced = DeviceInfo("NVIDIA H200", 16, (9, 0), 18 << 30)  # e.g. a MIG slice
    hit = tables.lookup(make_shape(), CPU, device_info=sliced)
    assert hit.notes == ("table tuned on 132 SMs, this 'NVIDIA H200' has 16",)
    assert len(messages(caplog)) == 1


def test_cuda_device_is_matched_by_its_properties(user_dir, monkeypatch):
    """lookup(shape, cuda device) reads the properties itself (faked here: no GPU on CI)."""
    props = SimpleNamespace(name="NVIDIA H200", multi_processor_count=132, major=9, minor=0,
                            total_memory=150_754_820_096)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert DeviceInfo.from_torch(torch.device("cuda")) == H200
    write(user_dir, num_warps=8)
    assert tables.lookup(make_shape(), torch.device("cuda", 0)).kernel_config.num_warps == 8
    with pytest.raises(ValueError, match="needs a CUDA device"):
        DeviceInfo.from_torch(CPU)


# ------------------------------------------------------------------------------------------------
# Missing, bad and stale tables; warn once
# ------------------------------------------------------------------------------------------------


def test_missing_table_warns_once_naming_the_tuner(caplog):
    tables.set_device_info_override(H200)
    for b in (1, 8, 64):
        assert tables.lookup(make_shape(b), CPU) is None
        assert select_config(make_shape(b), CPU).source == "heuristic"
    [msg] = messages(caplog)
    assert "'NVIDIA H200'" in msg and "tsdecode-tune --preset llama3-8b" in msg
    assert "NVIDIA_H200.json" in msg
    tables.clear_cache()  # resets the warn-once state
    tables.lookup(make_shape(), CPU)
    assert len(messages(caplog)) == 2


def test_cpu_without_a_path_is_quiet_and_explicit_path_matches_any_table(
    tmp_path, user_dir, monkeypatch, caplog
):
    write(user_dir)
    assert tables.lookup(make_shape(), CPU) is None  # no device properties, no path
    assert select_config(make_shape(), CPU).source == "heuristic"
    assert messages(caplog) == []
    write(tmp_path / "explicit", device=H100_PCIE, num_warps=8)
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path / "explicit"))
    hit = tables.lookup(make_shape(), CPU)
    assert hit.kernel_config.num_warps == 8
    assert hit.notes == ("device properties unknown: table used without device match",)
    assert messages(caplog) == []


def _valid_text(tmp_path) -> str:
    return write(tmp_path / "src").read_text()


BAD_FILES = {
    "corrupt": lambda text: b"\x00\xff garbage \x89PNG",
    "truncated": lambda text: text[: len(text) // 2].encode(),
    "empty": lambda text: b"",
    "wrong_version": lambda text: json.dumps({**json.loads(text), "format_version": 99}).encode(),
    "no_version": lambda text: json.dumps({"entries": {}}).encode(),
    "not_an_object": lambda text: b"[1, 2, 3]",
    "missing_field": lambda text: json.dumps(
        {k: v for k, v in json.loads(text).items() if k != "device"}).encode(),
    "bad_number": lambda text: text.replace('"time_us": 10.0', '"time_us": "fast"').encode(),
    "negative_time": lambda text: text.replace('"time_us": 10.0', '"time_us": -1').encode(),
    "bad_bucket": lambda text: text.replace('"batch_size": 64', '"batch_size": 48').encode(),
    "bad_class_key": lambda text: text.replace("mask=dense", "mask=sparse").encode(),
    # an int no float can hold: a format violation, not an OverflowError
    "huge_number": lambda text: text.replace('"time_us": 10.0', '"time_us": 1' + "0" * 400).encode(),
    "float_version": lambda text: json.dumps({**json.loads(text), "format_version": 1.0}).encode(),
}


@pytest.mark.parametrize("kind", [*BAD_FILES, "directory"])
def test_bad_file_warns_once_and_is_skipped(kind, tmp_path, user_dir, caplog):
    write(user_dir, num_warps=8)  # the good table behind the bad one
    bad = tmp_path / "explicit" / "NVIDIA_H200.json"
    bad.parent.mkdir()
    if kind == "directory":
        bad.mkdir()
    else:
        bad.write_bytes(BAD_FILES[kind](_valid_text(tmp_path)))
        assert tables.load_table(bad) is None
    for _ in range(3):
        hit = tables.lookup(make_shape(), CPU, config_dir=bad.parent, device_info=H200)
        assert hit.kernel_config.num_warps == 8 and hit.table_path == str(user_dir / bad.name)
    [msg] = messages(caplog)
    assert str(bad) in msg and "ignored" in msg
    if kind == "wrong_version":
        assert "format_version is 99" in msg


@pytest.mark.parametrize("explicit", ["config_dir", "env"])
def test_a_bad_table_is_one_warning_even_when_nothing_else_matches(explicit, tmp_path, caplog,
                                                                    monkeypatch):
    """The bad file's own warning, not also "no tuned config table" for the same cause."""
    bad = tmp_path / "explicit" / "NVIDIA_H200.json"
    bad.parent.mkdir()
    bad.write_bytes(BAD_FILES["truncated"](_valid_text(tmp_path)))
    config_dir = bad.parent if explicit == "config_dir" else None
    if explicit == "env":
        monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(bad.parent))
    for info in (None, H200):  # CPU: the explicit path only; H200: every source (all empty)
        tables.clear_cache()
        caplog.clear()
        for _ in range(3):
            assert tables.lookup(make_shape(), CPU, config_dir=config_dir, device_info=info) is None
            assert select_config(make_shape(), CPU).source == "heuristic"
        [msg] = messages(caplog)
        assert str(bad) in msg and "not valid JSON" in msg


@pytest.mark.parametrize("how", ["env", "set_config_path"])
def test_a_config_path_that_does_not_exist_warns_once(how, tmp_path, user_dir, caplog,
                                                      monkeypatch):
    missing = tmp_path / "no" / "such" / "dir"
    if how == "env":
        monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(missing))
    else:
        tables.set_config_path(missing)
    for _ in range(3):
        assert tables.lookup(make_shape(), CPU) is None
    [msg] = messages(caplog)
    assert str(missing) in msg and "does not exist" in msg
    assert ("$TSDECODE_CONFIG_DIR" if how == "env" else "set_config_path") in msg
    assert "does not exist" in tables.explain(48, 6000, 32, 8, 128, device="cpu")
    write(user_dir, num_warps=8)  # the search goes on to the next source
    hit = tables.lookup(make_shape(), CPU, device_info=H200)
    assert hit.kernel_config.num_warps == 8 and len(messages(caplog)) == 1


@pytest.mark.parametrize("tuned_batch_size", [10**309, 10**6, 32, 65],
                         ids=["1e309", "1e6", "32", "65"])
def test_tuned_batch_size_outside_its_bucket_skips_the_entry(tuned_batch_size, tmp_path, caplog):
    """Bucket 64 holds batch sizes 33..64: anything else would overflow or silently rescale the
    splits. Load skips the entry (one warning); merge refuses to write one."""
    key = tables.problem_class_key(make_shape())
    good = dataclasses.replace(kept_default(make_entry(num_kv_splits=4)), tuned_batch_size=48)
    path = write(tmp_path, entries={key: {(64, 8192): good}})
    data = json.loads(path.read_text())
    data["entries"][key][0]["tuned_batch_size"] = tuned_batch_size
    path.write_text(json.dumps(data))
    table = tables.load_table(path)
    assert key not in table.entries and len(table.skipped) == 1
    assert "tuned_batch_size" in table.skipped[0] and "bucket (64, 8192)" in table.skipped[0]
    tables.set_config_path(tmp_path)
    tables.set_device_info_override(H200)
    for _ in range(2):
        selected = select_config(make_shape(), CPU)  # B=48, L=6000: bucket (64, 8192)
        assert selected.source == "heuristic"
    [msg] = messages(caplog)
    assert "1 entries are not valid" in msg and len(msg) < 600
    bad = dataclasses.replace(good, tuned_batch_size=tuned_batch_size)
    with pytest.raises(ValueError, match=r"tuned_batch_size .* bucket \(64, 8192\)"):
        tables.merge_entries(path, H200, {key: {(64, 8192): bad}}, {})
    for bucket, b in (((64, 8192), 33), ((64, 8192), 64), ((1, 64), 1)):  # the edges are fine
        entry = dataclasses.replace(good, tuned_batch_size=b)
        tables.merge_entries(path, H200, {key: {bucket: entry}}, {})


def test_merge_moves_aside_a_table_holding_a_number_no_float_can_hold(tmp_path, caplog):
    key = tables.problem_class_key(make_shape())
    path = write(tmp_path)
    path.write_text(path.read_text().replace('"time_us": 10.0', '"time_us": 1' + "0" * 400))
    assert tables.load_table(path) is None
    tables.merge_entries(path, H200, {key: {(1, 64): make_entry(8)}}, {})
    assert set(tables.load_table(path).entries[key]) == {(1, 64)}
    [aside] = tmp_path.glob("NVIDIA_H200.json.corrupt-*")
    msgs = messages(caplog)
    assert len(msgs) == 2 and "violates the format" in msgs[0] and str(aside) in msgs[1]


def test_stale_table_warns_once_and_uses_only_valid_entries(tmp_path, caplog):
    key = tables.problem_class_key(make_shape())
    path = write(tmp_path, entries={key: {(64, 8192): make_entry(2), (64, 4096): make_entry(4)}})
    data = json.loads(path.read_text())
    data["kernel_hash"] = "0123456789abcdef"
    data["triton_version"] = "2.3.1"
    records = data["entries"][key]
    records[1]["kernel_config"]["block_n"] = 48  # (64, 8192): outside today's config space
    del records[0]["default_config"]["num_stages"]  # (64, 4096): an older config space
    records.append({**records[1], "batch_size": 1, "kv_len": 1})
    records[2]["kernel_config"] = {**records[2]["kernel_config"], "block_n": 64}  # still valid
    path.write_text(json.dumps(data))

    table = tables.load_table(path)
    assert set(table.entries[key]) == {(1, 1)} and len(table.skipped) == 2
    for _ in range(3):
        hit = tables.lookup(make_shape(), CPU, config_dir=tmp_path, device_info=H200)
        assert hit.bucket == (1, 1)  # the invalid exact bucket was skipped: nearest valid one
        assert hit.notes[0].startswith("nearest bucket (1, 1)")
        assert any("table kernel hash differs (table 0123456789abcdef" in n for n in hit.notes)
        assert any("triton 2.3.1" in n for n in hit.notes)
    msgs = messages(caplog)
    assert len(msgs) == 3, msgs  # skipped entries, kernel hash, triton major: once each
    assert sum("kernel hash differs" in m for m in msgs) == 1
    assert sum("2 entries are not valid" in m for m in msgs) == 1


def test_table_config_is_clamped_to_the_shape(tmp_path):
    shape = make_shape(2, 33, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    write(tmp_path, shape=shape, entries={tables.problem_class_key(shape): {
        (2, 64): make_entry(block_n=16, block_m=16, num_kv_splits=64)}})
    tables.set_config_path(tmp_path)
    tables.set_device_info_override(H200)
    selected = select_config(shape, CPU)
    assert selected.source == "table" and selected.bucket == (2, 64)
    assert selected.kernel_config.num_kv_splits == 3
    assert any(a.startswith("num_kv_splits 64 -> 3") for a in selected.adjustments)


# ------------------------------------------------------------------------------------------------
# Writing: merge, atomic replace, concurrent merges
# ------------------------------------------------------------------------------------------------


def test_merge_entries_merges(tmp_path, caplog):
    k1 = tables.problem_class_key(make_shape())
    k2 = tables.problem_class_key(make_shape(head_dim=64))
    path = tmp_path / "NVIDIA_H200.json"
    first = {k1: {(1, 64): make_entry(1), (2, 64): make_entry(1)}}
    tables.merge_entries(path, H200, first, {"a": 1})
    created = json.loads(path.read_text())["created"]
    tables.merge_entries(path, H200, {k1: {(2, 64): make_entry(8)}, k2: {(4, 64): make_entry(2)}},
                         {"a": 2})
    table = tables.load_table(path)
    warps = {k: {b: e.kernel_config.num_warps for b, e in v.items()}
             for k, v in table.entries.items()}
    assert warps == {k1: {(1, 64): 1, (2, 64): 8}, k2: {(4, 64): 2}}
    assert table.tuner_settings == {"a": 2} and table.created == created
    with pytest.raises(ValueError, match="not of 'NVIDIA H200 NVL'"):
        tables.merge_entries(path, H200_NVL, {k1: {(1, 64): make_entry()}}, {})
    with pytest.raises(ValueError, match="powers of two"):
        tables.merge_entries(path, H200, {k1: {(3, 64): make_entry()}}, {})
    with pytest.raises(ValueError, match="problem class key"):
        tables.merge_entries(path, H200, {"d=128": {(1, 64): make_entry()}}, {})
    assert messages(caplog) == []


@pytest.mark.parametrize("damage", ["corrupt", "stale"])
def test_merge_moves_an_unusable_table_aside(damage, tmp_path, caplog):
    key = tables.problem_class_key(make_shape())
    path = write(tmp_path)
    if damage == "corrupt":
        path.write_text(path.read_text()[:100])
    else:
        path.write_text(path.read_text().replace(tables.kernel_source_hash(), "0" * 16))
    tables.merge_entries(path, H200, {key: {(1, 64): make_entry(8)}}, {})
    assert set(tables.load_table(path).entries[key]) == {(1, 64)}
    [aside] = tmp_path.glob(f"NVIDIA_H200.json.{damage}-*")
    assert aside.stat().st_size > 0
    [msg] = messages(caplog)
    assert str(aside) in msg


def test_readers_never_see_a_partial_table(tmp_path, caplog):
    key = tables.problem_class_key(make_shape())
    buckets = {(1 << i, 1 << j): None for i in range(6) for j in range(6, 14)}
    versions = [{key: {b: make_entry(w) for b in buckets}} for w in (2, 8)]
    path = tmp_path / "NVIDIA_H200.json"
    tables.merge_entries(path, H200, versions[0], {})
    done = threading.Event()
    seen, errors = set(), []

    def reader():
        while not done.is_set():
            try:
                hit = tables.lookup(make_shape(), CPU, config_dir=tmp_path, device_info=H200)
                table = tables.load_table(path)
                assert len(table.entries[key]) == len(buckets)
                seen.add(hit.kernel_config.num_warps)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(40):
            tables.merge_entries(path, H200, versions[i % 2], {"i": i})
    finally:
        done.set()
        for t in threads:
            t.join()
    assert errors == [] and seen <= {2, 8} and seen
    assert messages(caplog) == []
    # the last write is what a lookup sees now, even if it landed within one timestamp tick
    assert tables.lookup(make_shape(), CPU, config_dir=tmp_path, device_info=H200) \
        .kernel_config.num_warps == 8


MERGER = textwrap.dedent("""
    import sys, time, pathlib
    from tsdecode import tables
    from tsdecode.configs import KernelConfig
    path, start, worker = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3])
    info = tables.DeviceInfo("NVIDIA H200", 132, (9, 0), 1)
    key = "q=bfloat16,kv=bfloat16,o=bfloat16,d=128,g=4,hkv=8,p=16,sq=1,mask=dense"
    cfg = KernelConfig()
    pathlib.Path(f"{start}.ready{worker}").touch()
    while not start.exists():
        time.sleep(0.01)
    for i in range(25):
        entry = tables.TableEntry(cfg, 1.0 + i, 1.0, None, cfg, 2.0, 1.0)
        tables.merge_entries(path, info, {key: {(1 << worker, 1 << i): entry}}, {"w": worker})
""")


def test_concurrent_merges_from_two_processes_lose_nothing(tmp_path):
    path, start = tmp_path / "NVIDIA_H200.json", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", MERGER, str(path), str(start), str(w)],
                              env=env, stderr=subprocess.PIPE, text=True) for w in (0, 1)]
    deadline = time.time() + 60
    while not all((tmp_path / f"go.ready{w}").exists() for w in (0, 1)) and time.time() < deadline:
        time.sleep(0.02)
    start.touch()
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    table = tables.load_table(path)
    [buckets] = table.entries.values()
    assert set(buckets) == {(1 << w, 1 << i) for w in (0, 1) for i in range(25)}


# ------------------------------------------------------------------------------------------------
# Packaging, end to end, explain, benchmark
# ------------------------------------------------------------------------------------------------


def test_shipped_tables_are_found_in_an_installed_wheel(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "build", "dist", "*.egg-info", ".pytest_cache", ".venv", ".whl"))
    for old in (src / "tuned_configs").glob("*.json"):
        old.unlink()
    write(src / "tuned_configs", device=H100_PCIE, num_warps=2)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", ".", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist")], cwd=src, check=True, capture_output=True)
    [wheel] = (tmp_path / "dist").glob("tsdecode-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    probe = textwrap.dedent("""
        import torch, tsdecode
        from tsdecode import tables
        from tsdecode.configs import ProblemShape
        shape = ProblemShape(batch_size=48, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                             page_size=16, max_kv_len=6000)
        hit = tables.lookup(shape, torch.device("cpu"), device_info=tables.DeviceInfo(
            "NVIDIA H100 PCIe", 114, (9, 0), 1))
        print(tsdecode.__file__, tables.shipped_config_dir(), hit.table_path,
              hit.kernel_config.num_warps, sep="\\n")
    """)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != tables.CONFIG_DIR_ENV}
    env.update(PYTHONPATH=str(site), XDG_CACHE_HOME=str(tmp_path / "empty-cache"),
               TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", probe], cwd=outside, env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    package, shipped, table_path, warps = out
    assert package.startswith(str(site)) and shipped == str(site / "tsdecode" / "tuned_configs")
    assert table_path == str(site / "tsdecode" / "tuned_configs" / "NVIDIA_H100_PCIe.json")
    assert warps == "2"


@pytest.mark.skipif(not interpreter_active(), reason="CPU-interpreter path (GPU: tests/test_tuner.py)")
def test_plan_picks_a_table_entry_end_to_end(tmp_path, monkeypatch):
    """CPU: no device properties, so the explicitly given folder's table is used as is."""
    lens, hq, hkv, d, p = [5, 33], 4, 2, 64, 16
    shape = ProblemShape(batch_size=2, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                         page_size=p, max_kv_len=max(lens), q_dtype=torch.float16,
                         kv_dtype=torch.float16, o_dtype=torch.float16)
    config = KernelConfig(block_n=16, block_m=16, num_kv_splits=2, num_warps=2, num_stages=1)
    entry = TableEntry(config, 5.0, 100.0, None, KernelConfig(), 6.0, 90.0)
    write(tmp_path, device=H100_PCIE,
          entries={tables.problem_class_key(shape): {tables.bucket_of(2, 33): entry}})
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path))

    gen = torch.Generator().manual_seed(0)
    cache = torch.randn((8, 2, hkv, p, d), generator=gen).to(torch.float16)
    block_tables = torch.tensor([[3, 0, 0], [5, 1, 6]], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn((2, hq, d), generator=gen).to(torch.float16)
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(block_tables, seq_lens, hq, hkv, d, p, q_data_type=torch.float16)
    assert w.config.source == "table" and w.config.kernel_config == config
    assert w.config.table_path == str(tmp_path / "NVIDIA_H100_PCIe.json")
    out = w.run(q, cache)
    ref = reference_decode(q, cache, block_tables, seq_lens)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_explain(tmp_path):
    """explain shows the config plan would use: the nearest entry scaled to the batch size (4
    splits tuned at B=64 -> 6 at B=40), and the heuristic instead of another bucket's winner."""
    from tsdecode.configs import heuristic_config

    key = tables.problem_class_key(make_shape())
    write(tmp_path, entries={key: {(64, 8192): kept_default(make_entry(8, num_kv_splits=4)),
                                   (8, 1024): make_entry(8, num_kv_splits=2)}})
    text = tsdecode.explain(40, 3000, 32, 8, 128, config_dir=tmp_path, device_info=H200)
    assert f"class: {key}" in text and "bucket: (64, 4096)" in text
    assert f"source: table {tmp_path / 'NVIDIA_H200.json'} bucket (64, 8192)" in text
    assert "note: nearest bucket (64, 8192) for (40, 3000)" in text
    assert "(1.00x)" in text and "num_warps=8" in text and "num_kv_splits=6" in text
    off = tsdecode.explain(8, 1500, 32, 8, 128, config_dir=tmp_path, device_info=H200)
    assert "source: heuristic (the table entry of bucket (8, 1024) is not used here)" in off
    assert f"config: {heuristic_config(make_shape(batch_size=8, kv_len=1500), 132)}" in off
    assert "tuned winner" in off
    own = tsdecode.explain(7, 1000, 32, 8, 128, config_dir=tmp_path, device_info=H200)
    assert "source: table" in own and "(1.25x)" in own
    miss = tsdecode.explain(40, 3000, 32, 8, 64, config_dir=tmp_path, device_info=H200)
    assert "no entry for this class" in miss and "source: heuristic" in miss
    assert "no table searched" in tsdecode.explain(1, 10, 8, 8, 128, device="cpu")


def test_lookup_benchmark_runs():
    result = tables.bench_lookup(iterations=200, verbose=False)
    assert set(result) >= {"exact", "nearest", "miss"}
    assert all(0 < v < 5000 for v in result.values())  # microseconds; loose: shared CI machines


def test_table_entry_from_another_batch_size_keeps_its_program_count(tmp_path):
    """B=16 served by the B=32 bucket's entry: twice the splits (same programs per wave)."""
    from tsdecode.configs import scale_splits_to_batch

    tuned = KernelConfig(block_n=64, block_m=16, num_kv_splits=2)
    scaled, notes = scale_splits_to_batch(tuned, 32, 16)
    assert scaled.num_kv_splits == 4 and "scaled to keep its program count" in notes[0]
    assert scale_splits_to_batch(tuned, 16, 16) == (tuned, ())
    assert scale_splits_to_batch(tuned, 32, 128)[0].num_kv_splits == 1
    # through select_config: a nearest-bucket hit gets the scaled split count
    key = tables.problem_class_key(make_shape())
    write(tmp_path, entries={key: {(32, 8192): kept_default(make_entry(num_kv_splits=2))}})
    tables.clear_cache()
    tables.set_config_path(tmp_path)
    tables.set_device_info_override(H200)
    try:
        sel = select_config(make_shape(batch_size=16, kv_len=8192), CPU)
    finally:
        tables.set_config_path(None)
        tables.set_device_info_override(None)
        tables.clear_cache()
    assert sel.source == "table" and sel.kernel_config.num_kv_splits == 4
    assert any("scaled" in a for a in sel.adjustments)


def test_kernel_hash_ignores_comments_and_docstrings_only():
    src = '''"""Module doc."""
import os  # a comment


def f(x):
    """Doc of f,
    two lines."""
    y = "kept: an assigned string"  # trailing comment
    # a whole-line comment

    return x + 1
'''
    code = tables.code_without_comments(src)
    assert "Module doc" not in code and "Doc of f" not in code and "comment" not in code
    assert '"kept: an assigned string"' in code and "return x + 1" in code
    edited_docs = src.replace("Doc of f", "Better doc of f").replace("# a comment", "# other")
    assert tables.code_without_comments(edited_docs) == code
    assert tables.code_without_comments(src.replace("\n", "\r\n")) == code
    assert tables.code_without_comments(src.replace("x + 1", "x + 2")) != code


def test_entry_scales_splits_from_the_batch_size_it_was_tuned_at(tmp_path):
    """An entry tuned at B=3 lands in bucket 4; B=3 gets it unchanged, B=1 scales from 3, not 4.
    Tables without tuned_batch_size scale from the bucket's batch size."""
    import dataclasses as dc

    key = tables.problem_class_key(make_shape())
    tuned = dc.replace(kept_default(make_entry(num_kv_splits=4)), tuned_batch_size=3)
    path = write(tmp_path, entries={key: {(4, 8192): tuned}})
    assert json.loads(path.read_text())["entries"][key][0]["tuned_batch_size"] == 3
    assert tables.load_table(path).entries[key][(4, 8192)] == tuned
    tables.clear_cache()
    tables.set_config_path(tmp_path)
    tables.set_device_info_override(H200)
    try:
        same = select_config(make_shape(batch_size=3, kv_len=8192), CPU)
        one = select_config(make_shape(batch_size=1, kv_len=8192), CPU)
        write(tmp_path, entries={key: {(4, 8192): kept_default(make_entry(num_kv_splits=4))}})  # no field
        tables.clear_cache()
        legacy = select_config(make_shape(batch_size=3, kv_len=8192), CPU)
    finally:
        tables.set_config_path(None)
        tables.set_device_info_override(None)
        tables.clear_cache()
    assert same.kernel_config.num_kv_splits == 4 and not any("scaled" in a for a in same.adjustments)
    assert one.kernel_config.num_kv_splits == 12
    assert legacy.kernel_config.num_kv_splits == 5  # round(4 * 4 / 3)


@pytest.mark.parametrize("value", [0, -2, 1.5, "3", None])
def test_bad_tuned_batch_size_is_a_format_error(value):
    entry = make_entry().to_dict()
    entry["tuned_batch_size"] = value
    with pytest.raises(tables.TableFormatError, match="tuned_batch_size"):
        TableEntry.from_dict(entry)


def test_ragged_one_wave_batches_get_more_splits():
    """longest / mean = 1.33 multiplies the splits while the programs stay within one wave;
    equal lengths, several waves or bound lengths (spread 1.0) change nothing."""
    from tsdecode.configs import scale_splits_to_raggedness

    cfg = KernelConfig(block_n=16, block_m=16, num_kv_splits=11, num_warps=1, num_stages=3)
    ragged = make_shape(batch_size=12, kv_len=5000, kv_len_spread=4 / 3)
    scaled, notes = scale_splits_to_raggedness(cfg, ragged, 132)
    assert scaled.num_kv_splits == 15 and "ragged lengths" in notes[0]
    assert scale_splits_to_raggedness(cfg, make_shape(batch_size=12, kv_len=5000), 132) == (cfg, ())
    many = dataclasses.replace(cfg, num_kv_splits=16)  # 12*8*16*1.33 > 12 programs per SM
    assert scale_splits_to_raggedness(many, ragged, 132) == (many, ())
    spread = make_shape(batch_size=1, kv_len=50000, kv_len_spread=50.0)
    assert scale_splits_to_raggedness(cfg, spread, 132)[0].num_kv_splits == 44  # capped at 4x
    short = make_shape(batch_size=1, kv_len=5000, kv_len_spread=50.0)  # 313 tiles of 16
    assert scale_splits_to_raggedness(cfg, short, 132)[0].num_kv_splits == 39  # >= 8 tiles a split
    tiny = make_shape(batch_size=2, kv_len=3000, kv_len_spread=4 / 3)  # 188 tiles: 66 splits stay
    wide = dataclasses.replace(cfg, num_kv_splits=66)
    assert scale_splits_to_raggedness(wide, tiny, 132) == (wide, ())


def test_ragged_batches_short_of_full_waves_step_to_full_waves():
    """Past one wave of the config's own residency but short of FULL_WAVES waves, a ragged batch
    steps to FULL_WAVES waves if each split keeps 768 tokens of the mean request."""
    from tsdecode.configs import FULL_WAVES, resident_programs_per_sm, scale_splits_to_raggedness

    wide = KernelConfig(block_n=64, block_m=16, num_kv_splits=1, num_warps=4, num_stages=2)
    ragged = make_shape(batch_size=64, kv_len=16384, kv_len_spread=1.32)  # 512 programs
    assert resident_programs_per_sm(wide, ragged) == 5  # 660 a wave: 512 * 1.32 does not fit
    scaled, notes = scale_splits_to_raggedness(wide, ragged, 132)
    assert scaled.num_kv_splits == 6 and "waves" in notes[0]  # ceil(4 * 660 / 512)
    assert 512 * scaled.num_kv_splits >= FULL_WAVES * 660 > 512 * (scaled.num_kv_splits - 1)
    # Equal lengths, or too few tiles of the mean request per split (B=200 L=1.5k: ~18), or
    # already FULL_WAVES waves: unchanged.
    assert scale_splits_to_raggedness(wide, make_shape(batch_size=64, kv_len=16384), 132) == (wide, ())
    short = make_shape(batch_size=200, kv_len=1500, kv_len_spread=1.33)
    assert scale_splits_to_raggedness(wide, short, 132) == (wide, ())
    many = make_shape(batch_size=400, kv_len=16384, kv_len_spread=1.32)  # 3200 programs, 4.8 waves
    assert scale_splits_to_raggedness(wide, many, 132) == (wide, ())
    # The floor counts tokens (768 of the mean request a split), not tiles: one split of 16-token
    # lean tiles at B=200, mean ~1120 tokens, would step to 4 splits of ~280 tokens: kept (the
    # H200 ran 4 splits 1.04x one split); at mean ~3000 tokens the step to 3 splits goes ahead.
    lean = KernelConfig(block_n=16, block_m=16, num_kv_splits=1, num_warps=1, num_stages=5)
    short_lean = make_shape(batch_size=200, kv_len=1500, kv_len_spread=1.34)
    assert resident_programs_per_sm(dataclasses.replace(lean, num_kv_splits=2), short_lean) == 10
    assert scale_splits_to_raggedness(lean, short_lean, 132) == (lean, ())
    long_lean = make_shape(batch_size=256, kv_len=4096, kv_len_spread=1.33)
    assert scale_splits_to_raggedness(lean, long_lean, 132)[0].num_kv_splits == 3  # ceil(4*1320/2048)


def test_resident_programs_per_sm_counts_registers_and_shared_memory():
    """Lean 1-warp 16-token programs at D=128: 168 registers, 3 warps a sub-partition, 12 a SM;
    at 5 stages (two K/V buffers) a 16-bit cache with splits is limited by shared memory (10), and
    with one split (the direct-output kernel: 182 registers) by registers to 8 (not 65536 // 5888
    = 11: registers are allocated per sub-partition); an fp8 cache by registers (12)."""
    from tsdecode.configs import resident_programs_per_sm, split_kernel_resources

    lean = KernelConfig(block_n=16, block_m=16, num_kv_splits=2, num_warps=1, num_stages=3)
    bf16 = make_shape(batch_size=1, kv_len=1024)
    fp8 = make_shape(batch_size=1, kv_len=1024, kv_dtype=torch.float8_e4m3fn)
    deep = dataclasses.replace(lean, num_stages=5)
    direct = dataclasses.replace(deep, num_kv_splits=1)
    assert resident_programs_per_sm(lean, bf16) == 12 == resident_programs_per_sm(lean, fp8)
    assert resident_programs_per_sm(deep, bf16) == 10 and resident_programs_per_sm(deep, fp8) == 12
    assert split_kernel_resources(direct, bf16) == (182, 20488)
    assert resident_programs_per_sm(direct, bf16) == 8
    big = KernelConfig(block_n=256, block_m=16, num_kv_splits=1, num_warps=8, num_stages=5)
    assert resident_programs_per_sm(big, bf16) == 1  # never 0


def test_programs_per_sm_by_registers_counts_per_sub_partition():
    """Registers are allocated per warp in 256-register units within each of an SM's four 16K
    register files (CUDA's occupancy calculator; the H200's driver agreed at 3,012 kernels)."""
    from tsdecode.configs import programs_per_sm_by_registers

    assert programs_per_sm_by_registers(182, 1) == 8  # 5888 a warp: 2 a sub-partition
    assert programs_per_sm_by_registers(168, 1) == 12  # 5376: 3
    assert programs_per_sm_by_registers(80, 1) == 24  # 2560: 6
    assert programs_per_sm_by_registers(96, 2) == 10  # 3072: 5 a sub-partition, 20 warps
    assert programs_per_sm_by_registers(255, 4) == 2  # 8192: 2, 8 warps
    assert programs_per_sm_by_registers(32, 1) == 64  # 64 warps a SM at most
    assert programs_per_sm_by_registers(255, 8) == 1  # 8192 a warp: 2 a sub-partition, 8 warps


def test_split_kernel_resources_take_the_nearest_measured_entry_or_a_bound():
    """The table is keyed by K/V bytes, block_d, block_m, block_n, warps, stages and one split or
    more, measured at G = 1, 4, 8, 16 for 16 rows: a shape takes the smallest measured G at or
    above its rows; D < 64 takes D=64; 4 stages the 3-stage entry where unmeasured; a config
    outside the table 255 registers and its Q tile plus K/V buffers of shared memory."""
    from tsdecode.configs import _resource_table, split_kernel_resources

    table = _resource_table()
    assert len(table) > 1000
    cfg = KernelConfig(block_n=64, block_m=16, num_kv_splits=1, num_warps=4, num_stages=2)
    measured = dict((g, (r, s)) for g, r, s in table[(2, 128, 16, 64, 4, 2, 1)])
    assert sorted(measured) == [1, 4, 8, 16]
    assert split_kernel_resources(cfg, make_shape(batch_size=1, kv_len=1024, num_qo_heads=8)) == measured[1]
    assert split_kernel_resources(cfg, make_shape(batch_size=1, kv_len=1024, num_qo_heads=24)) == measured[4]
    assert split_kernel_resources(cfg, make_shape(batch_size=1, kv_len=1024, num_qo_heads=40)) == measured[8]
    d32 = make_shape(batch_size=1, kv_len=1024, head_dim=32)
    assert split_kernel_resources(cfg, d32) == split_kernel_resources(cfg, make_shape(
        batch_size=1, kv_len=1024, head_dim=64))
    four = dataclasses.replace(cfg, num_stages=4, block_m=32)
    rows32 = make_shape(batch_size=1, kv_len=1024, num_qo_heads=256)
    assert (2, 128, 32, 64, 4, 4, 1) not in table
    assert split_kernel_resources(four, rows32) == split_kernel_resources(
        dataclasses.replace(four, num_stages=3), rows32)
    outside = KernelConfig(block_n=256, block_m=16, num_kv_splits=2, num_warps=4, num_stages=5)
    assert split_kernel_resources(outside, make_shape(batch_size=1, kv_len=1024)) == (
        255, 4096 + 16 * 128 * 6 + 2 * 2 * 256 * 128 * 2)
    # That bound is at least what every measured config uses.
    for (kv_bytes, block_d, block_m, block_n, _, stages, _), measured in table.items():
        bound = 4096 + block_m * block_d * 6 + (2 if stages >= 5 else 1) * 2 * block_n * block_d * kv_bytes
        assert all(shared <= bound for _, _, shared in measured)


def test_unreadable_resource_table_warns_once_and_falls_back(monkeypatch, tmp_path):
    """A missing or corrupt resource table: one warning, then the conservative estimate (255
    registers: 2 one-warp programs a sub-partition), never a crash."""
    from tsdecode import configs

    bad = tmp_path / "resources.csv"
    bad.write_text("kv_bytes,block_d\n2,notanumber\n")
    empty = tmp_path / "empty.csv"
    empty.write_text("# header only\nkv_bytes,block_d\n")
    for path in (bad, empty, tmp_path / "missing.csv"):
        monkeypatch.setattr(configs, "_RESOURCES_CSV", path)
        configs._resource_table.cache_clear()
        configs._resident_programs_per_sm.cache_clear()
        try:
            lean = KernelConfig(block_n=16, block_m=16, num_kv_splits=2, num_warps=1, num_stages=3)
            with pytest.warns(RuntimeWarning, match="conservative estimate"):
                assert configs.resident_programs_per_sm(lean, make_shape(batch_size=1, kv_len=64)) == 8
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                configs.heuristic_config(make_shape(batch_size=8, kv_len=4096), 132)
        finally:
            configs._resource_table.cache_clear()
            configs._resident_programs_per_sm.cache_clear()


def test_plan_passes_the_length_spread_of_fixed_lengths_only(monkeypatch):
    from tsdecode import BatchDecodePagedTSWrapper, api

    seen = []
    real = api.select_config
    monkeypatch.setattr(api, "select_config", lambda shape, *a: seen.append(shape) or real(shape, *a))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    lens = torch.tensor([300, 100, 200], dtype=torch.int32, device=dev)
    table = torch.arange(3 * 20, dtype=torch.int32, device=dev).reshape(3, 20)
    w = BatchDecodePagedTSWrapper()
    w.plan(table, lens, 8, 2, 64, 16)
    w.plan(table, lens, 8, 2, 64, 16, bind_seq_lens=True, max_kv_len=300)
    assert [s.kv_len_spread for s in seen] == [1.5, 1.0]


def test_tuned_winner_is_used_in_its_own_bucket_only(tmp_path):
    """An entry that beat its heuristic default serves shapes of its bucket; a shape in another
    bucket gets the heuristic, with a note naming the entry. An entry that kept the default
    still serves as the nearest bucket."""
    from tsdecode.configs import heuristic_config

    key = tables.problem_class_key(make_shape())
    winner = make_entry(num_warps=1, block_n=32, num_stages=3)
    kept = kept_default(make_entry(num_warps=1, block_n=16, num_stages=3, num_kv_splits=4))
    write(tmp_path, entries={key: {(256, 4096): winner, (8, 1024): kept}})
    tables.clear_cache()
    tables.set_config_path(tmp_path)
    tables.set_device_info_override(H200)
    try:
        own = select_config(make_shape(batch_size=200, kv_len=3000), CPU)
        other = select_config(make_shape(batch_size=96, kv_len=3000), CPU)
        near_kept = select_config(make_shape(batch_size=8, kv_len=2000), CPU)
    finally:
        tables.set_config_path(None)
        tables.set_device_info_override(None)
        tables.clear_cache()
    assert own.source == "table" and own.kernel_config == winner.kernel_config
    assert other.source == "heuristic"
    assert other.kernel_config == heuristic_config(make_shape(batch_size=96, kv_len=3000), 132)
    assert any("tuned winner" in a and "(256, 4096)" in a for a in other.adjustments)
    assert near_kept.source == "table" and near_kept.bucket == (8, 1024)


def test_heuristic_adds_splits_only_to_fill_a_mostly_empty_last_wave():
    """16-bit cache, L < 8k, >= 4 B*Hkv programs per SM (waves of 5 programs per SM) outside the
    batch-lean rule (K/V > 4096 tokens, or past one wave of 8 with a last wave less than 7/8
    full): 768 programs are 1.16 waves -> 2
    splits (the mean request of an 8/3-spread batch of L=6000 has 35 tiles: at most 2 splits of
    >= 12 tiles); 2048 programs (3.1 waves) -> 2 splits (6.2 waves); a last wave >= 2/3 full, or
    L=1k (16 tiles), keeps 1 split."""
    from tsdecode.configs import heuristic_config

    def config(b, n, spread=1.0):
        return heuristic_config(make_shape(batch_size=b, kv_len=n, kv_len_spread=spread), 132)

    def splits(b, n, spread=1.0):
        return config(b, n, spread).num_kv_splits

    assert splits(96, 6000, 8 / 3) == 2  # 5.8 per SM, K/V > 4096: not the batch-lean rule
    assert splits(96, 6144, 1.5) == 4  # 64 mean tiles (5 splits' room): 1.16 -> ... -> 4.65 waves
    assert splits(256, 4096) == 1  # 15.5 per SM: the batch-lean rule (1.94 waves of 8)
    assert splits(240, 4096) == 1  # 14.5 per SM: 1.82 waves of 8; 2.9 waves of 5, the last 91% full
    assert splits(128, 6144) == 3  # 1.55 -> 3.1 (last wave 10% full) -> 4.65 waves
    assert splits(136, 4096) == 3  # 8.2 per SM: 1.65 -> 3.3 -> 4.9 waves
    assert splits(150, 4096) == 1  # 1.82 waves: the last one is 82% full
    assert splits(232, 1024) == 1  # 2.8 waves, but 16 tiles: no room for 12-tile splits
    assert splits(200, 1500, 4 / 3) == 1  # 17 mean tiles: no room for 12-tile splits
    for b, n in ((96, 6000), (128, 6144), (136, 4096), (150, 4096), (232, 1024), (240, 4096)):
        c = config(b, n)
        assert (c.block_n, c.num_warps, c.num_stages) == (64, 4, 2)  # this rule's tiles
    assert splits(128, 8192) == 2  # L >= 8k: the long-K/V rule, unchanged


def test_heuristic_fp8_caches_take_lean_programs_at_about_46_per_sm():
    """fp8 cache, >= 4 B*Hkv programs per SM: 16-token tiles at D=128 (32 at D=64), 1 warp, 5
    stages, splits for ~46 programs per SM but >= 1k tokens each; a 16-bit cache at the same
    shape keeps its own rule, and fewer programs keep the small-batch rule."""
    from tsdecode.configs import heuristic_config

    def config(b, n, kv=torch.float8_e4m3fn, **kw):
        return heuristic_config(make_shape(batch_size=b, kv_len=n, kv_dtype=kv, **kw), 132)

    c = config(128, 8192)  # 1024 programs: round(46 * 132 / 1024) = 6 splits
    assert (c.block_n, c.num_warps, c.num_stages, c.num_kv_splits) == (16, 1, 5, 6)
    assert config(256, 8192).num_kv_splits == 3
    assert config(128, 6144).num_kv_splits == 6  # past 4k: the wave model does not apply
    assert config(128, 5120).num_kv_splits == 5  # capped at L / 1024
    assert config(32, 8192, num_qo_heads=32, num_kv_heads=32).num_kv_splits == 6
    assert config(128, 8192, num_qo_heads=32, num_kv_heads=32).num_kv_splits == 1
    assert config(128, 8192, head_dim=64).block_n == 32
    assert config(128, 8192, kv=torch.bfloat16).num_warps == 4  # the 16-bit large-batch rule
    assert config(8, 8192).num_kv_splits == 16  # 64 programs (< 4 per SM): not this rule


def test_heuristic_fp8_up_to_4k_mends_a_mostly_empty_last_wave():
    """fp8 cache, >= 4 B*Hkv programs per SM, K/V up to 4096 tokens: where the ~46-a-SM rule's
    count passes one wave of 12 a SM (1584 programs on 132 SMs) with a last wave under 60% full,
    the count of 1 up to it whose waves are fullest, a wave under 60% full counted as 60%, each
    split past the first 3% dearer (H200 A/B of 2026-12-01: one split at 0.65 of a wave beat two
    at 1.29 waves by 1.23x); elsewhere the rule's count."""
    from tsdecode.configs import heuristic_config

    def splits(b, n, **kw):
        shape = make_shape(batch_size=b, kv_len=n, kv_dtype=torch.float8_e4m3fn, **kw)
        return heuristic_config(shape, 132).num_kv_splits

    assert splits(128, 2048) == 1  # the rule's 2 splits: 1.29 waves; 1 split: one wave 65% full
    assert splits(128, 4096) == 1  # the rule's 4: 2.59 waves (last 59% full)
    assert splits(112, 2048, num_qo_heads=64, num_kv_heads=8) == 1  # G=8: 896 programs
    assert splits(32, 4096, num_qo_heads=32, num_kv_heads=32) == 1  # MHA: 1024 programs
    assert splits(256, 2048) == 2  # 1 split: 1.29 waves; 2: 2.59, the lowest cost
    assert splits(224, 4096) == 3  # 1792 programs: 1.13, 2.26, 3.39 waves; 3 the lowest cost
    # The rule's count where its last wave is at least 60% full or it fits one wave.
    assert splits(192, 3072) == 3  # 2.91 waves
    assert splits(256, 4096) == 3  # 3.88 waves
    assert splits(96, 2048) == 2  # 1536 programs: one wave
    assert splits(40, 2048, num_qo_heads=32, num_kv_heads=32) == 2  # 2560: 1.62 waves
    assert splits(512, 2048) == 1
    assert splits(128, 4097) == 4  # past 4k: the ~46 rule capped at L / 1024


def test_heuristic_fp8_caches_below_4_programs_per_sm_take_lean_programs_at_about_8_per_sm():
    """fp8 cache, < 4 B*Hkv programs per SM, <= 16 rows, D <= 128: 16-token tiles at D=128 (32 at
    D=64), 1 warp, 5 stages, splits for ~8 programs per SM (at most one a K/V tile); more rows
    or D=256 keep the 64-token rule, a 16-bit cache its lean rule."""
    from tsdecode.configs import heuristic_config

    def config(b, n, kv=torch.float8_e4m3fn, **kw):
        return heuristic_config(make_shape(batch_size=b, kv_len=n, kv_dtype=kv, **kw), 132)

    c = config(8, 8192)  # 64 programs: round(8 * 132 / 64) = 16 splits
    assert (c.block_n, c.num_warps, c.num_stages, c.num_kv_splits) == (16, 1, 5, 16)
    assert config(1, 131072).num_kv_splits == 132
    assert config(1, 1024).num_kv_splits == 64  # one 16-token tile a split
    assert config(48, 4096).num_kv_splits == 3  # 384 programs: round(2.75)
    assert config(64, 8192).num_kv_splits == 2  # 512 programs, 3.9 per SM
    assert config(16, 2048, num_qo_heads=32, num_kv_heads=32).num_kv_splits == 2
    assert config(8, 8192, head_dim=64).block_n == 32
    assert config(8, 8192, head_dim=256).num_warps == 4  # D = 256: the 64-token rule
    assert config(8, 8192, num_qo_heads=256, num_kv_heads=8).num_warps == 4  # 32 rows
    assert config(8, 8192, kv=torch.bfloat16).num_stages == 3  # the 16-bit lean rule


def test_heuristic_config_is_valid_on_any_gpu_and_shape():
    """The heuristic's rules count programs per SM; on every SM count (1 to 1000) and shape it
    returns a config inside the config space (the split bound included: B*Hkv = 1 on a 132-SM
    GPU asked for 1056 splits) with no more splits than the longest request has tiles."""
    from tsdecode.configs import MAX_NUM_KV_SPLITS, heuristic_config, num_kv_tiles

    for num_sms in (1, 8, 108, 114, 128, 129, 132, 148, 170, 256, 1000):
        for b, hq, hkv in ((1, 8, 1), (1, 32, 8), (2, 64, 1), (3, 28, 4), (64, 32, 8), (4096, 32, 32)):
            for kv_len in (1, 16, 1000, 1 << 20):
                for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
                    for head_dim in (64, 128, 256):
                        shape = make_shape(batch_size=b, kv_len=kv_len, num_qo_heads=hq, num_kv_heads=hkv,
                                           kv_dtype=kv_dtype, head_dim=head_dim)
                        config = heuristic_config(shape, num_sms)
                        config.validate()
                        assert config.num_kv_splits <= min(MAX_NUM_KV_SPLITS, num_kv_tiles(kv_len, config.block_n))
    one_head = make_shape(batch_size=1, kv_len=1 << 20, num_qo_heads=4, num_kv_heads=1)
    assert heuristic_config(one_head, 132).num_kv_splits == MAX_NUM_KV_SPLITS  # 8 * 132 = 1056 asked
    assert heuristic_config(one_head, 128).num_kv_splits == 1024  # 8 * 128: the bound itself


def test_lean_rules_take_only_the_programs_that_fit_an_sm():
    """On a GPU with 100 KiB of shared memory a SM (L40S, RTX 4090: 7 lean 3-stage programs fit
    at D=128 with a 16-bit cache, not 12) the lean rule splits for 7 programs per SM, rounded
    down, instead of ~8 (which would leave a few programs for a second wave); the fp8 rule's
    programs take less shared memory (9 fit) and keep ~8; with the H100/H200 default nothing
    changes."""
    from tsdecode.configs import (
        SHARED_MEMORY_PER_SM, config_from_table_hit, device_shared_memory_per_sm, heuristic_config,
        resident_programs_per_sm,
    )

    small = 102400
    for kv, stages, fit in ((torch.bfloat16, 3, 7), (torch.float8_e4m3fn, 5, 9)):
        shape = make_shape(batch_size=1, kv_len=32768, kv_dtype=kv)
        lean = KernelConfig(block_n=16, block_m=16, num_kv_splits=2, num_warps=1, num_stages=stages)
        assert resident_programs_per_sm(lean, shape, small) == fit
        assert resident_programs_per_sm(lean, shape) == 12
        capped = heuristic_config(shape, 142, small)
        assert (capped.block_n, capped.num_warps, capped.num_stages) == (16, 1, stages)
        expected = 7 * 142 // 8 if fit < 8 else 142  # bf16: 992 programs, 6.99 per SM
        assert capped.num_kv_splits == expected
        assert heuristic_config(shape, 142).num_kv_splits == 142  # round(8 * 142 / 8)
        assert heuristic_config(shape, 132, SHARED_MEMORY_PER_SM) == heuristic_config(shape, 132)
    # Ragged lengths (48 programs): H200 22 splits x 1.5 = 33 (1584 programs: 12 a SM fit); at 7 a
    # SM, 19 splits that 1.5x would push past one wave, and too short for 4 waves: kept.
    ragged = make_shape(batch_size=6, kv_len=8192, kv_len_spread=1.5)
    assert select_config(ragged, CPU).kernel_config.num_kv_splits == 33
    assert config_from_table_hit(ragged, None, 132, small).kernel_config.num_kv_splits == 19
    assert device_shared_memory_per_sm(CPU) == SHARED_MEMORY_PER_SM


def _bucket_shape(class_key: str, bucket: tuple[int, int], entry: TableEntry) -> ProblemShape:
    """The uniform-length shape a shipped entry was tuned at: its class key, the batch size it
    was measured at and the bucket's K/V length (the presets' lengths are powers of two). A
    windowed class key does not record the window: the heuristic does not look at it."""
    fields = dict(part.split("=", 1) for part in class_key.split(","))
    assert fields["sq"].isdigit() and fields["mask"] in ("dense", "causal", "windowed"), (
        f"{class_key}: extend _bucket_shape to this query mode / mask")
    hkv = int(fields["hkv"])
    return ProblemShape(
        batch_size=entry.tuned_batch_size or bucket[0], num_qo_heads=int(fields["g"]) * hkv, num_kv_heads=hkv,
        head_dim=int(fields["d"]), page_size=int(fields["p"]), max_kv_len=bucket[1],
        max_seq_len_q=int(fields["sq"]), mask_kind=fields["mask"],
        q_dtype=getattr(torch, fields["q"]), kv_dtype=getattr(torch, fields["kv"]),
        o_dtype=getattr(torch, fields["o"]),
    )


@pytest.mark.parametrize("path", sorted((REPO / "tuned_configs").glob("*.json")), ids=lambda p: p.name)
def test_shipped_entries_were_timed_against_todays_heuristic(path):
    """Every shipped entry records the default it beat (or kept): it must be what
    heuristic_config gives that bucket's shape today, else "tuned never slower than the
    heuristic" is unchecked for it and the class needs re-tuning after a heuristic change."""
    from tsdecode.configs import heuristic_config

    table = tables.load_table(path)
    assert table is not None and table.entries
    # Shared memory per SM by compute capability (tables do not record it; the heuristic's
    # residency model depends on it): add the GPU of a new shipped table here.
    shared_memory = {(9, 0): 233472}.get(tuple(table.device.compute_capability))
    assert shared_memory, f"{path.name}: add shared memory per SM of {table.device.describe()}"
    stale = []
    for class_key, buckets in table.entries.items():
        for bucket, entry in buckets.items():
            shape = _bucket_shape(class_key, bucket, entry)
            today = heuristic_config(shape, table.device.sm_count, shared_memory)
            if entry.default_config != today:
                stale.append(f"{class_key} {bucket}: recorded {entry.default_config}, today {today}")
    assert not stale, "\n".join(stale)


def test_heuristic_wide_rows_take_lean_tiles_where_a_split_walks_more_than_4():
    """17-32 query rows a KV head (block_m = 32), 16-bit cache, D <= 128: the rule's split count
    on 1-warp 5-stage tiles of 16 tokens at D=128 (32 at D=64) where a split walks more than 4 of
    them; 4 or fewer tiles a split, an fp8 cache, D=256, 16 rows or 64 keep the previous tiles."""
    from tsdecode.configs import heuristic_config

    def config(b, n, **kw):
        return heuristic_config(make_shape(batch_size=b, kv_len=n, **kw), 132)

    g32 = dict(num_qo_heads=64, num_kv_heads=2)
    for b, n, splits in ((1, 32768, 264), (8, 8192, 33), (32, 1024, 8), (128, 1024, 2), (128, 32768, 2)):
        c = config(b, n, **g32)
        assert (c.block_n, c.block_m, c.num_warps, c.num_stages, c.num_kv_splits) == (16, 32, 1, 5, splits)
    for b, n in ((1, 1024), (1, 8192), (8, 1024)):  # 64 tokens a split
        c = config(b, n, **g32)
        assert (c.block_n, c.block_m, c.num_warps, c.num_stages) == (64, 32, 4, 2)
    c = config(8, 8192, mask_kind="causal", max_seq_len_q=8)  # G=4, 8 query tokens
    assert (c.block_n, c.block_m, c.num_warps, c.num_stages) == (16, 32, 1, 5)
    assert config(32, 8192, head_dim=64, **g32).block_n == 32
    assert config(32, 8192, head_dim=256, **g32).num_warps == 4
    assert config(32, 8192, kv_dtype=torch.float8_e4m3fn, **g32).block_m == 32
    assert config(8, 8192, kv_dtype=torch.float8_e4m3fn, **g32).num_warps == 4  # fp8: unchanged
    assert config(8, 8192, num_qo_heads=128, num_kv_heads=2).num_warps == 4  # 64 rows
    assert config(8, 8192, num_qo_heads=64, num_kv_heads=4).block_m == 16  # 16 rows: lean rule


def test_heuristic_lean_programs_from_5_rows_take_5_stages_at_about_4_per_sm():
    """16-bit cache, < 3 B*Hkv programs per SM, 5-16 query rows a KV head, D=128: the lean tiles
    with 5 stages and splits for ~4 programs per SM; 1-4 rows keep 3 stages at ~8 per SM. D <= 64
    has its own rule (``test_heuristic_lean_programs_at_d64_take_16_token_tiles_5_stages``)."""
    from tsdecode.configs import heuristic_config

    def config(b, n, **kw):
        return heuristic_config(make_shape(batch_size=b, kv_len=n, **kw), 132)

    c = config(4, 4096, num_qo_heads=64, num_kv_heads=8)  # 32 programs: round(4 * 132 / 32)
    assert (c.block_n, c.num_warps, c.num_stages, c.num_kv_splits) == (16, 1, 5, 16)
    assert config(1, 8192, num_qo_heads=64, num_kv_heads=4).num_kv_splits == 132
    assert config(16, 16384, num_qo_heads=8, num_kv_heads=1).num_kv_splits == 33
    assert config(8, 8192, max_seq_len_q=2, mask_kind="causal").num_stages == 5  # G=4, SQ=2
    c = config(8, 8192)  # G=4: 4 rows
    assert (c.num_stages, c.num_kv_splits) == (3, 16)
    assert config(8, 8192, num_qo_heads=32, num_kv_heads=32).num_stages == 3  # MHA
    c = config(8, 8192, head_dim=96, num_qo_heads=64, num_kv_heads=8)  # block_d 128: this rule
    assert (c.block_n, c.num_warps, c.num_stages, c.num_kv_splits) == (16, 1, 5, 8)
    c = config(4, 4096, head_dim=64, num_qo_heads=64, num_kv_heads=8)  # D=64: ~8 per SM, not ~4
    assert (c.block_n, c.num_warps, c.num_stages, c.num_kv_splits) == (16, 1, 5, 33)


def test_heuristic_lean_programs_at_d64_take_16_token_tiles_5_stages():
    """16-bit cache, < 3 B*Hkv programs per SM, <= 16 rows, head dims up to 64 (block_d <= 64):
    16-token tiles, 1 warp, 5 stages and splits for ~8 programs per SM at every row count (not
    32-token tiles with 3 stages, nor ~4 per SM from 5 rows); at most one split a tile, and no
    more than fit an SM where fewer than 8 do. D=128 keeps its rules."""
    from tsdecode.configs import heuristic_config

    def config(b, n, sm=None, **kw):
        return heuristic_config(make_shape(batch_size=b, kv_len=n, **kw), 132, *([sm] if sm else []))

    def knobs(c):
        return (c.block_n, c.num_warps, c.num_stages, c.num_kv_splits)

    d64 = dict(head_dim=64)
    assert knobs(config(2, 4096, **d64)) == (16, 1, 5, 66)  # G=4, 16 programs: round(8 * 132 / 16)
    assert knobs(config(4, 8192, num_qo_heads=64, **d64)) == (16, 1, 5, 33)  # G=8, 32 programs
    assert knobs(config(3, 8192, num_qo_heads=128, **d64)) == (16, 1, 5, 44)  # G=16, 24 programs
    assert knobs(config(4, 8192, num_qo_heads=32, num_kv_heads=32, **d64)) == (16, 1, 5, 8)  # MHA
    assert knobs(config(2, 4096, head_dim=32)) == (16, 1, 5, 66)  # D=32: 16 tokens, not 64
    assert knobs(config(1, 1024, **d64)) == (16, 1, 5, 64)  # 132 asked, 64 tiles of 16
    assert config(2, 4096, **d64).block_m == 16
    # 100 KiB a SM: 9 such programs fit (10248 bytes + 1 KiB each): ~8 a SM as on the H200; at
    # 80 KiB 7 fit, rounded down: 7 * 132 // 16.
    assert knobs(config(2, 4096, sm=100 * 1024, **d64)) == (16, 1, 5, 66)
    assert knobs(config(2, 4096, sm=80 * 1024, **d64)) == (16, 1, 5, 57)
    # D=128 (and D=96, block_d 128): 16-token tiles with 3 stages at ~8 per SM at 4 rows.
    assert knobs(config(2, 4096)) == (16, 1, 3, 66)
    assert knobs(config(2, 4096, head_dim=96)) == (16, 1, 3, 66)
    # Not this rule: fp8 keeps 32-token tiles at D=64, 17+ rows their own tiles.
    assert config(2, 4096, kv_dtype=torch.float8_e4m3fn, **d64).block_n == 32
    assert config(2, 4096, num_qo_heads=256, **d64).block_m == 32


def test_heuristic_batch_lean_takes_one_split_of_lean_tiles_in_whole_waves():
    """16-bit cache, <= 16 rows (block_m 16), D <= 128, K/V of at most 4096 tokens, from 3 (the
    lean rule's limit) B*Hkv programs per SM up to one wave (8 a SM at D=128 on an H200: the
    direct-output kernel's 182 registers) or, at D=128, up to 4 waves whose last is at least 7/8
    full: one split of 16-token tiles, 1 warp, 5 stages. Other wave counts, K/V of 4097+ tokens,
    an fp8 cache, 17+ rows and D=256 keep the previous rules; ragged scaling still applies."""
    from tsdecode.configs import config_from_table_hit, heuristic_config, resident_programs_per_sm

    def config(b, n, sm=None, **kw):
        return heuristic_config(make_shape(batch_size=b, kv_len=n, **kw), 132, *([sm] if sm else []))

    def knobs(c):
        return (c.block_n, c.num_warps, c.num_stages, c.num_kv_splits)

    batch_lean = (16, 1, 5, 1)
    c = config(128, 1024)  # 1024 programs, 7.8 per SM
    assert knobs(c) == batch_lean and c.block_m == 16
    assert knobs(config(128, 1024, head_dim=64)) == batch_lean
    assert knobs(config(132, 4096)) == batch_lean  # 1056 = 8 per SM, K/V 4096: both bounds held
    assert knobs(config(99, 2048, num_qo_heads=16, num_kv_heads=4)) == batch_lean  # 396: 3 per SM
    # 392 programs (< 3 per SM): the lean rule, round(8 * 132 / 392) splits at 3 stages.
    assert knobs(config(98, 2048, num_qo_heads=16, num_kv_heads=4)) == (16, 1, 3, 3)
    # Past one wave of 8 a SM with a last wave under 7/8 full: the multi-wave rule's 64-token
    # tiles at 4 warps (16 tiles: 1 split).
    assert knobs(config(133, 1024)) == (64, 4, 2, 1)  # 1064 programs: 1.01 waves
    assert knobs(config(160, 1024)) == (64, 4, 2, 1)  # 1280 programs: 1.21 waves
    assert knobs(config(247, 1024)) == (64, 4, 2, 1)  # 1976: 1.87 waves, the last 87% full
    # ... and from 7/8 full up to 4 waves: this rule.
    assert knobs(config(248, 1024)) == batch_lean  # 1984: the last wave 88% full
    assert knobs(config(256, 2048)) == batch_lean  # 2048: 1.94 waves
    assert knobs(config(64, 2048, num_qo_heads=32, num_kv_heads=32)) == batch_lean  # MHA, 2048
    assert knobs(config(528, 1024)) == batch_lean  # 4224: 4.0 waves
    assert knobs(config(529, 1024)) == (64, 4, 2, 1)  # 4232: past 4 waves
    assert knobs(config(256, 4097))[:2] == (64, 4)  # K/V past 4096 tokens
    # D=64 stops at one wave (20 a SM: 2640 programs): past it, the multi-wave rule.
    assert knobs(config(330, 1024, head_dim=64)) == batch_lean
    assert knobs(config(640, 1024, head_dim=64))[:2] == (64, 4)  # 1.94 waves of 20
    # K/V of 4097+ tokens: the multi-wave rule (1.55 -> 3.1 -> 4.65 waves), and from 8k the
    # long-K/V rule.
    assert knobs(config(128, 4097)) == (64, 4, 2, 3)
    assert knobs(config(128, 8192)) == (32, 4, 2, 2)
    # fp8 caches keep their rules: ~46 per SM capped at L / 1024 (up to 4k, a mostly empty last
    # wave mended) from 4 per SM, ~8 per SM below.
    assert knobs(config(128, 4096, kv_dtype=torch.float8_e4m3fn)) == (16, 1, 5, 1)
    assert knobs(config(60, 4096, kv_dtype=torch.float8_e4m3fn)) == (16, 1, 5, 2)  # 480 programs
    # 17-32 rows (block_m 32) where a split walks <= 4 tiles, and 64 rows: the previous tiles;
    # 16 rows at the same shape take this rule.
    c = config(128, 64, num_qo_heads=256)  # G=32
    assert (c.block_m, *knobs(c)) == (32, 64, 4, 2, 1)
    assert knobs(config(128, 64, num_qo_heads=128)) == batch_lean  # G=16
    c = config(128, 1024, num_qo_heads=64, max_seq_len_q=8, mask_kind="causal")  # 64 rows
    assert (c.block_m, c.num_warps) == (64, 4)
    assert knobs(config(99, 1024, head_dim=256)) == (32, 4, 2, 2)  # 792 programs: 6 per SM would fit
    # 100 KiB a SM: 4 such programs fit at D=128 and 9 at D=64 (a wave of 528 and 1188).
    small = 100 * 1024
    lean = KernelConfig(block_n=16, block_m=16, num_kv_splits=1, num_warps=1, num_stages=5)
    assert resident_programs_per_sm(lean, make_shape(batch_size=1, kv_len=1024), small) == 4
    assert resident_programs_per_sm(lean, make_shape(batch_size=1, kv_len=1024, head_dim=64), small) == 9
    assert knobs(config(66, 1024, sm=small)) == batch_lean  # 528 programs: 4 per SM
    assert knobs(config(99, 1024, sm=small)) == (64, 4, 2, 1)  # 792 programs: 1.5 waves
    assert knobs(config(99, 1024)) == batch_lean
    assert knobs(config(148, 1024, sm=small, head_dim=64)) == batch_lean  # 1184 <= 9 * 132
    assert knobs(config(150, 1024, sm=small, head_dim=64)) == (64, 4, 2, 1)  # 1200: 9.1 per SM
    assert knobs(config(150, 1024, head_dim=64)) == batch_lean
    # Ragged lengths: the one split grows by the spread where the programs times the spread fit
    # one wave of the split kernel's 10 per SM (768 * 1.5 <= 1320; rounding up to 2 splits
    # passes it: 1536 programs).
    ragged = make_shape(batch_size=96, kv_len=4096, kv_len_spread=1.5)
    assert knobs(heuristic_config(ragged, 132)) == batch_lean
    assert knobs(config_from_table_hit(ragged, None, 132).kernel_config) == (16, 1, 5, 2)


def test_heuristic_batch_lean_at_d64_goes_past_8_per_sm_and_past_4k_tokens():
    """D <= 64: the batch-lean tiles up to as many B*Hkv programs as fit an SM at once (20 on an
    H200: shared memory) with one split up to 4096 tokens; past it up to 8 per SM, with
    ceil(8 * SMs / programs) splits capped at what fits an SM, and one split from there up to one
    wave. D=128 keeps the 4096-token bound and its own wave rule."""
    from tsdecode.configs import heuristic_config

    def knobs(b, n, **kw):
        c = heuristic_config(make_shape(batch_size=b, kv_len=n, **kw), 132)
        return (c.block_n, c.num_warps, c.num_stages, c.num_kv_splits)

    d64 = dict(head_dim=64)
    assert knobs(256, 1024, **d64) == (16, 1, 5, 1)  # 2048 programs, 15.5 per SM
    assert knobs(330, 2048, **d64) == (16, 1, 5, 1)  # 2640 = 20 * 132
    assert knobs(331, 2048, **d64)[:2] == (64, 4)  # 2648: past what fits
    assert knobs(160, 1024)[:2] == (64, 4)  # D=128: 1.21 waves of 8
    assert knobs(64, 8192, **d64) == (16, 1, 5, 3)  # 512 programs: ceil(1056 / 512)
    assert knobs(112, 12288, **d64) == (16, 1, 5, 2)  # 896: ceil(1056 / 896)
    assert knobs(132, 32768, **d64) == (16, 1, 5, 1)  # 1056: exactly 8 per SM
    assert knobs(200, 6144, num_qo_heads=14, num_kv_heads=2, **d64) == (16, 1, 5, 3)  # 400
    assert knobs(64, 8192)[1] == 4  # D=128 past 4k: the previous rules (4 warps)
    # Past 4k and past 8 per SM: one split up to one wave (20 a SM), then the previous rules.
    assert knobs(133, 8192, **d64) == (16, 1, 5, 1)  # 1064 programs
    assert knobs(200, 32768, **d64) == (16, 1, 5, 1)  # 1600
    assert knobs(330, 8192, **d64) == (16, 1, 5, 1)  # 2640 = 20 * 132
    assert knobs(331, 8192, **d64)[:2] == (32, 4)  # 2648: past one wave
    # ... and the splits never take the programs past what fits an SM at once: 80 KiB a SM
    # fits 7 (924 on 132 SMs), 400 base programs take 2 splits, not ceil(1056 / 400) = 3.
    c = heuristic_config(make_shape(batch_size=50, kv_len=4097, **d64), 132, 80 * 1024)
    assert (c.block_n, c.num_warps, c.num_stages, c.num_kv_splits) == (16, 1, 5, 2)
    c = heuristic_config(make_shape(batch_size=100, kv_len=4097, **d64), 132, 132 * 1024)  # 11 fit
    assert (c.block_n, c.num_kv_splits) == (16, 1)  # 800 programs: 1600 would not fit 1452
    # An fp8 cache at D=64 keeps its own rule.
    assert knobs(64, 8192, kv_dtype=torch.float8_e4m3fn, **d64)[3] != 3


def test_residency_model_at_d64_takes_its_own_measurements():
    """D=64 configs take their own measured registers and shared memory (the lean tiles: 80-92
    registers, 24 or 20 a SM by registers; 10248 bytes at 5 stages: 20 by shared memory); D=32
    takes D=64's; a smaller GPU's shared memory bounds them."""
    from tsdecode.configs import resident_programs_per_sm

    def resident(block_n, warps, stages, head_dim, smem=None, splits=2):
        c = KernelConfig(block_n=block_n, block_m=16, num_kv_splits=splits, num_warps=warps,
                         num_stages=stages)
        shape = make_shape(batch_size=1, kv_len=1024, head_dim=head_dim)
        return resident_programs_per_sm(c, shape, *([smem] if smem else []))

    assert resident(16, 1, 3, 64) == 20 and resident(16, 1, 3, 128) == 12
    assert resident(16, 1, 5, 64) == 233472 // (10248 + 1024) == 20
    assert resident(16, 1, 5, 64, splits=1) == 20
    assert resident(16, 1, 5, 32) == resident(16, 1, 5, 64)
    assert resident(16, 1, 5, 64, 100 * 1024) == 100 * 1024 // (10248 + 1024) == 9
