"""Link shaping with ``tc``: what one rank may send, per link class, and what one NIC carries.

Each rank's only interface (``eth0`` in its namespace, ``netns.py``) gets an
HTB root with one class per link class, selected by destination address:

    1:10  intra  destination inside the rank's own node (10.77.<node>.0/24)
    1:20  inter  any other emulated address (10.77.0.0/16)
    1:30  other  unclassified traffic (ARP) and pure TCP ACKs, effectively unshaped

so the bytes a rank sends to ranks of its own node are capped at the intra
rate and the bytes it sends to other nodes at the inter rate, whatever the
other ranks do: the hardware profiles' convention (``../hardware.py``: the rate
one rank gets when every rank of its node sends at once). Pure ACKs go to
1:30 so that a rank that both sends and receives (every ring step) does not
hold its upstream sender's ACKs behind its own queued data.

NICs (``nic_commands``). Where ranks share a NIC (the cluster profile's
``nics_per_node`` < ``ranks_per_node``: 8 GPUs behind 4 HCAs, or one RoCE NIC
per node), the node's ``uplink`` (its only port into the fabric: every byte
leaving the node for another node passes it, no intra-node byte does) gets an
HTB root with one class per NIC, rate = ceil = the NIC's rate, and under it
one leaf per rank of that NIC (rate NIC / ranks, ceil NIC), selected by the
packet's source address (each rank sends from its own address). A lone flow
borrows the whole NIC; k concurrent flows split it evenly (the leaves, not one
FIFO, so one TCP flow cannot crowd out its neighbours); pure ACKs and the
node's own traffic (torchrun agent, slurmd) are unshaped. Each such rank's own
``1:20`` is then set to a lone flow's rate, so it never limits a flow the NIC
would not. Only the sending side of a NIC is shaped: the patterns measured
here are symmetric (every NIC receives what one of the same width sends).
With one rank per NIC (the default) the rank's ``1:20`` is its NIC and the
uplink is left alone.

Latency: ``netem delay`` is attached under each class where the kernel has
``sch_netem``; where it does not (this development VM's kernel has neither
netem nor fq), latency is not emulated and every record says so.

Rates are given in bytes/s and written to tc in bit/s (tc's ``mbps`` means
megabytes, a classic source of 8x errors).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from . import netns

UNSHAPED_BIT_S = 10_000_000_000      # class 1:30
QUANTUM = 65536                       # bytes per DRR round; >= the largest (GSO) packet a veth sees
MIN_BURST = 16 * 1514                 # bytes; small, so a short message does not ride a large bucket
# Rates are payload bytes/s (what the suite's counters count). On the wire each 1448-byte TCP segment
# (MTU 1500, with timestamps) travels as a 1514-byte frame, and HTB counts frames.
WIRE_OVERHEAD = 1514 / 1448


@dataclass(frozen=True)
class LinkShape:
    bytes_per_s: float
    latency_us: float = 0.0        # one-way delay to add (0: none)

    def __post_init__(self):
        if not (self.bytes_per_s > 0 and math.isfinite(self.bytes_per_s)):
            raise ValueError(f"bytes_per_s={self.bytes_per_s!r} must be a positive finite number")
        if not (self.latency_us >= 0 and math.isfinite(self.latency_us)):
            raise ValueError(f"latency_us={self.latency_us!r} must be a non-negative finite number")


@dataclass(frozen=True)
class NicShape:
    """Ranks sharing one NIC of an emulated node, the NIC's rate, and a lone flow's (<= the NIC's)."""
    ranks_per_nic: int
    nic: LinkShape
    lone: LinkShape

    def __post_init__(self):
        if isinstance(self.ranks_per_nic, bool) or not isinstance(self.ranks_per_nic, int) or self.ranks_per_nic < 1:
            raise ValueError(f"ranks_per_nic={self.ranks_per_nic!r} must be an integer >= 1")


# Seconds of traffic an HTB class may send ahead of its rate after an idle spell (its bucket). A NIC
# has none: a message after idle still goes at its line rate, and a ring's hop comes after a compute
# step, when a large bucket has refilled. So inter-node classes (NICs included) hold 0.5 ms, which
# still meets their rates. Intra-node classes keep 5 ms: with 8 capped ranks on 2 cores their long
# flows fall short of the rate with less. Measurements: docs/findings.md#link-buckets.
BURST_S = {"intra": 0.005, "inter": 0.0005}


def _burst(bytes_per_s: float, klass: str) -> int:
    # at least 16 MTUs: HTB's bucket must hold a few packets or it under-shoots
    return max(MIN_BURST, int(bytes_per_s * BURST_S[klass]))


def _bits(bytes_per_s: float) -> str:
    return f"{int(round(bytes_per_s * WIRE_OVERHEAD * 8))}bit"


def _ack_filter(dev: str) -> list[str]:
    # Pure ACKs (TCP, total length < 128, flags == ACK; IPv4 without options) bypass the data classes.
    return ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "protocol", "6", "0xff", "match", "u16", "0x0000", "0xff80", "at", "2",
            "match", "u8", "0x05", "0x0f", "at", "0", "match", "u8", "0x10", "0xff", "at", "33", "flowid", "1:30"]


def nic_commands(rank_addrs: list[str], nic: NicShape, *, dev: str = "uplink") -> list[list[str]]:
    """The ``tc`` argument lists that shape one node's NICs on its ``dev`` (run in the node's namespace):
    NIC n = class ``1:<100+n>``, its ranks' leaves ``1:<1000+k>`` chosen by source address."""
    q = nic.ranks_per_nic
    if len(rank_addrs) % q:
        raise ValueError(f"ranks_per_nic={q} must divide the node's {len(rank_addrs)} ranks")
    rate, b = _bits(nic.nic.bytes_per_s), str(_burst(nic.nic.bytes_per_s, "inter"))
    share = _bits(nic.nic.bytes_per_s / q)
    cmds = [["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "30"],
            ["class", "add", "dev", dev, "parent", "1:", "classid", "1:30", "htb", "rate", f"{UNSHAPED_BIT_S}bit",
             "quantum", str(QUANTUM)], _ack_filter(dev)]
    for n in range(len(rank_addrs) // q):
        cmds.append(["class", "add", "dev", dev, "parent", "1:", "classid", f"1:{100 + n}", "htb", "rate", rate,
                     "ceil", rate, "burst", b, "cburst", b, "quantum", str(QUANTUM)])
        for k in range(n * q, (n + 1) * q):
            cmds.append(["class", "add", "dev", dev, "parent", f"1:{100 + n}", "classid", f"1:{1000 + k}", "htb",
                         "rate", share, "ceil", rate, "burst", b, "cburst", b, "quantum", str(QUANTUM)])
            cmds.append(["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "2", "u32",
                         "match", "ip", "src", f"{rank_addrs[k]}/32", "flowid", f"1:{1000 + k}"])
    return cmds


def rank_commands(node_cidr: str, fabric_cidr: str, intra: LinkShape, inter: LinkShape, *,
                  dev: str = "eth0", netem: bool = False) -> list[list[str]]:
    """The ``tc`` argument lists that shape one rank's ``dev`` (run inside the rank's namespace)."""
    cmds = [["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "30"]]
    for minor, shape, klass in ((10, intra, "intra"), (20, inter, "inter")):
        rate = _bits(shape.bytes_per_s)
        b = str(_burst(shape.bytes_per_s, klass))
        cmds.append(["class", "add", "dev", dev, "parent", "1:", "classid", f"1:{minor}", "htb", "rate", rate,
                     "ceil", rate, "burst", b, "cburst", b, "quantum", str(QUANTUM)])
        if netem and shape.latency_us > 0:
            cmds.append(["qdisc", "add", "dev", dev, "parent", f"1:{minor}", "handle", f"{minor}:", "netem",
                         "delay", f"{int(round(shape.latency_us))}us", "limit", "100000"])
    cmds.append(["class", "add", "dev", dev, "parent", "1:", "classid", "1:30", "htb", "rate",
                 f"{UNSHAPED_BIT_S}bit", "quantum", str(QUANTUM)])
    cmds.append(_ack_filter(dev))
    cmds.append(["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "2", "u32",
                 "match", "ip", "dst", node_cidr, "flowid", "1:10"])
    cmds.append(["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "3", "u32",
                 "match", "ip", "dst", fabric_cidr, "flowid", "1:20"])
    return cmds


def netem_available(ns: str) -> bool:
    """Whether ``sch_netem`` exists (tried on ``lo`` of one of our namespaces, then removed)."""
    out = netns.exec_in(ns, ["tc", "qdisc", "add", "dev", "lo", "root", "handle", "9:", "netem", "delay", "1us"],
                        check=False)
    if out.returncode == 0:
        netns.exec_in(ns, ["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
        return True
    return False


def shape(topo: netns.Topology, intra: LinkShape, inter: LinkShape, *, netem: bool = False,
          nic: NicShape | None = None) -> None:
    """Shape every rank of ``topo`` and, where ``nic`` puts several ranks on one NIC, every node's NICs
    (a rank's own inter class then runs at a lone flow's rate)."""
    shared = nic is not None and nic.ranks_per_nic > 1
    for i in range(topo.nodes):
        for k in range(topo.ranks_per_node):
            ns = topo.rank(i, k)
            for args in rank_commands(topo.node_cidr(i), topo.fabric_cidr, intra, nic.lone if shared else inter,
                                      netem=netem):
                netns.exec_in(ns, ["tc", *args])
        if shared and topo.nodes > 1:
            addrs = [topo.rank_addr(i, k) for k in range(topo.ranks_per_node)]
            for args in nic_commands(addrs, nic):
                netns.exec_in(topo.node(i), ["tc", *args])


def class_stats(ns: str, dev: str = "eth0") -> dict[str, dict]:
    """Bytes and packets sent per class of one rank, ``{"1:10": {"bytes": ..., "packets": ...}, ...}``
    (``dev="uplink"`` in a node's namespace: per NIC and per rank of a NIC, ``nic_commands``)."""
    out = netns.exec_in(ns, ["tc", "-s", "class", "show", "dev", dev], check=False).stdout
    stats, handle = {}, None
    for line in out.splitlines():
        m = re.match(r"class \S+ (\S+)", line)
        if m:
            handle = m.group(1)
            continue
        m = re.match(r"\s*Sent (\d+) bytes (\d+) pkt", line)
        if m and handle:
            stats[handle] = {"bytes": int(m.group(1)), "packets": int(m.group(2))}
    return stats
