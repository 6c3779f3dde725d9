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

The step's peak is the largest of its moments (``_moments``), each in a phase
(``PHASES``: forward, loss, backward): the end of the loss's forward and the
start of the backward (all kept activations, the loss's buffers, the head's
gradient), the backward of block 0 under a checkpoint mode (every block's
gradients, block 0's recomputed activations, the cached attention outputs of
block 0), the first backward block's SwiGLU moment, and, with replicated
weights at G > 1, the gradient all-reduce (``parallel.sync_grads``): every
gradient, plus each flat bucket twice, its gradients concatenated and the copy
the all-reduce runs on (2 x the largest bucket). Given an attention's transient
buffers (``AttentionTerms``: the performance model passes its schedules' or a
peer implementation's), three more: the last block's attention forward, the
first backward block's attention forward again (full: all of it; seq: the
first half), and its attention backward (its MLP half released, the MLP's
gradients made). ``phases`` keeps the moments of the phases a harness
measures. At G > 1 the attention is the registry method's layer
(``Method.layer_memory``: Ulysses' output projection keeps the
output all-to-all's result besides the head-sharded O), and ``seq``/``whole``
count as ``full`` for methods that cannot cache (O, lse)
(``checkpoint.effective_mode``: all but the BurstAttention operator's).

Checked against measurement (tests/test_step_memory.py, the CPU peak of
``experiments/harness/memory.py``, within 15% for every checkpoint mode): one
process; and every rank of G = 2 and 3 for ``burst`` and ``ulysses`` (zigzag,
fused loss), where the measured peak is the all-reduce moment (3 P e to the
byte for one bucket) or the start of the backward, as modelled; so is the
CPU ablation mirror's peak at G = 4 (measured: docs/findings.md, training memory);
and, with a narrow MLP (F = H/3), the attention backward's moment with the ring
schedule's buffers, where the measured peak is (without them the model is below it).

Not counted: the CUDA context, NCCL's buffers and allocator fragmentation (the
performance model's usable memory subtracts the first two,
experiments/perfmodel/usable_memory.py), the tokens and labels (int64, B N
each), and, without ``AttentionTerms``, the attention's communication buffers
(the rings' blocks in flight, their gradient accumulators, Ulysses' all-to-all
buffers, the ring forward's fp32 running output); gloo's or NCCL's own staging
is allocated outside torch's allocator (neither measured by the profiler nor by
``max_memory_allocated``). Not checked against measurement: FSDP2
(``gathered``), ``weights="tp"``, bf16, ``resident``/``loss_bytes`` (a peer's,
from its source), and the optimizer step's temporaries (not modelled; the
mirror's step includes them, and its peak is still the all-reduce moment).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

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
# The step's phases as a training harness marks them: the model's forward, the loss (its forward), the
# backward (loss backward included); the optimizer step is not modelled. ``step_memory(phases=...)`` takes
# the peak over the moments of the phases a harness measures (the suite's: all; the BurstEngine authors'
# harness: forward and backward, docs/memory.md "What the papers' memory columns measure").
PHASES = ("forward", "loss", "backward")


@dataclass(frozen=True)
class AttentionTerms:
    """One layer's attention per rank as an implementation holds it (bytes), for ``step_memory``: what it
    keeps for the backward besides the layer input x (q, k, v, O, lse and any copies), and the largest
    transient set of its forward and of its backward (blocks in flight, accumulators, kernel buffers).
    ``kept`` None: the registry method's own kept bytes (the suite's implementation, whose transient
    buffers the performance model's schedules declare, experiments/perfmodel/model_level.py). None in
    ``step_memory``: the registry method's kept bytes and no transient term (the CPU tests' model)."""

    kept: int | None = None
    forward: int = 0
    backward: int = 0


@dataclass(frozen=True)
class Resident:
    """Model state per rank on the device where an implementation keeps it otherwise than ``weights``
    says (bytes): parameters, gradients, optimizer state, and what one block gathers while it runs."""

    weights: int
    grads: int
    optimizer: int
    gathered: int


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
    moments: dict = field(default_factory=dict)   # {moment: bytes above resident} of the measured phases
    peak_moment: str = ""

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
    """One block's and the head's pieces of a step (bytes per rank), for ``_moments``."""

    per_block: int        # a block's kept activations without checkpointing
    inputs_block: int     # a checkpointed block's input
    cache_block: int      # seq/whole: its cached O and lse
    head_act: int
    head_grad: int
    logits: int           # the loss's buffers at the end of its forward
    block_temp: int
    block_grads: int
    gathered: int
    logits_backward: int = -1    # the loss's buffers at the start of its backward (-1: as ``logits``)
    attn_kept: int = 0           # the attention's kept bytes (in ``per_block``)
    attn_forward: int = 0        # AttentionTerms.forward / backward (0: not counted)
    attn_backward: int = 0
    mlp_block: int = 0           # the MLP half's kept activations (second norm 3H, SwiGLU 4F), in ``per_block``
    mlp_grads: int = 0           # the MLP half's weight gradients (in ``block_grads``): all a block's gradients
                                 # that exist when its attention's backward runs
    norm_block: int = 0          # the attention half's norm (3H), in ``per_block``
    token_grad: int = 0          # one (T, H) gradient: the incoming dX of a block's half


# seq re-runs the attention forward at N/2 (checkpoint.py): its forward transients at half the rows
RECOMPUTED = {"full": 1.0, "seq": 0.5}


def _moments(p: _Parts, layers: int, checkpoint: str) -> tuple[int, int, dict]:
    """(activations, recompute, {moment: (phase, bytes above the resident state)}) of a step.

    * ``loss_forward`` (loss): every block's kept activations, the head's, the loss's forward buffers;
    * ``backward_start`` (backward): the same with the loss's backward buffers;
    * ``block0`` (backward): every block's gradients, block 0's activations (recomputed under a
      checkpoint mode, whose cache it consumes), the SwiGLU backward's temporaries;
    * ``block_last`` (backward): the first block of the backward at its SwiGLU moment;
    * with ``AttentionTerms`` (``attn_forward``/``attn_backward`` set): ``attention_forward`` (forward):
      the last block's attention at its forward peak, the blocks before it kept; ``recompute_forward``
      (backward, full/seq): the first backward block re-running its attention forward; and
      ``attention_backward`` (backward): that block's attention backward, its MLP half released.
      The attention part live at a forward moment is its norm and its kept bytes (an upper bound: O's
      copies are not there yet)."""
    if checkpoint == "none":
        activations, recompute = layers * p.per_block, 0
        before = (layers - 1) * p.per_block                     # blocks kept before the last one
        kept = activations                                      # live while the last block's backward runs
    else:
        activations, recompute = layers * (p.inputs_block + p.cache_block), p.per_block
        before = (layers - 1) * (p.inputs_block + p.cache_block)
        kept = activations - p.cache_block + recompute
    lb = p.logits if p.logits_backward < 0 else p.logits_backward
    grads = p.head_grad + p.block_grads + p.gathered
    m = {"loss_forward": ("loss", activations + p.head_act + p.logits + p.head_grad + p.gathered),
         "backward_start": ("backward", activations + p.head_act + lb + p.head_grad + p.gathered),
         "block0": ("backward", layers * p.block_grads + p.head_grad + p.block_temp + p.gathered
                    + (p.per_block if checkpoint == "none" else p.inputs_block + recompute)),
         "block_last": ("backward", kept + grads + p.block_temp)}
    if p.attn_forward or p.attn_backward:
        live_attn = p.norm_block + p.attn_kept
        m["attention_forward"] = ("forward", before + p.inputs_block + live_attn + p.attn_forward + p.gathered)
        if checkpoint in RECOMPUTED:
            m["recompute_forward"] = ("backward", activations - p.cache_block + live_attn
                                      + int(RECOMPUTED[checkpoint] * p.attn_forward) + grads)
        m["attention_backward"] = ("backward", kept - p.mlp_block + p.token_grad + p.attn_backward
                                   + p.head_grad + p.mlp_grads + p.gathered)
    return activations, recompute, m


def step_memory(cfg: ModelConfig, *, batch: int, seqlen: int, world_size: int = 1, method: Method | None = None,
                layout: str = "zigzag", dtype: str = "float32", weights: str = "replicated",
                checkpoint: str | None = None, loss: str | None = None,
                loss_chunks: tuple[int, int] | None = None, loss_device: str = "cpu",
                optimizer: bool = True, attention: AttentionTerms | None = None, resident: Resident | None = None,
                loss_bytes: tuple[int, int] | None = None, phases: tuple[str, ...] = PHASES) -> StepMemory:
    """Bytes per rank of one training step of ``cfg`` (its ``checkpoint`` and ``loss`` unless given).
    ``method``: the attention method (a ``burst_impl.method.Method``; None: one device, the fused
    kernels). ``loss_chunks``, ``loss_device``: the fused loss's tiles (``logits_bytes``).

    An implementation other than the suite's (experiments/perfmodel/peer_memory.py) passes what it
    holds differently: ``attention`` (its kept and transient attention bytes), ``resident`` (its
    parameters, gradients, optimizer state and gathered block on the device), ``loss_bytes`` (its
    loss's buffers at the end of the loss's forward and at the start of its backward), and ``phases``,
    those its harness measures (``PHASES``): the peak is over the moments of those phases."""
    checkpoint = check_mode(cfg.checkpoint if checkpoint is None else checkpoint)
    loss = cfg.loss if loss is None else loss
    _check_args(batch, seqlen, world_size, weights)
    if not phases or set(phases) - set(PHASES):
        raise ValueError(f"phases={phases!r} must be a non-empty subset of {PHASES}")
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
    attn = _attention_bytes(method, shape, T, H, e) if attention is None or attention.kept is None else attention.kept
    cached_rows = {"seq": T - T // 2, "whole": T}.get(checkpoint, 0)
    logits = logits_bytes(cfg, T, e, loss, loss_chunks, loss_device)
    # the final norm's saved tensors: its input and normalised x, and the weighted output, which the loss
    # keeps for its backward; the fused loss's training path does not keep it, but it is live until the end
    # of the loss's forward, the moment the fused loss's buffers peak (measured: docs/findings.md)
    parts = _Parts(per_block=T * (6 * H + 4 * F) * e + attn, inputs_block=T * H * e,
                   cache_block=cached_rows * (cfg.n_heads * cfg.head_dim * e + 4 * cfg.n_heads),
                   head_act=3 * T * H * e, head_grad=cfg.vocab_size * H * e,
                   logits=logits if loss_bytes is None else loss_bytes[0],
                   logits_backward=-1 if loss_bytes is None else loss_bytes[1],
                   block_temp=T * (2 * F + H) * e, block_grads=layer_params(cfg) * e // shard, gathered=gathered,
                   attn_kept=attn, attn_forward=attention.forward if attention else 0,
                   attn_backward=attention.backward if attention else 0,
                   mlp_block=T * (3 * H + 4 * F) * e, norm_block=3 * T * H * e, token_grad=T * H * e,
                   mlp_grads=(3 * H * F + H) * e // shard)
    if weights == "tp":   # Megatron tensor parallelism: other token counts and widths per rank
        parts = _tensor_parallel(cfg, batch, seqlen, G, e, method, attn, loss, loss_chunks, loss_device, parts)
    grads, held = w, 0           # the suite's gradients appear during the backward (block_grads, head_grad)
    if resident is not None:     # an implementation's: allocated before the step, like its weights
        w, opt, grads, held = resident.weights, resident.optimizer, resident.grads, resident.grads
        parts = replace(parts, gathered=resident.gathered, block_grads=0, head_grad=0, mlp_grads=0)
    activations, recompute, moments = _moments(parts, cfg.n_layers, checkpoint)
    # Moment 3 (replicated weights, G > 1): the gradient all-reduce (parallel.sync_grads), every gradient
    # live. Each bucket is held twice: its gradients concatenated (torch.cat) and the copy the all-reduce
    # runs on (collectives.all_reduce_ clones its input and returns the copy): 2 x the largest bucket
    # (parallel.bucket_sizes: at most BUCKET_BYTES, or one larger gradient).
    bucket = max(bucket_sizes([n * e for n in param_numels(cfg)])) if weights == "replicated" and G > 1 else 0
    if bucket and resident is None:
        moments["grad_sync"] = ("backward", w + 2 * bucket)
    measured = {k: b for k, (ph, b) in moments.items() if ph in phases}
    peak_moment = max(measured, key=measured.get)
    peak = measured[peak_moment]
    return StepMemory(weights=w, optimizer=opt, grads=grads, activations=activations, recompute=recompute,
                      cache=cfg.n_layers * parts.cache_block, logits=parts.logits, attention=attn,
                      block_temp=parts.block_temp, gathered=parts.gathered, grad_sync=2 * bucket,
                      resident_bytes=w + opt + held, step_peak_bytes=peak, total_bytes=w + opt + held + peak,
                      moments=measured, peak_moment=peak_moment)


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
                   head_grad=V * H * e, logits=logits, block_temp=n * (2 * F + H) * e + regather, attn_kept=attn,
                   mlp_block=(held * 3 * H + n * 4 * F) * e, norm_block=held * 3 * H * e, token_grad=held * H * e)

