"""Activation checkpointing of the decoder blocks, including BurstEngine's sequence-level variant.

``ModelConfig.checkpoint`` (docs/papers.md §2 and §4, "Sequence-level selective checkpointing"):

* ``none``: every block keeps its activations for the backward (no recompute).
* ``full``: every block is checkpointed (``torch.utils.checkpoint``, non-reentrant):
  only its input (B, S, H) is kept; the backward re-runs the whole block,
  attention and its communication included.
* ``seq``: every block is checkpointed, but the first forward caches the
  attention output O (B, S/2, Z, d, input dtype) and lse (B, Z, S/2, fp32) of
  the SECOND half of each rank's local sequence; the recompute runs attention
  for the FIRST half only, joins [recomputed | cached] and runs the ordinary
  attention backward over the whole local sequence.
* ``whole``: as ``seq`` with all of O and lse cached: attention and its
  communication are never recomputed (their headline mode, docs/papers.md §4).

Which half, and why. With the causal zigzag layout rank r holds global
chunks (r, 2G-1-r), so the first local halves of all ranks are chunks
0..G-1: the first global half, in the contiguous layout. With the striped
layout rank r holds tokens r, r+G, ..., and its first local half is tokens
< N/2: again the first global half, in the striped layout. Under a causal
mask the first global half attends only to itself, so its attention is the
same operator (same method, same ring) on half-length shards in that
sub-layout, and costs 1/4 of the causal attention FLOPs and half of the
forward ring's bytes; the second half (the expensive 3/4, queries that see
up to all N keys) is the one cached. With the contiguous layout at G > 1 the
first local halves are not a prefix of the sequence, so ``seq`` is refused
(ValueError); at G = 1 every layout is contiguous and the rule holds.

Masks (``ModelConfig.mask``): ``full``, ``whole`` and ``none`` take any mask (the cache
holds the masked attention's O and lse). ``seq`` needs the first global half to attend
only to itself under the same mask spec at N/2: true for the causal mask and for a
causal sliding window (live pairs depend only on k - q), not for documents or a
block-sparse mask, whose spec strings draw a different mask at N/2 (ValueError).

Which attention runs this way. The cache needs an attention backward that
starts from (q, k, v, O, lse): the BurstAttention operator's ring backwards
(the methods whose ``Method.operator_backward`` names the scheme they bind:
``burst``, ``burst_qring``, ``burst_double_ring``, their ``_no_overlap``
variants, and ``ring``, which is that operator with the key/value-circulating
backward), a method with its own hook for it (``Method.cached_attention``: ``burst_usp``,
whose backward from (O, lse) is Burst's behind its all-to-alls) and the single-device kernels
(``LocalAttention``, fused). Other methods (Ulysses, usp, loongtrain_usp, ring_rsa, TP)
expose only their own autograd, so under ``seq``/``whole`` they are
checkpointed as ``full`` (exact, no saving); ``effective_mode`` says which.

Safety (their cache is a global dict keyed by layer with a stale entry
after a forward without backward): here the cache is an object created per
block call and reachable only from that call's checkpoint, so it dies with
the graph; under ``torch.no_grad`` (prefill) nothing is checkpointed or cached.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from burst_impl import burst_attn_func, masks
from burst_impl.attention import burst_attn_backward
from burst_impl.kernels import default_scale
from burst_impl.local import local_backward, local_forward
from burst_impl.method import Method

from .config import check_mode
from .layers import LocalAttention

Tensor = torch.Tensor

# The layout in which the ranks' first local halves hold the first global half.
SUB_LAYOUT = {"zigzag": "contiguous", "striped": "striped", "contiguous": "contiguous"}


# ---------------------------------------------------------------- attention with a cache


@dataclass
class AttnSpec:
    """How to run one block's attention from outside its method: forward -> (O, lse), and the
    backward from (q, k, v, O, lse). ``kind`` "ring" (the BurstAttention operator on ``group``) or
    "local" (one device)."""

    kind: str
    causal: bool
    layout: str = "contiguous"
    group: object = None
    scheme: str = "auto"              # the operator's backward: "burst", "ring" or "auto"
    backend: str | None = None
    topology: str = "flat"
    node_size: int | None = None
    overlap: bool = True
    grad_comm_dtype: torch.dtype | None = None
    softmax_scale: float | None = None
    mask: str = ""                    # ModelConfig.mask (a burst_impl.masks spec; "" = causal/full alone)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layout: str) -> tuple[Tensor, Tensor]:
        """(out (B, S, Z, d) in q's dtype, lse (B, Z, S) in the statistics dtype); no autograd."""
        if self.kind == "local":
            scale = default_scale(q.shape[-1], self.softmax_scale)
            return local_forward(q, k, v, masks.resolve(self.causal, self.mask, q.shape[1]), scale, self.backend)
        # The operator itself (called from a autograd.Function's forward, so it records no graph).
        return burst_attn_func(q, k, v, causal=self.causal, mask=self.mask or None, softmax_scale=self.softmax_scale,
                               group=self.group, layout=layout, backward=self.scheme, backend=self.backend,
                               grad_comm_dtype=self.grad_comm_dtype, return_lse=True, topology=self.topology,
                               node_size=self.node_size, overlap=self.overlap)

    def backward(self, dout, q, k, v, out, lse) -> tuple[Tensor, Tensor, Tensor]:
        scale = default_scale(q.shape[-1], self.softmax_scale)
        if self.kind == "local":
            the_mask = masks.resolve(self.causal, self.mask, q.shape[1])
            return local_backward(dout, q, k, v, out, lse, the_mask, scale, self.backend)
        return burst_attn_backward(dout, q, k, v, out, lse, causal=self.causal, mask=self.mask or None,
                                   softmax_scale=self.softmax_scale, group=self.group, layout=self.layout,
                                   backward=self.scheme, backend=self.backend, grad_comm_dtype=self.grad_comm_dtype,
                                   topology=self.topology, node_size=self.node_size, overlap=self.overlap)

def attention_spec(core) -> AttnSpec | None:
    """The ``AttnSpec`` of a block's attention core, or None when the core can only be recomputed
    through its own autograd (then ``seq``/``whole`` checkpoint it as ``full``)."""
    mask = getattr(core, "mask", "")
    if isinstance(core, LocalAttention):
        return AttnSpec("local", causal=core.causal, backend=core.backend, mask=mask) if core.fused else None
    method = getattr(core, "method", None)
    scheme = None if method is None else method.operator_backward
    opts = {} if method is None else {**method.options, **getattr(core, "options", {})}
    if method is not None and method.cached_attention is not None:
        # the hook reads the mask from its options, as the method's own call takes it
        opts = {**opts, "mask": mask} if mask else opts
        return method.cached_attention(causal=core.causal, layout=core.layout, group=core.group, options=opts)
    if scheme is None:
        return None
    return AttnSpec("ring", causal=core.causal, layout=core.layout, group=core.group,
                    scheme=scheme, backend=opts.get("backend"),
                    topology=opts.get("topology", "flat"), node_size=opts.get("node_size"),
                    overlap=opts.get("overlap", True), grad_comm_dtype=opts.get("grad_comm_dtype"), mask=mask)


@dataclass
class _Cache:
    """What one block call's first forward leaves for its recompute (never global)."""

    mode: str
    out: Tensor | None = None         # (B, S or S/2, Z, d)
    lse: Tensor | None = None         # (B, Z, S or S/2)
    filled: bool = False


class _CachedAttention(torch.autograd.Function):
    """o = attention(q, k, v); the first call (the checkpoint's forward) computes all of it and
    fills the cache; the second (the recompute) takes the cached part and computes the rest. The
    saved tensors (q, k, v, O, lse) are the same shapes both times, as the checkpoint requires."""

    @staticmethod
    def forward(ctx, q, k, v, spec: AttnSpec, cache: _Cache):
        half = q.shape[1] // 2
        if not cache.filled:
            out, lse = spec.forward(q, k, v, spec.layout)
            if cache.mode == "whole":
                cache.out, cache.lse = out.detach(), lse
            else:  # copies, so the full O is freed with the checkpoint's discarded activations
                cache.out, cache.lse = out[:, half:].clone(), lse[:, :, half:].clone()
            cache.filled = True
        else:
            if cache.out is None:
                raise RuntimeError("the attention cache of this block was already used: a checkpointed block "
                                   "with checkpoint='seq'/'whole' supports one backward per forward")
            if cache.mode == "whole":
                out, lse = cache.out, cache.lse
            else:
                o1, l1 = spec.forward(q[:, :half], k[:, :half], v[:, :half], SUB_LAYOUT[spec.layout])
                out, lse = torch.cat((o1, cache.out), 1), torch.cat((l1, cache.lse), 2)
            cache.out = cache.lse = None      # the saved tensors below now own them
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.spec.backward(dout.contiguous(), q, k, v, out, lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


# ---------------------------------------------------------------- blocks


def effective_mode(block, mode: str) -> str:
    """The mode a block actually runs: ``seq``/``whole`` fall back to ``full`` for attention
    cores without an ``AttnSpec`` (see the module docstring)."""
    check_mode(mode)
    if mode in ("seq", "whole") and attention_spec(block.attention.core) is None:
        return "full"
    return mode


def method_mode(method: Method, mode: str) -> str:
    """``effective_mode`` from an attention method, for models of a step that build no blocks
    (the memory and performance models): ``seq``/``whole`` are ``full`` unless the method is the
    BurstAttention operator (``Method.operator_backward``) or has its own hook (``Method.cached_attention``)."""
    check_mode(mode)
    if mode in ("seq", "whole") and method.operator_backward is None and method.cached_attention is None:
        return "full"
    return mode


def seq_mask_problem(mask: str, seqlen: int) -> str | None:
    """Why ``checkpoint='seq'`` cannot run the causal model with ``mask`` (a ``burst_impl.masks`` spec) at
    ``seqlen`` tokens, else None (module docstring, "Masks"; the harness checks it when a spec loads)."""
    kind = masks.resolve(True, mask or None, seqlen).kind
    if kind not in ("causal", "window"):
        return (f"checkpoint='seq' with mask={mask!r}: the recomputed first half must attend only to itself "
                "under the same mask at N/2, which holds for the causal mask and a causal sliding window only; "
                "use checkpoint 'whole' or 'full' with this mask")
    if kind == "window":
        try:
            masks.parse(mask, seqlen // 2)      # the recompute's mask at N/2
        except ValueError as e:
            return f"checkpoint='seq' recomputes the first N/2 = {seqlen // 2} tokens under mask={mask!r}: {e}"
    return None


def check_checkpoint(model, seqlen: int) -> None:
    """ValueError (before any communication) unless ``model.cfg.checkpoint`` can run a global
    sequence of ``seqlen`` tokens: ``seq`` needs a causal mask, an even local length, and at
    G > 1 the zigzag or striped layout (module docstring, "Which half")."""
    mode = check_mode(model.cfg.checkpoint)
    if mode != "seq":
        return
    plan = model.parallel
    G = plan.world_size if plan is not None and plan.shards_sequence else 1
    local = seqlen // G
    for block in model.layers:
        spec = attention_spec(block.attention.core)
        if spec is None:
            continue
        why = seq_mask_problem(model.cfg.mask, seqlen)
        if why:
            raise ValueError(why)
        if not spec.causal:
            raise ValueError("checkpoint='seq' needs causal attention (the recomputed first half must "
                             "attend only to itself)")
        if local % 2 or seqlen % (2 * G):   # equal, even shards: the halves must be the layout's sub-shards
            raise ValueError(f"checkpoint='seq' caches the second half of each rank's local sequence: "
                             f"seq_local = N/G = {seqlen}/{G} = {local} must be even and equal on every rank "
                             f"(N a multiple of 2G = {2 * G})")
        if G > 1 and spec.layout not in ("zigzag", "striped"):
            raise ValueError(f"checkpoint='seq' with layout={spec.layout!r} at G={G}: the ranks' first local "
                             "halves must form the first global half, which holds for 'zigzag' and 'striped' only")


def _cached_block(block, x: Tensor, rope, spec: AttnSpec, cache: _Cache) -> Tensor:
    attention = block.attention
    base = attention.core
    attention.core = lambda q, k, v: _CachedAttention.apply(q, k, v, spec, cache)
    try:
        return block(x, rope)
    finally:
        attention.core = base


def run_block(block, x: Tensor, rope, mode: str) -> Tensor:
    """``block(x, rope)`` under checkpoint mode ``mode``; plain when gradients are off."""
    if mode == "none" or not torch.is_grad_enabled():
        return block(x, rope)
    mode = effective_mode(block, mode)
    if mode == "full":
        return checkpoint(block, x, rope, use_reentrant=False)
    spec = attention_spec(block.attention.core)
    return checkpoint(_cached_block, block, x, rope, spec, _Cache(mode), use_reentrant=False)
