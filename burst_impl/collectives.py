"""Counted, differentiable collectives shared by every baseline.

Each collective records the bytes THIS rank sends through
``burst_impl.comm.record`` with the conventions at the top of
``burst_impl/comm.py`` (what an optimal ring / pairwise algorithm sends):

* all_to_all of a local buffer of n bytes:        n * (G-1)/G
* all_gather of a local shard of n bytes:         n * (G-1)
* reduce_scatter of a full input of n bytes:      n * (G-1)/G
* all_reduce of n bytes:                          2 * n * (G-1)/G

The autograd wrappers record their forward under phase "forward" and the
collective their backward runs under phase "backward", with the kind names
given by the caller (e.g. ``kind="q", grad_kind="dq"``). With G == 1 nothing
is sent and nothing is recorded, and no collective is called.

Link classes (``burst_impl.nodes``; ``nodes`` = the group's node map, default
``Nodes.of(group)``: ``LOCAL_WORLD_SIZE`` or one node): the ring algorithms
(all-gather, reduce-scatter, all-reduce) send everything to the next rank of
the group, so a rank's bytes are on the link class of that hop; an all-to-all
sends one piece (n/G) to each peer, (I-1) pieces intra-node and G-I inter-node.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from burst_impl import comm
from burst_impl.nodes import Nodes, a2a_split, ring_links

Tensor = torch.Tensor


def _size(group) -> int:
    return comm.world(group)[1]


def _ring_link(group, nodes: Nodes | None) -> str:
    """Link class of this rank's sends in a ring collective over ``group``."""
    return ring_links(nodes or Nodes.of(group), comm.world(group)[0])


# ---------------------------------------------------------------- plain counted calls


def all_to_all_(x: Tensor, scatter_dim: int, gather_dim: int, group, phase: str, kind: str,
                nodes: Nodes | None = None, scatter_sizes=None, gather_sizes=None) -> Tensor:
    """Split ``x`` in G parts along ``scatter_dim``, send part j to rank j, concatenate
    the received parts along ``gather_dim`` in rank order. Not differentiable.

    ``scatter_sizes``/``gather_sizes`` (G ints each, the same on every rank): part j's length along
    ``scatter_dim``, and the length along ``gather_dim`` of the part rank j sends here (uneven
    sequence shards); None: G equal parts, and every received part shaped like the sent ones."""
    G = _size(group)
    if G == 1:
        return x
    if scatter_sizes is not None or gather_sizes is not None:
        return _all_to_all_uneven(x, scatter_dim, gather_dim, group, phase, kind, nodes, scatter_sizes, gather_sizes)
    if x.shape[scatter_dim] % G:
        raise ValueError(f"x.shape[{scatter_dim}]={x.shape[scatter_dim]} must be divisible by the group size {G}")
    # (G, ...) with the part for rank j at index j, contiguous for all_to_all_single.
    send = torch.stack(x.chunk(G, dim=scatter_dim), dim=0).contiguous()
    recv = torch.empty_like(send)
    comm.record_split(phase, kind, a2a_split(nodes or Nodes.of(group), comm.world(group)[0], comm.nbytes(send) // G))
    if dist.get_backend(group) == "gloo":
        _all_to_all_receive_first(recv, send, group)
    else:
        dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


def _all_to_all_uneven(x: Tensor, scatter_dim: int, gather_dim: int, group, phase: str, kind: str,
                       nodes: Nodes | None, scatter_sizes, gather_sizes) -> Tensor:
    """``all_to_all_`` with parts of different lengths (lists of tensors instead of one stacked buffer);
    the bytes counted are those of the parts sent to the other ranks, by the peer's link class."""
    rank, G = comm.world(group)
    if scatter_sizes is None:
        if x.shape[scatter_dim] % G:
            raise ValueError(f"x.shape[{scatter_dim}]={x.shape[scatter_dim]} must be divisible by the group size {G}")
        scatter_sizes = [x.shape[scatter_dim] // G] * G
    send = [p.contiguous() for p in x.split(list(scatter_sizes), dim=scatter_dim)]   # part j for rank j
    recv = []
    for j in range(G):   # rank j's part: our shape with its scatter-dim length, its gather-dim length
        shape = list(send[rank].shape)
        if gather_sizes is not None:
            shape[gather_dim] = gather_sizes[j]
        recv.append(torch.empty(shape, dtype=x.dtype, device=x.device))
    nodes = nodes or Nodes.of(group)
    by_link = {"intra": 0, "inter": 0}
    for j in range(G):
        if j != rank:
            by_link["intra" if nodes.node[j] == nodes.node[rank] else "inter"] += comm.nbytes(send[j])
    comm.record_split(phase, kind, by_link)
    if dist.get_backend(group) == "gloo":
        _all_to_all_receive_first(recv, send, group)
    else:
        dist.all_to_all(recv, send, group=group)
    return torch.cat(recv, dim=gather_dim)


def _all_to_all_receive_first(recv: Tensor, send: Tensor, group) -> None:
    """``all_to_all_single`` on gloo as point-to-point messages, every receive posted before any send.

    gloo's own all-to-all posts, for each offset i, the send to rank r+i before the receive from
    r-i; for the pair (r, r+G/2) that is a send posted before the peer's receive, which serialises
    the pair's two directions (see ``burst_impl.comm.Channel.start``); this order reaches the link
    rate (measured: docs/findings.md, gloo posting order). Same bytes,
    same pieces (piece j of ``send`` to group rank j, piece j of ``recv`` from it; ``send``/``recv`` may be
    lists of pieces of different shapes)."""
    rank, G = comm.world(group)
    recv[rank].copy_(send[rank])
    peers = [(rank + i) % G for i in range(1, G)]
    ops = [dist.P2POp(dist.irecv, recv[j], comm.global_rank(group, j), group) for j in peers]
    ops += [dist.P2POp(dist.isend, send[j], comm.global_rank(group, j), group) for j in peers]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


# torch 2.13 renamed the flat collectives (the old names warn); a GPU venv may reuse an older torch that has only them
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_(x: Tensor, dim: int, group, phase: str, kind: str, nodes: Nodes | None = None) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order. Not differentiable."""
    G = _size(group)
    if G == 1:
        return x
    x = x.contiguous()
    out = torch.empty(G * x.numel(), dtype=x.dtype, device=x.device)  # flat: rank j's x at block j
    comm.record(phase, kind, comm.nbytes(x) * (G - 1), _ring_link(group, nodes))
    _ALL_GATHER(out, x.view(-1), group=group)
    return torch.cat(out.view((G,) + tuple(x.shape)).unbind(0), dim=dim)


def reduce_scatter_(x: Tensor, dim: int, group, phase: str, kind: str, nodes: Nodes | None = None) -> Tensor:
    """Sum ``x`` over ranks and keep this rank's part of ``dim``. Not differentiable."""
    G = _size(group)
    if G == 1:
        return x
    if x.shape[dim] % G:
        raise ValueError(f"x.shape[{dim}]={x.shape[dim]} must be divisible by the group size {G}")
    send = torch.stack(x.chunk(G, dim=dim), dim=0).contiguous()  # (G, ...) part j for rank j
    out = torch.empty_like(send[0])
    comm.record(phase, kind, comm.nbytes(send) * (G - 1) // G, _ring_link(group, nodes))
    _REDUCE_SCATTER(out.view(-1), send.view(-1), group=group)
    return out


def all_reduce_(x: Tensor, group, phase: str, kind: str, nodes: Nodes | None = None) -> Tensor:
    """Sum ``x`` over ranks (a new tensor). Not differentiable."""
    G = _size(group)
    if G == 1:
        return x
    out = x.contiguous().clone()
    comm.record(phase, kind, 2 * comm.nbytes(out) * (G - 1) // G, _ring_link(group, nodes))
    dist.all_reduce(out, group=group)
    return out


# ---------------------------------------------------------------- autograd wrappers


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, kind, grad_kind, nodes, scatter_sizes, gather_sizes):
        ctx.cfg = (scatter_dim, gather_dim, group, grad_kind, nodes, scatter_sizes, gather_sizes)
        return all_to_all_(x, scatter_dim, gather_dim, group, "forward", kind, nodes, scatter_sizes, gather_sizes)

    @staticmethod
    def backward(ctx, g):
        scatter_dim, gather_dim, group, grad_kind, nodes, scatter_sizes, gather_sizes = ctx.cfg
        # The transpose of an all-to-all is the all-to-all with the dims (and the split sizes) swapped.
        return all_to_all_(g, gather_dim, scatter_dim, group, "backward", grad_kind, nodes, gather_sizes,
                           scatter_sizes), *([None] * 8)


def all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group=None, *, kind: str,
               grad_kind: str, nodes: Nodes | None = None, scatter_sizes=None, gather_sizes=None) -> Tensor:
    """Differentiable ``all_to_all_`` (split sizes as there)."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group, kind, grad_kind, nodes, scatter_sizes, gather_sizes)


def _dual_pair(forward_fn, backward_fn, name: str):
    """An autograd collective whose backward is its dual (all-gather <-> reduce-scatter)."""

    def forward(ctx, x, dim, group, kind, grad_kind, nodes):
        ctx.cfg = (dim, group, grad_kind, nodes)
        return forward_fn(x, dim, group, "forward", kind, nodes)

    def backward(ctx, g):
        dim, group, grad_kind, nodes = ctx.cfg
        return backward_fn(g, dim, group, "backward", grad_kind, nodes), None, None, None, None, None

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


_AllGather = _dual_pair(all_gather_, reduce_scatter_, "_AllGather")
_ReduceScatter = _dual_pair(reduce_scatter_, all_gather_, "_ReduceScatter")


def all_gather(x: Tensor, dim: int, group=None, *, kind: str, grad_kind: str, nodes: Nodes | None = None) -> Tensor:
    """Differentiable all-gather; its backward is a counted reduce-scatter."""
    return _AllGather.apply(x, dim, group, kind, grad_kind, nodes)


def reduce_scatter(x: Tensor, dim: int, group=None, *, kind: str, grad_kind: str,
                   nodes: Nodes | None = None) -> Tensor:
    """Differentiable reduce-scatter; its backward is a counted all-gather."""
    return _ReduceScatter.apply(x, dim, group, kind, grad_kind, nodes)


class _ReduceFwd(torch.autograd.Function):
    """Megatron's "g": all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, kind, nodes):
        return all_reduce_(x, group, "forward", kind, nodes)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


class _ReduceBwd(torch.autograd.Function):
    """Megatron's "f": identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group, grad_kind, nodes):
        ctx.cfg = (group, grad_kind, nodes)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        group, grad_kind, nodes = ctx.cfg
        return all_reduce_(g, group, "backward", grad_kind, nodes), None, None, None


def all_reduce_forward(x: Tensor, group=None, *, kind: str, nodes: Nodes | None = None) -> Tensor:
    return _ReduceFwd.apply(x, group, kind, nodes)


def all_reduce_backward(x: Tensor, group=None, *, grad_kind: str, nodes: Nodes | None = None) -> Tensor:
    return _ReduceBwd.apply(x, group, grad_kind, nodes)


# ---------------------------------------------------------------- formula bytes of adapters


class _RecordFormula(torch.autograd.Function):
    """Identity on (q, k, v) that records formula bytes: forward now, backward when grads pass."""

    @staticmethod
    def forward(ctx, table, q, k, v):
        ctx.table = table
        for (phase, kind), b in table.items():
            if phase == "forward":
                comm.record(phase, kind, b)
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        for (phase, kind), b in ctx.table.items():
            if phase == "backward":
                comm.record(phase, kind, b)
        return None, dq, dk, dv


def record_formula(table: dict, q: Tensor, k: Tensor, v: Tensor):
    """Identity on (q, k, v) that records ``table``'s bytes (``{(phase, kind): bytes}``): forward
    bytes now, backward bytes when the gradients pass back. For adapters whose sends happen inside
    another package (their bytes are formulas, flagged by ``Method.bytes_by_formula``)."""
    return _RecordFormula.apply(table, q, k, v)

