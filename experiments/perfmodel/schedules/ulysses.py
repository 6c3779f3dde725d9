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

from .common import Ctx, all_to_all, sequence_parallel
from .ring_family import ring_backward, ring_forward
from .tiles import whole_sequence
from baselines.methods.ulysses import a2a_bytes
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
            t, f = whole_sequence(ctx, z, "forward")
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
            t, f = whole_sequence(ctx, z, "backward")
            ready = {g: ctx.compute(g, f"attn_bwd[r{g}]", t, deps=[ready[g]], phase="backward", flops=f)
                     for g in ready}
        else:
            ready = ring_backward(ctx, rings, ready, local=gathered, heads=z, kv_heads=zkv, default="burst",
                                  topology=topology, overlap=overlap)
        ctx.buffer("backward", "head-sharded dO, dQ, dK, dV", qkv + out)
        return _a2a_phase(ctx, groups, ready, phase="backward", kinds=("dq", "dk", "dv"), prefix=prefix)

    return sequence_parallel(ctx, forward, backward)


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


# ---------------------------------------------------------------- burst_usp's cache (checkpoint seq / whole)

CACHED_AGAIN = ("q", "k", "v", "out")      # sent to head shards again by the backward from the cache


def usp_cache_bytes(method: str, s, checkpoint: str, options: dict | None = None) -> dict[tuple[str, str], int]:
    """``{(phase, kind): bytes}`` one rank sends per layer in the all-to-alls a USP's cache hook adds to
    a training step under ``checkpoint`` "seq"/"whole" (``baselines/methods/burst_usp.py``, ``UspCache``),
    beyond what the step without the cache sends, each from the registry's formulas:

    * forward: ``a2a_lse``, the ring's lse back to sequence shards (one fp32 per row and query head: the
      registry's all-to-all formula on a (B, S, Z, 1) float32 tensor). Under "seq" the recompute of the
      first halves sends it again at N/2 (its q, k, v, out all-to-alls are the N/2 forward's own);
    * backward: q, k, v and O to head shards again (the registry's forward ``a2a_q/k/v/out``: the same
      tensors and split) and the lse (``a2a_lse`` at N), before the ring's backward from (O, lse).

    Empty for a method without a cache hook or a checkpoint mode that does not cache."""
    m = get(method)
    if m.cached_attention is None or checkpoint not in ("seq", "whole"):
        return {}
    table = m.bytes(s, **(options or {}))
    u = (options or {}).get("ulysses_degree") or _usp_degree(m, s)

    def lse(shape) -> int:
        return a2a_bytes(shape.replace(head_dim=1, dtype="float32"), u, prefix="a2a_").get(("forward", "a2a_q"), 0)

    out = {("backward", f"a2a_{k}"): table.get(("forward", f"a2a_{k}"), 0) for k in CACHED_AGAIN}
    out[("backward", "a2a_lse")] = lse(s)
    out[("forward", "a2a_lse")] = lse(s) + (lse(s.replace(seqlen=s.seqlen // 2)) if checkpoint == "seq" else 0)
    return {k: v for k, v in out.items() if v}


def usp_cache_all_to_alls(ctx: Ctx, method: str, checkpoint: str) -> dict:
    """The all-to-alls of ``usp_cache_bytes`` in ``ctx``'s phases, in the Ulysses groups, blocking (each
    waits for the one before, as ``_to_heads``/``_to_seq`` do); ``ctx.table`` holds their bytes."""
    s = ctx.shape
    u = ctx.options.get("ulysses_degree") or _usp_degree(get(method), s)
    groups = [[i * u + j for j in range(u)] for i in range(s.world_size // u)]
    ready: dict = {g: None for g in ctx.ranks}
    for phase, kinds in (("forward", ("lse",)), ("backward", CACHED_AGAIN + ("lse",))):
        if phase in ctx.phases:
            ready = _a2a_phase(ctx, groups, ready, phase=phase, kinds=kinds, prefix="a2a_")
    return ready
