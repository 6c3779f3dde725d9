"""Memory model of one training step per rank: weights, optimizer, gradients, activations, logits, attention.

    m = step_memory(cfg, batch=1, seqlen=1 << 20, world_size=32, method=get("burst"), weights="fsdp2")
    m.resident_bytes       # weights + optimizer state, live before and after the step
    m.step_peak_bytes      # the step's peak above that (what experiments/harness/memory.py measures)
    m.total_bytes          # both: compare with the accelerator's memory to mark an OOM

Per rank, with T = B * N / G local tokens, element size e of the model dtype,
H hidden, F FFN width, Z/Zkv heads of d, V vocabulary, L layers, P params:

* **weights / optimizer / gradients** by sharding: P e each for weights and
  gradients, 2 P e for AdamW's two moments (torch keeps them in the
  parameter dtype); divided by G under FSDP2 (``fsdp2``), which adds one
  gathered block's weights and gradients in flight.
* **tensor parallel** (``weights="tp"``, methods ``tp_v1``/``tp_v3``): weights,
  gradients and optimizer divided by G, nothing gathered; activations and
  the vocabulary-parallel loss per rank as ``_tensor_parallel`` says (approximate).
* **activations** by checkpoint mode (``checkpoint.py``). What autograd keeps
  per token and block, counted from the layers (``layers.py``): each RMSNorm
  its input, the normalised x and the weighted output (3H, twice); the
  SwiGLU w1 x, silu(w1 x), w3 x and their product (4F); the attention
  method's own saved tensors (``Method.memory``: q, k, v, O, lse for the ring
  family; the kernels' O and lse and q, k, v for one device):
  ``none`` L blocks of that; ``full`` L block inputs (H) plus one block's
  activations during its recompute; ``seq`` adds O (e) and lse (fp32) of half
  the local tokens per block; ``whole`` of all of them.
* **logits** by loss mode: ``unfused`` the (T, V) logits, their log-softmax
  (fp32) and, in the backward, two (T, V) gradients (3 T V fp32 live at the
  loss's backward for fp32; the input-dtype logits plus 2 fp32 for bf16);
  ``fused`` (a training step takes its gradients-in-the-forward path) one
  (rows, V) fp32 tile, the fp32 d hidden (T, H) and the fp32 d W (V, H), all
  live at the end of the loss's forward; d W is the head's gradient itself
  for fp32 weights (counted there), a second copy for bf16, and on CPU the
  fp32 copies of bf16 x and W too; ``fused_recompute`` one (chunk_tokens,
  chunk_vocab) fp32 tile plus its fp32 d hidden (T, H) accumulator;
  ``liger`` a (chunk, V) tile; ``cce`` nothing off-chip.
* **backward temporaries** of one block, at its largest moment (the SwiGLU
  product's backward): the incoming gradient (H), d(product) and the two
  factors' gradients (3F) are live while the product itself (F) has been
  released with the w2 node: a net 2F + H per token above its activations.

The step's peak is the largest of three moments: the start of the backward
(all kept activations, the loss's backward buffers, the head's gradient), the
backward of block 0 under a checkpoint mode (every block's gradients, block
0's recomputed activations, the cached attention outputs of block 0), and,
with replicated weights at G > 1, the gradient all-reduce
(``parallel.sync_grads``): every gradient, plus each flat bucket twice, its
gradients concatenated and the copy the all-reduce runs on (2 x the largest
bucket). At G > 1 the attention is the registry method's layer
(``Method.layer_memory``: Ulysses' output projection keeps the
output all-to-all's result besides the head-sharded O), and ``seq``/``whole``
count as ``full`` for methods that cannot cache (O, lse)
(``checkpoint.effective_mode``: all but the BurstAttention operator's).

Checked against measurement (tests/test_step_memory.py, the CPU peak of
``experiments/harness/memory.py``, within 15% for every checkpoint mode): one
process; and every rank of G = 2 and 3 for ``burst`` and ``ulysses`` (zigzag,
fused loss), where the measured peak is the all-reduce moment (3 P e to the
byte for one bucket) or the start of the backward, as modelled; so is the
CPU ablation mirror's peak at G = 4 (measured: docs/findings.md, training memory).

Not counted: the CUDA context, allocator fragmentation, the tokens and labels
(int64, B N each), and communication buffers that were not at the peak of
the tested shapes: the rings' blocks in flight and their fp32 gradient
accumulators (live during a block's attention backward, after its MLP has
freed 3H + 4F per token: below the SwiGLU backward's moment at F = 2.7 H in
fp32, not at F = H/3 (measured: docs/findings.md, training memory); bf16 with
fp32 accumulators narrows the margin too), the
all-to-all buffers of Ulysses, the ring forward's fp32 running output; and
gloo's or NCCL's own staging, which is allocated outside torch's allocator
(neither measured by the profiler nor by ``max_memory_allocated``). Not
checked against measurement: FSDP2 (``gathered``), ``weights="tp"``, bf16, and the optimizer
step's temporaries (not modelled; the mirror's step includes them, and its
peak is still the all-reduce moment).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from burst_impl import volume
from burst_impl.loss import DEFAULT_TILES, grad_rows
from burst_impl.loss_tiles import balanced_rows
from burst_impl.method import Method

from .checkpoint import check_mode, method_mode
from .config import ModelConfig, layer_params, num_params, param_numels
from .parallel import bucket_sizes
from .sequence_parallel import attn_shape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
WEIGHTS = ("replicated", "fsdp2", "tp")


@dataclass(frozen=True)
class StepMemory:
    weights: int
    optimizer: int
    grads: int
    activations: int        # kept for the backward at its start (by checkpoint mode)
    recompute: int          # one block's activations rebuilt in the backward (checkpoint modes)
    cache: int              # seq/whole: cached attention outputs (included in activations)
    logits: int             # the loss's buffers at its backward (by loss mode)
    attention: int          # the method's saved tensors of one layer (included in activations)
    block_temp: int         # one block's backward temporaries
    gathered: int           # FSDP2: one block's gathered weights and gradients
    grad_sync: int          # G > 1, replicated: the gradient all-reduce's two copies of its largest bucket
    resident_bytes: int     # weights + optimizer
    step_peak_bytes: int    # the step's peak above ``resident_bytes``
    total_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


def _elem(dtype: str | torch.dtype) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def logits_bytes(cfg: ModelConfig, tokens: int, e: int, loss: str, chunks: tuple[int, int] | None = None,
                 device: str = "cpu") -> int:
    """The loss's live buffers at the end of its forward / start of its backward, besides the head's
    gradient (see the module docstring). ``chunks``: the (chunk_tokens, chunk_vocab) the loss is
    called with (None: ``burst_impl.loss``'s defaults for ``device``, "cpu" or "cuda")."""
    V, H = cfg.vocab_size, cfg.hidden
    if loss == "unfused":
        return tokens * V * (e + 2 * 4) if e != 4 else 3 * tokens * V * 4
    if loss == "fused":
        c = 8 if e == 8 else 4                                   # the compute dtype: fp32, fp64 for fp64
        # rows: chunk_tokens as given, else the device's default evened out (as the loss chooses them)
        rows = min(chunks[0], max(tokens, 1)) if chunks else balanced_rows(tokens, grad_rows(device, V))
        upcast = (tokens + V) * H * 4 if e < 4 and device == "cpu" else 0
        return rows * V * c + tokens * H * c + (V * H * c if e != c else 0) + upcast
    if loss == "fused_recompute":
        ct, cv = chunks or DEFAULT_TILES.get(device, DEFAULT_TILES["cpu"])
        return min(ct, max(tokens, 1)) * min(cv, V) * 4 + tokens * H * 4
    if loss == "liger":
        return min(tokens, 2048) * V * 4    # its token chunk against the whole vocabulary (a model)
    if loss == "cce":
        return 0
    raise ValueError(f"loss={loss!r} is unknown; choose unfused, fused, fused_recompute, liger or cce")


def _check_args(batch: int, seqlen: int, world_size: int, weights: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r} must be one of {WEIGHTS}")
    for name, v in (("batch", batch), ("seqlen", seqlen), ("world_size", world_size)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive int")
    if seqlen % world_size:
        raise ValueError(f"seqlen={seqlen} must be divisible by world_size={world_size}")


def _attention_bytes(method: Method | None, shape, tokens: int, hidden: int, e: int) -> int:
    """The attention's kept bytes per block and rank (counted in ``per_block``)."""
    if method is None:
        # One device: the kernels keep q, k, v, O (e) and lse (fp32), as the ring family does.
        return volume.saved_bytes(shape)
    # Sequence parallel: the attention layer's kept bytes (the method's saved tensors, plus the output
    # all-to-all's result that Ulysses' output projection keeps at G > 1), less its input x: the norm's
    # 3H count it. Tensor parallel: the method's own model of its layer.
    if shape.world_size > 1 and method.level == "op":
        return method.layer_memory(shape) - tokens * hidden * e
    return int(method.memory(shape))


@dataclass(frozen=True)
class _Parts:
    """One block's and the head's pieces of a step (bytes per rank), for ``_peak``."""

    per_block: int        # a block's kept activations without checkpointing
    inputs_block: int     # a checkpointed block's input
    cache_block: int      # seq/whole: its cached O and lse
    head_act: int
    head_grad: int
    logits: int
    block_temp: int
    block_grads: int
    gathered: int


def _peak(p: _Parts, layers: int, checkpoint: str) -> tuple[int, int, int]:
    """(activations, recompute, peak over the step's three moments without the gradient sync)."""
    if checkpoint == "none":
        activations, recompute = layers * p.per_block, 0
    else:
        activations, recompute = layers * (p.inputs_block + p.cache_block), p.per_block
    # Moment 1: the loss's backward, every block's kept activations live.
    start = activations + p.head_act + p.logits + p.head_grad + p.gathered
    # Moment 2: block 0's backward: every block's gradients, block 0's activations (recomputed under
    # a checkpoint mode, whose cache it consumes), the block's temporaries.
    block0 = (layers * p.block_grads + p.head_grad
              + (p.per_block if checkpoint == "none" else p.inputs_block + recompute)
              + p.block_temp + p.gathered)
    # With no checkpointing the first moment's activations are all still live while block L-1 runs.
    kept = activations if checkpoint == "none" else activations - p.cache_block + recompute
    block_last = kept + p.head_grad + p.block_grads + p.block_temp + p.gathered
    return activations, recompute, max(start, block0, block_last)


def step_memory(cfg: ModelConfig, *, batch: int, seqlen: int, world_size: int = 1, method: Method | None = None,
                layout: str = "zigzag", dtype: str = "float32", weights: str = "replicated",
                checkpoint: str | None = None, loss: str | None = None,
                loss_chunks: tuple[int, int] | None = None, loss_device: str = "cpu",
                optimizer: bool = True) -> StepMemory:
    """Bytes per rank of one training step of ``cfg`` (its ``checkpoint`` and ``loss`` unless given).
    ``method``: the attention method (a ``burst_impl.method.Method``; None: one device, the fused
    kernels). ``loss_chunks``, ``loss_device``: the fused loss's tiles (``logits_bytes``)."""
    checkpoint = check_mode(cfg.checkpoint if checkpoint is None else checkpoint)
    loss = cfg.loss if loss is None else loss
    _check_args(batch, seqlen, world_size, weights)
    e, G = _elem(dtype), world_size
    T = batch * seqlen // G
    H, F = cfg.hidden, cfg.ffn_hidden
    shard = G if weights in ("fsdp2", "tp") else 1
    w = -(-num_params(cfg) // shard) * e
    opt = 2 * w if optimizer else 0
    gathered = 2 * layer_params(cfg) * e if weights == "fsdp2" and G > 1 else 0

    shape = attn_shape(cfg, batch, seqlen, G, layout, dtype=str(dtype).removeprefix("torch."))
    # seq/whole cache (O, lse) through the BurstAttention operator's backward only; blocks of other
    # methods (Ulysses, USP, ...) are checkpointed as full (checkpoint.effective_mode).
    checkpoint = method_mode(method, checkpoint) if method is not None else checkpoint
    attn = _attention_bytes(method, shape, T, H, e)
    cached_rows = {"seq": T - T // 2, "whole": T}.get(checkpoint, 0)
    # the final norm's saved tensors: its input and normalised x, and the weighted output, which the loss
    # keeps for its backward; the fused loss's training path does not keep it, but it is live until the end
    # of the loss's forward, the moment the fused loss's buffers peak (measured: docs/findings.md)
    parts = _Parts(per_block=T * (6 * H + 4 * F) * e + attn, inputs_block=T * H * e,
                   cache_block=cached_rows * (cfg.n_heads * cfg.head_dim * e + 4 * cfg.n_heads),
                   head_act=3 * T * H * e, head_grad=cfg.vocab_size * H * e,
                   logits=logits_bytes(cfg, T, e, loss, loss_chunks, loss_device),
                   block_temp=T * (2 * F + H) * e, block_grads=layer_params(cfg) * e // shard, gathered=gathered)
    if weights == "tp":   # Megatron tensor parallelism: other token counts and widths per rank
        parts = _tensor_parallel(cfg, batch, seqlen, G, e, method, attn, loss, loss_chunks, loss_device, parts)
    activations, recompute, peak = _peak(parts, cfg.n_layers, checkpoint)
    # Moment 3 (replicated weights, G > 1): the gradient all-reduce (parallel.sync_grads), every gradient
    # live. Each bucket is held twice: its gradients concatenated (torch.cat) and the copy the all-reduce
    # runs on (collectives.all_reduce_ clones its input and returns the copy): 2 x the largest bucket
    # (parallel.bucket_sizes: at most BUCKET_BYTES, or one larger gradient).
    bucket = max(bucket_sizes([n * e for n in param_numels(cfg)])) if weights == "replicated" and G > 1 else 0
    peak = max(peak, w + 2 * bucket)
    return StepMemory(weights=w, optimizer=opt, grads=w, activations=activations, recompute=recompute,
                      cache=cfg.n_layers * parts.cache_block, logits=parts.logits, attention=attn,
                      block_temp=parts.block_temp, gathered=gathered, grad_sync=2 * bucket, resident_bytes=w + opt,
                      step_peak_bytes=peak, total_bytes=w + opt + peak)


def _tensor_parallel(cfg: ModelConfig, batch: int, seqlen: int, G: int, e: int, method: Method | None, attn: int,
                     loss: str, loss_chunks, loss_device: str, parts: _Parts) -> _Parts:
    """``weights="tp"``: ``parts`` with the per-block, input, cache, head and logits bytes per rank under
    Megatron tensor parallelism over G ranks (``method`` tp_v1 or tp_v3).

    A rank holds the hidden states of all N tokens (V1) or of its N/G shard (V3: ``layer_input``
    "sequence"), 1/G of the heads and of the FFN columns, and (as Megatron, and as the performance
    model's LM head) 1/G of the vocabulary. Per block: the two RMSNorms' 6H per held token; the
    SwiGLU's 4 F/G per token over all N tokens (the MLP runs on the gathered sequence); the attention
    part is the registry's TP memory model (``tp_memory_bytes``: input, this rank's q, k, v, O, lse
    over N). V3 keeps what the paper's TP-V3 keeps: each column-parallel linear (QKV, w1/w3) saves its
    local (B, N/G, H) input, which is the norm's output counted above, and all-gathers it again in
    the backward for its weight gradient (BMTrain ``OpParallelLinear``, docs/memory.md "TP-V3"
    row), so no gathered (B, N, H) is kept per block; one is live as a backward temporary. The
    suite's own ``tp_v3`` operator keeps the gathered input (what ``tp_memory_bytes`` and
    tests/test_memory_reconcile.py measure): this step model is the paper's TP-V3, not that operator,
    and the backward's re-gather is not timed (docs/findings.md, 2026-12-02). Approximate: the V1
    norm output that the registry also counts as the attention input is
    counted twice (B N H e per block); the head's gathered input under V3 and the vocabulary-parallel
    loss's cross-rank max/sum buffers are not counted; our model-level ``tensor_parallel`` replicates
    the embedding and LM head (not Megatron's split), which this does not follow. ``seq``/``whole``
    cache nothing: TP attention is recomputed through its own autograd (``checkpoint.effective_mode``),
    so they are ``full`` here.
    """
    if method is None or method.level != "layer":
        name = None if method is None else method.name
        raise ValueError(f"weights='tp' needs a tensor-parallel attention method (tp_v1, tp_v3), got method={name!r}")
    H, F, V = cfg.hidden, cfg.ffn_hidden // G, -(-cfg.vocab_size // G)
    n = batch * seqlen                                                     # tokens the MLP and head run on
    held = n if method.layer_input == "replicated" else n // G             # tokens whose (B, ., H) a rank holds
    # V3: the gathered input is re-gathered in the backward, not kept (docstring; BMTrain
    # bmtrain/nn/parallel_linear_func.py OpParallelLinear.forward saves the local input, line 189, and
    # backward gathers it again, lines 225-228): out of the attention's kept bytes, one in the temporaries
    regather = n * H * e if held != n else 0
    per_block = (held * 6 * H + n * 4 * F) * e + attn - regather
    logits = logits_bytes(replace(cfg, vocab_size=V), n, e, loss, loss_chunks, loss_device)
    return replace(parts, per_block=per_block, inputs_block=held * H * e, cache_block=0, head_act=3 * held * H * e,
                   head_grad=V * H * e, logits=logits, block_temp=n * (2 * F + H) * e + regather)

