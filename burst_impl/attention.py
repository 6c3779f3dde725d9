"""The BurstAttention operator (docs/papers.md §1).

``burst_attn_func(q, k, v, *, causal, mask, softmax_scale, group, layout, backward)``
takes the local shards (B, N/G, Z, d) of q and (B, N/G, Zkv, d) of k, v and
returns the local shard of the attention output, differentiably.

Masks (``burst_impl.masks``): each ring step computes only the live part of
its (query shard, key/value shard) pair, the tiles of its plan
(``burst_impl.plan``), which depend only on the two shards' global positions
and the mask (never on the step index, so any transport can use them). A
fully masked pair is skipped (no compute) but its block still travels: the
bytes are those of ``burst_impl.volume``. The skipped pairs and the live
entries of each rank are noted in the byte counters
(``counts.notes["burst.skipped_blocks.forward"]``, ``...backward``,
``"burst.live_entries.forward"``, ...).

Forward: Q stays, K/V circulate G steps; each step's partial (O_ij, lse_ij)
merges into the running (O_i, lse_i) in fp32, fp64 for fp64 inputs (`merge_partial`).
Backward ``"burst"``: K, V, dK, dV stay; (Q, dO, lse, delta) circulate on one
ring and the dQ accumulator on a second ring that ends at the owner.
Backward ``"ring"``: Q, dO, lse, delta, dQ stay; (K, V) circulate and the dK,
dV accumulators follow on the second ring. ``"auto"`` takes whichever sends
fewer bytes (`volume.cheaper_backward`) and notes the choice in the byte
counters (``counts.notes["burst.backward"]``).

The ring loops themselves (``circulate``, ``AccumulatorRing``) live in
``burst_impl.comm``; they keep a rank whose block computation raises in the
ring until every transfer is done, then raise (see ``comm.circulate``).
They run on a transport built once per call before any byte is sent
(``burst_impl.topology.transport``): the flat ring, or the double ring
(``topology="double"``); the per-step compute only sees (q owner, kv owner).
"""
from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass

import torch

from . import comm, masks, volume
from .balance import resolve_layout
from .comm import AccumulatorRing, circulate  # the ring helpers live in comm; re-exported
from .kernels import (FLOAT_DTYPES, attn_backward, attn_forward, compute_delta, default_scale,
                      resolve_backend, stats_dtype)
from .layout import check_layout, check_seqlen, is_balanced_name, lengths
from .plan import ALL, StepPlan, step_plan
from .shape import AttnShape
from .topology import transport as topology_transport

Tensor = torch.Tensor
BACKWARDS = ("burst", "ring", "auto")
_DTYPE_NAMES = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)

# ---------------------------------------------------------------- validation


def check_inputs(q: Tensor, k: Tensor, v: Tensor, *, layout="contiguous",
                 backward: str = "burst", softmax_scale: float | None = None, backend: str | None = None,
                 grad_comm_dtype: torch.dtype | None = None, group=None, causal: bool = False,
                 mask=None, **agree) -> tuple[masks.Mask, object]:
    """``validate_call``'s resolved (mask, layout): the one validation every sequence-parallel method
    calls first (see there)."""
    c = validate_call(q, k, v, layout=layout, backward=backward, softmax_scale=softmax_scale, backend=backend,
                      grad_comm_dtype=grad_comm_dtype, group=group, causal=causal, mask=mask, **agree)
    return c.mask, c.layout


@dataclass(frozen=True)
class Call:
    """What ``validate_call`` settled: the resolved mask and layout, the global N and every rank's length."""

    mask: masks.Mask
    layout: object
    seqlen: int
    lengths: tuple[int, ...]


def validate_call(q: Tensor, k: Tensor, v: Tensor, *, layout="contiguous", backward: str = "burst",
                  softmax_scale: float | None = None, backend: str | None = None,
                  grad_comm_dtype: torch.dtype | None = None, group=None, causal: bool = False, mask=None,
                  method: str = "burst", options: dict | None = None, seqlen: int | None = None,
                  checks: tuple = ()) -> Call:
    """Raise ValueError (naming parameter, value and rule) before any communication.

    Local rules: tensors, dtypes (float16, bfloat16, float32, float64), shapes, layout, backward
    scheme, ``softmax_scale`` (finite, positive), ``grad_comm_dtype`` (a floating dtype), ``backend``
    (known, and able to run on the tensors' device and dtype), membership of ``group``. Then, with
    ``comm.check_shapes`` on (the default), one all-gather of a fixed-size signature over ``group``
    (``comm.agree_on_inputs``): every rank learns every rank's local length, so N, and the ranks must
    agree on dtype, batch, heads, kv heads, head dim, causal, mask, softmax_scale, layout, backward,
    grad_comm_dtype, backend, ``method`` and its ``options``, else the same ValueError on every
    rank. Off: N is ``seqlen``, else seq_local x G. Then the rules that need N, identical on every
    rank: the mask (``masks.resolve``: window sizes, document boundaries, block mask shape), the
    layout (``"balanced"`` resolved), ``N >= number of chunks``, and each rank's length is the
    layout's (``layout.lengths``). ``checks``: the method's own local rules (callables raising
    ValueError), run with the local ones, before the agreement (so a rank that fails them is named
    on every rank instead of leaving the others in the collective).
    """
    rank, world_size = comm.world(group)  # a non-member raises here, and must not join the agreement below
    problem = None
    try:
        _check_local(q, k, v, layout=layout, backward=backward, softmax_scale=softmax_scale, backend=backend,
                     grad_comm_dtype=grad_comm_dtype)
        for check in checks:
            check()
    except ValueError as e:
        problem = e
    lens = None
    if comm.shape_check_enabled() and world_size > 1:
        values = _agreed_values(q, k, causal, mask, softmax_scale, layout, backward, grad_comm_dtype, backend,
                                method, options, seqlen)
        rows = comm.agree_on_inputs(group, [_hash(x) for x in values] + [_local_len(q)], problem, _describe,
                                    names=AGREED + ("seq_local",), values=[_readable(x) for x in values] + [""],
                                    vary=(len(AGREED),))
        lens = tuple(row[-1] for row in rows)
    if problem is not None:
        raise problem
    n = sum(lens) if lens is not None else (seqlen if seqlen is not None else q.shape[1] * world_size)
    the_mask, layout = _check_global(n, layout, causal, mask, world_size)
    expected = lengths(layout, world_size, n)
    # every rank's length (agreed), or this rank's alone (the check off: the caller vouches for the rest)
    if lens is not None and lens != expected or lens is None and q.shape[1] != expected[rank]:
        where = f"the ranks hold {lens}" if lens is not None else f"rank {rank} holds {q.shape[1]}"
        raise ValueError(f"seq_local=q.shape[1]: {where} tokens, but layout={str(layout)!r} splits N={n} over "
                         f"world_size={world_size} as {expected} (rank r must hold layout.lengths(...)[r] tokens: "
                         "shard the inputs with burst_impl.layout.shard)")
    if seqlen is not None and seqlen != n:
        raise ValueError(f"seqlen={seqlen} must equal the sum of the ranks' seq_local, {n}")
    return Call(the_mask, layout, n, expected)


# What the ranks of a call must agree on (one signature slot each, in this order; then the local length).
AGREED = ("dtype", "batch", "heads", "kv_heads", "head_dim", "causal", "mask", "softmax_scale", "layout",
          "backward", "grad_comm_dtype", "backend", "method", "options", "seqlen")


def _agreed_values(q, k, causal, mask, softmax_scale, layout, backward, grad_comm_dtype, backend, method,
                   options, seqlen) -> list:
    shape = tuple(q.shape) if isinstance(q, Tensor) and q.dim() == 4 else (None,) * 4
    kv = k.shape[2] if isinstance(k, Tensor) and k.dim() == 4 else None
    the_mask = getattr(mask, "key", mask)
    return [getattr(q, "dtype", None), shape[0], shape[2], kv, shape[3], bool(causal), the_mask, softmax_scale,
            getattr(layout, "chunks", layout), backward, grad_comm_dtype, backend, method,
            sorted((options or {}).items()), seqlen]


def _readable(value):
    """What a disagreement message shows of an agreed value: options as a dict (its keys get named)."""
    return {k: repr(v) for k, v in value} if isinstance(value, list) else repr(value)


def _hash(value) -> int:
    """A stable (process-independent) signed 63-bit hash of ``repr(value)``."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 1


def _local_len(q) -> int:
    return q.shape[1] if isinstance(q, Tensor) and q.dim() >= 2 else -1


def _check_global(seqlen: int, layout, causal, mask, world_size: int):
    """The rules that need N: the mask for N, the layout resolved for it, N >= its chunks."""
    the_mask = masks.resolve(bool(causal), mask, seqlen)
    layout = resolve_layout(layout, the_mask, seqlen, world_size)
    # the layout (checked), its rank count and N >= its chunks, before any send
    check_seqlen(seqlen, layout, world_size, name="N=sum of seq_local over the ranks")
    return the_mask, layout


def _check_local(q, k, v, *, layout, backward, softmax_scale, backend, grad_comm_dtype):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}={type(t).__name__} must be a torch.Tensor (batch, seq_local, heads, head_dim)")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}.dtype={t.dtype} must be a floating dtype: one of {_DTYPE_NAMES}")
        if t.dim() != 4:
            raise ValueError(f"{name}.shape={tuple(t.shape)} must be 4-D (batch, seq_local, heads, head_dim)")
    if k.shape != v.shape:
        raise ValueError(f"k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} must be equal")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q.shape={tuple(q.shape)} and k.shape={tuple(k.shape)} must agree in batch, "
                         "seq_local and head_dim")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads q.shape[2]={q.shape[2]} must be a multiple of key/value heads "
                         f"k.shape[2]={k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"dtypes of q, k, v must be equal, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"devices of q, k, v must be equal, got {q.device}, {k.device}, {v.device}")
    if backward not in BACKWARDS:
        raise ValueError(f"backward={backward!r} is unknown; choose one of {BACKWARDS}")
    if q.shape[1] == 0:
        raise ValueError(f"seq_local=q.shape[1]={q.shape[1]} must be positive")
    if not is_balanced_name(layout):
        check_layout(layout)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real) \
                or not math.isfinite(softmax_scale) or not softmax_scale > 0:
            raise ValueError(f"softmax_scale={softmax_scale!r} must be a finite positive number "
                             "(or None for 1/sqrt(head_dim))")
    if grad_comm_dtype is not None and grad_comm_dtype not in FLOAT_DTYPES:
        raise ValueError(f"grad_comm_dtype={grad_comm_dtype!r} must be a floating torch.dtype: one of "
                         f"{_DTYPE_NAMES} (or None: fp32, fp64 for fp64 inputs)")
    resolve_backend(q.device, backend, q.dtype, q.shape[-1])


def _describe(sig: list[int]) -> str:
    return ", ".join(f"{n} #{x}" for n, x in zip(AGREED + ("seq_local",), sig))


# ---------------------------------------------------------------- numerics


def merge_partial(out: Tensor, lse: Tensor, out_blk: Tensor, lse_blk: Tensor) -> None:
    """In place: fold a block's (out_blk, lse_blk) into the running (out, lse).

    out (B, S, Z, d), lse (B, Z, S), both in the statistics dtype (fp32, or
    fp64 for fp64 inputs). docs/papers.md §1 online-softmax rule in a stable form:
    with m = max(lse, lse_blk), a = e^(lse - m), b = e^(lse_blk - m) (both in [0, 1]):
    lse' = m + log(a + b), out' = out + b / (a + b) (out_blk - out). The weight is
    taken from a and b, not from e^(lse_blk - lse'): lse' at |lse| ~ 1e4 carries an
    fp32 rounding of ~5e-4 that the latter would put into the weight. A row with no
    live key so far has lse = -inf and out = 0: merging two such rows leaves them so
    (m is taken as 0 there, a = b = 0, weight 0), never NaN.
    """
    m = torch.maximum(lse, lse_blk)
    m = m.masked_fill(m == float("-inf"), 0.0)                    # (B, Z, S)
    a, b = torch.exp(lse - m), torch.exp(lse_blk - m)
    total = a + b
    w = (b / total).nan_to_num_(nan=0.0).transpose(1, 2).unsqueeze(-1)  # (B, S, Z, 1)
    out.add_(w * (out_blk.to(out.dtype) - out))
    lse.copy_(m + torch.log(total))


# ---------------------------------------------------------------- tiles of a plan


def _sel(x: Tensor, sel, dim: int = 1) -> Tensor:
    """Rows/columns ``sel`` (a slice: a view; an index tensor: gathered) of ``x`` along ``dim``."""
    if isinstance(sel, slice):
        return x if sel == ALL else x[(slice(None),) * dim + (sel,)]
    return x.index_select(dim, sel.to(x.device))


class RowState:
    """The running (out, lse) of a shard's query rows, merged tile by tile in the statistics dtype.

    Rows that no tile reaches keep out = 0 and lse = -inf (fully masked rows)."""

    def __init__(self, q: Tensor):
        self.q, self.acc = q, stats_dtype(q.dtype)
        self.out: Tensor | None = None
        self.lse: Tensor | None = None

    def add(self, rows, out_blk: Tensor, lse_blk: Tensor) -> None:
        if self.out is None:
            if isinstance(rows, slice) and rows == ALL:   # the first tile covers every row: it initialises
                self.out, self.lse = out_blk.to(self.acc), lse_blk.to(self.acc).clone()
                return
            self._init()
        if isinstance(rows, slice):
            merge_partial(_sel(self.out, rows), _sel(self.lse, rows, 2), out_blk, lse_blk)
            return
        idx = rows.to(self.out.device)
        o, l = self.out.index_select(1, idx), self.lse.index_select(2, idx)
        merge_partial(o, l, out_blk, lse_blk)
        self.out.index_copy_(1, idx, o)
        self.lse.index_copy_(2, idx, l)

    def _init(self) -> None:
        b, s, z, _ = self.q.shape
        self.out = torch.zeros_like(self.q, dtype=self.acc, memory_format=torch.contiguous_format)
        self.lse = torch.full((b, z, s), float("-inf"), dtype=self.acc, device=self.q.device)

    def result(self) -> tuple[Tensor, Tensor]:
        if self.out is None:
            self._init()
        return self.out, self.lse


class GradAcc:
    """A full-shard gradient accumulator (statistics dtype), added to tile by tile; created on the
    first contribution (a tile covering every row is taken as is), or given (``home``)."""

    def __init__(self, like: Tensor, acc: torch.dtype, home: Tensor | None = None):
        self.like, self.acc, self.t = like, acc, home

    def add(self, sel, part: Tensor) -> None:
        if self.t is None:
            if isinstance(sel, slice) and sel == ALL:
                self.t = part.to(self.acc)
                return
            self.t = torch.zeros_like(self.like, dtype=self.acc, memory_format=torch.contiguous_format)
        if isinstance(sel, slice):
            _sel(self.t, sel).add_(part)
        else:
            self.t.index_add_(1, sel.to(self.t.device), part.to(self.acc))


def forward_tiles(state: RowState, plan: StepPlan, q: Tensor, k: Tensor, v: Tensor, scale: float,
                  backend) -> None:
    """Every tile of ``plan`` for local q against the block k, v, merged into ``state``."""
    for t in plan.tiles:
        r, c = t.on(q.device)
        o, l = attn_forward(_sel(q, r), _sel(k, c), _sel(v, c), mask=t.mask, scale=scale, backend=backend)
        state.add(r, o, l)


def backward_tiles(plan: StepPlan, dout, q, k, v, lse, delta, scale, backend,
                   dq: GradAcc, dk: GradAcc, dv: GradAcc) -> None:
    """Gradients of every tile of ``plan``: rows of the query side into ``dq``, columns of the
    key/value side into ``dk``, ``dv`` (lse, delta: the global statistics of the query rows)."""
    for t in plan.tiles:
        r, c = t.on(q.device)
        g = attn_backward(_sel(dout, r), _sel(q, r), _sel(k, c), _sel(v, c), _sel(lse, r, 2), _sel(delta, r, 2),
                          mask=t.mask, scale=scale, backend=backend)
        dq.add(r, g[0])
        dk.add(c, g[1])
        dv.add(c, g[2])


class _Planner:
    """Plans of one call (mask, layout, N, G); counts the skipped pairs and live entries of this rank."""

    def __init__(self, mask, layout, seqlen: int, world_size: int):
        self.args = (mask, layout, seqlen, world_size)
        self.lengths = lengths(layout, world_size, seqlen)   # every rank's shard length (blocks in flight)
        self.skipped = 0
        self.entries = 0

    def __call__(self, q_rank: int, kv_rank: int) -> StepPlan:
        mask, layout, n, g = self.args
        p = step_plan(mask, layout, q_rank, kv_rank, n, g)
        self.skipped += p.empty
        self.entries += p.entries
        return p

    def note(self, phase: str) -> None:
        comm.note(f"burst.skipped_blocks.{phase}", self.skipped)
        comm.note(f"burst.live_entries.{phase}", self.entries)


# ---------------------------------------------------------------- forward / backward


def ring_forward(q, k, v, *, mask, scale, ring, layout, backend, seqlen):
    """-> (out (B,S,Z,d) in q.dtype, lse (B,Z,S) in the statistics dtype). ``ring``: the transport."""
    plans = _Planner(mask, layout, seqlen, ring.size)
    state = RowState(q)

    def on_block(step, owner, kv):
        forward_tiles(state, plans(ring.rank, owner), q, kv[0], kv[1], scale, backend)
        return None

    circulate(ring, [k, v], "forward", ("k", "v"), on_block,
              shapes=comm.seq_shapes([k, v], (1, 1), plans.lengths))   # (B, S_owner, Zkv, d) blocks
    plans.note("forward")
    out, lse = state.result()
    return out.to(q.dtype), lse


def burst_backward(dout, q, k, v, out, lse, *, mask, scale, ring, layout, backend, grad_dtype, seqlen):
    """Query side circulates; dK, dV accumulate at home; dQ rides the second ring."""
    plans = _Planner(mask, layout, seqlen, ring.size)
    acc = stats_dtype(q.dtype)
    delta = compute_delta(dout, out)  # (B, Z, S); travels instead of O
    dk = GradAcc(k, acc, torch.zeros_like(k, dtype=acc))
    dv = GradAcc(v, acc, torch.zeros_like(v, dtype=acc))
    dq_ring = AccumulatorRing(ring, ("dq",), [q], grad_dtype, acc, shapes=comm.seq_shapes([q], (1,), plans.lengths))

    def on_block(step, owner, qside):
        q_j, do_j, lse_j, delta_j = qside
        plan = plans(owner, ring.rank)
        if plan.empty:
            return None
        dq = GradAcc(q_j, acc)   # (B, S_owner, Z, d): the visiting block's length
        backward_tiles(plan, do_j, q_j, k, v, lse_j, delta_j, scale, backend, dq, dk, dv)
        return [dq.t]

    bundle = [q, dout, lse, delta]    # (B, S, Z, d) x2, (B, Z, S) x2
    (dq,) = circulate(ring, bundle, "backward", ("q", "dout", "lse", "delta"), on_block,
                      acc=dq_ring, shapes=comm.seq_shapes(bundle, (1, 1, 2, 2), plans.lengths))
    plans.note("backward")
    return dq, dk.t, dv.t


def kv_ring_backward(dout, q, k, v, out, lse, *, mask, scale, ring, layout, backend, grad_dtype, seqlen):
    """Key/value side circulates; dQ accumulates at home; dK, dV ride the second ring."""
    plans = _Planner(mask, layout, seqlen, ring.size)
    acc = stats_dtype(q.dtype)
    delta = compute_delta(dout, out)
    dq = GradAcc(q, acc, torch.zeros_like(q, dtype=acc))
    kv_shapes = comm.seq_shapes([k, v], (1, 1), plans.lengths)   # (B, S_owner, Zkv, d) blocks
    dkv_ring = AccumulatorRing(ring, ("dk", "dv"), [k, v], grad_dtype, acc, shapes=kv_shapes)

    def on_block(step, owner, kv):
        plan = plans(ring.rank, owner)
        if plan.empty:
            return None
        dk, dv = GradAcc(kv[0], acc), GradAcc(kv[1], acc)
        backward_tiles(plan, dout, q, kv[0], kv[1], lse, delta, scale, backend, dq, dk, dv)
        return [dk.t, dv.t]

    dk, dv = circulate(ring, [k, v], "backward", ("k", "v"), on_block, acc=dkv_ring, shapes=kv_shapes)
    plans.note("backward")
    return dq.t, dk, dv


BACKWARD_FNS = {"burst": burst_backward, "ring": kv_ring_backward}


def resolve_backward(backward: str, q: Tensor, k: Tensor, world_size: int, grad_dtype) -> str:
    if backward != "auto":
        return backward
    return volume.cheaper_backward(AttnShape.from_tensors(q, k, world_size),
                                   torch.empty((), dtype=grad_dtype).element_size())


class _BurstAttnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, ring, layout, backward, backend, grad_dtype, seqlen):
        out, lse = ring_forward(q, k, v, mask=mask, scale=scale, ring=ring, layout=layout,
                                backend=backend, seqlen=seqlen)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = dict(mask=mask, scale=scale, ring=ring, layout=layout, backend=backend,
                       grad_dtype=grad_dtype, seqlen=seqlen)
        ctx.backward_name = backward
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = BACKWARD_FNS[ctx.backward_name](dout, q, k, v, out, lse, **ctx.cfg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None, None


def burst_attn_func(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, mask=None,
                    softmax_scale: float | None = None, group=None, layout="contiguous",
                    backward: str = "auto", backend: str | None = None,
                    grad_comm_dtype: torch.dtype | None = None, return_lse: bool = False,
                    topology: str = "flat", node_size: int | None = None, overlap: bool = True,
                    seqlen: int | None = None):
    """BurstAttention on local shards.

    q (B, N/G, Z, d), k and v (B, N/G, Zkv, d), Z a multiple of Zkv, each rank
    holding the shard of ``layout`` (see ``burst_impl.layout.shard``), in
    float16, bfloat16, float32 or float64, with any strides. Returns out
    (B, N/G, Z, d) in q's dtype, and with ``return_lse`` also the global
    log-sum-exp of the local rows, (B, Z, N/G), fp32 (fp64 for fp64 inputs).

    ``mask``: a ``burst_impl.masks.Mask`` (``SlidingWindow``, ``Documents``,
    ``BlockSparse``, ...) or its spec string (``"window:128:0"``), over global
    positions; with ``causal=True`` it is intersected with the causal mask,
    alone ``causal=True`` is the causal mask. ``layout`` is a named layout, a
    ``ChunkLayout`` or ``"balanced"`` (the balanced chunk assignment of the
    mask, ``burst_impl.balance``); shard the inputs with the same resolved
    layout (``balance.resolve_layout``). Rows with no live key (possible
    with windows and block-sparse masks) give out = 0, lse = -inf, zero gradients.

    ``grad_comm_dtype`` is the dtype of the travelling gradient accumulators
    (dQ for "burst", dK/dV for "ring"); None (default) means fp32, or fp64 for
    fp64 inputs, so that G partial sums do not lose precision in bf16.

    Any N >= the layout's chunks (``burst_impl.layout``: shards of uneven N
    differ by at most a token per chunk; rank r holds ``layout.lengths(layout,
    G, N)[r]`` tokens). Before the first byte the ranks agree on their inputs
    (``validate_call``: one small all-gather per call, which also gives every
    rank every shard's length); disagreement is the same ValueError on every
    rank. ``comm.check_shapes(False)`` skips it for callers that guarantee
    agreement: then N is ``seqlen`` (required for uneven shards), else
    seq_local x G.
    If a block computation raises on one rank, that rank finishes its part of
    the ring transfers and then raises; its peers complete without error (and
    without its contribution), and the group stays usable.

    ``topology``: "flat" (one ring over the group in rank order) or "double"
    (``burst_impl.topology``: an intra-node ring per node while the next
    round's block crosses to the same local rank of the next node; falls back
    to the flat ring, with a note, on one node or one rank per node).
    ``node_size``: ranks of the group per node (None: from ``LOCAL_WORLD_SIZE``,
    else one node); it also sets the link class of every counted send.
    ``overlap=False`` waits for each transfer before computing (no
    communication/computation overlap), to measure what overlap buys.
    """
    c = _prepare(q, k, v, causal=causal, mask=mask, softmax_scale=softmax_scale, group=group, layout=layout,
                 backward=backward, backend=backend, grad_comm_dtype=grad_comm_dtype, topology=topology,
                 node_size=node_size, overlap=overlap, seqlen=seqlen)
    out, lse = _BurstAttnFn.apply(q, k, v, c["mask"], c["scale"], c["ring"], c["layout"], c["backward"],
                                  c["backend"], c["grad_dtype"], c["seqlen"])
    return (out, lse) if return_lse else out


def burst_attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                        causal: bool = False, mask=None, softmax_scale: float | None = None, group=None,
                        layout="contiguous", backward: str = "auto", backend: str | None = None,
                        grad_comm_dtype: torch.dtype | None = None, topology: str = "flat",
                        node_size: int | None = None, overlap: bool = True, seqlen: int | None = None
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """The operator's backward from a saved forward: (dq, dk, dv) of ``burst_attn_func`` with the same
    keywords, given its ``out`` and ``lse`` (as ``return_lse=True`` gives them), without autograd. For
    callers that keep (out, lse) themselves, e.g. sequence-level checkpointing (burst_impl.model.checkpoint)."""
    c = _prepare(q, k, v, causal=causal, mask=mask, softmax_scale=softmax_scale, group=group, layout=layout,
                 backward=backward, backend=backend, grad_comm_dtype=grad_comm_dtype, topology=topology,
                 node_size=node_size, overlap=overlap, seqlen=seqlen)
    name = c.pop("backward")
    dq, dk, dv = BACKWARD_FNS[name](dout, q, k, v, out, lse, **c)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _prepare(q, k, v, *, causal, mask, softmax_scale, group, layout, backward, backend, grad_comm_dtype,
             topology, node_size, overlap, seqlen=None) -> dict:
    """Everything the forward and the backward need, settled before any byte is sent: inputs validated
    (``check_inputs``), the transport, scale, gradient dtype and the backward scheme (``auto`` resolved,
    and noted). Keys: the keywords of ``BACKWARD_FNS`` plus ``backward``."""
    opts = dict(topology=topology, node_size=getattr(node_size, "node", node_size), overlap=overlap)
    call = validate_call(q, k, v, layout=layout, backward=backward, softmax_scale=softmax_scale, backend=backend,
                         grad_comm_dtype=grad_comm_dtype, group=group, causal=causal, mask=mask, method="burst",
                         options=opts, seqlen=seqlen)
    ring = topology_transport(group, topology, node_size, overlap=overlap)
    grad_dtype = grad_comm_dtype if grad_comm_dtype is not None else stats_dtype(q.dtype)
    chosen = resolve_backward(backward, q, k, ring.size, grad_dtype)
    comm.note("burst.backward", chosen)
    return dict(mask=call.mask, scale=default_scale(q.shape[-1], softmax_scale), ring=ring, layout=call.layout,
                backend=backend, grad_dtype=grad_dtype, backward=chosen, seqlen=call.seqlen)
