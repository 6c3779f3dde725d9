"""A real SLURM cluster on the emulated nodes (Debian's munge, slurmctld, slurmd).

munged and slurmctld run in the head namespace, one ``slurmd -N n<i>`` in each
node namespace, all entered with ``nsenter --net`` only (``ip netns exec``
remounts /sys, and slurmd then finds no cgroup filesystem). Every file the
daemons write lives under one work directory of the run: the munge key and
socket, ``slurm.conf``, the controller's state, per-node spool, log and pid
files (``%n`` in slurm.conf). Node names do not resolve anywhere, so each node
has a ``NodeAddr`` (its address inside the emulated network) and job scripts
take the rendezvous address from ``scontrol show node`` (``../slurm.py``).

Plugins that need cgroups or accounting are off (``proctrack/linuxproc``,
``task/none``, no accounting): the point is the job path (sbatch, srun on
every node, torchrun rendezvous, retries, finalize), not resource control.

Packages: ``apt-get install -y slurmd slurmctld slurm-client munge`` (docs/emulator.md).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ...cli import ToolFailed
from . import netns

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel")
PARTITION = "emu"


def missing() -> list[str]:
    """SLURM/munge programs this machine lacks (empty when the packages are installed)."""
    return [b for b in BINARIES if shutil.which(b) is None]


def render_conf(topo: netns.Topology, work: Path, cpus: int) -> str:
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(f"NodeName=n{i} NodeAddr={topo.node_addr(i)} CPUs={cpus} State=UNKNOWN"
                      for i in range(topo.nodes))
    return f"""# Written by experiments/cluster/emulator/slurmd.py for emulated cluster {topo.run_id}.
ClusterName={topo.run_id}
# The controller's name must be this host's; its address is the head namespace's.
SlurmctldHost={host}({topo.head_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={work}/munge-sock/munge.socket
StateSaveLocation={work}/state
SlurmdSpoolDir={work}/spool/%n
SlurmctldPidFile={work}/run/slurmctld.pid
SlurmdPidFile={work}/run/slurmd-%n.pid
SlurmctldLogFile={work}/log/slurmctld.log
SlurmdLogFile={work}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=10
{nodes}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Slurm:
    topo: netns.Topology
    work: Path

    @property
    def conf(self) -> Path:
        return self.work / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a SLURM client (sbatch, scontrol) and the jobs need to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def client(self, args: list[str]) -> list[str]:
        """A SLURM client command, run in the head namespace (the only place the controller is reachable)."""
        return netns.nsenter(self.topo.head, args)

    def _daemon(self, ns: str, cmd: list[str], pidfile: Path, what: str) -> int:
        out = subprocess.run(netns.nsenter(ns, cmd), capture_output=True, text=True, timeout=60,
                             env={**os.environ, **self.env})
        deadline = time.monotonic() + 20
        pid = None
        while pid is None and time.monotonic() < deadline:
            try:
                pid = int(pidfile.read_text().split()[0])    # the daemon may not have written it yet
            except (OSError, ValueError, IndexError):
                time.sleep(0.1)
        if out.returncode != 0 or pid is None:
            log = ""
            for p in sorted((self.work / "log").glob("*")):
                log += p.read_text(errors="replace")[-600:]
            raise ToolFailed(f"{what} did not start (exit {out.returncode}): {out.stderr.strip()[-600:]} {log}")
        netns.write_state(self.topo, daemon_pids=sorted(set(
            netns.read_state(self.topo.run_id).get("daemon_pids", []) + [pid])))
        return pid

    def start(self, cpus: int | None = None, timeout_s: float = 60) -> None:
        w = self.work
        for d in ("state", "run", "log", *(f"spool/n{i}" for i in range(self.topo.nodes))):
            (w / d).mkdir(parents=True, exist_ok=True)
        (w / "munge").mkdir(mode=0o700, exist_ok=True)
        (w / "munge-sock").mkdir(mode=0o755, exist_ok=True)   # munged wants the socket dir world-searchable
        os.chmod(w, 0o755)
        key = w / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        self.conf.write_text(render_conf(self.topo, w, cpus or os.cpu_count() or 1))
        head = self.topo.head
        self._daemon(head, ["munged", f"--socket={w}/munge-sock/munge.socket", f"--key-file={key}",
                            f"--pid-file={w}/munge/munged.pid", f"--log-file={w}/log/munged.log",
                            f"--seed-file={w}/munge/munged.seed"], w / "munge" / "munged.pid", "munged")
        self._daemon(head, ["slurmctld", "-f", str(self.conf)], w / "run" / "slurmctld.pid", "slurmctld")
        for i in range(self.topo.nodes):
            self._daemon(self.topo.node(i), ["slurmd", "-f", str(self.conf), "-N", f"n{i}"],
                         w / "run" / f"slurmd-n{i}.pid", f"slurmd n{i}")
        self.wait_idle(timeout_s)

    def states(self) -> list[str]:
        out = subprocess.run(self.client(["sinfo", "-h", "-N", "-o", "%N %T"]), capture_output=True, text=True,
                             timeout=30, env={**os.environ, **self.env})
        return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]

    def wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states: list[str] = []
        while time.monotonic() < deadline:
            states = self.states()
            if len(states) == self.topo.nodes and all(s.split()[-1] == "idle" for s in states):
                return
            time.sleep(0.5)
        raise ToolFailed(f"SLURM nodes not idle after {timeout_s:.0f} s: {states}; "
                           f"logs in {self.work / 'log'}")

    def sbatch(self, script: Path, *, env: dict[str, str]) -> str:
        """Submit ``script`` from the head namespace; ``env`` is the job's environment (sbatch --export=ALL).
        Returns the job id."""
        out = subprocess.run(self.client(["sbatch", "--parsable", str(script)]), env={**env, **self.env},
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise ToolFailed(f"sbatch {script} failed: {out.stderr.strip()}")
        return out.stdout.strip().split(";")[0]

    def wait(self, job_id: str, timeout_s: float, poll_s: float = 0.5) -> tuple[str, str]:
        """(state, exit code) once job ``job_id`` has ended (``sbatch --wait`` polls far more slowly)."""
        deadline = time.monotonic() + timeout_s
        state, code = "UNKNOWN", ""
        while time.monotonic() < deadline:
            out = subprocess.run(self.client(["scontrol", "show", "job", "-o", job_id]), capture_output=True,
                                 text=True, timeout=30, env={**os.environ, **self.env})
            fields = dict(x.split("=", 1) for x in out.stdout.split() if "=" in x)
            state, code = fields.get("JobState", state), fields.get("ExitCode", code)
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "UNKNOWN", "SUSPENDED"):
                return state, code
            time.sleep(poll_s)
        subprocess.run(self.client(["scancel", job_id]), capture_output=True, env={**os.environ, **self.env})
        return f"TIMEOUT (still {state} after {timeout_s:.0f} s; cancelled)", code

    def stop(self) -> None:
        """Stop every daemon this cluster started (by pid); the namespaces' teardown catches the rest."""
        pids = netns.read_state(self.topo.run_id).get("daemon_pids", [])
        netns.kill_pids([int(p) for p in pids], grace_s=10)
