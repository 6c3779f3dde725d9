"""How long a ring's send holds its CPU rank, fitted to the send probe: the bytes the socket buffers take.

A ring step waits for its own send as well as its receive (``burst_impl.comm.Pending.wait``). Gloo sends on
rendezvous, and its send completes once its last byte is written into the connection's socket; the kernel's
buffers take up to some bytes on the way, so a sender whose message fits is released as the bytes start to go, and
one whose message does not is held while the rest drains (``cluster/emulator/send_probe.py``, run with ``burst-bench
cluster sends <profile> --out <results root>/send_probe.json``). On a GPU NCCL's send ends with its transfer, which
is what the hardware model keeps (``CostModel.sender_release``: None). Per link class (``oneway`` rows: across nodes;
``intra``: inside a node), with ``base`` the send wait of the class's smallest row (a message the buffers take
whole: its post and wake-up, which every send pays), from each row whose link time outweighs that (a receive of
at least ``LINK_X`` x ``base``):

    held   = send wait - base
    buffer = bytes - held x bytes / receive wait        (the bytes the sender did not wait for)

the median over the rows whose sender was held for at least ``HELD`` of the receive. A class none of whose rows
held its sender has a buffer of at least its largest row (``SendBuffers.at_least``). ``EmulatedCosts`` then
releases a ring's sender ``max(0, bytes - buffer) / bytes`` of the way through its transfer
(``SendBuffers.hold``), from the rendezvous on; the receiver still waits for the bytes to land.

    s = load_send_buffers(results_root, "a800_ib_emu_2x4")     # None without the file
    s.hold(nbytes, seconds, same_node=False), s.text
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from .excess import read_probe

SEND_FILE = "send_probe.json"
HELD = 0.2          # a row's sender is held when it waits this share of the receive beyond the smallest row's wait
LINK_X = 10.0       # a row tells the buffer only when its receive takes this many times the smallest row's send
CLASS_OF = {"oneway": "inter", "intra": "intra"}   # the probe's pattern -> the model's link class


@dataclass(frozen=True)
class SendBuffers:
    bytes_by_class: dict                        # {"intra" | "inter": bytes a send's buffers take}
    at_least: frozenset = frozenset()           # classes whose buffer took every row measured (a lower bound)
    path: str = ""

    def hold(self, nbytes: float, seconds: float, same_node: bool) -> float | None:
        """Seconds, from the rendezvous, until a send of ``nbytes`` (``seconds`` on the link) releases its sender;
        None for a class the probe did not measure (the sender is then held until the transfer lands)."""
        buf = self.bytes_by_class.get("intra" if same_node else "inter")
        if buf is None:
            return None
        return seconds * max(0.0, nbytes - buf) / nbytes if nbytes > 0 else 0.0

    @property
    def text(self) -> str:
        parts = [f"{k} {'>= ' if k in self.at_least else ''}{v / 2**20:.2f} MiB"
                 for k, v in sorted(self.bytes_by_class.items())]
        return (f"a ring's sender released once its send fits the socket buffers ({', '.join(parts)}; fitted to "
                f"{self.path}), its receiver when the bytes land")


def fit_send_buffers(rows: list[dict], path: str = "") -> SendBuffers:
    """The buffer per link class of the probe's rows (module docstring)."""
    out, lower = {}, set()
    for pattern, klass in CLASS_OF.items():
        mine = sorted((r for r in rows if r["pattern"] == pattern), key=lambda r: int(r["bytes"]))
        if not mine:
            continue
        base = float(mine[0]["send_s"])
        told = [r for r in mine if float(r["recv_s"]) >= LINK_X * base]
        bufs = []
        for r in told:
            n, recv = int(r["bytes"]), float(r["recv_s"])
            held = float(r["send_s"]) - base
            if held >= HELD * recv:
                bufs.append(max(0.0, n - held * n / recv))
        if bufs:
            out[klass] = statistics.median(bufs)
        elif told:
            out[klass] = float(told[-1]["bytes"])
            lower.add(klass)
    if not out:
        raise ValueError(f"{path or 'send probe'}: no row of {', '.join(CLASS_OF)}; nothing was measured")
    return SendBuffers(out, frozenset(lower), path)


def load_send_buffers(results_root, profile: str | None, experiment: str | None = None) -> SendBuffers | None:
    """The fitted buffers of the send probe (``excess.probe_path``), when measured on ``profile``."""
    found = read_probe(results_root, SEND_FILE, profile, experiment)
    return None if found is None else fit_send_buffers(found[1]["rows"], str(found[0]))
