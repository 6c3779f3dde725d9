"""Cluster profiles: where a spec runs (the spec's ``cluster:`` key).

``cpu`` is built in: this machine, gloo, torchrun --standalone. ``local`` is
this machine with whatever it has (NCCL on its GPUs, else gloo). Other
cluster profiles are YAML files in ``experiments/clusters/<name>.yaml`` and
run through the SLURM template (``experiments.cluster.slurm``); each names
the hardware profile it is made of (``experiments.cluster.hardware``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import yaml

PROFILE_DIR = Path(__file__).resolve().parents[1] / "clusters"


@dataclass(frozen=True)
class Profile:
    name: str
    scheduler: str                   # "local" (torchrun --standalone here) or "slurm"
    device: str                      # "cpu", "cuda" or "auto" (cuda when available)
    nodes: int = 1
    gpus_per_node: int = 0           # 0 for CPU clusters
    max_local_world: int = 8         # local CPU clusters: most processes per case
    description: str = ""
    partition: str = "<PARTITION>"
    account: str = "<ACCOUNT>"
    time_limit: str = "04:00:00"
    cpus_per_gpu: int = 8
    setup: tuple[str, ...] = ()      # shell lines run on each node before torchrun (modules, venv)
    python: str = ".venv/bin/python"
    sbatch_extra: tuple[str, ...] = ()  # extra "#SBATCH ..." options, e.g. "--qos=high"
    master_port: int = 29500
    hardware: str | None = None      # the hardware profile it is made of (experiments/hardware/<name>.yaml)
    path: str = "<builtin>"

    @property
    def max_world(self) -> int:
        return self.nodes * self.gpus_per_node if self.scheduler == "slurm" else self.max_local_world

    def world_size_rule(self, world_size: int) -> str | None:
        """Why ``world_size`` cannot run on this cluster, or None if it can."""
        if world_size > self.max_world:
            return f"world_size={world_size} exceeds the {self.max_world} processes of cluster {self.name!r}"
        if self.scheduler == "slurm" and world_size > self.gpus_per_node and world_size % self.gpus_per_node:
            return (f"world_size={world_size} spans nodes, so it must be a multiple of "
                    f"gpus_per_node={self.gpus_per_node} of cluster {self.name!r}")
        return None

    def nodes_for(self, world_size: int) -> int:
        if self.scheduler != "slurm" or world_size <= self.gpus_per_node:
            return 1
        return world_size // self.gpus_per_node

    def procs_per_node(self, world_size: int) -> int:
        return world_size // self.nodes_for(world_size)


BUILTIN = {
    "cpu": Profile(name="cpu", scheduler="local", device="cpu", max_local_world=8,
                   description="this machine's CPUs, gloo, one process per rank"),
    "local": Profile(name="local", scheduler="local", device="auto", max_local_world=64,
                     description="this machine: NCCL on its GPUs if it has any, else gloo"),
}

_KEYS = {f.name for f in fields(Profile)} - {"path"}


def load_profile(name_or_path: str) -> Profile:
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    p = Path(name_or_path)
    if not p.suffix:
        p = PROFILE_DIR / f"{name_or_path}.yaml"
    if not p.exists():
        known = sorted(BUILTIN) + sorted(x.stem for x in PROFILE_DIR.glob("*.yaml"))
        raise ValueError(f"cluster={name_or_path!r}: no such cluster profile; known: {known}")
    raw = yaml.safe_load(p.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: a profile must be a mapping")
    unknown = set(raw) - _KEYS
    if unknown:
        raise ValueError(f"{p}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_KEYS)}")
    raw.setdefault("name", p.stem)
    raw.setdefault("scheduler", "slurm")
    raw.setdefault("device", "cuda")
    for key in ("setup", "sbatch_extra"):
        if key in raw:
            if not isinstance(raw[key], list):
                raise ValueError(f"{p}: key {key!r} must be a list of strings")
            raw[key] = tuple(str(x) for x in raw[key])
    prof = Profile(**raw, path=str(p))
    if prof.scheduler not in ("local", "slurm"):
        raise ValueError(f"{p}: key 'scheduler'={prof.scheduler!r} must be 'local' or 'slurm'")
    if prof.device not in ("cpu", "cuda", "auto"):
        raise ValueError(f"{p}: key 'device'={prof.device!r} must be 'cpu', 'cuda' or 'auto'")
    if prof.hardware is not None:
        from .hardware import load_hardware

        hw = load_hardware(prof.hardware)   # ValueError naming the file and key if it is wrong
        if prof.scheduler == "slurm" and (hw.nodes, hw.devices_per_node) != (prof.nodes, prof.gpus_per_node):
            raise ValueError(f"{p}: nodes={prof.nodes} x gpus_per_node={prof.gpus_per_node} disagree with "
                             f"hardware {prof.hardware!r} ({hw.nodes} x {hw.devices_per_node})")
    for key in ("nodes", "gpus_per_node"):
        if prof.scheduler == "slurm" and getattr(prof, key) < 1:
            raise ValueError(f"{p}: key {key!r}={getattr(prof, key)} must be at least 1 for SLURM")
    return prof
