"""Link shaping with ``tc``: what one rank may send, per link class.

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

Latency: ``netem delay`` is attached under each class where the kernel has
``sch_netem``; where it does not (this development VM's kernel has neither
netem nor fq), latency is not emulated and every record says so.

Rates are given in bytes/s and written to tc in bit/s (tc's ``mbps`` means
megabytes, a classic source of 8x errors).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
import re

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


def _burst(bytes_per_s: float) -> int:
    # 5 ms of traffic, at least 16 MTUs: HTB's bucket must hold a few packets or it under-shoots.
    return max(MIN_BURST, int(bytes_per_s * 0.005))


def rank_commands(node_cidr: str, fabric_cidr: str, intra: LinkShape, inter: LinkShape, *,
                  dev: str = "eth0", netem: bool = False) -> list[list[str]]:
    """The ``tc`` argument lists that shape one rank's ``dev`` (run inside the rank's namespace)."""
    cmds = [["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "30"]]
    for minor, shape in ((10, intra), (20, inter)):
        rate = f"{int(round(shape.bytes_per_s * WIRE_OVERHEAD * 8))}bit"
        b = str(_burst(shape.bytes_per_s))
        cmds.append(["class", "add", "dev", dev, "parent", "1:", "classid", f"1:{minor}", "htb", "rate", rate,
                     "ceil", rate, "burst", b, "cburst", b, "quantum", str(QUANTUM)])
        if netem and shape.latency_us > 0:
            cmds.append(["qdisc", "add", "dev", dev, "parent", f"1:{minor}", "handle", f"{minor}:", "netem",
                         "delay", f"{int(round(shape.latency_us))}us", "limit", "100000"])
    cmds.append(["class", "add", "dev", dev, "parent", "1:", "classid", "1:30", "htb", "rate",
                 f"{UNSHAPED_BIT_S}bit", "quantum", str(QUANTUM)])
    # Pure ACKs (TCP, total length < 128, flags == ACK; IPv4 without options) bypass the data classes.
    cmds.append(["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                 "match", "ip", "protocol", "6", "0xff", "match", "u16", "0x0000", "0xff80", "at", "2",
                 "match", "u8", "0x05", "0x0f", "at", "0", "match", "u8", "0x10", "0xff", "at", "33",
                 "flowid", "1:30"])
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


def shape(topo: netns.Topology, intra: LinkShape, inter: LinkShape, *, netem: bool = False) -> None:
    """Shape every rank of ``topo``."""
    for i in range(topo.nodes):
        for k in range(topo.ranks_per_node):
            ns = topo.rank(i, k)
            for args in rank_commands(topo.node_cidr(i), topo.fabric_cidr, intra, inter, netem=netem):
                netns.exec_in(ns, ["tc", *args])


def class_stats(ns: str, dev: str = "eth0") -> dict[str, dict]:
    """Bytes and packets sent per class of one rank, ``{"1:10": {"bytes": ..., "packets": ...}, ...}``."""
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
