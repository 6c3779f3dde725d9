"""Fused LM head + cross-entropy (docs/papers.md §2, "Fused LM head + cross-entropy").

``fused_linear_cross_entropy(hidden, weight, labels)`` is
``F.cross_entropy(F.linear(hidden, weight, bias), labels)`` without ever
holding the (tokens, vocab) logits: at 1M tokens and a 128K vocabulary those
are about 250 GB. It has two paths; both compute every logits tile into one
reused fp32 buffer.

**Gradients in the forward** (the default when a gradient is needed and the
reduction is "mean" or "sum"; ``grad_in_forward=True`` forces it). One pass
over chunks of ``rows`` tokens, each against the *whole* vocabulary (the
approach of Liger-Kernel's fused linear cross-entropy):

    tile = x_c @ W^T (+ b)                      (rows, V), one GEMM
    lse  = m + log sum_v exp(tile - m)          exact per row, m its maximum
    loss_t = lse_t - tile[t, y_t]
    p = softmax(tile) - onehot(y), scaled by 1/count for the mean, in place
    d x_c  = p @ W                              (rows, V) @ (V, H)
    d W   += p^T @ x_c                          (V, rows) @ (rows, H)
    d b   += p.sum(0)

so 3 (tokens x vocab x H) GEMMs in all, as many as the unfused loss. The
gradients of the loss for an incoming gradient of 1 are kept from the forward
to the backward, which only scales them by the incoming (0-dim) gradient and
casts them to the inputs' dtypes (in place: a second backward through the same
graph is an error; hidden itself is not kept). Memory: one (rows, V) fp32 tile, the fp32 d hidden (T, H)
and the fp32 d W (V, H) (for fp32 weights that is the weight's gradient
itself; for bf16/fp16 a copy beside it), plus on CPU the fp32 copies of
half-precision x and W. ``rows``: ``grad_rows`` (``GRAD_TILE``), or
``chunk_tokens`` when given; ``chunk_vocab`` does not apply.

**Recomputing backward** (``reduction="none"``, calls that need no gradient,
``grad_in_forward=False``). (chunk_tokens x chunk_vocab) tiles:

* Forward. Vocabulary chunks outer, token chunks inner. For every tile the
  running log-sum-exp of each token is updated online (stable form: shift by
  the running maximum m, rescale the running sum s by exp(m_old - m_new) when
  the maximum grows, lse = m + log s), and the target logit is picked out of
  the tile that holds the label. Only lse (fp32, one float per token) is saved;
  loss_t = lse_t - logit_t[y_t].
* Backward. The same tiles are recomputed as ``logits - lse`` in one GEMM,
  exponentiated in place into the softmax p, the one-hot of the label is
  subtracted, and the tile goes straight into the gradients (g = incoming
  gradient, 1/count for the mean):

      d hidden[t] += g_t * (p - onehot)[t, :] @ W_chunk        (tokens, H)
      d W_chunk   += (g * (p - onehot))^T @ hidden              (chunk_vocab, H)

  so the forward's GEMM is paid again: 4 GEMMs of (tokens x vocab x H)
  against the unfused 3, for O(tokens + vocab) memory besides the gradients
  (one tile, lse, the fp32 d hidden accumulator).

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

from .loss_tiles import Tiles, backward_tiles, forward_lse, forward_with_grads

Tensor = torch.Tensor

IGNORE_INDEX = -100
REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Tile defaults by device type.
#
# Recomputing path: (chunk_tokens, chunk_vocab).
# CPU: 1024 x 2048 (an 8 MiB fp32 tile, L3-resident), the fastest of 512..2048 x 1024..4096 in
# two preliminary sweeps (docs/findings.md, fused loss tile sizes).
# CUDA: not measured yet; 2048 x 8192 (64 MiB) keeps kernel launches a small
# share of a step at 1M tokens while the tile stays far below the logits.
DEFAULT_TILES = {"cpu": (1024, 2048), "cuda": (2048, 8192)}
#
# Gradients-in-the-forward path: a (rows, V) tile, rows = max(least, budget // (4 V)) (``grad_rows``),
# as (fp32 tile budget in bytes, least rows). Two limits. The tile against the logits: at a 128 MiB
# budget it is rows/T of one (T, V) fp32 copy, 1/8 at T = 8192 and V = 32K, where the unfused loss
# holds about three copies (3 GiB). The GEMMs' efficiency on CPU: every chunk re-reads and rewrites
# the fp32 d W (V, H) accumulator in d W += p^T x_c (inner dimension rows) and reads W twice, about
# 16 V H bytes against the chunk's 6 rows V H flops of its three GEMMs, i.e. 2.7/rows bytes per flop:
# at least 512 rows keep that traffic near 0.5 GB/s at 100 GFLOP/s, a few per cent of the memory
# bandwidth. Liger's rule (a tile of about T x H elements) would take 64 rows at T = 8192, H = 1024,
# V = 128K: eight times that traffic. So on CPU 1024 rows at V = 32K (128 MiB), 512 rows (256 MiB,
# the floor) at V = 128K. Chunks are evened out (``balanced_rows``) so that no small last chunk
# pays a whole re-read of d W. A preliminary rows sweep found 256 rows slow and 512..2048 alike
# (docs/findings.md, fused loss tile sizes).
# CUDA: not measured; 512 MiB and at least 1024 rows (tensor cores want a large inner dimension;
# HBM makes the re-read cheap): 1092 rows at a 123K vocabulary.
GRAD_TILE = {"cpu": (128 << 20, 512), "cuda": (512 << 20, 1024)}


def grad_rows(device_type: str, vocab: int) -> int:
    """Default rows per chunk of the gradients-in-the-forward path on ``device_type`` (``GRAD_TILE``)."""
    budget, least = GRAD_TILE.get(device_type, GRAD_TILE["cpu"])
    return max(least, budget // (4 * max(vocab, 1)))


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


# ---------------------------------------------------------------- the autograd function


def _reduce(per_token: Tensor, t: Tiles, labels1d: Tensor, reduction: str) -> Tensor:
    """The per-token losses of the counted rows (n,) as the call's output."""
    if reduction == "none":
        out = torch.zeros(labels1d.shape[0], dtype=t.cdt, device=labels1d.device)
        return out.copy_(per_token) if t.rows is None else out.index_copy_(0, t.rows, per_token)
    out = per_token.sum()
    return out / max(t.n, 1) if reduction == "mean" else out


def _to_hidden(dx: Tensor, rows: Tensor | None, like: tuple) -> Tensor:
    """d x of the counted rows (n, H) as the gradient of hidden2d, ``like`` = its (shape, dtype,
    device) (T, H): zeros for ignored rows."""
    shape, dtype, device = like
    if rows is None:
        return dx.to(dtype)
    return torch.zeros(shape, dtype=dtype, device=device).index_copy_(0, rows, dx.to(dtype))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden2d, weight, bias, labels1d, ignore_index, reduction, chunk_tokens, chunk_vocab,
                grads_now):
        """grads_now: None (recomputing backward) or (need_dx, need_dw, need_db, balance): the
        gradients to compute here (gradients in the forward; reduction "mean" or "sum"), in token
        chunks of chunk_tokens rows against the whole vocabulary, evened out if balance."""
        ctx.saved_grads = None
        if grads_now is not None:
            ctx.hidden_like = (hidden2d.shape, hidden2d.dtype, hidden2d.device)
            *needs, balance = grads_now
            t = Tiles(hidden2d, weight, bias, labels1d, ignore_index, chunk_tokens, weight.shape[0], balance)
            if t.n:
                # The gradients for an incoming gradient of 1, the mean's 1/n included.
                scale = 1.0 / t.n if reduction == "mean" else 1.0
                per_token, dx, dw, db = forward_with_grads(t, scale, *needs)
                ctx.saved_grads = (dx, dw, db, t.rows)
            else:
                per_token = torch.zeros(0, dtype=t.cdt, device=hidden2d.device)
            # hidden itself is not kept: its gradient is computed, and the backward needs only its shape
            ctx.save_for_backward(weight, bias)
            ctx.opts = (ignore_index, reduction, chunk_tokens, chunk_vocab, t.n, True)
            return _reduce(per_token, t, labels1d, reduction)
        t = Tiles(hidden2d, weight, bias, labels1d, ignore_index, chunk_tokens, chunk_vocab)
        if t.n:
            lse, target = forward_lse(t)
            per_token = lse - target                                 # (n,) fp32 (fp64 for fp64 inputs)
        else:
            lse = per_token = torch.zeros(0, dtype=t.cdt, device=hidden2d.device)
        ctx.save_for_backward(hidden2d, weight, bias, labels1d, lse)
        ctx.opts = (ignore_index, reduction, chunk_tokens, chunk_vocab, t.n, False)
        return _reduce(per_token, t, labels1d, reduction)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        ignore_index, reduction, chunk_tokens, chunk_vocab, n, in_forward = ctx.opts
        if in_forward:
            weight, bias = ctx.saved_tensors
            like = ctx.hidden_like
        else:
            hidden2d, weight, bias, labels1d, lse = ctx.saved_tensors
            like = (hidden2d.shape, hidden2d.dtype, hidden2d.device)
        need_dx, need_dw = ctx.needs_input_grad[:2]
        need_db = bias is not None and ctx.needs_input_grad[2]
        dhidden = dweight = dbias = None
        if n == 0:
            return (torch.zeros(like[0], dtype=like[1], device=like[2]) if need_dx else None,
                    torch.zeros_like(weight) if need_dw else None,
                    torch.zeros_like(bias) if need_db else None, None, None, None, None, None, None)
        if in_forward:
            return (*_scale_saved(ctx, grad, like, weight, bias, need_dx, need_dw, need_db),
                    None, None, None, None, None, None)
        t = Tiles(hidden2d, weight, bias, labels1d, ignore_index, chunk_tokens, chunk_vocab)
        if reduction == "none":
            g = grad.to(t.cdt)
            g = g if t.rows is None else g.index_select(0, t.rows)
            alpha = 1.0
        else:
            g, alpha = None, float(grad) / (n if reduction == "mean" else 1)
        dx, dw, db = backward_tiles(t, lse.to(t.cdt), g, alpha, need_dx, need_dw, need_db, weight.dtype)
        if need_dx:
            dhidden = _to_hidden(dx, t.rows, like)
        if need_dw:
            dweight = dw
        if need_db:
            dbias = db.to(bias.dtype)
        return dhidden, dweight, dbias, None, None, None, None, None, None


def _scale_saved(ctx, grad: Tensor, like: tuple, weight: Tensor, bias: Tensor | None,
                 need_dx: bool, need_dw: bool, need_db: bool):
    """The gradients-in-the-forward path's backward: the saved gradients (for an incoming gradient
    of 1) times ``grad`` (0-dim), in place, cast to the inputs' dtypes; the saved copies are released."""
    if ctx.saved_grads is None:
        raise RuntimeError("fused_linear_cross_entropy: backward ran twice through a call that computed its "
                           "gradients in the forward (they are scaled in place and released); call it with "
                           "grad_in_forward=False to back-propagate through one graph more than once")
    dx, dw, db, rows = ctx.saved_grads
    ctx.saved_grads = None
    missing = [name for name, need, got in (("hidden", need_dx, dx), ("weight", need_dw, dw), ("bias", need_db, db))
               if need and got is None]
    if missing:
        raise RuntimeError(f"fused_linear_cross_entropy: the gradient of {missing} is asked for in the backward but "
                           "was not computed in the forward (requires_grad changed after the call?)")
    g = grad.to(dx.dtype if dx is not None else dw.dtype if dw is not None else db.dtype)
    dhidden = _to_hidden(dx.mul_(g), rows, like) if need_dx else None
    dweight = dw.mul_(g).to(weight.dtype) if need_dw else None      # no copy when weight is fp32/fp64
    dbias = db.mul_(g).to(bias.dtype) if need_db else None
    return dhidden, dweight, dbias


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                               ignore_index: int = IGNORE_INDEX, reduction: str = "mean",
                               chunk_tokens: int | None = None, chunk_vocab: int | None = None,
                               grad_in_forward: bool | None = None, return_count: bool = False):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, never materialising the logits.

    hidden (T, H) or (B, S, H), float16/bfloat16/float32/float64; weight (V, H)
    in hidden's dtype; labels hidden.shape[:-1], integers in [0, V) or
    ``ignore_index``; bias None or (V,). ``reduction``: "mean" (over counted
    tokens; 0 when none is counted), "sum", or "none" (per-token losses shaped
    like labels, 0 where ignored). Returns the loss in fp32 (fp64 for fp64
    inputs), and with
    ``return_count=True`` also the number of counted tokens (int64 0-dim) for
    an external mean (see the module docstring).

    ``grad_in_forward``: compute the gradients in the forward (3 head GEMMs; keeps fp32 d hidden and
    d W until the backward) or recompute the tiles in the backward (4 GEMMs; O(T + V) memory besides
    the gradients). None: in the forward when autograd will need a gradient of hidden, weight or bias
    and the reduction is "mean" or "sum". True with reduction "none" is a ValueError.
    Tiles: in the forward, (``chunk_tokens``, V) with ``chunk_tokens`` default ``grad_rows`` for the
    device; recomputing, ``chunk_tokens`` x ``chunk_vocab`` (default ``DEFAULT_TILES`` for the device).
    """
    kind = getattr(getattr(hidden, "device", None), "type", "cpu")
    default = DEFAULT_TILES.get(kind, DEFAULT_TILES["cpu"])
    explicit_rows = chunk_tokens is not None
    chunk_tokens = _check_chunk("chunk_tokens", default[0] if chunk_tokens is None else chunk_tokens)
    chunk_vocab = _check_chunk("chunk_vocab", default[1] if chunk_vocab is None else chunk_vocab)
    if grad_in_forward is not None and not isinstance(grad_in_forward, bool):
        raise ValueError(f"grad_in_forward={grad_in_forward!r} must be True, False or None (automatic)")
    if grad_in_forward and reduction == "none":
        raise ValueError("grad_in_forward=True needs reduction 'mean' or 'sum' (with 'none' the per-token "
                         "incoming gradients are known only in the backward), got reduction='none'")
    check_loss_inputs(hidden, weight, labels, bias=bias, ignore_index=ignore_index, reduction=reduction)
    grad_on = torch.is_grad_enabled()
    need = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad)
    if grad_in_forward is None:
        grad_in_forward = reduction != "none" and any(need)
    grads_now = None
    if grad_in_forward:
        # Rows per chunk: chunk_tokens as given, else the device's default evened out over the counted tokens.
        chunk_tokens = chunk_tokens if explicit_rows else grad_rows(kind, weight.shape[0])
        grads_now = (*need, not explicit_rows)
    H = hidden.shape[-1]
    loss = _FusedLinearCrossEntropy.apply(hidden.reshape(-1, H), weight, bias, labels.reshape(-1),
                                          ignore_index, reduction, chunk_tokens, chunk_vocab, grads_now)
    if reduction == "none":
        loss = loss.view(labels.shape)
    return _finish(loss, labels, ignore_index, return_count)
