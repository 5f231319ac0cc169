"""Test setup: without CUDA, kernels run in Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection.
The user's tuned-table folders are isolated for the whole session, before tsdecode is imported:
XDG_CACHE_HOME (which platformdirs honours for the user cache folder) points at a fresh
temporary folder and TSDECODE_CONFIG_DIR is unset, so a table that ``tsdecode-tune`` wrote on
the developer's machine never changes the config a test gets.
"""

import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_SESSION_CACHE = tempfile.mkdtemp(prefix="tsdecode-test-cache-")
os.environ["XDG_CACHE_HOME"] = _SESSION_CACHE
os.environ.pop("TSDECODE_CONFIG_DIR", None)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture
def fresh_tables():
    """No table path set and no parsed table or warning remembered, before and after the test."""
    from tsdecode.config import tables

    tables.set_config_path(None)
    tables.clear_cache()
    yield tables
    tables.set_config_path(None)
    tables.clear_cache()


@pytest.fixture
def device_override():
    """``tsdecode.device.set_override`` for one test: describes every device as the given
    properties, reset afterwards."""
    from tsdecode import device

    yield device.set_override
    device.set_override(None)
