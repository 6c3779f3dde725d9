"""A method is one file: a module that defines ``METHODS`` is all the suite needs.

The module below is written to a temporary folder, imported and registered (``registry.add_module``,
what ``BURST_METHOD_MODULES`` does for users' own modules); with no other edit the method runs, and the
performance model, sequence-level checkpointing, the byte report and the generated methods table know
it. Every fact they use is a field of its ``Method``: the test fails if any of them still reads a
table of names.
"""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

from baselines import registry
from baselines.methods_table import render
from baselines.report_bytes import default_methods
from burst_impl.model.checkpoint import method_mode
from burst_impl.shape import AttnShape
from experiments.perfmodel.model import predict_case
from tests.refs import attention_reference, make_inputs

TOY = '''
from burst_impl import burst_attn_func, volume
from burst_impl.method import Method, Schedule

ORDER = 99


def toy_fn(q, k, v, *, causal=False, softmax_scale=None, group=None, layout="contiguous", **kw):
    return burst_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, layout=layout,
                           backward="burst", **kw)


METHODS = (Method(
    name="toy_qring", level="op", fn=toy_fn, masks=True,
    comm_bytes=lambda s, **_: volume.expected_bytes(s, backward="burst"),
    memory_bytes=lambda s, **_: volume.saved_bytes(s),
    operator_backward="burst", schedule=Schedule("ring", {"default": "burst"}),
    description="a one-file copy of burst_qring, registered from a temporary module",
    travels="fwd: K, V; bwd: Q, dO, lse, delta + dQ ring",
),)
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / "toy_method_module.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("toy_method_module")
    names = registry.add_module(module)
    try:
        yield registry.get("toy_qring")
    finally:
        for n in names:
            registry.METHODS.pop(n, None)
        sys.modules.pop("toy_method_module", None)


def test_a_new_method_needs_only_its_module(toy):
    assert registry.get("toy_qring") is toy
    # it runs (world size 1: no group) and is exact
    q, k, v, do = make_inputs(1, 16, 2, 2, 8, dtype=torch.float64)
    out = toy.call(q, k, v, causal=True)
    # fp64 against the fp64 reference: only summation order differs (errors near 1e-16)
    torch.testing.assert_close(out, attention_reference(q, k, v, do, True)["out"], rtol=1e-12, atol=1e-12)
    # the performance model builds its schedule from Method.schedule, and its bytes are the formula's
    s = AttnShape(1, 8192, 8, 8, 64, 4, causal=True, layout="zigzag")
    p = predict_case("toy_qring", s, mode="fwd_bwd", level="op", hardware="a800_ib_4x8")
    assert p.time_s > 0 and p.bytes_per_rank[0] == {k: b for k, b in toy.bytes(s).items() if b}
    # sequence-level checkpointing can cache its (O, lse): Method.operator_backward
    assert method_mode(toy, "seq") == "seq"
    # the byte report lists it by default, the generated methods table has its row
    assert "toy_qring" in default_methods()
    assert "toy_qring" in render() and toy.description in render()


def test_a_module_without_methods_or_with_a_taken_name_is_refused(toy, tmp_path):
    (tmp_path / "toy_dup_module.py").write_text(TOY)
    with pytest.raises(ValueError, match="'toy_qring' registered twice"):
        registry.add_module(importlib.import_module("toy_dup_module"))
    sys.modules.pop("toy_dup_module", None)
    with pytest.raises(ValueError, match="must define METHODS"):
        registry.add_module(sys.modules[__name__])
