"""What a ring's send holds its CPU rank for (experiments/perfmodel/emulated/send_buffer.py): the buffers fitted to
the send probe's rows, the hold they give a send, and the emulated cost model that asks for it."""
from __future__ import annotations

import json

import pytest

from experiments.cluster.emulator.send_probe import CASES, parse_cases, roles
from experiments.perfmodel.costs import CostModel
from experiments.perfmodel.emulated.costs import EmulatedCosts
from experiments.perfmodel.emulated.send_buffer import SEND_FILE, fit_send_buffers, load_send_buffers
from experiments.profiles.hardware import load_hardware

MIB = 1 << 20
RATE = 17e6                # bytes/s, the 2 x 4 mirror's inter-node rate
BASE = 0.0005              # s a send's post and wake-up take whatever its size


def _rows(pattern: str, buffer: float, rate: float, sizes) -> list[dict]:
    """Rows of a sender held while its bytes beyond ``buffer`` drain at ``rate``."""
    return [{"pattern": pattern, "bytes": n, "recv_s": n / rate, "send_s": BASE + max(0.0, n - buffer) / rate}
            for n in sizes]


def test_the_fit_finds_the_buffer_a_sender_was_not_held_for():
    rows = _rows("oneway", 1.1 * MIB, RATE, [131072, 524288, 2 * MIB, 4 * MIB, 8 * MIB])
    rows += _rows("intra", 16 * MIB, 250e6, [4096, 131072, 8 * MIB])  # never held: a lower bound
    rows += _rows("intra", 0, 1e12, [8])   # the smallest row: the base; rows no longer than 10 x it tell nothing
    s = fit_send_buffers(rows, "p.json")
    assert s.bytes_by_class["inter"] == pytest.approx(1.1 * MIB, rel=1e-9)
    assert s.bytes_by_class["intra"] == 8 * MIB and s.at_least == {"intra"}
    assert ">= 8.00 MiB" in s.text and "inter 1.10 MiB" in s.text and "p.json" in s.text
    # a send that fits releases its sender at the rendezvous; one twice the buffer half-way through its transfer
    assert s.hold(524288, 0.03, same_node=False) == 0.0
    assert s.hold(2.2 * MIB, 0.14, same_node=False) == pytest.approx(0.07, rel=1e-9)
    assert s.hold(8 * MIB, 0.03, same_node=True) == 0.0


def test_a_class_the_probe_did_not_measure_holds_its_sender_until_the_bytes_land():
    s = fit_send_buffers(_rows("oneway", MIB, RATE, [65536, 2 * MIB, 4 * MIB]))
    assert s.hold(MIB, 0.01, same_node=True) is None
    with pytest.raises(ValueError, match="no row"):
        fit_send_buffers([])


def test_the_cost_models_release_a_sender_as_measured():
    hw = load_hardware("a800_ib_4x8")
    assert CostModel(hw, "float32").sender_release(MIB, 0.1, False) is None          # NCCL: when it lands
    assert EmulatedCosts(hw, "float32").sender_release(MIB, 0.1, False) is None      # no probe: the same
    s = fit_send_buffers(_rows("oneway", MIB, RATE, [65536, 2 * MIB, 4 * MIB]))
    assert EmulatedCosts(hw, "float32", sends=s).sender_release(3 * MIB, 0.3, False) == pytest.approx(0.2, rel=1e-2)


def test_the_probe_file_is_read_for_its_profile(tmp_path):
    rec = {"profile": "t_emu", "rows": _rows("oneway", MIB, RATE, [65536, 2 * MIB, 4 * MIB])}
    (tmp_path / SEND_FILE).write_text(json.dumps(rec))
    assert load_send_buffers(tmp_path, "t_emu").bytes_by_class["inter"] == pytest.approx(MIB, rel=1e-2)
    assert load_send_buffers(tmp_path, "other_emu") is None and load_send_buffers(tmp_path / "none", "t_emu") is None


def test_the_probes_roles_pair_every_sender_with_a_receiver():
    for world, per_node in ((8, 4), (4, 2), (12, 4)):
        for pattern in ("oneway", "intra"):
            sends = {r: roles(pattern, r, world, per_node)[0] for r in range(world)}
            recvs = {r: roles(pattern, r, world, per_node)[1] for r in range(world)}
            pairs = {d: r for r, d in sends.items() if d is not None}
            assert pairs and pairs == {r: s for r, s in recvs.items() if s is not None}
    assert [c.name for c in parse_cases("oneway:4096,intra:8")] == ["oneway:4096", "intra:8"]
    assert {c.pattern for c in CASES} == {"oneway", "intra"}
    with pytest.raises(ValueError, match="pattern"):
        parse_cases("ring:4096")
