"""Fused LM head + cross-entropy (PAPER.md §2, "Fused LM head + cross-entropy").

``fused_linear_cross_entropy(hidden, weight, labels)`` is
``F.cross_entropy(F.linear(hidden, weight, bias), labels)`` without ever
holding the (tokens, vocab) logits: at 1M tokens and a 128K vocabulary those
are about 250 GB. The work is cut into (chunk_tokens x chunk_vocab) tiles of
logits, each computed into one reused fp32 buffer:

* **Forward.** Vocabulary chunks outer, token chunks inner. For every tile the
  running log-sum-exp of each token is updated online (stable form: shift by
  the running maximum m, rescale the running sum s by exp(m_old - m_new) when
  the maximum grows, lse = m + log s), and the target logit is picked out of
  the tile that holds the label. Only lse (fp32, one float per token) is saved;
  loss_t = lse_t - logit_t[y_t].
* **Backward.** The same tiles are recomputed as ``logits - lse`` in one GEMM,
  exponentiated in place into the softmax p, the one-hot of the label is
  subtracted, and the tile goes straight into the gradients (g = incoming
  gradient, 1/count for the mean):

      d hidden[t] += g_t * (p - onehot)[t, :] @ W_chunk        (tokens, H)
      d W_chunk   += (g * (p - onehot))^T @ hidden              (chunk_vocab, H)

  so the forward's single GEMM is paid again: 4 GEMMs of (tokens x vocab x H)
  against the unfused 3. That is the price of O(tokens + vocab) memory.

Precision: every tile is computed and accumulated in fp32 (fp64 for fp64
inputs) whatever the input dtype; bf16/fp16 operands are upcast chunk by chunk
on CPU (where bf16 GEMMs are slow) and multiplied natively with fp32 output on
CUDA. d hidden and d W are accumulated in fp32 and rounded once to the input
dtype. The loss is returned in fp32, fp64 for fp64 inputs (torch returns the input dtype; a bf16
loss near 10 has a resolution of 0.06).

Ignored tokens (``labels == ignore_index``) are dropped before any GEMM: they
cost nothing and get zero loss and zero gradient. ``count`` is the number of
tokens that are not ignored. With every token ignored the loss is 0 and the
gradients are 0 for every reduction (torch's mean is 0/0 = nan there; we
differ on purpose: a sequence-parallel rank may hold only padding, and a nan
would poison the all-reduce).

Sequence parallelism: each rank calls ``reduction="sum", return_count=True``,
all-reduces the count, and back-propagates ``loss_sum / global_count`` (the
gradient of the global mean with respect to this rank's tokens); the logged
loss is the all-reduced sum over the all-reduced count.
"""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

Tensor = torch.Tensor

IGNORE_INDEX = -100
REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Tile defaults (chunk_tokens, chunk_vocab) by device type.
# CPU: measured (README, "Fused LM head + cross-entropy"): at tokens 4096, hidden 1024,
# vocab 32K, one thread, 1024 x 2048 (an 8 MiB fp32 tile, L3-resident) was the fastest of
# 512..2048 x 1024..4096 in two sweeps (1.07x and 1.09x the unfused time; the others
# 1.14-1.25x; differences of the order of the spread between rounds on a loaded machine,
# so a preliminary choice). CUDA: not measured yet; 2048 x 8192 (64 MiB) keeps kernel launches a small
# share of a step at 1M tokens while the tile stays far below the logits.
DEFAULT_TILES = {"cpu": (1024, 2048), "cuda": (2048, 8192)}


# ---------------------------------------------------------------- validation


def _check_chunk(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} must be a positive int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name}={value} must be a positive int")
    return int(value)


def check_loss_inputs(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                      ignore_index: int = IGNORE_INDEX, reduction: str = "mean") -> None:
    """Raise ValueError (naming parameter, value and rule) for anything the loss cannot take.

    hidden (T, H) or (B, S, H); weight (V, H); labels hidden.shape[:-1], an integer
    dtype, each in [0, V) or equal to ignore_index; bias None or (V,).
    """
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden.shape={tuple(hidden.shape)} must be 2-D (tokens, hidden) "
                         "or 3-D (batch, seq, hidden)")
    if weight.dim() != 2:
        raise ValueError(f"weight.shape={tuple(weight.shape)} must be 2-D (vocab, hidden)")
    if weight.shape[0] == 0:
        raise ValueError(f"weight.shape={tuple(weight.shape)}: the vocabulary must not be empty")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight.shape={tuple(weight.shape)} and hidden.shape={tuple(hidden.shape)} "
                         "must agree in the hidden size (weight.shape[1] == hidden.shape[-1])")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels.shape={tuple(labels.shape)} must equal hidden.shape[:-1]="
                         f"{tuple(hidden.shape[:-1])}")
    if hidden.dtype not in FLOAT_DTYPES:
        raise ValueError(f"hidden.dtype={hidden.dtype} must be one of {FLOAT_DTYPES}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight.dtype={weight.dtype} must equal hidden.dtype={hidden.dtype}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels.dtype={labels.dtype} must be an integer dtype (class indices)")
    if bias is not None:
        if not isinstance(bias, Tensor) or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias.shape={tuple(getattr(bias, 'shape', ()))} must be (vocab,)="
                             f"({weight.shape[0]},)")
        if bias.dtype != weight.dtype:
            raise ValueError(f"bias.dtype={bias.dtype} must equal weight.dtype={weight.dtype}")
    devices = {t.device for t in (hidden, weight, labels) + ((bias,) if bias is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"hidden, weight, labels (and bias) must be on one device, got {sorted(map(str, devices))}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise ValueError(f"ignore_index={ignore_index!r} must be an int")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is unknown; choose one of {REDUCTIONS}")
    vocab = weight.shape[0]
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"labels[{', '.join(map(str, pos))}]={int(labels[pos])} is outside the vocabulary: "
                         f"every label must be in [0, {vocab}) or equal ignore_index={ignore_index}")


def count_tokens(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Number of tokens the loss counts (labels != ignore_index), int64 0-dim tensor."""
    return (labels != ignore_index).sum()


def _finish(loss: Tensor, labels: Tensor, ignore_index: int, return_count: bool):
    return (loss, count_tokens(labels, ignore_index)) if return_count else loss


# ---------------------------------------------------------------- the unfused reference


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                         ignore_index: int = IGNORE_INDEX, reduction: str = "mean",
                         return_count: bool = False):
    """F.linear + F.cross_entropy: materialises the (tokens, vocab) logits in the input dtype.

    Same arguments and checks as the fused loss; torch's semantics (loss in the
    input dtype; mean over zero counted tokens is nan).
    """
    check_loss_inputs(hidden, weight, labels, bias=bias, ignore_index=ignore_index, reduction=reduction)
    logits = F.linear(hidden, weight, bias)                       # (..., V)
    loss = F.cross_entropy(logits.reshape(-1, weight.shape[0]), labels.reshape(-1).long(),
                           ignore_index=ignore_index, reduction=reduction)
    if reduction == "none":
        loss = loss.view(labels.shape)
    return _finish(loss, labels, ignore_index, return_count)


# ---------------------------------------------------------------- tiles


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _upcast_operands(t: Tensor) -> bool:
    """Multiply in the compute dtype (True) or natively with fp32 output (False).

    CPU BLAS has no fast half-precision GEMM (a bf16 GEMM runs 5-200x slower than
    fp32 on an AVX2 machine), so there half operands are upcast chunk by chunk.
    On CUDA the tensor cores multiply bf16/fp16 and accumulate in fp32.
    """
    return t.device.type != "cuda" or t.dtype in (torch.float32, torch.float64)


_MM_OUT_DTYPE: dict[str, bool] = {}   # device type -> torch.mm(..., out_dtype=) works there


def _mm_wide(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """a @ b with half operands and a ``dtype`` (fp32) result."""
    kind = a.device.type
    if _MM_OUT_DTYPE.get(kind, True):
        try:
            return torch.mm(a, b, out_dtype=dtype)
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE[kind] = False
    return torch.mm(a, b).to(dtype)   # fp32 accumulation inside the kernel, output rounded once


class _Tiles:
    """The operands of one call, as the tile loops need them.

    x (n, H): the hidden rows of counted tokens (upcast to the compute dtype on
    CPU); y (n,): their labels, int64; weight/bias chunks via ``w(v0, v1)`` /
    ``b(v0, v1)``; ``logits(...)`` writes a tile into a contiguous view of one
    reused (chunk_tokens * chunk_vocab) buffer in the compute dtype.
    """

    def __init__(self, hidden2d: Tensor, weight: Tensor, bias: Tensor | None, labels1d: Tensor,
                 ignore_index: int, chunk_tokens: int, chunk_vocab: int):
        self.cdt = _compute_dtype(hidden2d.dtype)
        self.upcast = _upcast_operands(hidden2d)
        keep = labels1d != ignore_index
        self.rows = None if bool(keep.all()) else keep.nonzero().squeeze(1)   # (n,) or None = all
        x = hidden2d if self.rows is None else hidden2d.index_select(0, self.rows)
        self.x = x.to(self.cdt) if self.upcast else x                       # (n, H)
        y = labels1d if self.rows is None else labels1d.index_select(0, self.rows)
        self.y = y.long()
        self.weight, self.bias = weight, bias
        self.n, self.vocab = self.x.shape[0], weight.shape[0]
        self.tc, self.vc = max(1, min(chunk_tokens, self.n)), min(chunk_vocab, self.vocab)
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
        # C operand is first copied into the tile, and that GEMM measured ~30% slower.
        if self.upcast:
            torch.mm(x, w.t(), out=out)
        else:
            out.copy_(_mm_wide(x, w.t(), self.cdt))
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
            acc.add_(_mm_wide(a.to(b.dtype), b, self.cdt), alpha=alpha)


# ---------------------------------------------------------------- forward / backward


def _forward_lse(t: _Tiles) -> tuple[Tensor, Tensor]:
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


def _backward_tiles(t: _Tiles, lse: Tensor, g: Tensor | None, alpha: float,
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


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden2d, weight, bias, labels1d, ignore_index, reduction, chunk_tokens, chunk_vocab):
        t = _Tiles(hidden2d, weight, bias, labels1d, ignore_index, chunk_tokens, chunk_vocab)
        if t.n:
            lse, target = _forward_lse(t)
            per_token = lse - target                                 # (n,) fp32 (fp64 for fp64 inputs)
        else:
            lse = per_token = torch.zeros(0, dtype=t.cdt, device=hidden2d.device)
        if reduction == "none":
            out = torch.zeros(labels1d.shape[0], dtype=t.cdt, device=hidden2d.device)
            if t.rows is None:
                out.copy_(per_token)
            else:
                out.index_copy_(0, t.rows, per_token)
        else:
            out = per_token.sum()
            if reduction == "mean":
                out = out / max(t.n, 1)
        ctx.save_for_backward(hidden2d, weight, bias, labels1d, lse)
        ctx.opts = (ignore_index, reduction, chunk_tokens, chunk_vocab, t.n)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        hidden2d, weight, bias, labels1d, lse = ctx.saved_tensors
        ignore_index, reduction, chunk_tokens, chunk_vocab, n = ctx.opts
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        dhidden = dweight = dbias = None
        if n == 0:
            return (torch.zeros_like(hidden2d) if need_dx else None, torch.zeros_like(weight) if need_dw else None,
                    torch.zeros_like(bias) if need_db else None, None, None, None, None, None)
        t = _Tiles(hidden2d, weight, bias, labels1d, ignore_index, chunk_tokens, chunk_vocab)
        if reduction == "none":
            g = grad.to(t.cdt)
            g = g if t.rows is None else g.index_select(0, t.rows)
            alpha = 1.0
        else:
            g, alpha = None, float(grad) / (n if reduction == "mean" else 1)
        dx, dw, db = _backward_tiles(t, lse.to(t.cdt), g, alpha, need_dx, need_dw, need_db, weight.dtype)
        if need_dx:
            if t.rows is None:
                dhidden = dx.to(hidden2d.dtype)
            else:
                dhidden = torch.zeros_like(hidden2d).index_copy_(0, t.rows, dx.to(hidden2d.dtype))
        if need_dw:
            dweight = dw
        if need_db:
            dbias = db.to(bias.dtype)
        return dhidden, dweight, dbias, None, None, None, None, None


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                               ignore_index: int = IGNORE_INDEX, reduction: str = "mean",
                               chunk_tokens: int | None = None, chunk_vocab: int | None = None,
                               return_count: bool = False):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, never materialising the logits.

    hidden (T, H) or (B, S, H), float16/bfloat16/float32/float64; weight (V, H)
    in hidden's dtype; labels hidden.shape[:-1], integers in [0, V) or
    ``ignore_index``; bias None or (V,). ``reduction``: "mean" (over counted
    tokens; 0 when none is counted), "sum", or "none" (per-token losses shaped
    like labels, 0 where ignored). Returns the loss in fp32 (fp64 for fp64
    inputs), and with
    ``return_count=True`` also the number of counted tokens (int64 0-dim) for
    an external mean (see the module docstring). ``chunk_tokens`` x
    ``chunk_vocab`` is the logits tile (default ``DEFAULT_TILES`` for the
    device); the extra memory is one such fp32 tile plus O(T + V)
    vectors and an fp32 (T, H) gradient accumulator.
    """
    default = DEFAULT_TILES.get(getattr(getattr(hidden, "device", None), "type", "cpu"), DEFAULT_TILES["cpu"])
    chunk_tokens = _check_chunk("chunk_tokens", default[0] if chunk_tokens is None else chunk_tokens)
    chunk_vocab = _check_chunk("chunk_vocab", default[1] if chunk_vocab is None else chunk_vocab)
    check_loss_inputs(hidden, weight, labels, bias=bias, ignore_index=ignore_index, reduction=reduction)
    H = hidden.shape[-1]
    loss = _FusedLinearCrossEntropy.apply(hidden.reshape(-1, H), weight, bias, labels.reshape(-1),
                                          ignore_index, reduction, chunk_tokens, chunk_vocab)
    if reduction == "none":
        loss = loss.view(labels.shape)
    return _finish(loss, labels, ignore_index, return_count)
