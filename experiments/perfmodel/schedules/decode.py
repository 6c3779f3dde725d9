"""One decode step of an attention layer (``baselines/decode_layer.py``), and the MLP block around it, for the
three rows of inference: context parallel with the all-gather or the heads merge, tensor parallel.

Per rank, in program order (``decode_step``):

1. the new tokens' QKV projection, (B q x H) @ (H x (Zq + 2 Zkv) d): all heads (context parallel) or the
   rank's (TP); a ``weight_gemm`` (``decode_costs``: memory-bound at small B q);
2. per sequence (``burst_impl.inference.decode`` and ``baselines.tp_decode`` loop over the batch): the new
   K/V appended to the cache (an HBM write), then the q new queries over the rank's cached keys
   (``decode_attention``): its shard, N/G + the new tokens it owns (context parallel), or every token of
   its KV heads (TP);
3. context parallel: the merge's two collectives, (O, lse) each (``all_gather``: NCCL's ring algorithm over
   the group, ``common.ring_collective``; ``heads``: ``common.all_to_all``), then the log-sum-exp merge of
   the G partials (G-1 ``merge_partial`` passes over HBM);
4. the output projection ((B q x zo d) @ (zo d x H)): all heads (all-gather merge), or the rank's rows of
   W_o, whose partial sums an all-reduce adds (heads merge, TP).

Bytes are never computed here: the collectives ``take`` the entries of ``decode_layer_bytes`` (the merge's
``out``, ``lse`` and the projection's ``out_proj``), so they equal the formula the measurement counts.
``mlp_block`` adds a decoder layer's SwiGLU MLP for a whole model's step (model level): replicated weights
for the all-gather row, F/G columns and the all-reduce of its output for the other two (Helix and
Megatron shard the FFN), the all-reduce's bytes from the same formula.
"""
from __future__ import annotations

from baselines.decode_layer import MERGE_OF, cache_kv_heads, decode_layer_bytes, row_parallel_bytes

from .common import Ctx, all_to_all, merge_bytes, ring_collective


def _local_tokens(ctx: Ctx, row: str, rank: int, q: int) -> int:
    """Keys rank ``rank`` attends over in one sequence: its shard of the N cached tokens plus the new ones
    the round-robin placement gives it (position t on rank t mod G), or all N + q (TP)."""
    s = ctx.shape
    if row == "tp":
        return s.seqlen + q
    g = s.world_size
    return s.lengths[rank] + sum(1 for t in range(s.seqlen, s.seqlen + q) if t % g == rank)


def decode_layer(ctx: Ctx, row: str, new_tokens: int, ready: dict | None = None) -> dict:
    """The tasks of one decode step of ``row`` on every rank, after ``ready``; ``ctx.table`` holds
    ``decode_layer_bytes`` (every entry is placed). Returns ``{rank: task}`` after which the step is done."""
    s, q, g = ctx.shape, new_tokens, ctx.shape.world_size
    d, z, e = s.head_dim, s.heads, ctx.elem
    zq = z // g if row == "tp" else z
    zkv = cache_kv_heads(row, s)
    zo = z if row == "cp_all_gather" else z // g           # heads whose W_o rows the rank applies
    m = s.batch * q
    ready = dict(ready or {r: None for r in ctx.ranks})
    for r in ctx.ranks:
        t, f = ctx.cost.weight_gemm(m, (zq + 2 * zkv) * d, z * d)
        last = ctx.compute(r, f"qkv_proj[r{r}]", t, deps=[ready[r]], phase="forward", flops=f)
        keys = _local_tokens(ctx, row, r, q)
        for b in range(s.batch):
            last = ctx.compute(r, f"append[r{r},b{b}]", ctx.cost.hbm(2 * q * zkv * d * e), deps=[last],
                               phase="forward")
            t, f = ctx.cost.decode_attention(q, keys, zq, zkv, d, s.batch)   # one of the step's B sequences
            last = ctx.compute(r, f"decode_attn[r{r},b{b}]", t, deps=[last], phase="forward", flops=f)
        ready[r] = last
    merge = MERGE_OF[row]
    if merge is not None and g > 1:
        for kind in ("out", "lse"):
            nb = ctx.take("forward", (kind,))
            if merge == "all_gather":
                ready = ring_collective(ctx, list(ctx.ranks), phase="forward", name=f"all_gather_{kind}", nbytes=nb,
                                        steps=g - 1, ready=ready)
            else:
                ready = all_to_all(ctx, [list(ctx.ranks)], phase="forward", name=f"all_to_all_{kind}", nbytes=nb,
                                   ready=ready)
        heads = z if merge == "all_gather" else z // g
        merged = (g - 1) * merge_bytes(s.batch, q, heads, d, e)
        ready = {r: ctx.compute(r, f"merge[r{r}]", ctx.cost.hbm(merged), deps=[ready[r]], phase="forward")
                 for r in ctx.ranks}
    for r in ctx.ranks:
        t, f = ctx.cost.weight_gemm(m, z * d, zo * d)
        ready[r] = ctx.compute(r, f"out_proj[r{r}]", t, deps=[ready[r]], phase="forward", flops=f)
    if row != "cp_all_gather" and g > 1:
        ready = ring_collective(ctx, list(ctx.ranks), phase="forward", name="all_reduce_out_proj",
                                nbytes=ctx.take("forward", ("out_proj",)), steps=2 * (g - 1), ready=ready)
    return ready


def layer_table(row: str, shape, new_tokens: int) -> dict:
    """The registry-style byte table a decode step's schedule takes from (``decode_layer_bytes``)."""
    return dict(decode_layer_bytes(row, shape, new_tokens))


def mlp_block(ctx: Ctx, row: str, ffn_hidden: int, new_tokens: int, ready: dict) -> dict:
    """A decoder layer's SwiGLU MLP on the B q new tokens, after ``ready`` (module docstring); its all-reduce
    bytes (rows heads and TP) are ``row_parallel_bytes`` of the (B, q, H) output, placed here, not taken."""
    s, g = ctx.shape, ctx.shape.world_size
    h, e, m = s.heads * s.head_dim, ctx.elem, s.batch * new_tokens
    f = ffn_hidden if row == "cp_all_gather" else ffn_hidden // g
    for r in ctx.ranks:
        t1, f1 = ctx.cost.weight_gemm(m, 2 * f, h)
        t2, f2 = ctx.cost.weight_gemm(m, h, f)
        # two RMSNorms and two residual adds over (m, H), SwiGLU over (m, F): HBM-bound, tiny at decode
        elementwise = ctx.cost.hbm((2 * 2 * m * h + 3 * m * f + 2 * 3 * m * h) * e)
        ready[r] = ctx.compute(r, f"mlp[r{r}]", t1 + t2 + elementwise, deps=[ready[r]], phase="forward",
                               flops=f1 + f2)
    if row != "cp_all_gather" and g > 1:
        ready = ring_collective(ctx, list(ctx.ranks), phase="forward", name="all_reduce_mlp",
                                nbytes=row_parallel_bytes(m * h * e, g), steps=2 * (g - 1), ready=ready)
    return ready
