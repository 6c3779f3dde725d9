"""The device's usable memory per rank, and the memory constants' file (docs/memory.md, "The device's usable memory").

    usable = total as the CUDA runtime reports it - CUDA context - NCCL's buffers

Every constant comes from ``experiments/hardware/memory/memory_terms.yaml``, each with its source;
``load_terms`` refuses a constant without one (a ValueError naming the key). A model's OOM verdict
compares its peak against ``capacity``:

* total: ``device_total`` of the accelerator (by the hardware profile's ``accelerator.name``); a device
  with no sourced total (the emulated cluster, H100/H200, test profiles) keeps the profile's ``hbm_gib``
  and nothing is subtracted (its record says so);
* CUDA context: one per process, one process per rank (``cuda_context.lazy_loading_bytes``);
* NCCL's buffers (allocated outside PyTorch's allocator, so in neither its allocated nor its reserved
  count, but taken from what it can get), for the communicators the implementation creates
  (``Comms``): per communicator that runs collectives, each channel's ring connection holds one
  buffer per protocol (SIMPLE + LL128 + LL; ``src/init.cc`` computeBuffSizes, ``net.cc`` lines
  914-920); per point-to-point peer, channels x 16 steps x the p2p chunk of its link (``net.cc``
  lines 646, 666). Channels: the authors' ``NCCL_MIN_NCHANNELS=4`` (a lower bound: NCCL may open more).

Not subtracted: other device memory outside PyTorch's allocator (cuBLAS workspaces, loaded kernels;
one sourced data point of "context plus libraries", 0.51 GiB on an A800, is a cross-check in the
YAML), and the allocator's fragmentation (reserved minus allocated: a behaviour, no sourced constant).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..harness.env import REPO

TERMS_PATH = REPO / "experiments" / "hardware" / "memory" / "memory_terms.yaml"
GIB = 2 ** 30
NAMES = ("commit", "source_commit", "accelerators")      # keys that hold names, not constants


def _check(node, key: str, path) -> None:
    """Every number is the ``value`` of a mapping with a non-empty ``source`` (module docstring)."""
    if isinstance(node, dict):
        if "value" in node:
            src = node.get("source")
            if not isinstance(src, str) or not src.strip():
                raise ValueError(f"{path}: key '{key}': constant {node['value']!r} has no source (a datasheet, an "
                                 "implementation's file and function, or a published measurement)")
            if isinstance(node["value"], bool) or not isinstance(node["value"], (int, float)):
                raise ValueError(f"{path}: key '{key}.value': {node['value']!r} must be a number")
            return
        for k, v in node.items():
            _check(v, f"{key}.{k}" if key else str(k), path)
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        raise ValueError(f"{path}: key '{key}': {node!r} is a constant without a source; write it as "
                         "{value: ..., source: ...}")
    elif isinstance(node, list) and key.rsplit(".", 1)[-1] not in NAMES:
        raise ValueError(f"{path}: key '{key}': lists are names only ({', '.join(NAMES)})")


def parse_terms(raw: dict, path: str | Path = "<memory>") -> dict:
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a mapping of memory constants")
    _check(raw, "", path)
    return raw


@functools.cache
def load_terms(path: str | Path = TERMS_PATH) -> dict:
    return parse_terms(yaml.safe_load(Path(path).read_text()), path)


def value(*keys: str) -> float:
    """The constant at ``keys`` (e.g. ``value("nccl", "channels")``)."""
    node = load_terms()
    for k in keys:
        node = node[k]
    return node["value"]


@dataclass(frozen=True)
class Comms:
    """NCCL communicators a rank holds (that run collectives) and its point-to-point peers by link."""

    collective: int = 1        # communicators that run collectives (the process group at least)
    p2p_intra: int = 0         # point-to-point peers in the node (NVLink or PCIe)
    p2p_inter: int = 0         # point-to-point peers across nodes (network)
    source: str = "one process group (torch.distributed's NCCL communicator)"


def nccl_bytes(comms: Comms, intra_kind: str = "nvlink") -> dict:
    """NCCL's device buffers per rank for ``comms`` (module docstring), by part."""
    ch = value("nccl", "channels")
    ring = ch * (value("nccl", "buffsize_simple_bytes") + value("nccl", "buffsize_ll128_bytes")
                 + value("nccl", "buffsize_ll_bytes"))
    steps = value("nccl", "shared_p2p_steps")
    chunk_intra = value("nccl", "p2p_chunk_nvlink_bytes" if intra_kind == "nvlink" else "p2p_chunk_pci_bytes")
    return {"nccl_collective": int(comms.collective * ring),
            "nccl_p2p_intra": int(comms.p2p_intra * ch * steps * chunk_intra),
            "nccl_p2p_inter": int(comms.p2p_inter * ch * steps * value("nccl", "p2p_chunk_net_bytes"))}


def device_total_gib(accelerator_name: str) -> float | None:
    """The sourced total of ``accelerator_name`` (GiB), None if the YAML has none."""
    for entry in load_terms()["device_total"].values():
        if accelerator_name in entry["accelerators"]:
            return entry["gib"]["value"]
    return None


def capacity(accelerator, comms: Comms | None = None, intra_kind: str = "nvlink") -> dict:
    """``{"capacity_bytes", "parts", "basis"}``: what the rank's tensors may take on ``accelerator`` (a hardware
    profile's ``Accelerator``) with the implementation's NCCL ``comms`` (None: one process group)."""
    total = device_total_gib(accelerator.name)
    if total is None:
        return {"capacity_bytes": int(accelerator.hbm_gib * GIB), "parts": {"hbm_gib": int(accelerator.hbm_gib * GIB)},
                "basis": f"the profile's hbm_gib ({accelerator.hbm_gib:g} GiB): no sourced device total for "
                         f"{accelerator.name!r} in {TERMS_PATH.name}, nothing subtracted"}
    parts = {"device_total": int(total * GIB), "cuda_context": -int(value("cuda_context", "lazy_loading_bytes"))}
    parts.update({k: -v for k, v in nccl_bytes(comms or Comms(), intra_kind).items()})
    return {"capacity_bytes": sum(parts.values()), "parts": parts,
            "basis": f"usable memory: {accelerator.name} reports {total:g} GiB, less the CUDA context and NCCL's "
                     f"buffers ({(comms or Comms()).source}); {TERMS_PATH.name}"}
