"""Emulated nodes as Linux network namespaces: the wiring, and its removal.

One emulated cluster of E nodes x P ranks per node is, for one run id
``bemuXXXXXX`` (every namespace we create starts with ``bemu``):

    <id>-fab          the fabric: bridge ``br0``, one port per node and one for the head
    <id>-head         the head (slurmctld, sbatch): ``eth0`` = 10.77.255.1
    <id>-n<i>         node i (torchrun agent, slurmd): bridge ``nb`` with address 10.77.i.1,
                      ``uplink`` into the fabric, one port ``r<k>`` per rank
    <id>-n<i>r<k>     rank k of node i: ``eth0`` = 10.77.i.(10+k), its only interface

One flat 10.77.0.0/16 network, so any rank reaches any other and every node's
rendezvous address. Why one namespace per rank, not only per node: the kernel
here has neither netem nor fq nor a flow classifier, and gloo's outgoing
connections carry the node's address whatever interface the rank listens on,
so a node-level qdisc cannot tell which rank sent a packet. A rank's own
``eth0`` can: shaping it caps what that rank sends, per link class
(``shaping.py``), which is the hardware profiles' convention (bytes/s one rank
gets when every rank sends at once). Ranks sharing a NIC are told apart on the
node's ``uplink`` by their own source addresses (``shaping.nic_commands``). Ranks enter their namespace through
``rankexec.py`` (torchrun starts them in the node's namespace).

Addresses exist only on interfaces inside these namespaces; nothing is created
in the caller's namespace (veth pairs are created with both ends already in
ours). Processes are entered with ``nsenter --net`` only (``ip netns exec``
remounts /sys, which breaks slurmd's cgroup detection).

A state file ``/run/burst-emu/<id>.json`` (written before the first namespace)
names the owner process; ``stale()`` lists run ids whose owner is gone, so the
leftovers of a crashed run can be found and removed (``python -m
experiments.cluster down --stale``).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ...cli import ToolFailed
from ...harness.cpuquota import remove as remove_cgroups  # the ranks' cpu cgroups, once their processes are gone

PREFIX = "bemu"
NETNS_DIR = Path("/var/run/netns")
STATE_DIR = Path("/run/burst-emu")
SUBNET = "10.77"
MAX_NODES = 200           # node i uses 10.77.i.0/24; 255 is the head's
MAX_RANKS_PER_NODE = 200  # rank k of a node is .10+k


class NetnsError(ToolFailed):
    """A namespace operation failed; the message names the command and the kernel's answer."""


@dataclass(frozen=True)
class Topology:
    run_id: str
    nodes: int
    ranks_per_node: int

    def __post_init__(self):
        if not (1 <= self.nodes <= MAX_NODES):
            raise ValueError(f"nodes={self.nodes} must be in 1..{MAX_NODES}")
        if not (1 <= self.ranks_per_node <= MAX_RANKS_PER_NODE):
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must be in 1..{MAX_RANKS_PER_NODE}")
        if not self.run_id.startswith(PREFIX) or "-" in self.run_id:
            raise ValueError(f"run_id={self.run_id!r} must start with {PREFIX!r} and contain no '-'")

    @staticmethod
    def new(nodes: int, ranks_per_node: int) -> "Topology":
        return Topology(run_id=PREFIX + secrets.token_hex(3), nodes=nodes, ranks_per_node=ranks_per_node)

    # names
    @property
    def fabric(self) -> str:
        return f"{self.run_id}-fab"

    @property
    def head(self) -> str:
        return f"{self.run_id}-head"

    def node(self, i: int) -> str:
        return f"{self.run_id}-n{i}"

    def rank(self, i: int, k: int) -> str:
        return f"{self.run_id}-n{i}r{k}"

    @property
    def rank_netns_template(self) -> str:
        """Path of a rank's namespace with ``{node}`` and ``{local_rank}`` left to fill (rankexec.py)."""
        return str(NETNS_DIR / f"{self.run_id}-n{{node}}r{{local_rank}}")

    def namespaces(self) -> list[str]:
        """Every namespace of this cluster, in creation order."""
        out = [self.fabric, self.head]
        for i in range(self.nodes):
            out.append(self.node(i))
            out.extend(self.rank(i, k) for k in range(self.ranks_per_node))
        return out

    # addresses (all inside our namespaces)
    @property
    def head_addr(self) -> str:
        return f"{SUBNET}.255.1"

    def node_addr(self, i: int) -> str:
        return f"{SUBNET}.{i}.1"

    def rank_addr(self, i: int, k: int) -> str:
        return f"{SUBNET}.{i}.{10 + k}"

    def node_cidr(self, i: int) -> str:
        return f"{SUBNET}.{i}.0/24"

    @property
    def fabric_cidr(self) -> str:
        return f"{SUBNET}.0.0/16"

    def to_dict(self) -> dict:
        return {**asdict(self), "head_addr": self.head_addr,
                "node_addrs": [self.node_addr(i) for i in range(self.nodes)],
                "rank_addrs": [[self.rank_addr(i, k) for k in range(self.ranks_per_node)]
                               for i in range(self.nodes)]}


# ---------------------------------------------------------------- commands


def run(cmd: list[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise NetnsError(f"{cmd[0]!r} is not installed: {e}") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(cmd)}` did not finish within {timeout:.0f} s") from None
    if check and out.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out


def ip(ns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(["ip", *(["-n", ns] if ns else []), *args], check=check)


def nsenter(ns: str, cmd: list[str]) -> list[str]:
    """``cmd`` run inside namespace ``ns`` (network namespace only: /sys, mounts, pids stay the host's)."""
    return ["nsenter", f"--net={NETNS_DIR / ns}", *cmd]


def exec_in(ns: str, cmd: list[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return run(nsenter(ns, cmd), check=check, timeout=timeout)


def probe() -> str | None:
    """Why this machine cannot host emulated nodes, or None if it can (creates and removes one namespace)."""
    if os.geteuid() != 0:
        return "network namespaces need root (this process is not root)"
    name = f"{PREFIX}probe{os.getpid()}"
    try:
        ip(None, "netns", "add", name)
    except NetnsError as e:
        return f"`ip netns add` is not permitted here: {e}"
    try:
        ip(name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
    except NetnsError as e:
        return f"veth pairs are not available here: {e}"
    finally:
        ip(None, "netns", "del", name, check=False)
    return None


# ---------------------------------------------------------------- state and leftovers


def state_path(run_id: str) -> Path:
    return STATE_DIR / f"{run_id}.json"


def write_state(topo: Topology, **extra) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    p = state_path(topo.run_id)
    old = json.loads(p.read_text()) if p.exists() else {}
    old.update({"owner_pid": os.getpid(), "created": old.get("created", time.time()),
                "topology": topo.to_dict(), **extra})
    p.write_text(json.dumps(old, indent=1))


def read_state(run_id: str) -> dict:
    try:
        return json.loads(state_path(run_id).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def our_namespaces() -> list[str]:
    out = ip(None, "netns", "list", check=False).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.strip().startswith(PREFIX)]


def run_ids() -> list[str]:
    ids = {ns.split("-")[0] for ns in our_namespaces()}
    if STATE_DIR.exists():
        ids |= {p.stem for p in STATE_DIR.glob(f"{PREFIX}*.json")}
    return sorted(ids)


def stale() -> list[str]:
    """Run ids left behind: their owner process is gone (or they have no state file at all)."""
    out = []
    for rid in run_ids():
        st = read_state(rid)
        pid = st.get("owner_pid")
        if not pid or not _alive(int(pid)):
            out.append(rid)
    return out


# ---------------------------------------------------------------- build and tear down


def build(topo: Topology) -> None:
    """Create every namespace, link and address of ``topo``. Raises NetnsError on the first failure
    (the caller tears down: ``teardown(topo.run_id)`` removes whatever was made)."""
    write_state(topo)
    for ns in topo.namespaces():
        ip(None, "netns", "add", ns)
        ip(ns, "link", "set", "lo", "up")
    fab = topo.fabric
    ip(fab, "link", "add", "br0", "type", "bridge")
    ip(fab, "link", "set", "br0", "up")
    ip(topo.head, "link", "add", "eth0", "type", "veth", "peer", "name", "head", "netns", fab)
    ip(fab, "link", "set", "head", "master", "br0", "up")
    ip(topo.head, "addr", "add", f"{topo.head_addr}/16", "dev", "eth0")
    ip(topo.head, "link", "set", "eth0", "up")
    for i in range(topo.nodes):
        node = topo.node(i)
        ip(node, "link", "add", "nb", "type", "bridge")
        ip(node, "link", "add", "uplink", "type", "veth", "peer", "name", f"n{i}", "netns", fab)
        ip(fab, "link", "set", f"n{i}", "master", "br0", "up")
        ip(node, "link", "set", "uplink", "master", "nb", "up")
        ip(node, "addr", "add", f"{topo.node_addr(i)}/16", "dev", "nb")
        ip(node, "link", "set", "nb", "up")
        for k in range(topo.ranks_per_node):
            rank = topo.rank(i, k)
            ip(rank, "link", "add", "eth0", "type", "veth", "peer", "name", f"r{k}", "netns", node)
            ip(node, "link", "set", f"r{k}", "master", "nb", "up")
            ip(rank, "addr", "add", f"{topo.rank_addr(i, k)}/16", "dev", "eth0")
            ip(rank, "link", "set", "eth0", "up")
            # Per-namespace TCP settings: no slow start after an idle ring step, and a short
            # per-socket queue so a shaped link does not hold seconds of data (ACKs wait behind it).
            run(["ip", "netns", "exec", rank, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0",
                 "net.ipv4.tcp_limit_output_bytes=131072"])
            # ...and no delayed ACKs towards other nodes (the route's quickack), as RDMA acknowledges at
            # once: with the short inter-node buckets (shaping.BURST_S) a message's tail is paced and a
            # delayed ACK held the next one back. The own node's /24 keeps delayed ACKs: an ACK per
            # segment costs capped ranks part of their intra-node rate (docs/findings.md#link-buckets).
            ip(rank, "route", "replace", f"{SUBNET}.0.0/16", "dev", "eth0", "proto", "kernel", "scope", "link",
               "src", topo.rank_addr(i, k), "quickack", "1")
            ip(rank, "route", "add", f"{SUBNET}.{i}.0/24", "dev", "eth0", "scope", "link", "src", topo.rank_addr(i, k))


def ns_pids(ns: str) -> list[int]:
    out = ip(None, "netns", "pids", ns, check=False)
    return [int(x) for x in out.stdout.split() if x.strip().isdigit()]


def kill_pids(pids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL what is still alive after ``grace_s`` (only the pids given)."""
    pids = [p for p in pids if p != os.getpid()]
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for p in pids:
        if _alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def teardown(run_id: str, *, grace_s: float = 5.0) -> list[str]:
    """Stop every process inside ``run_id``'s namespaces, delete the namespaces (their veths, bridges
    and qdiscs go with them) and the state file. Idempotent; returns the namespaces removed."""
    if not run_id.startswith(PREFIX):
        raise ValueError(f"run_id={run_id!r} is not one of ours (must start with {PREFIX!r})")
    mine = [ns for ns in our_namespaces() if ns.split("-")[0] == run_id]
    pids = sorted({p for ns in mine for p in ns_pids(ns)})
    state = read_state(run_id)
    for extra in state.get("daemon_pids", []):
        if _alive(int(extra)):
            pids.append(int(extra))
    kill_pids(pids, grace_s)

    remove_cgroups(run_id)
    # Ranks before nodes before the fabric: deleting a namespace destroys its end of each veth pair.
    for ns in sorted(mine, key=lambda n: (0 if re.search(r"-n\d+r\d+$", n) else 1 if "-n" in n else 2, n)):
        ip(None, "netns", "del", ns, check=False)
    left = [ns for ns in our_namespaces() if ns.split("-")[0] == run_id]
    work = state.get("work")
    if work and Path(work).name.startswith(run_id + "-"):     # the run's own daemon files (slurmd.py)
        shutil.rmtree(work, ignore_errors=True)
    state_path(run_id).unlink(missing_ok=True)
    if left:
        raise NetnsError(f"could not remove namespaces {left}")
    return mine
