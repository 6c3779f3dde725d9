"""Megatron-style tensor parallelism at model level (docs/papers.md §3, "TP V1 / V3"), as a transform.

    model = tensor_parallel(build_model(cfg), "v3", group=g, layout="zigzag", fused=True)

Rank r of G keeps, in every block, the query heads [r Z/G, (r+1) Z/G) and
their kv heads (rows of wq, wk, wv: column-parallel), the matching columns
of wo (row-parallel), FFN columns [r F/G, (r+1) F/G) of w1, w3 and the rows
of w2. Embedding, norms and the LM head are replicated (Megatron splits the
vocabulary too; we do not, so the per-layer bytes below are all TP sends).

* ``"v1"``: every rank holds all N tokens. Attention and MLP each start with
  "f" (identity forward, all-reduce of dX backward) and end with "g"
  (all-reduce of the partial outputs forward, identity backward).
* ``"v3"`` (sequence parallel): each rank holds the ``layout`` shard
  (B, N/G, H). Attention and MLP each start with an all-gather of the
  sequence (backward: reduce-scatter of dX) and end with a reduce-scatter of
  the partial outputs (backward: all-gather of dY). Before attention the
  gathered tokens are put in position order (``burst_impl.reorder``, local).

``fused=True`` runs the local fused kernel on the rank's heads over all N
tokens; ``fused=False`` materialises the (B, Z/G, N, N) scores, the paper's
"TP without FlashAttention".

Bytes one rank sends per layer (``layer_comm_bytes``), c = (G-1)/G,
e bytes per activation element, H = Z d, forward and backward each
4 c BNHe, docs/papers.md §1's 4BZNd (attention and MLP together):
V1: an all-reduce (2 c BNHe) after attention and after the MLP forward, of
dX before each backward. V3: an all-gather (c BNHe) and a reduce-scatter
(c BNHe) around each of them, both directions.

Kv heads: Zkv must be divisible by G (Megatron-core's rule for query groups);
splitting fewer kv heads would replicate their weights on several ranks,
whose gradients then need their own reduction.
"""
from __future__ import annotations

import torch
from torch import nn

from burst_impl import reorder
from burst_impl.collectives import all_gather, all_reduce_backward, all_reduce_forward, reduce_scatter
from baselines.methods.tp import head_columns, tp_region_bytes
from burst_impl import comm

from burst_impl.model.config import ModelConfig
from burst_impl.model.layers import LocalAttention, apply_rope, rope_tables
from burst_impl.model.model import Transformer
from burst_impl.model.parallel import ParallelPlan

Tensor = torch.Tensor
VERSIONS = ("v1", "v3")


def check_tp(cfg: ModelConfig, version: str, world_size: int) -> None:
    """ValueError naming the rule when ``cfg`` cannot be split ``version`` over ``world_size`` ranks."""
    if version not in VERSIONS:
        raise ValueError(f"version={version!r} is unknown; choose one of {VERSIONS}")
    for name, value in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads), ("ffn_hidden", cfg.ffn_hidden)):
        if value % world_size:
            raise ValueError(f"{name}={value} must be divisible by the tensor-parallel size {world_size} "
                             f"(model {cfg.name!r})")


def _sliced(linear: nn.Linear, dim: int, idx: Tensor) -> nn.Linear:
    """A Linear holding rows (dim 0: output features) or columns (dim 1) ``idx`` of ``linear``."""
    w = linear.weight.detach().index_select(dim, idx.to(linear.weight.device))
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
    return out


class _Comm:
    """The collectives around one TP region (attention or MLP), named ``prefix.*`` in the counters."""

    def __init__(self, plan: ParallelPlan, version: str, prefix: str):
        self.plan, self.version, self.p = plan, version, prefix

    def enter(self, x: Tensor) -> Tensor:
        if self.version == "v1":
            return all_reduce_backward(x, self.plan.group, grad_kind=f"{self.p}.dx")
        return all_gather(x, 1, self.plan.group, kind=f"{self.p}.x", grad_kind=f"{self.p}.dx")

    def leave(self, y: Tensor) -> Tensor:
        if self.version == "v1":
            return all_reduce_forward(y, self.plan.group, kind=f"{self.p}.out")
        return reduce_scatter(y, 1, self.plan.group, kind=f"{self.p}.out", grad_kind=f"{self.p}.dout")


class TPAttention(nn.Module):
    def __init__(self, attn, cfg: ModelConfig, plan: ParallelPlan, version: str, fused: bool,
                 backend: str | None = None):
        super().__init__()
        G, r, d = plan.world_size, plan.rank, cfg.head_dim
        zq, zk = cfg.n_heads // G, cfg.n_kv_heads // G
        qcols = head_columns(list(range(r * zq, (r + 1) * zq)), d)
        kvcols = head_columns(list(range(r * zk, (r + 1) * zk)), d)
        self.index = {"wq": (0, qcols), "wk": (0, kvcols), "wv": (0, kvcols), "wo": (1, qcols)}
        for name, (dim, idx) in self.index.items():
            setattr(self, name, _sliced(getattr(attn, name), dim, idx))
        self.head_dim, self.theta, self.plan, self.version = d, cfg.rope_theta, plan, version
        self.comm = _Comm(plan, version, "attn")
        self.core = LocalAttention(fused=fused, backend=backend, mask=cfg.mask)   # all N in position order

    def forward(self, x: Tensor, rope) -> Tensor:
        G, layout = self.plan.world_size, self.plan.layout
        x = self.comm.enter(x)                                              # (B, N, H)
        b, n, _ = x.shape
        perm = None
        if self.version == "v3":
            # Gathered in rank order; put the tokens in position order for the causal kernel.
            perm = reorder.gather_perm(layout, G, n, tuple(range(G)), 0, 1)
            x = reorder.apply(x, perm)
            rope = rope_tables(torch.arange(n, device=x.device), self.head_dim, self.theta, dtype=rope.cos.dtype)
        q = apply_rope(self.wq(x).view(b, n, -1, self.head_dim), rope)     # (B, N, Z/G, d)
        k = apply_rope(self.wk(x).view(b, n, -1, self.head_dim), rope)     # (B, N, Zkv/G, d)
        v = self.wv(x).view(b, n, -1, self.head_dim)
        y = self.wo(self.core(q, k, v).reshape(b, n, -1))                  # (B, N, H) partial over heads
        if perm is not None:
            y = reorder.apply(y, reorder.inverse(perm))
        return self.comm.leave(y)


class TPFeedForward(nn.Module):
    def __init__(self, mlp, cfg: ModelConfig, plan: ParallelPlan, version: str):
        super().__init__()
        f = cfg.ffn_hidden // plan.world_size
        cols = torch.arange(plan.rank * f, (plan.rank + 1) * f)
        self.index = {"w1": (0, cols), "w3": (0, cols), "w2": (1, cols)}
        for name, (dim, idx) in self.index.items():
            setattr(self, name, _sliced(getattr(mlp, name), dim, idx))
        self.comm = _Comm(plan, version, "mlp")

    def forward(self, x: Tensor) -> Tensor:
        x = self.comm.enter(x)                                              # (B, N, H); token order is irrelevant
        y = self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))           # (B, N, H) partial over F
        return self.comm.leave(y)


def tensor_parallel(model: Transformer, version: str, *, group=None, layout: str = "contiguous",
                    fused: bool = True, backend: str | None = None) -> Transformer:
    """Turn ``model`` (weights identical on every rank) into this rank's TP model. In place.

    ``layout`` is the sequence layout of the V3 shards (V1 holds all tokens in order);
    ``backend`` the fused local kernel (``burst_impl.kernels`` name, None: automatic).
    ``model.tp_index[name] = (dim, indices)`` says which slice of the full weight a
    sharded parameter is (for gathering gradients in tests).
    """
    if model.parallel is not None:
        raise ValueError(f"model is already parallel ({model.parallel.kind}); apply one transform")
    rank, G = comm.world(group)
    check_tp(model.cfg, version, G)
    plan = ParallelPlan(f"tp_{version}", group=group, layout=layout if version == "v3" else "contiguous",
                        rank=rank, world_size=G)
    index = {}
    for i, block in enumerate(model.layers):
        block.attention = TPAttention(block.attention, model.cfg, plan, version, fused, backend)
        block.feed_forward = TPFeedForward(block.feed_forward, model.cfg, plan, version)
        for mod, prefix in ((block.attention, f"layers.{i}.attention"),
                            (block.feed_forward, f"layers.{i}.feed_forward")):
            index.update({f"{prefix}.{n}.weight": di for n, di in mod.index.items()})
    # V3: the replicated weights (embedding, norms, head) saw only this rank's tokens.
    plan.reduce_grads = () if version == "v1" else tuple(n for n, _ in model.named_parameters() if n not in index)
    model.parallel, model.tp_index = plan, index
    return model


def layer_comm_bytes(cfg: ModelConfig, version: str, batch: int, seqlen: int, world_size: int,
                     elem_size: int = 2) -> dict[tuple[str, str], int]:
    """``{(phase, kind): bytes}`` one rank sends per layer for one forward + backward."""
    check_tp(cfg, version, world_size)
    region = tp_region_bytes(batch * seqlen * cfg.hidden * elem_size, world_size, version)   # B N H e
    return {(ph, f"{p}.{k}"): b for p in ("attn", "mlp") for (ph, k), b in region.items()}
