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
    for name in ("a100_8", "a100_32", "a800_32"):
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
