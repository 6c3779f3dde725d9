"""The memory constants (experiments/hardware/memory/memory_terms.yaml) and the device's usable memory.

Every constant carries its source: the loader refuses one without (a ValueError naming the key), and a
bare number, so a constant cannot be added without saying where it comes from. Usable memory is the
reported total less the CUDA context and NCCL's buffers, each from the file (docs/memory.md).
"""
from __future__ import annotations

import copy

import pytest
import yaml

from experiments.perfmodel.usable_memory import TERMS_PATH, Comms, capacity, load_terms, nccl_bytes, parse_terms
from experiments.profiles.hardware import load_hardware

GIB = 2 ** 30


def _raw() -> dict:
    return copy.deepcopy(yaml.safe_load(TERMS_PATH.read_text()))


def _constants(node, key=""):
    if isinstance(node, dict):
        if "value" in node:
            yield key, node
            return
        for k, v in node.items():
            yield from _constants(v, f"{key}.{k}" if key else k)


def test_every_constant_has_a_source():
    terms = load_terms()
    found = dict(_constants(terms))
    assert len(found) >= 20
    for key, c in found.items():
        assert isinstance(c["value"], (int, float)) and len(c["source"]) > 20, key


@pytest.mark.parametrize("edit,key,rule", [
    (lambda d: d["nccl"]["channels"].pop("source"), "nccl.channels", "has no source"),
    (lambda d: d["nccl"]["channels"].update(source="  "), "nccl.channels", "has no source"),
    (lambda d: d["cuda_context"].update(lazy_loading_bytes=287047680), "cuda_context.lazy_loading_bytes",
     "without a source"),
    (lambda d: d["implementations"]["deepspeed_offload_ratio"].update(value="0.8"),
     "implementations.deepspeed_offload_ratio.value", "must be a number"),
    (lambda d: d.update(new_constant=[1, 2]), "new_constant", "lists are names only"),
])
def test_a_constant_without_a_source_is_refused(edit, key, rule):
    raw = _raw()
    edit(raw)
    with pytest.raises(ValueError, match=rf"key '{key}'.*{rule}"):
        parse_terms(raw, "bad.yaml")


def test_usable_memory_of_an_a800():
    """79.33 GiB reported (a published A800 OOM message), less the lazy-loading CUDA context and one process
    group's ring buffers on 4 channels: SIMPLE 4 MiB + LL128 4,915,200 + LL 512 KiB each."""
    a800 = load_hardware("a800_ib_4x8").accelerator
    cap = capacity(a800)
    assert cap["parts"] == {"device_total": int(79.33 * GIB), "cuda_context": -287047680,
                            "nccl_collective": -4 * (4194304 + 4915200 + 524288), "nccl_p2p_intra": 0,
                            "nccl_p2p_inter": 0}
    assert cap["capacity_bytes"] == sum(cap["parts"].values())
    # point-to-point peers: channels x 16 steps x the chunk (512 KiB over NVLink, 128 KiB over the network)
    assert nccl_bytes(Comms(collective=0, p2p_intra=2, p2p_inter=1)) == {
        "nccl_collective": 0, "nccl_p2p_intra": 2 * 4 * 16 * 524288, "nccl_p2p_inter": 4 * 16 * 131072}
    more = capacity(a800, Comms(collective=6, p2p_intra=2, p2p_inter=2))
    assert more["capacity_bytes"] < cap["capacity_bytes"]


def test_a_device_without_a_sourced_total_keeps_its_profile_hbm():
    h100 = load_hardware("h100_sxm_ib_4x8").accelerator
    cap = capacity(h100)
    assert cap["capacity_bytes"] == int(h100.hbm_gib * GIB) and "no sourced device total" in cap["basis"]


def test_the_h200_total_is_the_one_the_gpu_check_measured():
    import json
    from pathlib import Path
    summary = Path(__file__).resolve().parents[1] / "results" / "gpu_check" / "nvidia-h200" / "summary.json"
    measured = json.loads(summary.read_text())["devices"][0]["memory_gib"]
    cap = capacity(load_hardware("h200_sxm_ib_4x8").accelerator)
    assert cap["parts"]["device_total"] == int(measured * GIB)
