"""``ring_rsa``: RingAttention as the BurstAttention paper measured it (Li et al. 2021 ring
self-attention, baselines/ring_rsa.py), which materialises the (B, Z, N/G, N) score rows.

Forward: a K ring fills the score rows (one (N/G x N/G) block per step, a
GEMM written to HBM in fp32), a softmax over the whole rows (HBM-bound), then
a V ring accumulates P V. Backward: a V ring (dP and this rank's share of
every dV_j), the softmax backward over the whole rows (HBM-bound), a K ring
(dQ and this rank's share of every dK_j), then two all-reduces of the
full-length dK and dV buffers (fp32). No causal block is skipped: the mask is
applied to the full rows, as Li et al. do.

Our implementation computes its matmuls in fp32 (``q.float()``), so on a GPU
they run at the fp32 peak, not bf16; ``options["matmul_dtype"]`` changes that.
"""
from __future__ import annotations

from ..costs import FP32
from .common import Ctx, hbm_step, ring_collective, ring_pass, sequence_parallel


def ring_rsa(ctx: Ctx, overlap: bool = True) -> dict:
    if not overlap:
        ctx.note("overlap off: every ring transfer is waited for before the step computes")
    s = ctx.shape
    G, b, d, z, e = s.world_size, s.batch, s.head_dim, s.heads, ctx.elem
    local = s.seqlen // G
    rings = [list(range(G))]
    mm = ctx.options.get("matmul_dtype", "float32")
    ctx.note(f"ring_rsa's matmuls run in {mm} (baselines/ring_rsa.py upcasts q, k, v to fp32) at the "
             f"GEMM efficiency; every block pair is computed (the causal mask is applied afterwards)")
    block = b * z * local * local          # elements of one (B, Z, N/G, N/G) score block
    rows = b * z * local * s.seqlen        # elements of the (B, Z, N/G, N) score rows

    def gemm(label, nbytes):
        # per head, a (N/G x d) result = (N/G x N/G) @ (N/G x d) (PV, P^T dO, dS K, dS^T Q): the FLOPs of
        # a score block's GEMM, which is all an accelerator's GEMM rate sees, but not the same work on a
        # CPU (a 32x smaller output at d = 32), so it is asked for in its own shape
        t, f = ctx.cost.gemm(b * z * local, d, local, dtype=mm)
        return [(label, t, f), hbm_step(ctx, label + ".hbm", nbytes)]

    def scores(label, passes):
        # a score block stored into its columns of the (B, Z, N/G, N) rows: the GEMM's output, then
        # ``passes`` - 1 more fp32 read/write passes (QK^T: the scaling and the strided copy, 5 in all;
        # dO V^T: the copy, 3)
        t, f = ctx.cost.score_block(b * z, local, local, d, s.seqlen, dtype=mm, nbytes=passes * block * FP32)
        return [(label, t, f)]

    def softmax_all(ready, phase, label, nbytes):
        t = ctx.cost.softmax_rows(b * z, local, s.seqlen, phase, nbytes=nbytes)
        return {g: ctx.compute(g, f"{label}[r{g}]", t, deps=[ready[g]], phase=phase) for g in ready}

    def forward(ready):
        k_hop = ctx.take("forward", ("k",))
        v_hop = ctx.take("forward", ("v",))
        # K ring: S block = Q K_j^T, written in fp32
        r = ring_pass(ctx, rings, phase="forward", name="rsa_k", hop=k_hop, ready=ready, overlap=overlap,
                      work=lambda i, o, st: scores("qk", 5))
        # mask (read/write fp32), softmax (read fp32, write fp32), cast to the input dtype (read, write)
        r = softmax_all(r, "forward", "rsa_softmax", rows * (4 * FP32 + FP32 + e))
        # V ring: O += P_j V_j, reading the block of P and its fp32 copy
        ctx.buffer("forward", "fp32 score rows (B, Z, N/G, N)", rows * FP32)
        ctx.buffer("forward", "fp32 output and one fp32 probability block", b * local * z * d * FP32 + block * FP32)
        return ring_pass(ctx, rings, phase="forward", name="rsa_v", hop=v_hop, ready=r, overlap=overlap,
                         work=lambda i, o, st: gemm("pv", block * (e + 2 * FP32)))

    def backward(ready):
        v_hop = ctx.take("backward", ("v",))
        k_hop = ctx.take("backward", ("k",))
        dk, dv = ctx.take("backward", ("dk",)), ctx.take("backward", ("dv",))
        # V ring: dP block = dO V_j^T (fp32 write); dV_j share = P_j^T dO (read P, fp32 copy)
        r = ring_pass(ctx, rings, phase="backward", name="rsa_bv", hop=v_hop, ready=ready, overlap=overlap,
                      work=lambda i, o, st: scores("dp", 3) + gemm("dv", block * (e + 2 * FP32)))
        # dS = P * (dP - rowsum(dP * P)) over the whole rows: P to fp32, two products, a reduction
        r = softmax_all(r, "backward", "rsa_softmax_bwd", rows * (e + 9 * FP32))
        # K ring: dQ += dS_j K_j; dK_j share = dS_j^T Q
        r = ring_pass(ctx, rings, phase="backward", name="rsa_bk", hop=k_hop, ready=r, overlap=overlap,
                      work=lambda i, o, st: gemm("dq", block * FP32) + gemm("dk", block * FP32))
        grp = list(range(G))
        r = ring_collective(ctx, grp, phase="backward", name="rsa_allreduce_dk", nbytes=dk, steps=2 * (G - 1),
                            ready=r)
        r = ring_collective(ctx, grp, phase="backward", name="rsa_allreduce_dv", nbytes=dv, steps=2 * (G - 1),
                            ready=r)
        ctx.buffer("backward", "fp32 dP, dS and P copies of the score rows", 3 * rows * FP32)
        ctx.buffer("backward", "full-length fp32 dK, dV buffers", 2 * b * s.seqlen * s.kv_heads * d * FP32)
        return r

    return sequence_parallel(ctx, forward, backward)
