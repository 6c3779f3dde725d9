"""What a small blocking message holds its CPU rank for, fitted to the message probe.

A rank that posts a message of a few hundred bytes to tens of KiB and waits for it (a decode merge's
all-gather, an all-to-all, a collective's ring step) is held far longer than bytes / rate: its own
send and receive path and its wake-up when the message lands run at its capped share of a core
(docs/perfmodel.md#small-messages). ``python -m experiments.cluster messages <profile> --out <results
root>/message_probe.json`` (``cluster/emulator/message_probe.py``) times such calls on the emulated
cluster under the runs' caps. Per row, the wall seconds per message a rank sends:

    hop (ring, pair): the call's wall          all_gather: wall / (G-1), messages of ``bytes``
    all_reduce: wall / 2(G-1), of bytes / G    all_to_all: wall / (G-1), one per piece of ``bytes``

``fit_messages`` draws the least-squares line ``held(b) = a + k b`` (neither term below 0) through the
collectives' points (``FIT``: every small transfer the validated schedules make is a collective's ring step
or an all-to-all's piece), leaving out the rows the link bounds (the link alone takes at least half the
row's time per message, at the probe's own shaped rates: the transfer already carries that part). The
lone hops (``ring``, ``pair``: one message per Python call) are reported beside the line, not fitted: a
ring pass's hop that small is in no validated row (docs/perfmodel.md#small-messages). ``EmulatedCosts``
then charges a transfer whose messages are at most the largest size measured ``held`` per message on
its sender's compute stream, instead of the overlap probe's line (fitted on 0.5-2 MiB hops, whose
3-8 ms intercept is no measurement of a small message); the link time is unchanged.

    m = load_messages(results_root, "a800_ib_emu_2x4")      # None without the file
    m.held(2048), m.covers(2048), m.text
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from .excess import read_probe
from .fits import line
from .hardware import emulated_hardware

MESSAGE_FILE = "message_probe.json"
FIT = ("all_gather", "all_reduce", "all_to_all")     # the probe's patterns the line is fitted to
LINK_BOUND = 0.5            # a row whose link time per message is at least this share of its wall is left out


@dataclass(frozen=True)
class MessageCost:
    held_s: float                   # a: seconds a blocking message holds its rank, at 0 bytes
    held_s_per_byte: float          # k
    max_bytes: int                  # the largest message measured: the term's range
    cpu_s: float                    # median CPU seconds per message over the rows (all threads)
    points: tuple = ()              # (pattern, bytes per message, held s per message, used in the fit)
    path: str = ""

    def covers(self, nbytes: float) -> bool:
        return 0 < nbytes <= self.max_bytes

    def held(self, nbytes: float) -> float:
        return self.held_s + self.held_s_per_byte * nbytes

    def cpu_only(self, cpus: float) -> "MessageCost":
        """The same range charged the messages' CPU alone, at a rank capped at ``cpus`` (``cpu_s / cpus`` per
        message): what ``host_cost`` subtracts from a call's measured CPU (a held rank's wait is no CPU)."""
        return MessageCost(self.cpu_s / cpus, 0.0, self.max_bytes, self.cpu_s, self.points, self.path)

    @property
    def text(self) -> str:
        used = sorted({p for p, _, _, u in self.points if u})
        hops = [y for p, _, y, _ in self.points if p not in FIT]
        return (f"small blocking messages (<= {self.max_bytes} B each, fitted to {self.path}: {', '.join(used)}): "
                f"{self.held_s * 1e3:.2f} ms + {self.held_s_per_byte * 1e9:.2f} ns/B per message on the sender's "
                f"compute stream, instead of the overlap excess" + (
                    f"; lone hops, not fitted: {statistics.median(hops) * 1e3:.2f} ms per message (median)"
                    if hops else ""))


def for_host(messages: MessageCost | None, cpus: float | None) -> MessageCost | None:
    """What the host term's small call is charged for its small messages (``MessageCost.cpu_only``)."""
    return messages.cpu_only(cpus) if messages is not None and cpus else None


def messages_of(pattern: str, nbytes: int, world: int) -> tuple[int, float]:
    """(messages one rank sends, bytes of each) in one call of ``pattern`` over ``world`` ranks (gloo's ring
    all-gather and all-reduce; the all-to-all one message per other rank, ``burst_impl.collectives``)."""
    if pattern in ("ring", "pair"):
        return 1, float(nbytes)
    if pattern == "all_gather":
        return world - 1, float(nbytes)
    if pattern == "all_reduce":
        return 2 * (world - 1), nbytes / world
    if pattern == "all_to_all":
        return world - 1, float(nbytes)
    raise ValueError(f"pattern={pattern!r} is not one of the message probe's")


def _link_s(pattern: str, per_message: float, hw) -> float:
    """Seconds the slowest link the row's messages take needs for one message (a ring pattern stays in a
    node; everything else crosses nodes where there are two)."""
    same = pattern == "ring" or hw.inter is None
    link = hw.intra if same else hw.inter
    return per_message * 8 / (link.gbits_s * 1e9 / link.shared_by)


def fit_messages(rec: dict, path: str = "") -> MessageCost:
    """The line through the probe record's per-message wall seconds (module docstring)."""
    cluster = rec["cluster"]
    hw = emulated_hardware(cluster, "float32")
    world = int(cluster["nodes"]) * int(cluster["ranks_per_node"])
    points, cpu = [], []
    for r in rec["rows"]:
        n, each = messages_of(r["pattern"], int(r["bytes"]), world)
        held = float(r["wall_s"]) / n
        points.append((r["pattern"], each, held,
                       r["pattern"] in FIT and _link_s(r["pattern"], each, hw) < LINK_BOUND * held))
        cpu.append(float(r["cpu_s"]) / n)
    used = [(x, y) for _, x, y, u in points if u]
    if not used:
        raise ValueError(f"{path or 'message probe'}: no collective ({', '.join(FIT)}) row that the link does not "
                         "bound; no small blocking message was measured")
    a, k = line(used, one_size="intercept")
    return MessageCost(a, k, int(max(x for _, x, _, _ in points)), statistics.median(cpu), tuple(points), path)


def load_messages(results_root, profile: str | None, experiment: str | None = None) -> MessageCost | None:
    """The fitted message cost of the message probe (``excess.probe_path``), when measured on ``profile``."""
    found = read_probe(results_root, MESSAGE_FILE, profile, experiment)
    return None if found is None else fit_messages(found[1], str(found[0]))
