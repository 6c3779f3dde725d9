"""``ulysses`` / ``deepspeed_ulysses`` and ``usp`` (Ulysses inside groups, Burst ring across them).

Ulysses (baselines/ulysses.py): one all-to-all each for Q, K, V (sequence
shards -> head shards, in that order, each a blocking collective), one flash
kernel over the whole sequence for the rank's Z/G heads, one all-to-all of
the output back; backward: the all-to-all of dO, the backward kernel, then
those of dQ, dK, dV. Zigzag and striped layouts reorder the gathered tokens
locally (an HBM copy, no bytes). With GQA and Zkv < G the kv heads are
replicated before the all-to-all (the registry's k, v bytes include them).

USP (baselines/usp.py): the same all-to-alls inside groups of u consecutive
ranks (one node when u divides the node size), then the Burst ring over the r
= G/u ranks with the same index in every group (u rings side by side, one rank
per group), with Z/u query heads on N/r tokens per ring rank.
"""
from __future__ import annotations

from burst_impl.flops import mask_area

from .common import Ctx, all_to_all, sequence_parallel
from .ring_family import ring_backward, ring_forward
from baselines.registry import get


def _kv_rep(heads: int, kv_heads: int, degree: int) -> int:
    """Copies of each kv head in the all-to-all (as baselines/ulysses.py; shapes were validated)."""
    return 1 if kv_heads % degree == 0 else degree // kv_heads


def _a2a_phase(ctx: Ctx, groups, ready, *, phase: str, kinds, prefix: str) -> dict:
    for kind in kinds:
        ready = all_to_all(ctx, groups, phase=phase, name=f"a2a_{kind}", nbytes=ctx.take(phase, (prefix + kind,)),
                           ready=ready)
    return ready


def _reorder(ctx: Ctx, ready: dict, *, phase: str, tensors: float, name: str) -> dict:
    """zigzag / striped: gathered tokens permuted locally into position order (read + write)."""
    if ctx.shape.layout == "contiguous":
        return ready
    return {g: ctx.compute(g, f"{name}[r{g}]", ctx.cost.hbm(2 * tensors), deps=[ready[g]], phase=phase)
            for g in ready}


def _ulysses_schedule(ctx: Ctx, u: int, *, prefix: str, topology: str = "flat", overlap: bool = True) -> dict:
    s = ctx.shape
    G = s.world_size
    r = G // u
    b, d, e = s.batch, s.head_dim, ctx.elem
    rep = _kv_rep(s.heads, s.kv_heads, u)
    z, zkv = s.heads // u, s.kv_heads * rep // u
    groups = [[i * u + j for j in range(u)] for i in range(r)]
    rings = [[i * u + j for i in range(r)] for j in range(u)]
    gathered = s.seqlen // r                 # tokens per rank after the all-to-all
    qkv = b * gathered * (z + 2 * zkv) * d * e
    out = b * gathered * z * d * e

    def forward(ready):
        ready = _a2a_phase(ctx, groups, ready, phase="forward", kinds=("q", "k", "v"), prefix=prefix)
        ready = _reorder(ctx, ready, phase="forward", tensors=qkv, name="reorder_qkv")
        if r == 1:
            t, f = _kernel(ctx, z, s.seqlen, "forward")
            ready = {g: ctx.compute(g, f"attn_fwd[r{g}]", t, deps=[ready[g]], phase="forward", flops=f)
                     for g in ready}
        else:
            ready = ring_forward(ctx, rings, ready, local=gathered, heads=z, kv_heads=zkv, topology=topology,
                                 overlap=overlap)
        ready = _reorder(ctx, ready, phase="forward", tensors=out, name="reorder_out")
        ctx.buffer("forward", "head-sharded q, k, v, out after the all-to-all", qkv + out)
        return _a2a_phase(ctx, groups, ready, phase="forward", kinds=("out",), prefix=prefix)

    def backward(ready):
        ready = _a2a_phase(ctx, groups, ready, phase="backward", kinds=("dout",), prefix=prefix)
        if r == 1:
            t, f = _kernel(ctx, z, s.seqlen, "backward")
            ready = {g: ctx.compute(g, f"attn_bwd[r{g}]", t, deps=[ready[g]], phase="backward", flops=f)
                     for g in ready}
        else:
            ready = ring_backward(ctx, rings, ready, local=gathered, heads=z, kv_heads=zkv, default="burst",
                                  topology=topology, overlap=overlap)
        ctx.buffer("backward", "head-sharded dO, dQ, dK, dV", qkv + out)
        return _a2a_phase(ctx, groups, ready, phase="backward", kinds=("dq", "dk", "dv"), prefix=prefix)

    return sequence_parallel(ctx, forward, backward)


def _kernel(ctx: Ctx, heads: int, n: int, mode: str) -> tuple[float, float]:
    s = ctx.shape
    return ctx.cost.attention(s.batch, heads, s.head_dim, n, n, s.causal, mode, entries=mask_area(s))


def ulysses(ctx: Ctx) -> dict:
    ctx.note("Ulysses: four blocking all-to-alls per direction; attention of Z/G heads over all N tokens")
    return _ulysses_schedule(ctx, ctx.shape.world_size, prefix="")


def usp(ctx: Ctx, overlap: bool = True, method: str = "usp", ring_topology: str = "double") -> dict:
    """``method``: the registry entry whose default degree this is (usp, burst_usp, loongtrain_usp: each
    its own); ``ring_topology``: that method's default ring. The ring's backward follows its bytes."""
    s = ctx.shape
    u = ctx.options.get("ulysses_degree")
    if u is None:
        # the registry's default degree, read back from its byte formula's all-to-all entries
        u = _usp_degree(get(method), s)
    topology = ctx.options.get("ring_topology", ring_topology)
    ring = "K/V ring" if ("backward", "k") in ctx.table else "Burst ring"
    where = " where it has >= 2 ranks per node" if topology == "double" else ""
    ctx.note(f"USP{'' if method == 'usp' else f' ({method})'}: Ulysses degree u={u} (all-to-all inside {u} "
             f"consecutive ranks), {ring} over {s.world_size // u} ranks ({topology} ring{where})")
    if not overlap:
        ctx.note("overlap off: every ring transfer is waited for before the step computes")
    return _ulysses_schedule(ctx, u, prefix="a2a_", topology=topology, overlap=overlap)


def _usp_degree(method, s) -> int:
    """The largest u dividing G whose all-to-all bytes the registry reports for this shape."""
    table = method.bytes(s)
    q = table.get(("forward", "a2a_q"), 0)
    if q == 0:
        return 1
    full = s.batch * (s.seqlen // s.world_size) * s.heads * s.head_dim * s.elem_size
    for u in range(s.world_size, 1, -1):
        if s.world_size % u == 0 and full * (u - 1) // u == q:
            return u
    raise ValueError(f"cannot recover usp's ulysses_degree from its registry bytes a2a_q={q} for {s}")
