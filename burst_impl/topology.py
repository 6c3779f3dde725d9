"""Topology-aware ring ("double ring", docs/papers.md §2 and §4) and the choice of a group's transport.

Ranks are placed node-major: group rank r = n*I + l (node n of E, local
index l of I ranks per node; ``burst_impl.nodes``). A pass visits the G = E*I
blocks in E rounds of I steps. At step t = rho*I + j, rank (n, l) holds the
block of

    owner(t) = ((n - rho) mod E) * I + (l - j) mod I

(docs/papers.md §4's "true source block", 0-based), so causal block skipping and
every layout (contiguous, zigzag, striped) work unchanged: the per-step
compute only ever sees (q owner, kv owner) pairs.

How blocks move (the read side). Inside a round the block makes I-1 intra-node
hops (rank (n, l) -> (n, l+1)). At the first step of each round but the last,
the rank also sends the block it starts the round with to the rank of the same
local index on the next node ((n, l) -> (n+1, l)): that is the block it starts
the next round with, so the slow inter-node transfer overlaps the I steps of
the round (I-1 intra hops and I computations) instead of being waited for at
every step. Per rank and pass: E*(I-1) intra-node sends and E-1 inter-node
sends (a flat ring: G-1 sends, all inter-node on the rank at local index I-1).

How accumulators move (the write side; dQ of the burst backward, dK/dV of the
ring backward). Within round rho the partial sum of a block follows it
through the node (intra hops; round 0 starts on the rank after the owner,
whose own contribution stays home). At the end of round 0 the partial sum is
kept on the last rank of the chain, (n_b, l_b - 1). At the end of round
rho >= 1 it is sent to the same local index on the next node, where the next
round's chain of the same block ends I steps later (so this transfer overlaps
I steps too) and the two are added. After the last round it makes one
inter-node hop to (n_b, l_b - 1), meets the kept round-0 sum, and one
intra-node hop home (these last two are not overlapped). Per rank: E*(I-1)
intra-node and E-1 inter-node accumulator sends, G-1 in all as on the flat ring.

Channels. The read ring inside the node, the write ring inside the node and
the inter-node hop (blocks and accumulators), docs/papers.md §2's separate
streams. On gloo they share the group's process group, told apart by tags; gloo progresses every posted
transfer on its own threads, so a transfer posted early runs while the rank
computes. On NCCL each channel gets its own communicator (and so its own
CUDA stream): the read ring the group itself, the write ring the node's
ranks, the inter-node hop the ranks with the same local index. Every rank
of the group creates every one of these groups, in one fixed order
(``channel_splits``: nodes, then rails), at the first double ring over the
group, before its first send (``channel_groups``; ``dist.split_group`` when
the default group is bound to a device, whose NCCL splits are collective).

Degenerate cases. With one node (E = 1) or one rank per node (I = 1) a double
ring is exactly the flat ring: ``transport(..., topology="double")`` then
returns the flat ``Ring`` and says so (``note``, counters' notes
"burst.topology"). A group whose ranks do not form equal runs of consecutive
ranks per node cannot be served: ValueError, before any byte is sent.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import comm
from .comm import AccRoute, Channel, Ring, Transport
from .nodes import Nodes, group_ranks

TOPOLOGIES = ("flat", "double")

# gloo tags of the double ring's channels (the flat ring uses tag 0)
_TAGS = {"intra": 1, "acc_intra": 2, "inter": 3, "acc_inter": 4}
_SUBGROUPS: dict[tuple, tuple[object, object]] = {}   # (group's ranks, E, I) -> (node, rail) groups


def check_topology(topology: str) -> None:
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology={topology!r} is unknown; choose one of {TOPOLOGIES}")


def separate_groups(group) -> bool:
    """Each channel on its own communicator: NCCL (its own CUDA stream per channel); gloo uses tags."""
    return dist.get_backend(group) == "nccl"


def channel_splits(E: int, I: int) -> tuple[list[list[int]], list[list[int]]]:
    """The double ring's channel groups in group ranks, in the one order every rank creates them:
    the E node groups (node n: ranks n*I .. n*I+I-1), then the I rail groups (local index l: ranks
    l, I+l, ..., (E-1)*I+l)."""
    return ([[n * I + i for i in range(I)] for n in range(E)],
            [[m * I + l for m in range(E)] for l in range(I)])


def _timeout_kw(parent) -> dict:
    try:  # the parent's timeout, so a failure in a channel is bounded like one in the group
        return {"timeout": parent._get_backend(comm_device(parent)).options._timeout}
    except Exception:  # noqa: BLE001 - private API; torch's default timeout otherwise
        return {}


def _bound_device(parent) -> bool:
    """Is the default group bound to a device (``init_process_group(device_id=...)``)? Then NCCL
    makes new groups by splitting the default communicator, collective over ITS ranks, and only
    ``dist.split_group`` (collective over the parent alone) is safe for a parent smaller than it."""
    return dist.get_backend(parent) == "nccl" and dist.group.WORLD.bound_device_id is not None


def channel_groups(group, E: int, I: int) -> tuple[object, object]:
    """(this rank's node group, its rail group), every channel group created by every rank of ``group``
    in ``channel_splits``' order, once per rank set (cached): no rank creates a group its peers do
    not create at the same point, so no creation waits on a rank that is elsewhere.

    Bound NCCL default group: two ``dist.split_group`` calls on ``group`` (nodes, then rails).
    Otherwise ``dist.new_group`` for each group in turn; over the whole world every rank takes part
    in every creation, while over a smaller group (a USP ring) only the group's members call, so
    each creation synchronises its members only (``use_local_synchronization``)."""
    ranks = group_ranks(group)
    key = (tuple(ranks), E, I)
    if key in _SUBGROUPS:
        return _SUBGROUPS[key]
    parent = dist.group.WORLD if group is None else group
    me = comm.world(group)[0]
    nodes, rails = channel_splits(E, I)
    kw = _timeout_kw(parent)
    if _bound_device(parent):
        made = [dist.split_group(parent, split_ranks=split, **kw) for split in (nodes, rails)]
    else:
        local = len(ranks) != dist.get_world_size()
        extra = {"use_local_synchronization": True} if local else {}
        every = [dist.new_group([ranks[r] for r in m], **extra, **kw) for m in nodes + rails]
        made = [every[me // I], every[E + me % I]]   # this rank's node, then its rail
    _SUBGROUPS[key] = (made[0], made[1])
    return _SUBGROUPS[key]


def comm_device(group):
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


@dataclass(frozen=True)
class DoubleRingSchedule:
    """The double ring's plan for group rank ``rank`` of E nodes x I ranks: no process group needed
    (``DoubleRing`` runs it; tests simulate it for every rank)."""

    E: int
    I: int
    rank: int

    @property
    def node(self) -> int:
        return self.rank // self.I

    @property
    def local(self) -> int:
        return self.rank % self.I

    def peer(self, channel: str, direction: int = 1) -> int:
        """Group rank this rank sends to (direction 1) or receives from (-1) on ``channel``."""
        n, l = self.node, self.local
        if channel == "intra":
            return n * self.I + (l + direction) % self.I
        return ((n + direction) % self.E) * self.I + l

    def owner(self, step: int) -> int:
        rho, j = divmod(step, self.I)
        return ((self.node - rho) % self.E) * self.I + (self.local - j) % self.I

    def bundle_posts(self, step: int) -> tuple[str, ...]:
        rho, j = divmod(step, self.I)
        posts = ("inter",) if j == 0 and rho < self.E - 1 else ()   # the slow hop first: it has a round to land
        return posts + (("intra",) if j < self.I - 1 else ())

    def bundle_source(self, step: int) -> str:
        return "intra" if step % self.I < self.I - 1 else "inter"

    def acc_route(self, step: int) -> AccRoute:
        rho, j = divmod(step, self.I)
        if step == 0:
            return AccRoute(then="own")
        # an intra partial sum arrives unless this is a chain's first rank (j == 0, or j == 1 in round 0)
        takes = ("intra",) if j >= 1 and not (rho == 0 and j == 1) else ()
        if j < self.I - 1:
            return AccRoute(takes=takes, then="intra")
        if rho == 0:
            return AccRoute(takes=takes, then="keep")
        return AccRoute(takes=takes + (("inter",) if rho >= 2 else ()), then="inter")

    def acc_finish(self) -> tuple[AccRoute, ...]:
        # the last round's sum crosses to the owner's node, meets the kept round-0 sum there, goes home
        return (AccRoute(takes=("inter",), kept=True, then="intra"), AccRoute(takes=("intra",), then="own"))


class DoubleRing(Transport):
    """The double ring over ``group`` (E nodes x I ranks, E >= 2, I >= 2; see the module docstring).

    ``subgroups``: one communicator per channel (default: on NCCL only; gloo separates them by tags).
    """

    def __init__(self, group, nodes: Nodes, *, overlap: bool = True, subgroups: bool | None = None):
        self.group = group
        self.rank, self.size = comm.world(group)
        grid = nodes.grid()
        if nodes.size != self.size or grid is None:
            raise ValueError(f"group of {self.size} ranks on {nodes.describe()}: a double ring needs the group "
                             "to split into equal nodes of consecutive ranks (node-major placement)")
        E, I = grid
        if E < 2 or I < 2:
            raise ValueError(f"a double ring needs >= 2 nodes of >= 2 ranks, got {E} x {I}")
        self.overlap = bool(overlap)
        self.plan = plan = DoubleRingSchedule(E, I, self.rank)
        use_groups = separate_groups(group) if subgroups is None else subgroups
        if use_groups:
            node_group, rail_group = channel_groups(group, E, I)
            groups = {"intra": group, "acc_intra": node_group, "inter": rail_group, "acc_inter": rail_group}
            tags = dict.fromkeys(_TAGS, 0)
        else:
            groups, tags = dict.fromkeys(_TAGS, group), _TAGS

        def channel(name: str, hop: str) -> Channel:
            return Channel(groups[name], dst=comm.global_rank(group, plan.peer(hop, 1)),
                           src=comm.global_rank(group, plan.peer(hop, -1)), link=hop, tag=tags[name])

        self.read = {"intra": channel("intra", "intra"), "inter": channel("inter", "inter")}
        self.write = {"intra": channel("acc_intra", "intra"), "inter": channel("acc_inter", "inter")}
        self.description = f"double ring over {E} nodes x {I} ranks ({nodes.source})"

    def owner(self, step: int) -> int:
        return self.plan.owner(step)

    def src_owner(self, channel: str, step: int) -> int:
        if step >= self.size:   # acc_finish's only send: the intra-node hop home, of the receiver's own block
            return self.rank
        src = self.plan.peer(channel, -1)
        return DoubleRingSchedule(self.plan.E, self.plan.I, src).owner(step)

    def bundle_posts(self, step: int) -> tuple[str, ...]:
        return self.plan.bundle_posts(step)

    def bundle_source(self, step: int) -> str:
        return self.plan.bundle_source(step)

    def acc_route(self, step: int) -> AccRoute:
        return self.plan.acc_route(step)

    def acc_finish(self) -> tuple[AccRoute, ...]:
        return self.plan.acc_finish()


def transport(group=None, topology: str = "flat", node_size: int | None = None, *,
              overlap: bool = True) -> Transport:
    """The transport of a pass over ``group``: ``Ring`` (flat) or ``DoubleRing``.

    ``node_size``: ranks of the group per node (None: ``LOCAL_WORLD_SIZE``, else one node). Validation
    happens here, before any byte is sent. A double ring that would be the flat ring (one node, or
    one rank per node) falls back to ``Ring`` and notes it in the counters ("burst.topology").
    """
    nodes = Nodes.of(group, node_size)
    double = check_transport(nodes, topology, overlap)
    if not double:
        ring = Ring(group, nodes=nodes, overlap=overlap)
        fell_back = topology == "double"
        why = f"{nodes.describe()}" if ring.size > 1 else "one rank"
        comm.note("burst.topology", ring.description if not fell_back else
                  f"flat ring over {ring.size} ranks (topology='double' fell back: {why}; a double ring needs "
                  ">= 2 nodes of >= 2 ranks, otherwise it is the flat ring)")
        return ring
    ring = DoubleRing(group, nodes, overlap=overlap)
    comm.note("burst.topology", ring.description)
    return ring


def check_transport(nodes: Nodes, topology: str, overlap: bool = True) -> bool:
    """ValueError (naming parameter, value and rule) unless a pass of ``topology`` can run on a
    group on ``nodes``; True when it is a real double ring (False: the flat ring)."""
    check_topology(topology)
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap={overlap!r} must be True or False")
    if topology == "flat" or nodes.size == 1:
        return False
    grid = nodes.grid()
    if grid is None:
        raise ValueError(f"topology='double': the group's {nodes.size} ranks are on {nodes.describe()}; a double "
                         "ring needs the group to split into equal nodes of consecutive ranks (node-major placement)")
    return grid[0] >= 2 and grid[1] >= 2
