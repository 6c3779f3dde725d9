"""One emulated cluster for the length of a run: bring it up, launch on it, always tear it down.

    with EmulatedCluster(profile, shape=CalibrationShape(...)) as cl:
        for launch in cl.launches(world_size, worker_args, port=29600):   # one per node namespace
            ...
        cl.info(world_size)            # what every record says about where it ran

``up()`` probes whether namespaces are permitted (``netns.probe``); if not,
the cluster falls back to plain loopback (one ``torchrun --standalone`` on
this machine) and ``info()`` says so, as every record and figure title must.
Otherwise it builds the namespaces, measures this machine's compute rate and
derives the link rates (``emulation.py``; or takes ``link_rates`` from the
profile), shapes every rank's link (``shaping.py``), and for ``launcher:
slurm`` starts munge, slurmctld and the slurmds (``slurmd.py``).

Tear-down runs on leaving the ``with`` block (also after an exception or
Ctrl-C), at interpreter exit (atexit) and on SIGTERM/SIGHUP (turned into
SystemExit, so the ``with`` block unwinds): daemons and every process inside
the namespaces are stopped, the namespaces (with their veths and qdiscs)
deleted, the work directory removed.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ...harness import cpuquota
from . import emulation, netns, shaping
from ...profiles.hardware import load_hardware
from ...profiles.cluster import Profile
from .rankexec import ENV as RANK_NETNS_ENV
from .slurmd import Slurm

CLUSTER_ENV = "EXPERIMENTS_CLUSTER"   # JSON read by experiments.harness.results.base_record


@dataclass(frozen=True)
class CalibrationShape:
    tokens: int          # block tokens of one ring step (N / G)
    heads: int
    head_dim: int
    dtype: str


def local_info(profile: Profile, world_size: int) -> dict:
    """What a record says about a non-emulated target."""
    return {"profile": profile.name, "scheduler": profile.scheduler, "emulated": False,
            "ranks_per_core": world_size / (os.cpu_count() or 1),
            "summary": f"target {profile.name}"}


class EmulatedCluster:
    def __init__(self, profile: Profile, *, shape: CalibrationShape | None = None, python: str = sys.executable,
                 log=print):
        if profile.scheduler != "emulated":
            raise ValueError(f"profile {profile.name!r} has scheduler={profile.scheduler!r}, not 'emulated'")
        self.profile = profile
        self.shape = shape
        self.python = python
        self.log = log
        self.topo: netns.Topology | None = None
        self.scaling: emulation.Scaling | None = None
        self.fallback: str | None = None
        self.cpu_quota: dict = {}        # {"cpus_per_rank", "applied", "why"}: harness/cpuquota.py
        self._cgroup_template: str | None = None
        self.slurm = None
        self.work: Path | None = None
        self._old_handlers: dict = {}
        self._down = False

    # ------------------------------------------------------------ bring-up

    def __enter__(self) -> "EmulatedCluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "EmulatedCluster":
        p = self.profile
        why = netns.probe()
        if why:
            self.fallback = f"plain loopback, not emulated: {why}"
            self.log(f"[emulated cluster] {p.name}: {self.fallback}")
            return self
        self.topo = netns.Topology.new(p.nodes, p.ranks_per_node)
        self._install_handlers()
        try:
            self.work = Path(tempfile.mkdtemp(prefix=f"{self.topo.run_id}-"))
            netns.build(self.topo)
            self._cap_cpus()
            self.scaling = self._scaling()
            netem = self.scaling.links and any(v.latency_us > 0 for v in self.scaling.links.values())
            links = self.scaling.links
            one = shaping.LinkShape(1e12)    # a class the topology does not use
            nic = None
            if "inter" in links:             # ranks sharing a NIC share one shaped class (shaping.nic_commands)
                inter = links["inter"]
                nic = shaping.NicShape(inter.ranks_per_nic, shaping.LinkShape(inter.nic_bytes_s), inter.lone_shape)
            shaping.shape(self.topo, links["intra"].shape if "intra" in links else one,
                          links["inter"].shape if "inter" in links else one, netem=bool(netem), nic=nic)
            netns.write_state(self.topo, profile=p.name, scaling=self.scaling.to_dict(), work=str(self.work))
            if p.launcher == "slurm":
                self.slurm = Slurm(self.topo, self.work)
                self.slurm.start()
        except BaseException:
            self.down()
            raise
        self.log(f"[emulated cluster] {p.name}: {self.topo.run_id}, {p.nodes} nodes x {p.ranks_per_node} ranks, "
                 f"{self.scaling.summary()}")
        return self

    def _cap_cpus(self) -> None:
        """Each rank at the CPU share it has when every rank computes (harness/cpuquota.py)."""
        p = self.profile
        cpus = (os.cpu_count() or 1) / (p.nodes * p.ranks_per_node)
        names = [self.topo.rank(i, k) for i in range(p.nodes) for k in range(p.ranks_per_node)]
        self._cgroup_template, why = cpuquota.create(self.topo.run_id, names, cpus)
        self.cpu_quota = {"cpus_per_rank": cpus, "applied": self._cgroup_template is not None, "why": why,
                          "period_us": cpuquota.period_us()}
        if why:
            self.log(f"[emulated cluster] ranks not capped at {cpus:.3g} CPU each: {why}")

    def _rank_cgroups(self) -> list[str] | None:
        p = self.profile
        if self._cgroup_template is None:
            return None
        return [self._cgroup_template.format(node=i, local_rank=k)
                for i in range(p.nodes) for k in range(p.ranks_per_node)]

    def _scaling(self) -> emulation.Scaling:
        p = self.profile
        netem = shaping.netem_available(self.topo.fabric)
        if p.link_rates:
            return emulation.fixed(p.hardware, dict(p.link_rates), netem=netem, ranks_per_nic=p.ranks_per_nic)
        s = self.shape or CalibrationShape(tokens=p.calibration_tokens or 1024, heads=8, head_dim=32,
                                           dtype="float32")
        tokens = p.calibration_tokens or s.tokens
        procs = p.nodes * p.ranks_per_node
        threads = max(1, (os.cpu_count() or 1) // p.ranks_per_node)   # as the worker sets it
        self.log(f"[emulated cluster] calibrating: {procs} processes x {threads} thread(s), fwd+bwd of a "
                 f"{tokens}-token block, {s.heads} heads x {s.head_dim}, {s.dtype}")
        cal = emulation.calibrate(procs=procs, threads=threads, tokens=tokens, heads=s.heads,
                                  head_dim=s.head_dim, dtype=s.dtype, python=self.python,
                                  cgroups=self._rank_cgroups())
        return emulation.scale(load_hardware(p.hardware), cal, latency_cap_us=p.latency_cap_us, netem=netem,
                               ranks_per_nic=p.ranks_per_nic)

    # ------------------------------------------------------------ tear-down

    def _install_handlers(self) -> None:
        atexit.register(self.down)
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            raise SystemExit(128 + signum)   # unwinds the with-block, which tears down

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                pass

    def down(self) -> None:
        if self._down:
            return
        self._down = True
        try:
            if self.slurm is not None:
                self.slurm.stop()
            if self.topo is not None:
                netns.teardown(self.topo.run_id)
        finally:
            if self.work is not None:
                shutil.rmtree(self.work, ignore_errors=True)
            for sig, old in self._old_handlers.items():
                try:
                    signal.signal(sig, old)
                except (ValueError, OSError):
                    pass
            try:
                atexit.unregister(self.down)
            except Exception:  # noqa: BLE001 - best effort while tearing down
                pass

    # ------------------------------------------------------------ use

    @property
    def emulated(self) -> bool:
        return self.fallback is None and self.topo is not None

    def info(self, world_size: int) -> dict:
        p = self.profile
        d = {"profile": p.name, "scheduler": "emulated", "launcher": p.launcher, "hardware": p.hardware,
             "emulated": self.emulated, "nodes": p.nodes_for(world_size),
             "ranks_per_node": p.procs_per_node(world_size),
             "ranks_per_core": world_size / (os.cpu_count() or 1)}
        if not self.emulated:
            d.update(fallback=self.fallback, summary=f"{p.name}: {self.fallback}")
            return d
        s = self.scaling
        d.update(run_id=self.topo.run_id, scaling_mode=s.mode, dilation=s.dilation,
                 links={k: {"bytes_per_s": v.bytes_s, "target_bytes_per_s": v.target_bytes_s, "kind": v.kind,
                            "latency_us": v.latency_us, "latency_dilated_us": v.latency_dilated_us,
                            "latency_note": v.latency_note,
                            **({"ranks_per_nic": v.ranks_per_nic, "nic_bytes_per_s": v.nic_bytes_s,
                                "lone_bytes_per_s": v.lone_shape.bytes_per_s} if k == "inter" else {})}
                        for k, v in s.links.items()},
                 nics_per_node=p.ranks_per_node // p.ranks_per_nic,
                 calibration=s.to_dict().get("calibration"), cpu_quota=dict(self.cpu_quota),
                 summary=f"emulated {d['nodes']}x{d['ranks_per_node']} {p.hardware} ({s.summary()}), "
                         f"{d['ranks_per_core']:.3g} ranks/core"
                         + (f", each capped at {self.cpu_quota['cpus_per_rank']:.3g} CPU"
                            if self.cpu_quota.get("applied") else ", CPU not capped per rank"))
        return d

    def env(self, world_size: int) -> dict[str, str]:
        """Variables every launch on this cluster needs (the ranks' interface and namespaces, the record info)."""
        e = {CLUSTER_ENV: json.dumps(self.info(world_size))}
        if self.emulated:
            e.update({"GLOO_SOCKET_IFNAME": "eth0", RANK_NETNS_ENV: self.topo.rank_netns_template})
            if self._cgroup_template is not None:
                e[cpuquota.ENV] = self._cgroup_template
        if self.slurm is not None:
            e.update(self.slurm.env)
        return e

    def launches(self, world_size: int, worker_args: list[str], *, port: int,
                 module: str = "experiments.harness.worker") -> list[list[str]]:
        """One command per node: torchrun in the node's namespace, ranks (``python -m module``) in their own
        (``rankexec``)."""
        p = self.profile
        if not self.emulated:
            return [[self.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                     str(world_size), "--monitor-interval", "0.5", "-m", module, *worker_args]]
        nodes, ppn = p.nodes_for(world_size), p.procs_per_node(world_size)
        out = []
        for i in range(nodes):
            out.append(netns.nsenter(self.topo.node(i), [
                self.python, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(i),
                "--nproc-per-node", str(ppn), "--master-addr", self.topo.node_addr(0), "--master-port", str(port),
                "--monitor-interval", "0.5", "-m", "experiments.cluster.emulator.rankexec",
                module, *worker_args]))
        return out
