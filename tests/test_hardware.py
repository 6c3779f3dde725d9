"""Hardware profiles (experiments/hardware/*.yaml): every file loads, rates follow the stated convention,
bad numbers are errors naming the key."""
from __future__ import annotations

import copy

import pytest
import yaml

from experiments.profiles.hardware import HARDWARE_DIR, known_hardware, load_hardware, parse_hardware
from experiments.profiles.cluster import load_profile


@pytest.mark.parametrize("name", known_hardware())
def test_every_profile_loads_with_sources(name):
    hw = load_hardware(name)
    assert hw.accelerator.source and hw.intra.source
    assert hw.inter is not None or hw.nodes == 1
    assert hw.inter is None or hw.inter.source         # every link's constants say where they come from
    # memory constants (experiments/hardware/memory/memory_terms.yaml): tests/test_memory_terms.py
    # efficiency is interpolated between the table's points and clamped outside them
    pts = hw.accelerator.attn_efficiency
    assert hw.accelerator.efficiency(1) == pts[0][1] and hw.accelerator.efficiency(1 << 30) == pts[-1][1]


def test_link_rate_convention():
    hw = load_hardware("a100_pcie_roce_4x8")
    # 600 Gb/s per node, 80% efficiency, shared by 8 GPUs: 7.5 GB/s per GPU per direction
    assert hw.inter.bytes_per_s == pytest.approx(600e9 / 8 * 0.8 / 8)
    assert hw.link(same_node=False) is hw.inter and hw.link(same_node=True) is hw.intra
    assert hw.inter.transfer_s(7.5e9) == pytest.approx(1.0 + 5e-6)


def test_interpolation_is_log_linear():
    acc = load_hardware("a100_pcie_8").accelerator
    (t0, e0), (t1, e1) = acc.attn_efficiency[:2]
    mid = int((t0 * t1) ** 0.5)   # geometric midpoint: halfway in log2
    assert acc.efficiency(mid) == pytest.approx((e0 + e1) / 2, abs=1e-3)


def test_cluster_profiles_name_their_hardware():
    for name in ("a100_8", "a100_8_p2p_off", "a100_32", "a800_32"):
        prof = load_profile(name)
        hw = load_hardware(prof.hardware)
        assert (hw.nodes, hw.devices_per_node) == (prof.nodes, prof.gpus_per_node)


@pytest.mark.parametrize("edit,key", [
    (lambda d: d["intra"].update(gbits_s=0), "intra.gbits_s"),
    (lambda d: d["intra"].update(efficiency=1.5), "intra.efficiency"),
    (lambda d: d["inter"].update(kind="carrier-pigeon"), "inter.kind"),
    (lambda d: d["accelerator"].update(attn_efficiency=[[4096, 0.5], [1024, 0.4]]), "accelerator.attn_efficiency"),
    (lambda d: d["accelerator"]["peak_tflops"].update(bfloat16=-1), "accelerator.peak_tflops.bfloat16"),
    (lambda d: d.pop("inter"), "inter"),
    (lambda d: d["accelerator"].update(gemm_efficiency=1.2), "accelerator.gemm_efficiency"),
    (lambda d: d["accelerator"].update(attn_efficiency_forward=[[512, 0.0]]), "accelerator.attn_efficiency_forward"),
    (lambda d: d.update(gpus=8), "gpus"),
    (lambda d: d["intra"].update(transport="carrier-pigeon"), "intra.transport"),
    (lambda d: d["inter"].update(transport="shm"), "inter.transport"),          # SHM is an intra-node transport
    (lambda d: d["intra"].update(step_latency_us=99), "intra.step_latency_us"),  # above latency_us
    (lambda d: d["accelerator"].update(attn_grid={"sms": 0, "tile_rows": 128}), "accelerator.attn_grid.sms"),
    (lambda d: d["accelerator"].update(attn_grid={"sms": 108}), "accelerator.attn_grid.tile_rows"),
    (lambda d: d["accelerator"].update(attn_grid={"sms": 108, "tile_rows": 128, "warps": 8}),
     "accelerator.attn_grid.warps"),
])
def test_bad_profiles_name_the_key(edit, key):
    raw = yaml.safe_load((HARDWARE_DIR / "a100_pcie_roce_4x8.yaml").read_text())
    raw = copy.deepcopy(raw)
    edit(raw)
    with pytest.raises(ValueError, match=f"key '{key}'"):
        parse_hardware(raw, "bad.yaml")


def test_forward_table_is_optional():
    h100, a100 = load_hardware("h100_sxm_ib_4x8").accelerator, load_hardware("a100_pcie_8").accelerator
    assert h100.forward_efficiency(16384) > h100.efficiency(16384)   # forward alone runs closer to peak
    assert a100.attn_efficiency_forward is None and a100.forward_efficiency(4096) == a100.efficiency(4096)


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match="known: .*a800_ib_4x8"):
        load_hardware("nope")


# ---------------------------------------------------------------- NICs


def test_nics_and_the_rank_to_nic_map():
    a800, roce, h100 = (load_hardware(n) for n in ("a800_ib_4x8", "a100_pcie_roce_4x8", "h100_sxm_ib_4x8"))
    assert (a800.nics, a800.ranks_per_nic) == (4, 2) and [a800.nic_of(k) for k in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert (roce.nics, roce.ranks_per_nic) == (1, 8) and {roce.nic_of(k) for k in range(8)} == {0}
    assert (h100.nics, h100.ranks_per_nic) == (8, 1)
    with pytest.raises(ValueError, match="local_rank=8"):
        a800.nic_of(8)


def test_a_lone_flow_gets_the_nic_and_concurrent_flows_split_it():
    a800 = load_hardware("a800_ib_4x8")
    hca = 200e9 / 8 * 0.85
    assert a800.inter.nic_bytes_per_s == pytest.approx(hca)
    assert a800.inter_flow_bytes_per_s(1) == pytest.approx(hca)
    assert a800.inter_flow_bytes_per_s(2) == pytest.approx(hca / 2) == pytest.approx(a800.inter.bytes_per_s)
    # a one-NIC PCIe node: a lone flow is capped by the GPU's own PCIe link, 8 flows split the NIC
    roce = load_hardware("a100_pcie_roce_4x8")
    assert roce.inter_flow_bytes_per_s(1) == pytest.approx(roce.intra.bytes_per_s)      # 24 GB/s < 60 GB/s
    assert roce.inter_flow_bytes_per_s(8) == pytest.approx(600e9 / 8 * 0.8 / 8)
    # an emulated node slice: a NIC of q per-rank shares
    assert roce.inter_flow_bytes_per_s(1, ranks_per_nic=2) == pytest.approx(2 * roce.inter.bytes_per_s)
    with pytest.raises(ValueError, match="flows=0"):
        a800.inter_flow_bytes_per_s(0)


@pytest.mark.parametrize("edit,key,rule", [
    (lambda d: d.update(nics_per_node=3), "nics_per_node", "must divide devices_per_node=8"),
    (lambda d: d.update(nics_per_node=16), "nics_per_node", "must divide devices_per_node=8"),
    (lambda d: d.update(nics_per_node=-1), "nics_per_node", "integer >= 0"),
    (lambda d: d.update(nics_per_node=2.0), "nics_per_node", "integer >= 0"),
    (lambda d: d.update(nics_per_node=8), "inter.shared_by", "disagrees with devices_per_node=8 / nics_per_node=8"),
    (lambda d: (d.pop("nics_per_node"), d["inter"].update(shared_by=3)), "inter.shared_by", "must divide"),
])
def test_bad_nic_counts_name_the_key_value_and_rule(edit, key, rule):
    raw = copy.deepcopy(yaml.safe_load((HARDWARE_DIR / "a800_ib_4x8.yaml").read_text()))
    edit(raw)
    with pytest.raises(ValueError, match=rf"key '{key}': .*{rule}"):
        parse_hardware(raw, "bad.yaml")


def test_nics_derived_from_shared_by_when_absent():
    raw = copy.deepcopy(yaml.safe_load((HARDWARE_DIR / "a800_ib_4x8.yaml").read_text()))
    raw.pop("nics_per_node")
    assert parse_hardware(raw, "x.yaml").nics_per_node == 4


# ---------------------------------------------------------------- the sourced PCIe server (issue 35)


def test_the_tables_server_as_the_authors_ran_it():
    """BurstAttention's Tables 2-3 ran with NCCL_P2P_DISABLE=1: their cluster sets it and its profile's intra
    rate is the host-staged one (10 GB/s per direction), not a100_pcie_8's P2P-like 24."""
    prof = load_profile("a100_8_p2p_off")
    hw = load_hardware(prof.hardware)
    assert prof.env["NCCL_P2P_DISABLE"] == "1" and hw.intra.transport == "shm"
    assert hw.intra.bytes_per_s == pytest.approx(10e9) and load_hardware("a100_pcie_8").intra.transport is None
    assert hw.accelerator.attn_grid.sms == 108 and hw.intra.step_latency_us == 5.7


@pytest.mark.parametrize("blocks,w", [(128, 128 / 216), (108, 1.0), (216, 1.0), (1024, 1024 / 1080), (1, 1 / 108)])
def test_wave_efficiency_is_the_busy_share_of_the_slots(blocks, w):
    acc = load_hardware("a100_pcie_8_sourced").accelerator        # 108 SMs x 1 block
    assert acc.wave_efficiency(blocks) == pytest.approx(w)
    assert load_hardware("a100_pcie_8").accelerator.wave_efficiency(blocks) == 1.0   # no grid: no factor
