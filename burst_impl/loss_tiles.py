"""The tile loops of the fused LM head + cross-entropy (``burst_impl.loss``; its docstring has the
algorithm): the operands of one call as the loops need them (``Tiles``), the recomputing path's
lse forward and tile backward, and the gradients-in-the-forward pass. Internal: called through
``burst_impl.loss.fused_linear_cross_entropy``, which validates the inputs.
"""
from __future__ import annotations

import torch

Tensor = torch.Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast_operands(t: Tensor) -> bool:
    """Multiply in the compute dtype (True) or natively with fp32 output (False).

    CPU BLAS has no fast half-precision GEMM (measured: docs/findings.md, fused
    loss tile sizes), so there half operands are upcast chunk by chunk.
    On CUDA the tensor cores multiply bf16/fp16 and accumulate in fp32.
    """
    return t.device.type != "cuda" or t.dtype in (torch.float32, torch.float64)


_MM_OUT_DTYPE: dict[str, bool] = {}   # device type -> torch.mm(..., out_dtype=) works there


def mm_wide(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """a @ b with half operands and a ``dtype`` (fp32) result."""
    kind = a.device.type
    if _MM_OUT_DTYPE.get(kind, True):
        try:
            return torch.mm(a, b, out_dtype=dtype)
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE[kind] = False
    return torch.mm(a, b).to(dtype)   # fp32 accumulation inside the kernel, output rounded once


def balanced_rows(n: int, rows: int) -> int:
    """At most ``rows`` rows per chunk, in as few chunks as that allows, of near-equal size."""
    if n <= rows:
        return max(n, 1)
    chunks = -(-n // rows)
    return -(-n // chunks)


class Tiles:
    """The operands of one call, as the tile loops need them.

    x (n, H): the hidden rows of counted tokens (upcast to the compute dtype on
    CPU); y (n,): their labels, int64; weight/bias chunks via ``w(v0, v1)`` /
    ``b(v0, v1)``; ``logits(...)`` writes a tile into a contiguous view of one
    reused (chunk_tokens * chunk_vocab) buffer in the compute dtype.
    """

    def __init__(self, hidden2d: Tensor, weight: Tensor, bias: Tensor | None, labels1d: Tensor,
                 ignore_index: int, chunk_tokens: int, chunk_vocab: int, balance: bool = False):
        self.cdt = compute_dtype(hidden2d.dtype)
        self.upcast = upcast_operands(hidden2d)
        keep = labels1d != ignore_index
        self.rows = None if bool(keep.all()) else keep.nonzero().squeeze(1)   # (n,) or None = all
        x = hidden2d if self.rows is None else hidden2d.index_select(0, self.rows)
        self.x = x.to(self.cdt) if self.upcast else x                       # (n, H)
        y = labels1d if self.rows is None else labels1d.index_select(0, self.rows)
        self.y = y.long()
        self.weight, self.bias = weight, bias
        self.n, self.vocab = self.x.shape[0], weight.shape[0]
        # balance: at most chunk_tokens rows per token chunk, evened out over the counted tokens.
        tc = balanced_rows(self.n, chunk_tokens) if balance else max(1, min(chunk_tokens, self.n))
        self.tc, self.vc = tc, min(chunk_vocab, self.vocab)
        self._buf = torch.empty(self.tc * self.vc, dtype=self.cdt, device=hidden2d.device)

    def token_chunks(self):
        return [(t0, min(t0 + self.tc, self.n)) for t0 in range(0, self.n, self.tc)]

    def vocab_chunks(self):
        return [(v0, min(v0 + self.vc, self.vocab)) for v0 in range(0, self.vocab, self.vc)]

    def w(self, v0: int, v1: int) -> Tensor:
        w = self.weight[v0:v1]                                               # (vc, H)
        return w.to(self.cdt) if self.upcast else w

    def b(self, v0: int, v1: int) -> Tensor | None:
        return None if self.bias is None else self.bias[v0:v1].to(self.cdt)

    def logits(self, t0: int, t1: int, w: Tensor, b: Tensor | None, shift: Tensor | None = None) -> Tensor:
        """(t1-t0, vc) tile of x @ w.T + b - shift[:, None] in the compute dtype, in the reused buffer."""
        out = self._buf[:(t1 - t0) * w.shape[0]].view(t1 - t0, w.shape[0])
        x = self.x[t0:t1]
        # mm + in-place adds, not addmm(bias or -shift[:, None], ...): on CPU the broadcast
        # C operand is first copied into the tile, and that GEMM is slower (docs/findings.md).
        if self.upcast:
            torch.mm(x, w.t(), out=out)
        else:
            out.copy_(mm_wide(x, w.t(), self.cdt))
        if b is not None:
            out.add_(b)
        if shift is not None:
            out.sub_(shift.unsqueeze(1))
        return out

    def gemm_acc(self, acc: Tensor, a: Tensor, b: Tensor, alpha: float) -> None:
        """acc += alpha * a @ b with acc in the compute dtype; a is an fp32 tile or its transpose."""
        if self.upcast:
            acc.addmm_(a, b, alpha=alpha)
        else:
            acc.add_(mm_wide(a.to(b.dtype), b, self.cdt), alpha=alpha)


# ---------------------------------------------------------------- forward / backward


def forward_lse(t: Tiles) -> tuple[Tensor, Tensor]:
    """Per counted token: lse = log sum_v exp(logit_v) and the target logit, both (n,) fp32/64."""
    dev = t.x.device
    m = torch.full((t.n,), float("-inf"), dtype=t.cdt, device=dev)   # running max
    s = torch.zeros(t.n, dtype=t.cdt, device=dev)                     # running sum of exp(logit - m)
    target = torch.zeros(t.n, dtype=t.cdt, device=dev)
    for v0, v1 in t.vocab_chunks():
        w, b = t.w(v0, v1), t.b(v0, v1)
        for t0, t1 in t.token_chunks():
            tile = t.logits(t0, t1, w, b)                             # (tc, vc)
            y = t.y[t0:t1]
            here = (y >= v0) & (y < v1)
            picked = tile.gather(1, (y - v0).clamp_(0, v1 - v0 - 1).unsqueeze(1)).squeeze(1)
            target[t0:t1] = torch.where(here, picked, target[t0:t1])
            m_old = m[t0:t1]
            m_new = torch.maximum(m_old, tile.amax(1))
            tile.sub_(m_new.unsqueeze(1)).exp_()
            # s' = s * exp(m_old - m_new) + sum exp(tile - m_new); exp(-inf) = 0 on the first chunk.
            s[t0:t1].mul_((m_old - m_new).exp_()).add_(tile.sum(1))
            m[t0:t1] = m_new
    return m + s.log(), target


def backward_tiles(t: Tiles, lse: Tensor, g: Tensor | None, alpha: float,
                    need_dx: bool, need_dw: bool, need_db: bool, w_grad_dtype: torch.dtype):
    """d x (n, H) in the compute dtype, d W (V, H) in ``w_grad_dtype``, d b (V,) fp32/64.

    Gradient of sum_t c_t * loss_t with c_t = alpha * g_t (g None: c_t = alpha).
    """
    dev = t.x.device
    H = t.weight.shape[1]
    dx = torch.zeros(t.n, H, dtype=t.cdt, device=dev) if need_dx else None
    dw = torch.empty(t.vocab, H, dtype=w_grad_dtype, device=dev) if need_dw else None
    db = torch.zeros(t.vocab, dtype=t.cdt, device=dev) if need_db else None
    direct = need_dw and w_grad_dtype == t.cdt               # accumulate straight into d W
    acc = None if direct or not need_dw else torch.empty(t.vc, H, dtype=t.cdt, device=dev)
    for v0, v1 in t.vocab_chunks():
        w, b = t.w(v0, v1), t.b(v0, v1)
        dw_c = None
        if need_dw:
            dw_c = dw[v0:v1] if direct else acc[:v1 - v0]
            dw_c.zero_()
        for t0, t1 in t.token_chunks():
            p = t.logits(t0, t1, w, b, shift=lse[t0:t1]).exp_()     # softmax tile (tc, vc)
            y = t.y[t0:t1]
            here = (y >= v0) & (y < v1)
            hit = here.to(p.dtype)
            if g is not None:                                        # reduction="none": per-token weights
                p.mul_(g[t0:t1].unsqueeze(1))
                hit = hit * g[t0:t1]
            p.scatter_add_(1, (y - v0).clamp_(0, v1 - v0 - 1).unsqueeze(1), hit.neg().unsqueeze(1))
            if need_dx:
                t.gemm_acc(dx[t0:t1], p, w, alpha)                     # (tc, vc) @ (vc, H)
            if need_dw:
                t.gemm_acc(dw_c, p.t(), t.x[t0:t1], alpha)             # (vc, tc) @ (tc, H)
            if need_db:
                db[v0:v1].add_(p.sum(0), alpha=alpha)
        if need_dw and not direct:
            dw[v0:v1].copy_(dw_c)
    return dx, dw, db


def forward_with_grads(t: Tiles, scale: float, need_dx: bool, need_dw: bool, need_db: bool):
    """Per-token loss (n,) and the gradients of ``scale * sum_t loss_t``, in one pass (3 GEMMs).

    Token chunks of ``t.tc`` rows, each against the whole vocabulary (``t.vc == V``). Returns
    loss (n,), d x (n, H), d W (V, H), d b (V,), all in the compute dtype (None where not needed).
    """
    dev, H = t.x.device, t.weight.shape[1]
    w, b = t.w(0, t.vocab), t.b(0, t.vocab)       # (V, H), (V,): upcast once for the whole pass
    loss = torch.empty(t.n, dtype=t.cdt, device=dev)
    dx = torch.zeros(t.n, H, dtype=t.cdt, device=dev) if need_dx else None
    dw = torch.zeros(t.vocab, H, dtype=t.cdt, device=dev) if need_dw else None
    db = torch.zeros(t.vocab, dtype=t.cdt, device=dev) if need_db else None
    for t0, t1 in t.token_chunks():
        tile = t.logits(t0, t1, w, b)                                 # (rows, V)
        y = t.y[t0:t1].unsqueeze(1)                                   # (rows, 1)
        target = tile.gather(1, y).squeeze(1)                         # (rows,)
        m = tile.amax(1)
        tile.sub_(m.unsqueeze(1)).exp_()                              # exp(logit - m), in (0, 1]
        s = tile.sum(1)
        loss[t0:t1] = m + s.log() - target                            # exact lse over all of V, minus target
        if not (need_dx or need_dw or need_db):
            continue
        tile.mul_((scale / s).unsqueeze(1))                           # scale * softmax
        tile.scatter_add_(1, y, torch.full_like(target, -scale).unsqueeze(1))   # - scale * onehot(y)
        if need_dx:
            t.gemm_acc(dx[t0:t1], tile, w, 1.0)                         # (rows, V) @ (V, H)
        if need_dw:
            t.gemm_acc(dw, tile.t(), t.x[t0:t1], 1.0)                   # (V, rows) @ (rows, H)
        if need_db:
            db.add_(tile.sum(0))
    return loss, dx, dw, db
