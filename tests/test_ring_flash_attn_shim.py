"""ring-flash-attn importable next to the pinned transformers (issue 39, item 2).

ring-flash-attn 0.1.8's ``__init__`` imports its HF adapter, which does
``from transformers.modeling_flash_attention_utils import is_flash_attn_greater_or_equal_2_10``:
with transformers 5.x that raises ImportError, so ``import ring_flash_attn`` fails although its ring
functions need only torch and flash-attn. A stand-in package in tmp_path has that layout (the
adapter's import is the real one, against the installed transformers); its ring functions are
markers. The shim must get them, and report any other failure with its reason.
"""
from __future__ import annotations

import importlib
import sys

import pytest

from baselines.methods import ring_flash_attn_shim as shim

INIT = """from .ring_flash_attn import ring_flash_attn_func
from .zigzag_ring_flash_attn import zigzag_ring_flash_attn_func
from .adapters import substitute_hf_flash_attn
"""
ADAPTER = """from transformers.modeling_flash_attention_utils import is_flash_attn_greater_or_equal_2_10
def substitute_hf_flash_attn(): pass
"""


def _package(root, ring_body="def ring_flash_attn_func(*a, **kw):\n    return 'ring'\n"):
    pkg = root / "ring_flash_attn"
    (pkg / "adapters").mkdir(parents=True)
    (pkg / "__init__.py").write_text(INIT)
    (pkg / "adapters" / "__init__.py").write_text(ADAPTER)
    (pkg / "utils.py").write_text("RING = 'utils'\n")
    (pkg / "ring_flash_attn.py").write_text("from .utils import RING\n" + ring_body)
    (pkg / "zigzag_ring_flash_attn.py").write_text("def zigzag_ring_flash_attn_func(*a, **kw):\n    return 'zigzag'\n")


@pytest.fixture
def clean(monkeypatch, tmp_path):
    def drop():
        for name in [m for m in sys.modules if m.split(".")[0] == "ring_flash_attn"]:
            del sys.modules[name]
        shim.load.cache_clear()

    drop()
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    drop()


def test_the_package_import_fails_next_to_transformers_5(clean):
    _package(clean)
    with pytest.raises(ImportError, match="is_flash_attn_greater_or_equal_2_10"):
        importlib.import_module("ring_flash_attn")


def test_the_shim_imports_the_ring_functions_without_the_hf_adapter(clean):
    _package(clean)
    got = shim.load()
    assert got.shimmed and got.reason == ""
    assert got.module.ring_flash_attn_func() == "ring"
    assert got.module.zigzag_ring_flash_attn_func() == "zigzag"
    assert "ring_flash_attn.adapters" not in sys.modules


def test_another_failure_is_reported_with_its_reason(clean):
    _package(clean, ring_body="from flash_attn.flash_attn_interface import _flash_attn_forward\n")
    got = shim.load()
    assert got.module is None
    assert "No module named 'flash_attn'" in got.reason
    assert "ring_flash_attn" not in sys.modules


def test_a_missing_package_is_not_importable_with_the_reason(clean):
    got = shim.load()
    assert got.module is None and "No module named 'ring_flash_attn'" in got.reason
