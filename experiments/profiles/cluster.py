"""Cluster profiles: where a spec runs (the spec's ``cluster:`` key).

``cpu`` is built in: this machine, gloo, torchrun --standalone. ``local`` is
this machine with whatever it has (NCCL on its GPUs, else gloo). Other
profiles are YAML files in ``experiments/clusters/<name>.yaml``, one of three
schedulers:

* ``slurm``: a real cluster, one batch job per (spec, world size) rendered by
  ``slurm.py`` and submitted with sbatch;
* ``emulated``: ``nodes`` x ``ranks_per_node`` CPU ranks on this machine, each
  node a network namespace with links shaped to scale ``hardware`` (a
  hardware profile, ``hardware.py``) down to this machine's compute rate
  (``emulator/emulation.py``), ``nics_per_node`` NICs per node shared by its ranks
  (default one per rank; ``emulated_target`` is the hardware at that shape,
  for the performance model). ``launcher: torchrun`` starts one torchrun per node
  namespace; ``launcher: slurm`` runs munge, slurmctld and one slurmd per node
  inside the namespaces and submits the very job script a real cluster gets;
* ``local``: the built-ins.

Every key is checked on load: an unknown key, a missing or impossible number
is a ValueError naming the file, the key and the rule.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from .hardware import load_hardware

PROFILE_DIR = Path(__file__).resolve().parents[1] / "clusters"
SCHEDULERS = ("local", "slurm", "emulated")
LAUNCHERS = ("torchrun", "slurm")
LINK_CLASSES = ("intra", "inter")
PLACEHOLDER = re.compile(r"<[A-Z_]+>")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Profile:
    name: str
    scheduler: str                   # "local", "slurm" or "emulated"
    device: str                      # "cpu", "cuda" or "auto" (cuda when available)
    nodes: int = 1
    gpus_per_node: int = 0           # 0 for CPU clusters
    max_local_world: int = 8         # local CPU clusters: most processes per case
    description: str = ""
    partition: str = "<PARTITION>"
    account: str = "<ACCOUNT>"       # "" or null: no --account line
    time_limit: str = "04:00:00"
    cpus_per_gpu: int = 8            # cpus per rank (GPU or emulated CPU rank)
    setup: tuple[str, ...] = ()      # shell lines in the batch script (modules, venv): their env reaches srun tasks
    node_setup: tuple[str, ...] = ()  # shell lines run once on every node, inside srun, before the first launch
    python: str = ".venv/bin/python"
    sbatch_extra: tuple[str, ...] = ()  # extra "#SBATCH ..." options, e.g. "--qos=high"
    master_port: int = 29500         # base; a job adds SLURM_JOB_ID % 2000 so concurrent jobs differ
    env: dict = field(default_factory=dict)   # exported in job scripts (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...)
    hardware: str | None = None      # the hardware profile it is made of (experiments/hardware/<name>.yaml)
    # emulated only
    ranks_per_node: int = 0
    # NICs per emulated node (0: one per rank, every rank shaped at its per-rank share, the pre-NIC
    # convention); ranks_per_node / nics_per_node consecutive ranks share one shaped NIC (emulator/shaping.py)
    nics_per_node: int = 0
    launcher: str = "torchrun"
    link_rates: dict | None = None   # {intra: bytes/s, inter: bytes/s}: given rates, no calibration
    latency_cap_us: float = 2000.0
    calibration_tokens: int | None = None   # block tokens to calibrate at (default: the specs' largest N/G)
    path: str = "<builtin>"

    @property
    def per_node(self) -> int:
        return self.ranks_per_node if self.scheduler == "emulated" else self.gpus_per_node

    @property
    def ranks_per_nic(self) -> int:
        """Ranks of an emulated node sharing one NIC (1 where every rank has its own)."""
        return self.ranks_per_node // self.nics_per_node if self.nics_per_node else 1

    @property
    def via_slurm(self) -> bool:
        return self.scheduler == "slurm" or (self.scheduler == "emulated" and self.launcher == "slurm")

    @property
    def max_world(self) -> int:
        return self.nodes * self.per_node if self.scheduler != "local" else self.max_local_world

    def world_size_rule(self, world_size: int) -> str | None:
        """Why ``world_size`` cannot run on this cluster, or None if it can."""
        if world_size > self.max_world:
            return f"world_size={world_size} exceeds the {self.max_world} processes of cluster {self.name!r}"
        if self.scheduler != "local" and world_size > self.per_node and world_size % self.per_node:
            key = "ranks_per_node" if self.scheduler == "emulated" else "gpus_per_node"
            return (f"world_size={world_size} spans nodes, so it must be a multiple of "
                    f"{key}={self.per_node} of cluster {self.name!r}")
        return None

    def nodes_for(self, world_size: int) -> int:
        if self.scheduler == "local" or world_size <= self.per_node:
            return 1
        return world_size // self.per_node

    def procs_per_node(self, world_size: int) -> int:
        return world_size // self.nodes_for(world_size)

    @property
    def time_limit_s(self) -> int:
        return parse_time_limit(self.time_limit)

    def placeholders(self) -> list[str]:
        """Keys still holding a ``<PLACEHOLDER>`` that must be filled in before a job is submitted."""
        out = [k for k in ("partition", "account") if PLACEHOLDER.search(str(getattr(self, k) or ""))]
        out += [f"env.{k}" for k, v in self.env.items() if PLACEHOLDER.search(str(v))]
        out += [f"setup[{i}]" for i, s in enumerate(self.setup) if PLACEHOLDER.search(s)]
        return out


BUILTIN = {
    "cpu": Profile(name="cpu", scheduler="local", device="cpu", max_local_world=8,
                   description="this machine's CPUs, gloo, one process per rank"),
    "local": Profile(name="local", scheduler="local", device="auto", max_local_world=64,
                     description="this machine: NCCL on its GPUs if it has any, else gloo"),
}

_KEYS = {f.name for f in fields(Profile)} - {"path"}


def parse_time_limit(text: str) -> int:
    """SLURM's time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) -> seconds."""
    m = _TIME.match(str(text).strip())
    if not m:
        raise ValueError(f"time_limit={text!r} is not a SLURM time (e.g. 04:00:00 or 1-12:00:00)")
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:                       # D-HH[:MM[:SS]]
        h, mi, s = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + mi) * 60 + s
    if len(parts) == 1:                         # MM
        return parts[0] * 60
    if len(parts) == 2:                         # MM:SS
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def _err(p, key: str, rule: str) -> ValueError:
    return ValueError(f"{p}: key {key!r}: {rule}")


def _int(p, raw: dict, key: str, low: int) -> None:
    v = raw.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise _err(p, key, f"{v!r} must be an integer >= {low}")


def _validate(p, raw: dict) -> None:
    if raw["scheduler"] not in SCHEDULERS:
        raise _err(p, "scheduler", f"{raw['scheduler']!r} must be one of {SCHEDULERS}")
    if raw["device"] not in ("cpu", "cuda", "auto"):
        raise _err(p, "device", f"{raw['device']!r} must be 'cpu', 'cuda' or 'auto'")
    for key, low in (("nodes", 1), ("gpus_per_node", 0), ("cpus_per_gpu", 1), ("max_local_world", 1),
                     ("ranks_per_node", 0), ("master_port", 1024), ("calibration_tokens", 1), ("nics_per_node", 0)):
        _int(p, raw, key, low)
    if raw.get("master_port", 0) > 65535 - 2000 - 10:
        raise _err(p, "master_port", f"{raw['master_port']} leaves no room for per-job ports (<= 63525)")
    for key in ("setup", "node_setup", "sbatch_extra"):
        if key in raw:
            if not isinstance(raw[key], list) or not all(isinstance(x, str) for x in raw[key]):
                raise _err(p, key, "must be a list of strings")
            raw[key] = tuple(raw[key])
    env = raw.get("env", {}) or {}
    if not isinstance(env, dict):
        raise _err(p, "env", "must be a mapping NAME: value")
    for k, v in env.items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise _err(p, f"env.{k}", "must be a shell variable name")
        if not isinstance(v, (str, int, float)) or isinstance(v, bool):
            raise _err(p, f"env.{k}", f"{v!r} must be a string or a number")
    raw["env"] = {k: str(v) for k, v in env.items()}
    if raw.get("account") is None:
        raw["account"] = ""
    try:
        parse_time_limit(raw.get("time_limit", "04:00:00"))
    except ValueError as e:
        raise _err(p, "time_limit", str(e)) from None
    lat = raw.get("latency_cap_us", 0.0)
    if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not (lat >= 0 and math.isfinite(lat)):
        raise _err(p, "latency_cap_us", f"{lat!r} must be a non-negative number")
    if raw["scheduler"] == "slurm":
        for key in ("nodes", "gpus_per_node"):
            if raw.get(key, 1 if key == "nodes" else 0) < 1:
                raise _err(p, key, "must be at least 1 for SLURM")
    if raw["scheduler"] == "emulated":
        _validate_emulated(p, raw)
    elif any(k in raw for k in _EMULATED_ONLY):
        bad = next(k for k in _EMULATED_ONLY if k in raw)
        raise _err(p, bad, "only applies to scheduler: emulated")


_EMULATED_ONLY = ("ranks_per_node", "nics_per_node", "link_rates", "calibration_tokens", "launcher")


def _validate_nics(p, raw: dict, hw) -> None:
    """An emulated node's NICs: they divide its ranks evenly, and no NIC carries more ranks than one of
    the hardware's does (its rate is ranks_per_nic x the per-rank share, so more ranks would make a lone
    flow faster than the real NIC)."""
    nics, per_node = raw.get("nics_per_node", 0), raw["ranks_per_node"]
    if not nics:
        return
    if nics > per_node or per_node % nics:
        raise _err(p, "nics_per_node", f"{nics} must divide ranks_per_node={per_node} (every NIC shared by "
                                       "the same number of ranks, at least one)")
    if hw.inter is not None and per_node // nics > hw.ranks_per_nic:
        raise _err(p, "nics_per_node", f"{nics} puts {per_node // nics} ranks on one NIC, more than the "
                                       f"{hw.ranks_per_nic} of hardware {hw.name!r} (inter.shared_by)")


def _validate_emulated(p, raw: dict) -> None:
    if raw["device"] != "cpu":
        raise _err(p, "device", f"{raw['device']!r}: emulated nodes run CPU ranks; use device: cpu")
    if not raw.get("hardware"):
        raise _err(p, "hardware", "is required for scheduler: emulated (the hardware the links scale to)")
    if raw.get("ranks_per_node", 0) < 1:
        raise _err(p, "ranks_per_node", f"{raw.get('ranks_per_node')!r} must be an integer >= 1 for emulated")
    if raw.get("launcher", "torchrun") not in LAUNCHERS:
        raise _err(p, "launcher", f"{raw['launcher']!r} must be one of {LAUNCHERS}")
    hw = load_hardware(raw["hardware"])
    if raw.get("nodes", 1) > 1 and hw.inter is None:
        raise _err(p, "nodes", f"{raw['nodes']} nodes need an inter-node link, and hardware {hw.name!r} has none")
    _validate_nics(p, raw, hw)
    rates = raw.get("link_rates")
    if rates is not None:
        if not isinstance(rates, dict):
            raise _err(p, "link_rates", "must map link classes (intra, inter) to bytes/s")
        for k, v in rates.items():
            if k not in LINK_CLASSES:
                raise _err(p, f"link_rates.{k}", f"unknown link class; choose from {LINK_CLASSES}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
                raise _err(p, f"link_rates.{k}", f"{v!r} must be a positive number of bytes/s")
        need = [c for c, n in (("intra", raw["ranks_per_node"]), ("inter", raw.get("nodes", 1))) if n > 1]
        for c in need:
            if c not in rates:
                raise _err(p, f"link_rates.{c}", "is required: the topology has links of this class")


def parse_profile(raw, p: str | Path = "<memory>") -> Profile:
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: a profile must be a mapping")
    unknown = set(raw) - _KEYS
    if unknown:
        raise _err(p, sorted(unknown)[0], f"unknown key; allowed: {sorted(_KEYS)}")
    raw = dict(raw)
    raw.setdefault("name", Path(str(p)).stem)
    raw.setdefault("scheduler", "slurm")
    raw.setdefault("device", "cuda" if raw["scheduler"] == "slurm" else "cpu")
    _validate(p, raw)
    prof = Profile(**raw, path=str(p))
    if prof.hardware is not None:
        hw = load_hardware(prof.hardware)   # ValueError naming the file and key if it is wrong
        if prof.scheduler == "slurm" and (hw.nodes, hw.devices_per_node) != (prof.nodes, prof.gpus_per_node):
            raise _err(p, "nodes", f"nodes={prof.nodes} x gpus_per_node={prof.gpus_per_node} disagree with "
                                   f"hardware {prof.hardware!r} ({hw.nodes} x {hw.devices_per_node})")
    return prof


def emulated_target(prof: Profile):
    """The hardware an emulated profile stands for, at its own shape: ``prof.nodes`` nodes of
    ``ranks_per_node`` devices of its hardware profile, ``ranks_per_nic`` of them per NIC, each NIC
    carrying that many of the hardware's per-rank shares (as the emulator shapes it, before the time
    dilation): what the performance model predicts an emulated run on (``experiments.perfmodel``)."""
    if prof.scheduler != "emulated":
        raise ValueError(f"cluster={prof.name!r} has scheduler={prof.scheduler!r}; only an emulated profile "
                         "reshapes its hardware")
    hw = load_hardware(prof.hardware)
    q = prof.ranks_per_nic
    inter = None
    if hw.inter is not None and prof.nodes > 1:
        # per-rank share unchanged (bytes_per_s), NIC = q shares (nic_bytes_per_s)
        inter = dataclasses.replace(hw.inter, gbits_s=hw.inter.gbits_s * q / hw.inter.shared_by, shared_by=q,
                                    source=f"{hw.inter.source}; emulated NIC of {q} per-rank share(s) ({prof.name})")
    return dataclasses.replace(hw, name=prof.name, nodes=prof.nodes, devices_per_node=prof.ranks_per_node,
                               nics_per_node=prof.ranks_per_node // q, inter=inter, path=prof.path,
                               description=f"{hw.name} as emulated by {prof.name}: {prof.nodes} nodes x "
                                           f"{prof.ranks_per_node} ranks, {q} rank(s) per NIC")


def load_profile(name_or_path: str) -> Profile:
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    p = Path(name_or_path)
    if not p.suffix:
        p = PROFILE_DIR / f"{name_or_path}.yaml"
    if not p.exists():
        known = sorted(BUILTIN) + sorted(x.stem for x in PROFILE_DIR.glob("*.yaml"))
        raise ValueError(f"cluster={name_or_path!r}: no such cluster profile; known: {known}")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from None
    return parse_profile(raw, p)


def known_profiles() -> list[str]:
    return sorted(BUILTIN) + sorted(x.stem for x in PROFILE_DIR.glob("*.yaml"))
