"""``tsdecode.explain``: the report of which table, bucket and config a plan gets, and why."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import triton

import tsdecode
from tsdecode.config import table_format, tables
from tsdecode.config.heuristic import heuristic_config
from tsdecode.config.select import select_config
from tsdecode.config.space import KernelConfig, ProblemShape
from tsdecode.device import DeviceProperties, set_override

H200 = DeviceProperties("NVIDIA H200", 132, (9, 0), 150_109_880_320)
KEY = "q=bfloat16,kv=bfloat16,o=bfloat16,d=128,g=4,hkv=8,p=16,sq=1,mask=dense"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(tables.CONFIG_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(tables, "shipped_config_dir", lambda: None)
    caplog.set_level(logging.WARNING, logger="tsdecode")
    tables.clear_cache()
    set_override(H200)
    yield
    set_override(None)
    tables.set_config_path(None)
    tables.clear_cache()


def write_table(folder, config: KernelConfig, bucket=(64, 8192)):
    folder.mkdir(parents=True, exist_ok=True)
    record = {"batch_size": bucket[0], "kv_len": bucket[1], "kernel_config": config.to_dict(), "time_us": 10.0,
              "bandwidth_gbs": 3000.0, "fraction_of_copy": None, "default_config": KernelConfig().to_dict(),
              "default_time_us": 12.5, "default_bandwidth_gbs": 2400.0}
    data = {"format_version": table_format.FORMAT_VERSION, "device": H200.to_dict(), "triton_version": triton.__version__,
            "torch_version": torch.__version__, "kernel_hash": tables.kernel_source_hash(), "tuner_settings": {},
            "created": "2026-12-01", "updated": "2026-12-01", "entries": {KEY: [record]}}
    path = folder / "NVIDIA_H200.json"
    path.write_text(json.dumps(data))
    return path


def test_explain_a_table_hit(tmp_path):
    config = KernelConfig(block_n=32, block_m=16, num_kv_splits=4, num_warps=1, num_stages=5)
    path = write_table(tmp_path, config)
    text = tsdecode.explain(64, 6000, 32, 8, 128, config_dir=tmp_path)
    lines = text.splitlines()
    assert lines[0] == "shape: batch_size=64 kv_len=6000 Hq=32 Hkv=8 D=128 P=16 SQ=1 dense"
    assert f"class: {KEY}" in lines and "bucket: (64, 8192)" in lines
    assert "device: 'NVIDIA H200' (compute capability 9.0, 132 SMs)" in lines
    assert f"  config_dir argument: {tmp_path}" in lines
    assert f"    {path}: {KEY} bucket (64, 8192) -> hit" in lines
    assert f"source: table {path} bucket (64, 8192)" in lines
    assert f"config: {config}" in lines
    # the same as a plan's selection, with its adjustments as notes (B=40: splits scaled)
    text = tsdecode.explain(40, 6000, 32, 8, 128, config_dir=tmp_path)
    shape = ProblemShape(batch_size=40, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, max_kv_len=6000)
    selected = select_config(shape, H200, config_dir=tmp_path)
    assert f"config: {selected.kernel_config}" in text and selected.kernel_config.num_kv_splits == 6
    assert "note: num_kv_splits 4 -> 6: entry tuned at batch size 64" in text


def test_explain_a_heuristic_pick(tmp_path):
    write_table(tmp_path, KernelConfig())
    text = tsdecode.explain(8, 1500, 32, 8, 128, config_dir=tmp_path)  # bucket (8, 2048): no entry
    shape = ProblemShape(batch_size=8, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, max_kv_len=1500)
    assert "source: heuristic" in text and "no entry for this class and bucket" in text
    assert f"config: {heuristic_config(shape, H200)}" in text
    other = tsdecode.explain(8, 1500, 16, 8, 64, page_size=32, seq_len_q=4, mask_type="causal", window_left=128,
                             kv_dtype=torch.float8_e4m3fn, o_dtype=torch.float32)
    assert "Hq=16 Hkv=8 D=64 P=32 SQ=4 windowed" in other
    assert "class: q=bfloat16,kv=float8_e4m3fn,o=float32,d=64,g=2,hkv=8,p=32,sq=4,mask=windowed" in other
    assert "source: heuristic" in other
    packed = tsdecode.explain(8, 1500, 32, 8, 128, seq_len_q=5, packed=True)
    assert "SQ=5 packed" in packed and ",sq=packed," in packed
    # window_left 0 (each query token sees itself only) is a window, as a plan classes it
    own = tsdecode.explain(8, 1500, 32, 8, 128, mask_type="causal", window_left=0)
    assert " windowed\n" in own and ",mask=windowed" in own


def test_explain_names_an_entry_skipped_as_invalid_and_why_a_file_is_unusable(tmp_path):
    path = write_table(tmp_path / "skipped", KernelConfig())
    data = json.loads(path.read_text())
    data["entries"][KEY][0]["kernel_config"]["block_n"] = 0
    path.write_text(json.dumps(data))
    text = tsdecode.explain(64, 6000, 32, 8, 128, config_dir=tmp_path / "skipped")
    assert f"    {path}: entry skipped: KernelConfig.block_n must be one of" in text and "got 0" in text
    assert "no entry for this class" not in text and "source: heuristic" in text
    path.write_text('{"format_version": 1, "entries": {')
    text = tsdecode.explain(64, 6000, 32, 8, 128, config_dir=tmp_path / "skipped")
    assert f"    {path}: unusable (Expecting" in text


def test_explain_on_the_cpu_names_the_cpu():
    set_override(None)
    text = tsdecode.explain(1, 10, 8, 8, 128, device="cpu")
    assert "device: 'cpu (Triton interpreter)'" in text and "132 SMs" not in text
    assert "user cache:" in text and "source: heuristic" in text


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(batch_size=0), ValueError, "batch_size"),
    (dict(batch_size=2.0), TypeError, "batch_size"),
    (dict(kv_len=0), ValueError, "kv_len"),
    (dict(kv_len="10"), TypeError, "kv_len"),
    (dict(num_qo_heads=0), ValueError, "num_qo_heads"),
    (dict(num_qo_heads=12, num_kv_heads=8), ValueError, "num_qo_heads"),
    (dict(num_kv_heads=None), TypeError, "num_kv_heads"),
    (dict(head_dim=100), NotImplementedError, "head_dim"),
    (dict(page_size=0), ValueError, "page_size"),
    (dict(page_size=4096), NotImplementedError, "page_size"),
    (dict(seq_len_q=0), ValueError, "seq_len_q"),
    (dict(kv_len=2**31), NotImplementedError, "kv_len must be <= 2147483392"),
    (dict(batch_size=2**20, seq_len_q=2**7), NotImplementedError, r"B\*SQ\*Hq"),
    (dict(packed="yes"), TypeError, "packed"),
    (dict(mask_type="sliding"), ValueError, "mask_type"),
    (dict(window_left=64), ValueError, "window_left"),
    (dict(q_dtype=torch.float32), NotImplementedError, "q_dtype"),
    (dict(q_dtype="bfloat16"), TypeError, "q_dtype"),
    (dict(kv_dtype=torch.float32), NotImplementedError, "kv_dtype"),
    (dict(o_dtype=torch.int8), NotImplementedError, "o_dtype"),
    (dict(device="tpu:0"), ValueError, "device 'tpu:0' is not a device"),
    (dict(device=True), TypeError, "device must be an int, str or torch.device"),
    pytest.param(dict(device="cuda"), ValueError, "device cuda is a CUDA device, but torch finds none",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")),
])
def test_explain_argument_errors_name_the_argument(kwargs, error, name):
    args = dict(batch_size=4, kv_len=1000, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    args.update(kwargs)
    with pytest.raises(error, match=name):
        tsdecode.explain(**args)
