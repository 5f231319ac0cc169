"""The tuned-table reader (``tsdecode.config.tables``) and how a plan uses what it finds.

Format validation, class keys and buckets, file names, the search order, exact-bucket lookup,
the float16/bfloat16 twin class, device matching, bad and stale files (one warning, never a
crash, never a wrong result), table configs adjusted to the planned shape, the shipped table,
and the shipped tables in an installed wheel. Writing tables is the tuner's
(``tuner/table_writer.py``, tested in ``tests/test_table_writer.py``); here files are written as
plain JSON.

Lookup is by exact (batch_size, kv_len) bucket on purpose: a neighbouring bucket's winner
either equals the heuristic's pick or was faster only at its own bucket, so a shape with no
entry of its own takes the heuristic (there are no nearest-bucket tests).
"""

from __future__ import annotations

import copy
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
import types
from pathlib import Path

import pytest
import torch
import triton

import tsdecode
from tsdecode import device as D
from tsdecode.config import table_format, tables
from tsdecode.config.heuristic import heuristic_config
from tsdecode.config.select import select_config
from tsdecode.config.space import KernelConfig, ProblemShape
from tsdecode.config.table_format import TableEntry, TableFormatError
from tsdecode.device import DeviceProperties, set_override
from tsdecode.reference import reference_decode

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "tuned_configs"
H200 = DeviceProperties("NVIDIA H200", 132, (9, 0), 150_109_880_320)
H200_NVL = DeviceProperties("NVIDIA H200 NVL", 132, (9, 0), 150_109_880_320)
H100_PCIE = DeviceProperties("NVIDIA H100 PCIe", 114, (9, 0), 85_029_158_912)
KEY = "q=bfloat16,kv=bfloat16,o=bfloat16,d=128,g=4,hkv=8,p=16,sq=1,mask=dense"
FP16 = dict(q_dtype=torch.float16, kv_dtype=torch.float16, o_dtype=torch.float16)


def make_shape(batch_size=48, kv_len=6000, **kw) -> ProblemShape:
    args = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    args.update(kw)
    return ProblemShape(batch_size=batch_size, max_kv_len=kv_len, **args)


def record(bucket, config: KernelConfig, default: KernelConfig | None = None, **extra) -> dict:
    """One bucket's JSON record: ``config`` timed 10 us against ``default`` 12.5 us."""
    return {"batch_size": bucket[0], "kv_len": bucket[1], "kernel_config": config.to_dict(), "time_us": 10.0,
            "bandwidth_gbs": 3000.0, "fraction_of_copy": 0.75, "default_config": (default or KernelConfig()).to_dict(),
            "default_time_us": 12.5, "default_bandwidth_gbs": 2400.0, **extra}


def table_data(device=H200, entries: dict | None = None, shape=None, num_warps=4, **top) -> dict:
    """A valid table as decoded JSON; by default one entry (``num_warps``) in ``shape``'s bucket."""
    if entries is None:
        shape = shape or make_shape()
        bucket = tables.bucket_of(shape.batch_size, shape.max_kv_len)
        entries = {tables.problem_class_key(shape): [record(bucket, KernelConfig(num_warps=num_warps))]}
    data = {"format_version": table_format.FORMAT_VERSION, "device": device.to_dict(),
            "triton_version": triton.__version__, "torch_version": torch.__version__,
            "kernel_hash": tables.kernel_source_hash(), "tuner_settings": {"trials": 10},
            "created": "2026-12-01T10:00:00+00:00", "updated": "2026-12-02T10:00:00+00:00", "entries": entries}
    data.update(top)
    return data


def write(folder: Path, device=H200, data: dict | None = None, **kw) -> Path:
    """Write a table (``table_data(device, **kw)`` unless ``data``) as folder/<device file>."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / tables.table_filename(device.name)
    path.write_text(json.dumps(table_data(device, **kw) if data is None else data))
    return path


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("tsdecode") and r.levelno >= logging.WARNING]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch, caplog):
    """No real user cache, shipped tables, env path, device override or parsed-table state."""
    monkeypatch.delenv(tables.CONFIG_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(tables, "shipped_config_dir", lambda: shipped)
    caplog.set_level(logging.WARNING, logger="tsdecode")
    tables.clear_cache()
    yield
    tables.set_config_path(None)
    set_override(None)
    tables.clear_cache()


@pytest.fixture
def settled(monkeypatch):
    """The reader's clock a minute ahead: every file and folder written counts as settled (kept
    by the cache; a ctime cannot be set back)."""
    monkeypatch.setattr(tables, "time", types.SimpleNamespace(time_ns=lambda: time.time_ns() + 60 * 10**9))


@pytest.fixture
def user_dir(tmp_path) -> Path:
    return tmp_path / "xdg" / "tsdecode" / "tuned_configs"


def warps(hit) -> int | None:
    return None if hit is None else hit.kernel_config.num_warps


# ------------------------------------------------------------------------------------------------
# Keys, buckets, file names
# ------------------------------------------------------------------------------------------------


def test_problem_class_key_and_query_modes():
    assert tables.problem_class_key(make_shape()) == KEY
    fp8 = make_shape(q_dtype=torch.float16, kv_dtype=torch.float8_e4m3fn, o_dtype=torch.float32,
                     mask_kind="windowed", window_left=100, max_seq_len_q=3)
    assert tables.problem_class_key(fp8) == (
        "q=float16,kv=float8_e4m3fn,o=float32,d=128,g=4,hkv=8,p=16,sq=4,mask=windowed")
    modes = {sq: tables.query_mode(make_shape(max_seq_len_q=sq)) for sq in (1, 2, 3, 8, 9, 16, 40)}
    assert modes == {1: "1", 2: "2", 3: "4", 8: "8", 9: "16+", 16: "16+", 40: "16+"}
    assert tables.query_mode(make_shape(max_seq_len_q=5, packed=True)) == "packed"
    assert tables.problem_class_key(make_shape(head_dim=96, num_qo_heads=56, page_size=1)) == (
        "q=bfloat16,kv=bfloat16,o=bfloat16,d=96,g=7,hkv=8,p=1,sq=1,mask=dense")


def test_buckets_are_powers_of_two_rounded_up():
    assert tables.bucket_of(48, 6000) == (64, 8192)
    assert tables.bucket_of(1, 1) == (1, 1)
    assert tables.bucket_of(64, 8192) == (64, 8192)
    assert tables.bucket_of(33, 8193) == (64, 16384)
    assert tables.bucket_of(32, 4097) == (32, 8192)


def test_twin_class_key_swaps_float16_and_bfloat16():
    fp16 = tables.problem_class_key(make_shape(**FP16))
    assert tables.twin_class_key(KEY) == fp16 and tables.twin_class_key(fp16) == KEY
    mixed = tables.problem_class_key(make_shape(kv_dtype=torch.float8_e4m3fn, o_dtype=torch.float32))
    assert tables.twin_class_key(mixed).startswith("q=float16,kv=float8_e4m3fn,o=float32,")
    none16 = tables.problem_class_key(make_shape(q_dtype=torch.float8_e4m3fn, kv_dtype=torch.float8_e4m3fn,
                                                 o_dtype=torch.float32))
    assert tables.twin_class_key(none16) is None


@pytest.mark.parametrize("name, filename", [
    ("NVIDIA H200", "NVIDIA_H200.json"),
    ("cpu (Triton interpreter)", "cpu_Triton_interpreter.json"),
    ("NVIDIA H100 80GB HBM3", "NVIDIA_H100_80GB_HBM3.json"),
    ("  NVIDIA A100-SXM4-80GB ", "NVIDIA_A100_SXM4_80GB.json"),
])
def test_table_filename(name, filename):
    assert tables.table_filename(name) == filename


# ------------------------------------------------------------------------------------------------
# Format
# ------------------------------------------------------------------------------------------------


def test_a_valid_table_parses(tmp_path, settled):
    path = write(tmp_path)
    table = tables.load_table(path)
    assert table.device == H200 and table.path == str(path)
    assert table.stale == () and table.skipped == ()
    assert table.tuner_settings == {"trials": 10} and table.created.startswith("2026-12-01")
    entry = table.entries[KEY][(64, 8192)]
    assert entry == TableEntry(KernelConfig(num_warps=4), 10.0, 3000.0, 0.75, KernelConfig(), 12.5, 2400.0)
    assert entry.speedup == pytest.approx(1.25)
    assert TableEntry.from_dict(entry.to_dict()) == entry
    assert tables.load_table(path) is table  # parsed once
    assert len(tables.kernel_source_hash()) == 16


def test_shipped_tables_are_current_for_todays_kernel():
    """A kernel change moves each shipped table's ``kernel_hash`` (docs/config-tables.md says when
    that needs no re-tune) or re-tunes it: a stale shipped table would warn on every GPU it serves."""
    shipped = sorted((REPO / "tuned_configs").glob("*.json"))  # this module's fixture hides the package's
    assert shipped
    for path in shipped:
        data = json.loads(path.read_text())
        assert data["kernel_hash"] == tables.kernel_source_hash(), path.name


def test_the_shipped_h100_table_holds_some_buckets_and_the_h200s_serves_the_rest():
    """An H100 SXM plan takes its own shipped table's entry where it has one (a few buckets), else
    the H200's (same compute capability and SM count), not the heuristic."""
    h100 = DeviceProperties("NVIDIA H100 80GB HBM3", 132, (9, 0), 85_017_493_504)
    fp8 = make_shape(batch_size=128, kv_len=8192, kv_dtype=torch.float8_e4m3fn)
    own = tables.load_table(SHIPPED / "NVIDIA_H100_80GB_HBM3.json", h100)
    assert own is not None and not own.stale and not own.skipped
    held = own.entries[tables.problem_class_key(fp8)]
    assert (128, 8192) in held and len(held) < 14
    hit = tables.lookup(fp8, h100, config_dir=SHIPPED)
    assert hit.table_path == str(SHIPPED / "NVIDIA_H100_80GB_HBM3.json")
    assert hit.kernel_config == held[(128, 8192)].kernel_config
    bf16, fp8_elsewhere = make_shape(batch_size=128, kv_len=8192), dataclasses.replace(fp8, batch_size=8)
    for shape in (bf16, fp8_elsewhere):
        hit = tables.lookup(shape, h100, config_dir=SHIPPED)
        assert hit.table_path == str(SHIPPED / "NVIDIA_H200.json"), shape


def _set(path: tuple, value):
    """A mutation of decoded JSON: data[path...] = value (``DELETE`` removes the key)."""
    def mutate(data):
        target = data
        for part in path[:-1]:
            target = target[part]
        if value is DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return mutate


DELETE = object()
R0 = ("entries", KEY, 0)
# (mutation, text the error must contain: the field's name)
FORMAT_ERRORS = {
    "format_version": (_set(("format_version",), 2), "format_version"),
    "format_version float": (_set(("format_version",), 1.0), "format_version"),
    "format_version missing": (_set(("format_version",), DELETE), "format_version"),
    "device missing": (_set(("device",), DELETE), "device"),
    "device not an object": (_set(("device",), "H200"), "device"),
    "device.name": (_set(("device", "name"), ""), "device.name"),
    "device.sm_count": (_set(("device", "sm_count"), 0), "device.sm_count"),
    "device.compute_capability": (_set(("device", "compute_capability"), [9]), "device.compute_capability"),
    "device.total_memory": (_set(("device", "total_memory"), -1), "device.total_memory"),
    "device unknown field": (_set(("device", "clock"), 1), "clock"),
    "triton_version": (_set(("triton_version",), ""), "triton_version"),
    "torch_version": (_set(("torch_version",), 2), "torch_version"),
    "kernel_hash": (_set(("kernel_hash",), "XYZ"), "kernel_hash"),
    "tuner_settings": (_set(("tuner_settings",), []), "tuner_settings"),
    "created": (_set(("created",), "yesterday"), "created"),
    "updated": (_set(("updated",), None), "updated"),
    "entries": (_set(("entries",), []), "entries"),
    "unknown top field": (_set(("comment",), "hi"), "comment"),
    "class key": (lambda d: d["entries"].update({"d=128": d["entries"].pop(KEY)}), "d=128"),
    "bad mask in key": (lambda d: d["entries"].update({KEY.replace("dense", "sparse"): d["entries"].pop(KEY)}),
                        "sparse"),
    "empty bucket list": (_set(("entries", KEY), []), KEY),
    "record not an object": (_set(R0, 5), KEY),
    "batch_size": (_set(R0 + ("batch_size",), 48), "batch_size"),
    "kv_len": (_set(R0 + ("kv_len",), 0), "kv_len"),
    "kernel_config": (_set(R0 + ("kernel_config",), "fast"), "kernel_config"),
    "kernel_config value": (_set(R0 + ("kernel_config", "block_n"), 1.5), "kernel_config"),
    "time_us": (_set(R0 + ("time_us",), "fast"), "time_us"),
    "time_us negative": (_set(R0 + ("time_us",), -1), "time_us"),
    "time_us zero": (_set(R0 + ("time_us",), 0), "time_us"),
    "time_us bool": (_set(R0 + ("time_us",), True), "time_us"),
    "time_us nan": (_set(R0 + ("time_us",), float("nan")), "time_us"),
    "time_us huge int": (_set(R0 + ("time_us",), 10**400), "time_us"),
    "bandwidth_gbs": (_set(R0 + ("bandwidth_gbs",), -3), "bandwidth_gbs"),
    "fraction_of_copy": (_set(R0 + ("fraction_of_copy",), "most"), "fraction_of_copy"),
    "default_config": (_set(R0 + ("default_config",), None), "default_config"),
    "default_time_us": (_set(R0 + ("default_time_us",), float("inf")), "default_time_us"),
    "default_bandwidth_gbs": (_set(R0 + ("default_bandwidth_gbs",), None), "default_bandwidth_gbs"),
    "tuned_batch_size": (_set(R0 + ("tuned_batch_size",), 0), "tuned_batch_size"),
    "record missing field": (_set(R0 + ("time_us",), DELETE), "time_us"),
    "record unknown field": (_set(R0 + ("note",), "x"), "note"),
    "duplicate bucket": (lambda d: d["entries"][KEY].append(copy.deepcopy(d["entries"][KEY][0])), "duplicate"),
}


@pytest.mark.parametrize("case", FORMAT_ERRORS)
def test_format_errors_name_the_field(case):
    mutate, field = FORMAT_ERRORS[case]
    data = table_data()
    table_format.validate_table_data(copy.deepcopy(data))  # valid before
    mutate(data)
    with pytest.raises(TableFormatError, match=None) as info:
        table_format.validate_table_data(data)
    assert field in str(info.value), str(info.value)
    assert len(str(info.value)) < 300


def test_a_table_that_is_not_an_object_is_a_format_error():
    for data in ([1, 2], "table", None, 3):
        with pytest.raises(TableFormatError, match="format_version|JSON object"):
            table_format.validate_table_data(data)


@pytest.mark.parametrize("value", [0, -2, 1.5, "3", None, True])
def test_tuned_batch_size_must_be_a_positive_int(value):
    data = table_data()
    data["entries"][KEY][0]["tuned_batch_size"] = value
    with pytest.raises(TableFormatError, match="tuned_batch_size"):
        table_format.validate_table_data(data)


# ------------------------------------------------------------------------------------------------
# Search order and lookup
# ------------------------------------------------------------------------------------------------


def test_search_order(tmp_path, user_dir, monkeypatch):
    """config_dir argument > set_config_path > $TSDECODE_CONFIG_DIR > user cache > shipped; the
    first table holding the class and bucket wins."""
    shape = make_shape()
    folders = {name: tmp_path / name for name in ("arg", "setpath", "env")}
    write(folders["arg"], num_warps=1)
    write(folders["setpath"], num_warps=2)
    write(folders["env"], num_warps=4)
    write(user_dir, num_warps=8)
    write(tables.shipped_config_dir(), num_warps=8, shape=make_shape(head_dim=64))  # d=64 only here
    tables.set_config_path(folders["setpath"])
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(folders["env"]))

    assert warps(tables.lookup(shape, H200, config_dir=folders["arg"])) == 1
    assert warps(tables.lookup(shape, H200)) == 2  # set_config_path beats the variable
    tables.set_config_path(None)
    hit = tables.lookup(shape, H200)
    assert warps(hit) == 4 and hit.table_path == str(folders["env"] / "NVIDIA_H200.json")
    monkeypatch.delenv(tables.CONFIG_DIR_ENV)
    assert tables.lookup(shape, H200).table_path == str(user_dir / "NVIDIA_H200.json")
    # the first table *with the class and bucket* wins: d=64 falls through to the shipped table
    hit = tables.lookup(make_shape(head_dim=64), H200)
    assert hit.table_path == str(tables.shipped_config_dir() / "NVIDIA_H200.json")
    # an explicit path may name one file
    one = write(tmp_path / "one", num_warps=1)
    assert tables.lookup(shape, H200, config_dir=one).table_path == str(one)
    # the user cache folder is platformdirs' (here under XDG_CACHE_HOME)
    assert tables.user_tables_dir() == user_dir


def test_exact_bucket_lookup_only(tmp_path, caplog):
    """An entry serves its own (batch_size, kv_len) bucket; any other bucket gets the heuristic."""
    entries = {KEY: [record((64, 8192), KernelConfig(num_warps=1)), record((1, 128), KernelConfig(num_warps=2)),
                     record((256, 65536), KernelConfig(num_warps=8))]}
    write(tmp_path, entries=entries)

    def hit(b, n):
        return tables.lookup(make_shape(b, n), H200, config_dir=tmp_path)

    exact = hit(48, 6000)
    assert (exact.bucket, warps(exact), exact.notes, exact.table_path) == (
        (64, 8192), 1, (), str(tmp_path / "NVIDIA_H200.json"))
    assert warps(hit(33, 4097)) == 1 and warps(hit(64, 8192)) == 1  # the bucket's edges
    assert warps(hit(1, 100)) == 2 and warps(hit(129, 40000)) == 8
    for b, n in ((40, 3000), (32, 8192), (65, 8192), (64, 8193), (2, 100), (1000, 100_000)):
        assert hit(b, n) is None, (b, n)
        selected = select_config(make_shape(b, n), H200, config_dir=tmp_path)
        assert selected.source == "heuristic" and selected.table_path is None
        assert selected.kernel_config == heuristic_config(make_shape(b, n), H200)
    assert messages(caplog) == []  # the GPU has a table: a missing bucket is not worth a warning


def test_a_class_no_table_holds_uses_the_heuristic_quietly(tmp_path, caplog):
    write(tmp_path)
    tables.set_config_path(tmp_path)
    other = make_shape(head_dim=64)
    assert tables.lookup(other, H200) is None
    selected = select_config(other, H200)
    assert selected.source == "heuristic" and selected.table_path is None and selected.bucket is None
    assert select_config(make_shape(), H200).source == "table"
    assert messages(caplog) == []


def test_the_other_16bit_dtype_stands_in_for_a_class_no_table_holds(tmp_path, user_dir):
    """float16 and bfloat16 run the same kernel and configs: a class absent from every matching
    table takes the other 16-bit dtype's entry (noted), after every table's own class."""
    write(user_dir, num_warps=2)  # bfloat16 only
    hit = tables.lookup(make_shape(**FP16), H200)
    assert warps(hit) == 2 and hit.bucket == (64, 8192)
    assert hit.notes == (f"entries of class {KEY} (float16 and bfloat16 share kernel and configs)",)
    selected = select_config(make_shape(**FP16), H200)
    assert selected.source == "table" and selected.kernel_config.num_warps == 2
    assert any("share kernel and configs" in a for a in selected.adjustments)
    # the class itself in a later table (shipped) beats the twin in an earlier one (user cache)
    write(tables.shipped_config_dir(), num_warps=8, shape=make_shape(**FP16))
    tables.clear_cache()
    hit = tables.lookup(make_shape(**FP16), H200)
    assert warps(hit) == 8 and hit.notes == ()
    # the other way round: a bfloat16 query with only float16-query entries (fp8 cache, fp32 out)
    fp8 = dict(kv_dtype=torch.float8_e4m3fn, o_dtype=torch.float32)
    write(tmp_path / "fp8", num_warps=1, shape=make_shape(q_dtype=torch.float16, **fp8))
    hit = tables.lookup(make_shape(**fp8), H200, config_dir=tmp_path / "fp8")
    assert warps(hit) == 1 and "q=float16,kv=float8_e4m3fn,o=float32" in hit.notes[0]


def test_device_matching(user_dir, caplog):
    """Exact name; else the same compute capability and SM count (a variant: one warning and a
    note); another chip's table is skipped."""
    write(user_dir, num_warps=2)  # NVIDIA H200
    for _ in range(3):
        hit = tables.lookup(make_shape(), H200_NVL)
        assert warps(hit) == 2
        assert hit.notes == ("table for 'NVIDIA H200' used for 'NVIDIA H200 NVL' (same compute capability "
                             "and SM count)",)
    [msg] = messages(caplog)
    assert "NVIDIA_H200.json" in msg and "NVIDIA H200 NVL" in msg
    selected = select_config(make_shape(), H200_NVL)
    assert selected.source == "table" and "same compute capability" in selected.adjustments[0]
    # an exact-name table beats a variant, and the variant's own table does not serve the H200
    write(user_dir, device=H200_NVL, num_warps=8)
    assert warps(tables.lookup(make_shape(), H200_NVL)) == 8
    assert warps(tables.lookup(make_shape(), H200)) == 2
    # another SM count is another chip: no match, one "missing table" warning naming the tuner
    caplog.clear()
    for _ in range(3):
        assert tables.lookup(make_shape(), H100_PCIE) is None
    [msg] = messages(caplog)
    assert "'NVIDIA H100 PCIe'" in msg and "tsdecode-tune --preset llama3-8b" in msg
    assert str(user_dir / "NVIDIA_H100_PCIe.json") in msg
    assert select_config(make_shape(), H100_PCIE).source == "heuristic"
    # a variant's table that holds no entry for the shape is another GPU's table: no warning (the
    # H200 NVL's own table, above, serves the H200 only by falling through to it)
    caplog.clear()
    assert tables.lookup(make_shape(batch_size=1), H200) is None
    assert messages(caplog) == []


def test_missing_table_warns_once_naming_the_tuner(caplog):
    for b in (1, 8, 64):
        assert tables.lookup(make_shape(b), H200) is None
        assert select_config(make_shape(b), H200).source == "heuristic"
    [msg] = messages(caplog)
    assert "'NVIDIA H200'" in msg and "tsdecode-tune --preset llama3-8b" in msg and "NVIDIA_H200.json" in msg
    tables.clear_cache()  # resets the warn-once state
    tables.lookup(make_shape(), H200)
    assert len(messages(caplog)) == 2
    caplog.clear()
    cpu = D.device_properties("cpu")
    tables.lookup(make_shape(), cpu)
    [msg] = messages(caplog)
    assert "tsdecode-tune --preset smoke" in msg and "cpu_Triton_interpreter.json" in msg


def test_a_warning_given_once_is_not_built_again(tmp_path, caplog, monkeypatch):
    """Every plan searches the tables: a warning already given (no table, a stale table) must not
    build its advice again (paths resolved on disk) on each later plan."""
    built = []
    real = tables.tune_advice
    monkeypatch.setattr(tables, "tune_advice", lambda *a, **k: built.append(1) or real(*a, **k))
    for b in (1, 8, 64):
        assert tables.lookup(make_shape(b), H200) is None
    assert len(built) == 1 and len(messages(caplog)) == 1
    write(tmp_path / "stale", num_warps=8, kernel_hash="0" * 16)
    for _ in range(3):
        assert warps(tables.lookup(make_shape(), H200, config_dir=tmp_path / "stale")) == 8
    assert len(built) == 2 and len(messages(caplog)) == 2


def test_no_warning_is_built_while_warnings_are_not_logged(tmp_path, caplog, monkeypatch):
    """A warning's text (its advice resolves paths) is built only to be logged: not while the
    logger drops warnings, not again on each re-read of an unusable file (written within the
    second, so never cached); once warnings are logged, each is given."""
    built = []
    real = tables.tune_advice
    monkeypatch.setattr(tables, "tune_advice", lambda *a, **k: built.append(1) or real(*a, **k))
    bad = tmp_path / "bad" / tables.table_filename(H200.name)
    bad.parent.mkdir()
    bad.write_text("[]")
    write(tmp_path / "stale", num_warps=8, kernel_hash="0" * 16)
    for level, advice, warnings in ((logging.ERROR, 0, 0), (logging.WARNING, 3, 4)):
        caplog.set_level(level, logger="tsdecode")
        for _ in range(3):
            assert tables.lookup(make_shape(), H200, config_dir=bad.parent) is None
            assert warps(tables.lookup(make_shape(), H200, config_dir=tmp_path / "stale")) == 8
            assert tables.lookup(make_shape(), H200, config_dir=tmp_path / "none") is None  # and no table
        assert len(built) == advice and len(messages(caplog)) == warnings


def test_a_folder_is_listed_again_only_when_it_changes(tmp_path, caplog, monkeypatch, settled):
    """A folder's table names are kept while its times stay; a table written into it afterwards
    (a new name changes the folder's times) is found by the next lookup."""
    folder = tmp_path / "tables"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a table")
    listed = []
    real = os.listdir
    monkeypatch.setattr(tables.os, "listdir",
                        lambda path=".": (listed.append(path) if path == str(folder) else None) or real(path))
    for _ in range(3):
        assert tables.lookup(make_shape(), H200, config_dir=folder) is None
    assert listed == [str(folder)]  # listed once, then kept
    write(folder, num_warps=8)
    assert warps(tables.lookup(make_shape(), H200, config_dir=folder)) == 8
    assert len(listed) == 2
    (folder / tables.table_filename(H200.name)).unlink()
    assert tables.lookup(make_shape(), H200, config_dir=folder) is None


def test_a_table_changed_with_its_old_times_put_back_is_found_on_a_coarse_filesystem(tmp_path, monkeypatch):
    """Where times step by whole seconds, a table rewritten in place, or added to a folder, in the
    second of a lookup and then given its old mtime back (``cp -p``, ``rsync -t``) keeps the key
    that lookup saw: a file or folder whose ctime is within a second of now is not kept."""
    second = 1_000_000_000
    now = time.time_ns()
    past = now - 60 * second
    monkeypatch.setattr(tables, "time", types.SimpleNamespace(time_ns=lambda: now))
    real_stat = os.stat

    def coarse_stat(path, *args, **kw):  # every change of this test falls in the second of now
        st = real_stat(path, *args, **kw)
        return types.SimpleNamespace(st_mode=st.st_mode, st_ino=st.st_ino, st_size=st.st_size,
                                     st_mtime_ns=st.st_mtime_ns - st.st_mtime_ns % second,
                                     st_ctime_ns=now - now % second)

    def put(folder: Path, num_warps: int) -> None:
        path = folder / tables.table_filename(H200.name)
        path.write_text(json.dumps(table_data(num_warps=num_warps)))  # the same size for 2, 4 and 8
        for p in (path, folder):
            os.utime(p, ns=(past, past))

    def lookup(folder: Path) -> int | None:
        with monkeypatch.context() as m:
            m.setattr(tables.os, "stat", coarse_stat)
            return warps(tables.lookup(make_shape(), H200, config_dir=folder))

    rewritten, added = tmp_path / "rewritten", tmp_path / "added"
    rewritten.mkdir()
    added.mkdir()
    os.utime(added, ns=(past, past))
    put(rewritten, 2)
    assert lookup(rewritten) == 2
    put(rewritten, 4)
    assert lookup(rewritten) == 4
    assert lookup(added) is None
    put(added, 8)
    assert lookup(added) == 8


def test_the_user_cache_folder_follows_xdg_cache_home(tmp_path, monkeypatch):
    """The user cache folder is kept per value of the variables platformdirs reads."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "one"))
    first = tables.user_tables_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "two"))
    assert tables.user_tables_dir() == tmp_path / "two" / "tsdecode" / "tuned_configs"
    assert first == tmp_path / "one" / "tsdecode" / "tuned_configs"
    write(tmp_path / "two" / "tsdecode" / "tuned_configs", num_warps=8)
    assert warps(tables.lookup(make_shape(), H200)) == 8
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "one"))
    assert tables.lookup(make_shape(), H200) is None


# ------------------------------------------------------------------------------------------------
# The CPU finds its own table (issue 28, finding 1), end to end
# ------------------------------------------------------------------------------------------------


def _problem(lens=(30, 33), hq=4, hkv=2, d=64, p=16, dtype=torch.float16):
    gen = torch.Generator().manual_seed(0)
    pages = 8
    cache = torch.randn((pages, 2, hkv, p, d), generator=gen).to(dtype)
    block_tables = torch.tensor([[3, 0, 0], [5, 1, 6]], dtype=torch.int32)
    q = torch.randn((len(lens), hq, d), generator=gen).to(dtype)
    ref = reference_decode(q, cache, block_tables, torch.tensor(lens, dtype=torch.int32))
    return q, cache, block_tables, ref


def _plan(lens=(30, 33)):  # longest / mean < 1.1: no ragged scaling
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan("cpu", len(lens), 4, 2, 64, 16, 48, q_data_type=torch.float16, seq_lens=list(lens))
    return w


def test_a_cpu_plan_uses_the_cpu_table_in_the_user_cache(user_dir, caplog):
    """What ``tsdecode-tune --preset smoke`` writes on a CPU is what a CPU plan then uses, with
    no path given; the result matches the reference."""
    cpu = D.device_properties("cpu")
    shape = ProblemShape(batch_size=2, num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_kv_len=48,
                         **FP16)
    config = KernelConfig(block_n=16, block_m=16, num_kv_splits=2, num_warps=2, num_stages=1)
    write(user_dir, device=cpu, entries={tables.problem_class_key(shape): [record((2, 64), config)]})
    assert (user_dir / "cpu_Triton_interpreter.json").exists()
    w = _plan()
    assert w.config.source == "table" and w.config.kernel_config == config
    assert w.config.table_path == str(user_dir / "cpu_Triton_interpreter.json") and w.config.bucket == (2, 64)
    q, cache, block_tables, ref = _problem()
    out = w.run(q, cache, None, block_tables)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert messages(caplog) == []
    assert f"source: table {user_dir / 'cpu_Triton_interpreter.json'}" in tsdecode.explain(
        2, 48, 4, 2, 64, q_dtype=torch.float16, device="cpu")


def test_a_plan_beside_a_corrupt_table_falls_back_and_stays_correct(user_dir, caplog):
    cpu = D.device_properties("cpu")
    path = user_dir / tables.table_filename(cpu.name)
    user_dir.mkdir(parents=True)
    path.write_text('{"format_version": 1, "entries": {')
    w = _plan()
    assert w.config.source == "heuristic"
    q, cache, block_tables, ref = _problem()
    torch.testing.assert_close(w.run(q, cache, None, block_tables).double(), ref, atol=2e-2, rtol=2e-2)
    _plan()
    [msg] = messages(caplog)
    assert str(path) in msg and "ignored" in msg


# ------------------------------------------------------------------------------------------------
# Bad, stale and partly valid tables
# ------------------------------------------------------------------------------------------------


def _valid_text() -> str:
    return json.dumps(table_data())


BAD_FILES = {
    "corrupt": lambda text: b"\x00\xff garbage \x89PNG",
    "not utf-8": lambda text: text.encode().replace(b"NVIDIA", b"\xff\xfe", 1),
    "truncated": lambda text: text[: len(text) // 2].encode(),
    "empty": lambda text: b"",
    "wrong version": lambda text: json.dumps({**json.loads(text), "format_version": 99}).encode(),
    "no version": lambda text: json.dumps({"entries": {}}).encode(),
    "not an object": lambda text: b"[1, 2, 3]",
    "missing field": lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "device"}).encode(),
    "bad number": lambda text: text.replace('"time_us": 10.0', '"time_us": "fast"').encode(),
    "negative time": lambda text: text.replace('"time_us": 10.0', '"time_us": -1').encode(),
    "bad bucket": lambda text: text.replace('"batch_size": 64', '"batch_size": 48').encode(),
    "bad class key": lambda text: text.replace("mask=dense", "mask=sparse").encode(),
    "huge number": lambda text: text.replace('"time_us": 10.0', '"time_us": 1' + "0" * 400).encode(),
    "deep nesting": lambda text: b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("kind", [*BAD_FILES, "directory"])
def test_a_bad_file_warns_once_and_the_search_goes_on(kind, tmp_path, user_dir, caplog):
    write(user_dir, num_warps=8)  # the good table behind the bad one
    bad = tmp_path / "explicit" / "NVIDIA_H200.json"
    bad.parent.mkdir()
    if kind == "directory":
        bad.mkdir()
    else:
        bad.write_bytes(BAD_FILES[kind](_valid_text()))
        assert tables.load_table(bad) is None
    for _ in range(3):
        hit = tables.lookup(make_shape(), H200, config_dir=bad.parent)
        assert warps(hit) == 8 and hit.table_path == str(user_dir / bad.name)
    [msg] = messages(caplog)
    assert str(bad) in msg and "ignored" in msg
    if kind == "wrong version":
        assert "format_version is 99" in msg


@pytest.mark.parametrize("how", ["config_dir", "env", "file"])
def test_a_bad_table_alone_is_one_warning_and_the_heuristic(how, tmp_path, caplog, monkeypatch):
    """The bad file's own warning, not also "no tuned config table" for the same cause."""
    bad = tmp_path / "explicit" / "NVIDIA_H200.json"
    bad.parent.mkdir()
    bad.write_bytes(BAD_FILES["truncated"](_valid_text()))
    config_dir = {"config_dir": bad.parent, "file": bad}.get(how)
    if how == "env":
        monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(bad.parent))
    for _ in range(3):
        assert tables.lookup(make_shape(), H200, config_dir=config_dir) is None
        assert select_config(make_shape(), H200, config_dir=config_dir).source == "heuristic"
    [msg] = messages(caplog)
    assert str(bad) in msg and "unusable" in msg


def test_a_table_unusable_for_another_cause_after_it_changed_warns_again(tmp_path, caplog):
    """One warning per file and cause: a file that is unusable again after it changed warns again
    when the cause differs, not when it is the same."""
    path = tmp_path / tables.table_filename(H200.name)
    for text in (b"[1, 2, 3]", BAD_FILES["wrong version"](_valid_text()), b"[1, 2, 3]", b"[1, 2, 3, 4]"):
        path.write_bytes(text)
        for _ in range(2):
            assert tables.lookup(make_shape(), H200, config_dir=path) is None
    first, second = messages(caplog)
    assert "JSON without a format_version" in first and "format_version is 99" in second


@pytest.mark.parametrize("cause", ["unusable", "stale"])
@pytest.mark.parametrize("where", ["user cache", "env", "config_dir file", "shipped"])
@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_a_bad_table_warning_advises_the_command_that_replaces_it(cause, where, gpu, tmp_path, user_dir, caplog,
                                                                   monkeypatch):
    """The preset fits the device (smoke under the interpreter); a file outside the user cache
    folder gets ``--out`` its folder, so the command rewrites it where it lies. A shipped table is
    shadowed by the user cache's instead."""
    device = H200 if gpu else D.device_properties("cpu")
    folder = {"user cache": user_dir, "shipped": tables.shipped_config_dir()}.get(where, tmp_path / "my tables")
    path = write(folder, device=device, kernel_hash="0123456789abcdef")
    if cause == "unusable":
        path.write_text('{"format_version": 1, "entries": {')
    if where == "env":
        monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(folder))
    for _ in range(3):
        tables.lookup(make_shape(), device, config_dir=path if where == "config_dir file" else None)
    [msg] = messages(caplog)
    preset = "llama3-8b" if gpu else "smoke"
    if where in ("user cache", "shipped"):
        assert f"Re-tune with `tsdecode-tune --preset {preset}`" in msg
    else:
        assert f"Re-tune with `tsdecode-tune --preset {preset} --out '{folder}'`" in msg
    assert ("(writes" in msg) is (where == "shipped")
    if where == "shipped":
        assert str(user_dir / path.name) in msg


def test_an_unusable_file_under_another_name_is_one_warning(tmp_path, caplog, monkeypatch):
    """Not also "no tuned config table": the warning says to delete it and how to tune the device."""
    folder = tmp_path / "mine"
    folder.mkdir()
    bad = folder / "my_table.json"
    bad.write_text('{"format_version": 1, "entries": {')
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(folder))
    cpu = D.device_properties("cpu")
    for _ in range(3):
        assert select_config(make_shape(), cpu).source == "heuristic"
    [msg] = messages(caplog)
    assert str(bad) in msg and "is unusable" in msg and "Delete it" in msg
    assert f"`tsdecode-tune --preset smoke --out {folder}` (writes {folder / 'cpu_Triton_interpreter.json'})" in msg


@pytest.mark.parametrize("name, content, reason", [
    ("package.json", '{"name": "my-app", "version": "1.0.0"}', "JSON without a format_version"),
    ("notes.json", "my notes", "not JSON: Expecting value: line 1 column 1 (char 0)"),
    ("list.json", "[1, 2]", "JSON without a format_version"),
    ("a-folder.json", None, "not a regular file but a folder"),
])
def test_a_file_that_is_no_table_is_said_to_be_ignored_not_to_be_deleted(name, content, reason, tmp_path, user_dir,
                                                                          caplog, monkeypatch):
    """Another tool's JSON file (or a folder) in a config folder is none of tsdecode's business: one
    warning says it is not a table and is ignored, and where this device's table comes from."""
    folder = tmp_path / "mine"
    folder.mkdir()
    other = folder / name
    if content is None:
        other.mkdir()
    else:
        other.write_text(content)
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(folder))
    cpu = D.device_properties("cpu")
    for _ in range(3):
        assert select_config(make_shape(), cpu).source == "heuristic"
    [msg] = messages(caplog)
    assert msg == (f"{other} is not a tsdecode config table ({reason}); ignored. This device's table comes from "
                   f"`tsdecode-tune --preset smoke` (writes {user_dir / 'cpu_Triton_interpreter.json'})")
    assert other.exists()


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null")
def test_a_device_given_as_the_config_path_is_not_to_be_deleted(user_dir, caplog):
    for _ in range(3):
        tables.lookup(make_shape(), H200, config_dir="/dev/null")
    [msg] = messages(caplog)
    assert msg.startswith("/dev/null is not a tsdecode config table (not a regular file but a device file); ignored")
    assert "Delete" not in msg and "--out /dev" not in msg


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_a_fifo_named_like_a_table_is_unusable_not_a_hang(tmp_path, user_dir, caplog):
    write(user_dir, num_warps=8)
    fifo = tmp_path / "fifo" / "NVIDIA_H200.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    found = []

    def search():
        for _ in range(3):
            found.append(warps(tables.lookup(make_shape(), H200, config_dir=fifo.parent)))

    thread = threading.Thread(target=search, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the search hangs reading the FIFO"
    assert found == [8, 8, 8]
    [msg] = messages(caplog)
    assert str(fifo) in msg and "not a regular file but a FIFO" in msg and "ignored" in msg


@pytest.mark.parametrize("device", [H200, H200_NVL], ids=["exact", "variant"])
def test_a_stale_table_with_a_skipped_entry_is_one_warning(device, tmp_path, caplog):
    """Stale, an entry skipped (and, for the variant, used for another name): one warning naming all."""
    invalid = record((1, 1), KernelConfig())
    invalid["kernel_config"]["block_n"] = 0
    write(tmp_path, entries={KEY: [record((64, 8192), KernelConfig(num_warps=2)), invalid]},
          kernel_hash="0123456789abcdef")
    for _ in range(3):
        assert warps(tables.lookup(make_shape(), device, config_dir=tmp_path)) == 2
    [msg] = messages(caplog)
    assert "kernel hash differs" in msg and "1 entry is not valid today" in msg and "block_n" in msg
    assert ("used for 'NVIDIA H200 NVL'" in msg) is (device is H200_NVL)
    assert f"Re-tune with `tsdecode-tune --preset llama3-8b --out {tmp_path}`" in msg


def test_a_folder_that_cannot_be_listed_warns_once_and_the_search_goes_on(tmp_path, user_dir, caplog,
                                                                           monkeypatch):
    """A table folder os.listdir refuses (no read permission) never fails a plan; explain's
    search says so."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.listdir

    def listdir(path="."):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(tables.os, "listdir", listdir)
    write(user_dir, num_warps=8)  # the next source
    for _ in range(3):
        assert warps(tables.lookup(make_shape(), H200, config_dir=locked)) == 8
    [msg] = messages(caplog)
    assert str(locked) in msg and "Permission denied" in msg
    trace = []
    tables.lookup(make_shape(), H200, config_dir=locked, trace=trace)
    assert f"    {locked}: cannot be listed ([Errno 13] Permission denied: '{locked}')" in trace


@pytest.mark.parametrize("how", ["env", "set_config_path"])
def test_a_config_path_that_does_not_exist_warns_once(how, tmp_path, user_dir, caplog, monkeypatch):
    missing = tmp_path / "no" / "such" / "dir"
    if how == "env":
        monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(missing))
    else:
        tables.set_config_path(missing)
    write(user_dir, num_warps=8)  # the search goes on to the next source
    for _ in range(3):
        assert warps(tables.lookup(make_shape(), H200)) == 8
    [msg] = messages(caplog)
    assert str(missing) in msg and "does not exist" in msg
    assert ("$TSDECODE_CONFIG_DIR" if how == "env" else "set_config_path") in msg
    assert "does not exist" in tsdecode.explain(48, 6000, 32, 8, 128, device="cpu")


def test_a_stale_table_warns_once_naming_each_cause_and_is_still_used(tmp_path, caplog):
    path = write(tmp_path, kernel_hash="0123456789abcdef", triton_version="2.3.1")
    table = tables.load_table(path)
    assert len(table.stale) == 2
    for _ in range(3):
        selected = select_config(make_shape(), H200, config_dir=tmp_path)
        assert selected.source == "table" and selected.kernel_config.num_warps == 4
    assert any("kernel hash differs (table 0123456789abcdef" in a for a in selected.adjustments)
    assert any("triton 2.3.1" in a for a in selected.adjustments)
    [msg] = messages(caplog)
    assert "kernel hash differs" in msg and "triton 2.3.1" in msg and "Re-tune with" in msg
    # another triton minor version of the same major is current
    path = write(tmp_path / "minor", triton_version=triton.__version__.split(".")[0] + ".99.0")
    assert tables.load_table(path).stale == ()


def test_entries_outside_todays_config_space_are_skipped_with_one_warning(tmp_path, caplog):
    good = record((1, 1), KernelConfig(block_n=64))
    outside = record((64, 8192), KernelConfig())
    outside["kernel_config"]["block_n"] = 48  # not a tile size today
    old_space = record((64, 4096), KernelConfig())
    del old_space["default_config"]["num_stages"]  # an older config space
    too_many = record((8, 8192), KernelConfig())
    too_many["kernel_config"]["num_kv_splits"] = 2000
    path = write(tmp_path, entries={KEY: [outside, old_space, good, too_many]})
    table = tables.load_table(path)
    assert set(table.entries[KEY]) == {(1, 1)} and len(table.skipped) == 3
    assert any("block_n" in s and "(64, 8192)" in s for s in table.skipped)
    for _ in range(3):
        assert select_config(make_shape(), H200, config_dir=tmp_path).source == "heuristic"  # (64, 8192)
        assert select_config(make_shape(1, 1), H200, config_dir=tmp_path).source == "table"
    [msg] = messages(caplog)
    assert "3 entries are not valid today" in msg and str(path) in msg and len(msg) < 600


@pytest.mark.parametrize("tuned_batch_size", [10**309, 10**6, 32, 65], ids=["1e309", "1e6", "32", "65"])
def test_tuned_batch_size_outside_its_bucket_skips_the_entry(tuned_batch_size, tmp_path, caplog):
    """Bucket 64 holds batch sizes 33..64: anything else would overflow or silently rescale the
    splits. The entry is skipped with one warning; the bucket's edges are fine."""
    path = write(tmp_path, entries={KEY: [record((64, 8192), KernelConfig(num_kv_splits=4),
                                                 tuned_batch_size=tuned_batch_size)]})
    table = tables.load_table(path)
    assert KEY not in table.entries and len(table.skipped) == 1
    assert "tuned_batch_size" in table.skipped[0] and "bucket (64, 8192)" in table.skipped[0]
    for _ in range(2):
        assert select_config(make_shape(), H200, config_dir=tmp_path).source == "heuristic"
    [msg] = messages(caplog)
    assert "1 entry is not valid" in msg and len(msg) < 600
    for bucket, b in (((64, 8192), 33), ((64, 8192), 64), ((1, 64), 1)):
        ok = write(tmp_path / f"edge{b}", entries={KEY: [record(bucket, KernelConfig(), tuned_batch_size=b)]})
        assert tables.load_table(ok).entries[KEY][bucket].tuned_batch_size == b


# ------------------------------------------------------------------------------------------------
# Staleness: the kernel hash
# ------------------------------------------------------------------------------------------------


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
    assert tables.code_without_comments(src + "\n\n# trailing\n") == code
    assert tables.code_without_comments(src.replace("x + 1", "x + 2")) != code
    assert tables.code_without_comments(src.replace('"kept', '"changed')) != code


def test_kernel_source_hash_follows_the_kernel_code(tmp_path, monkeypatch):
    source = tables.KERNEL_SOURCE.read_text(encoding="utf-8")
    today = tables.kernel_source_hash()
    assert len(today) == 16 and int(today, 16) >= 0
    copy_ = tmp_path / "decode.py"
    for text, same in ((source, True), ("# a new comment\n" + source + "\n# end\n", True),
                       (source + "\nEXTRA = 1\n", False)):
        copy_.write_text(text)
        monkeypatch.setattr(tables, "KERNEL_SOURCE", copy_)
        tables.clear_cache()
        assert (tables.kernel_source_hash() == today) is same


# ------------------------------------------------------------------------------------------------
# A table's config adjusted to the planned shape
# ------------------------------------------------------------------------------------------------


def test_a_table_config_is_clamped_to_the_shape(tmp_path):
    shape = make_shape(2, 33, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    config = KernelConfig(block_n=16, block_m=64, num_kv_splits=64)
    write(tmp_path, entries={tables.problem_class_key(shape): [record((2, 64), config)]})
    selected = select_config(shape, H200, config_dir=tmp_path)
    assert selected.source == "table" and selected.bucket == (2, 64)
    assert (selected.kernel_config.num_kv_splits, selected.kernel_config.block_m) == (3, 16)
    assert any(a.startswith("num_kv_splits 64 -> 3") for a in selected.adjustments)
    assert any(a.startswith("block_m 64 -> 16") for a in selected.adjustments)


def test_an_entry_keeps_its_program_count_at_another_batch_size_of_its_bucket(tmp_path):
    """Tuned at B=3 (bucket 4) with 4 splits: B=3 gets it unchanged, B=4 scales to 3 splits. A
    table without tuned_batch_size scales from the bucket's batch size (4 -> round(16 / 3) = 5)."""
    write(tmp_path, entries={KEY: [record((4, 8192), KernelConfig(num_kv_splits=4), tuned_batch_size=3)]})
    same = select_config(make_shape(3, 8192), H200, config_dir=tmp_path)
    assert same.source == "table" and same.kernel_config.num_kv_splits == 4
    assert not any("scaled" in a for a in same.adjustments)
    four = select_config(make_shape(4, 8192), H200, config_dir=tmp_path)
    assert four.kernel_config.num_kv_splits == 3 and any("tuned at batch size 3" in a for a in four.adjustments)
    write(tmp_path / "legacy", entries={KEY: [record((4, 8192), KernelConfig(num_kv_splits=4))]})
    legacy = select_config(make_shape(3, 8192), H200, config_dir=tmp_path / "legacy")
    assert legacy.kernel_config.num_kv_splits == 5


def test_ragged_fixed_lengths_scale_the_splits_of_plans(tmp_path):
    """Lengths fixed at plan time with longest / mean = 1.5: the heuristic's 66 splits (16 programs;
    63 where the lengths are equal, which leave the same chains) and a table entry's both grow 1.5x
    within one wave, then fit the longest request's 375 tiles (99 splits walk them 4 at a time, as
    94 do; 30 13 at a time, as 29 do); lengths passed to run do not."""
    def plan(seq_lens, **kw):
        w = tsdecode.BatchDecodePagedTSWrapper()
        w.plan("cpu", 2, 32, 8, 128, 16, 6000, q_data_type=torch.bfloat16, seq_lens=seq_lens, **kw)
        return w.config

    set_override(H200)
    assert plan(None).kernel_config.num_kv_splits == 63
    ragged = plan([6000, 2000])
    assert ragged.source == "heuristic" and ragged.kernel_config.num_kv_splits == 94
    assert any("ragged lengths (longest / mean = 1.50)" in a for a in ragged.adjustments)
    assert plan([6000, 6000]).kernel_config.num_kv_splits == 63
    tables.set_config_path(tmp_path)
    write(tmp_path, entries={KEY: [record((2, 8192), KernelConfig(block_n=16, num_kv_splits=20, num_warps=1))]})
    assert plan(None).kernel_config.num_kv_splits == 20
    table = plan([6000, 2000])
    assert table.source == "table" and table.kernel_config.num_kv_splits == 29


# ------------------------------------------------------------------------------------------------
# The shipped tables
# ------------------------------------------------------------------------------------------------


def _shape_of(class_key: str, bucket: tuple[int, int], entry: TableEntry) -> ProblemShape:
    """A uniform-length shape of a shipped entry's class and bucket (the batch size it was timed at)."""
    fields = dict(part.split("=", 1) for part in class_key.split(","))
    hkv = int(fields["hkv"])
    window = 4095 if fields["mask"] == "windowed" else -1
    return ProblemShape(batch_size=entry.tuned_batch_size or bucket[0], num_qo_heads=int(fields["g"]) * hkv,
                        num_kv_heads=hkv, head_dim=int(fields["d"]), page_size=int(fields["p"]),
                        max_kv_len=bucket[1], max_seq_len_q=int(fields["sq"].rstrip("+")),
                        mask_kind=fields["mask"], window_left=window, q_dtype=getattr(torch, fields["q"]),
                        kv_dtype=getattr(torch, fields["kv"]), o_dtype=getattr(torch, fields["o"]))


@pytest.mark.parametrize("path", sorted(SHIPPED.glob("*.json")), ids=lambda p: p.name)
def test_a_shipped_table_parses_and_serves_its_gpu(path, monkeypatch, caplog):
    monkeypatch.setattr(tables, "shipped_config_dir", lambda: SHIPPED)
    data = json.loads(path.read_text())
    table_format.validate_table_data(data)
    table = tables.load_table(path)
    assert table is not None and table.skipped == ()
    assert sum(len(b) for b in table.entries.values()) == sum(len(r) for r in data["entries"].values()) > 0
    assert path.name == tables.table_filename(table.device.name)
    gpu = DeviceProperties.from_dict(data["device"])
    set_override(gpu)
    w = tsdecode.BatchDecodePagedTSWrapper()
    for class_key, buckets in table.entries.items():
        for bucket, entry in buckets.items():
            shape = _shape_of(class_key, bucket, entry)
            assert tables.problem_class_key(shape) == class_key
            selected = select_config(shape, gpu)
            assert selected.source == "table" and selected.table_path == str(path), (class_key, bucket)
            assert selected.bucket == bucket
            assert selected.kernel_config == entry.kernel_config or any(
                "->" in a for a in selected.adjustments)
    # a plan on the CPU described as that GPU takes the same entry
    class_key, buckets = next(iter(table.entries.items()))
    bucket, entry = next(iter(buckets.items()))
    shape = _shape_of(class_key, bucket, entry)
    w.plan("cpu", shape.batch_size, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.page_size,
           shape.max_kv_len, q_data_type=shape.q_dtype, kv_data_type=shape.kv_dtype, o_data_type=shape.o_dtype)
    assert w.config.source == "table" and w.config.table_path == str(path)
    # stale or not (the kernel may have changed since it was tuned), at most one warning per cause
    assert len(messages(caplog)) <= 2


def test_the_shipped_tables_are_found_in_an_installed_wheel(tmp_path):
    """Built as a wheel and installed elsewhere: the packaged tables are found through
    importlib.resources, not the source tree, and the package says it is typed (PEP 561)."""
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    for name in filter(None, files):
        if name.startswith(("reports/", "tests/", "docs/")) or not (REPO / name).is_file():
            continue
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    for old in (src / "tuned_configs").glob("*.json"):
        old.unlink()
    write(src / "tuned_configs", device=H100_PCIE, num_warps=2)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")],
                   cwd=src, check=True, capture_output=True)
    [wheel] = (tmp_path / "dist").glob("tsdecode-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True,
                   capture_output=True)
    probe = textwrap.dedent("""
        import sys
        # this environment's editable install would fill in what the wheel lacks: not here
        sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
        import tsdecode
        from tsdecode.config import tables
        from tsdecode.config.space import ProblemShape
        from tsdecode.device import DeviceProperties
        shape = ProblemShape(batch_size=48, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                             page_size=16, max_kv_len=6000)
        hit = tables.lookup(shape, DeviceProperties("NVIDIA H100 PCIe", 114, (9, 0)))
        print(tsdecode.__file__, tables.shipped_config_dir(), hit.table_path,
              hit.kernel_config.num_warps, sep="\\n")
    """)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != tables.CONFIG_DIR_ENV}
    env.update(PYTHONPATH=str(site), XDG_CACHE_HOME=str(tmp_path / "empty-cache"), TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", probe], cwd=outside, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    package, shipped, table_path, num_warps = run.stdout.split()
    assert package.startswith(str(site)) and shipped == str(site / "tsdecode" / "tuned_configs")
    assert table_path == str(site / "tsdecode" / "tuned_configs" / "NVIDIA_H100_PCIe.json")
    assert num_warps == "2"
    assert (site / "tsdecode" / "py.typed").is_file()
