"""The correctness tests about every method of a capability find a new method by themselves.

Fake methods are registered (``registry.add_module``, in process; ``BURST_METHOD_MODULES`` for a
pytest collection in a child process) with a chosen capability, and the case lists of
tests/test_defects.py, test_masks_ring.py, test_hf_parity.py, test_double_ring.py and test_uneven.py must include
each one where its capability says, and leave it out where it does not. Nothing runs the fakes:
only the lists are checked, so this stays cheap. With hard-coded method lists it fails.
"""
from __future__ import annotations

import os
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest

from baselines import registry
from tests import test_defects, test_double_ring, test_hf_parity, test_masks_ring, test_uneven
from tests._helpers import method_params

ROOT = Path(__file__).resolve().parents[1]


def _fake_methods() -> tuple:
    """A copy of burst_qring under a new name, one that takes no masks, one of its timing variants, one
    that cannot run here, and a copy of the layer-level tp_v3."""
    qring = replace(registry.get("burst_qring"), name="fake_qring", colour=None, marker=None)
    return (qring,
            replace(qring, name="fake_nomask", masks=False),
            replace(qring, name="fake_qring_no_overlap", variant_of="fake_qring",
                    options={**qring.options, "overlap": False}),
            replace(qring, name="fake_cuda_only", available=lambda: False, external="a CUDA-only package"),
            replace(registry.get("tp_v3"), name="fake_tp", colour=None, marker=None))


@pytest.fixture
def fakes():
    module = types.ModuleType("fake_methods_module")
    module.METHODS = _fake_methods()
    names = registry.add_module(module)
    try:
        yield set(names)
    finally:
        for n in names:
            registry.METHODS.pop(n, None)


def _names(cases, key=0) -> set:
    return {c[key] for c in cases}


def test_the_case_lists_take_new_methods_by_capability(fakes):
    new_sp = {"fake_qring", "fake_nomask", "fake_cuda_only"}       # op level, no variant, no adapter
    # test_defects: strides, fp64, bad input and uneven shards take every sequence-parallel method ...
    assert _names(test_defects.strided_cases()) & fakes == new_sp
    assert _names(test_defects.fp64_cases()) & fakes == new_sp
    assert set(test_defects.sp_methods("contiguous")) & fakes == new_sp
    # ... and the layer test every layer-level one
    assert _names(test_defects.layer_methods()) & fakes == {"fake_tp"}
    # masks: only methods that take mask= and run here, on every layout they accept
    masked = [c for c in test_masks_ring.cases(2) if c["method"] in fakes]
    assert {c["method"] for c in masked} == {"fake_qring"}
    assert {c["layout"] for c in masked} == set(test_masks_ring.LAYOUTS)
    # Hugging Face parity: every sequence-parallel method that runs here, on both layouts
    hf = [c for c in test_hf_parity.sp_cases("llama", 2) if c[1] in fakes]
    assert {(c[1], c[2]) for c in hf} == {(m, lay) for m in ("fake_qring", "fake_nomask")
                                          for lay in test_hf_parity.LAYOUTS}
    # bytes per link class: every method we implement that runs here, timing variants and layers too
    links = _names(test_double_ring._method_cases(4, 2), "method")
    assert links & fakes == {"fake_qring", "fake_nomask", "fake_qring_no_overlap", "fake_tp"}
    # uneven N: every sequence-parallel method that runs here, on every layout it accepts; the masked
    # cases only for methods that take masks
    uneven = [c for c in test_uneven._cases(2) if c[0] in fakes]
    assert _names(uneven) == {"fake_qring", "fake_nomask"}
    assert {c[2] for c in uneven if c[0] == "fake_qring"} == {"contiguous", "zigzag", "striped", "balanced:2"}
    assert _names(test_uneven._mask_cases(3)) & fakes == {"fake_qring"}


def test_a_method_that_cannot_run_here_is_a_skipped_case_with_its_reason(fakes):
    params = [p for p in method_params(test_defects.strided_cases()) if p.values[0] == "fake_cuda_only"]
    assert len(params) == 2
    for p in params:
        (mark,) = p.marks
        assert mark.name == "skip" and "needs a CUDA-only package" in mark.kwargs["reason"], mark


def test_methods_with_refuses_unknown_capabilities():
    with pytest.raises(ValueError, match=r"level='block' must be one of \('op', 'layer'\)"):
        registry.methods_with(level="block")
    with pytest.raises(ValueError, match="layout='diagonal' must be one of"):
        registry.methods_with(layout="diagonal")
    assert registry.methods_with(layout="balanced:2") == registry.methods_with(layout="balanced")
    assert "usp" not in registry.methods_with(layout="striped")       # its 2-D split cannot form striped


# A plugin module is imported while the registry is being built, so it takes burst_qring from its module.
FAKE_MODULE = '''
from dataclasses import replace
from baselines.methods import burst
QRING = next(m for m in burst.METHODS if m.name == "burst_qring")
METHODS = (replace(QRING, name="fake_collected", colour=None, marker=None),)
'''


def test_pytest_collects_a_method_named_in_the_environment(tmp_path):
    """End to end: a method module named in BURST_METHOD_MODULES is in test_defects' parametrised
    test ids when pytest collects them (a child process: the registry reads the variable at import)."""
    (tmp_path / "fake_collected_module.py").write_text(FAKE_MODULE)
    env = dict(os.environ, BURST_METHOD_MODULES="fake_collected_module",
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/test_defects.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = [line for line in out.stdout.splitlines() if "fake_collected" in line]
    assert any("test_any_strides_match_fp64_reference[fake_collected-3-" in i for i in ids), out.stdout[-2000:]
    assert any("test_fp64_end_to_end[fake_collected-1-" in i for i in ids), out.stdout[-2000:]
