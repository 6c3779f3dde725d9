"""Generation with the suite's LLaMA model on a KV cache sharded across a context-parallel group
(docs/inference.md, "Generation").

    out = generate(model, prompt, 64, seed=0, temperature=0.8, group=g)   # sampled; temperature=0: greedy
    out.tokens   # (B, 64) new tokens, the same on every rank
    out.logits   # (B, 64, V) the logits each token was drawn from, the same bits on every rank

The model is replicated: every rank holds every weight. The hook is the attention block's
swappable ``core`` (``burst_impl.model.layers``): for the duration of the call each layer's core
is bound to its layer of a ``ShardedKVCache``, so the model's own projections and RoPE run as
usual and the keys enter the cache already rotated at their global positions. The prompt's first
N-1 tokens are prefilled pass-KV (each rank its layout shard); the last prompt token and every
new token then go through ``decode`` with the all-gather merge, whose output is the same bits on
every rank, so the logits are too. (A prompt too short for the layout's chunks is decoded whole,
as one multi-token decode step.) Each token is drawn once, on rank 0 of the group, from a
generator seeded with ``seed``, and broadcast, so the ranks cannot drift apart.

The model's mask (``ModelConfig.mask``, always intersected with causal) reaches the cache's
attention when it is a sliding window (``window:L:R``: a query at position p attends keys p-L .. p,
the ``window=`` of ``prefill`` and ``decode``); any other mask (documents, block-sparse) is refused.

Bad input (a prompt and new tokens past ``max_len``, an empty prompt, a mask generation does not
support, ranks that disagree on the seed, the prompt or the settings) is a ValueError on every rank
before any byte.
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm, layout as layouts
from ..model.config import ModelConfig
from ..model.layers import Attention
from ..model.model import Transformer
from .agree import agree
from .decode import decode
from .kv_cache import ShardedKVCache, check_placement
from .prefill import prefill

Tensor = torch.Tensor


@dataclass(frozen=True)
class Generation:
    """``tokens`` (B, n) int64 and the ``logits`` (B, n, V) each was drawn from; ``cache``: this rank's shards."""

    tokens: Tensor
    logits: Tensor
    cache: ShardedKVCache


def sample(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """One token per row of ``logits`` (B, V): the argmax at temperature 0, else one uniform draw
    per row through the inverse CDF of softmax(logits / temperature), computed in fp64 (so a
    single-process run and a sharded one draw the same token from logits equal to 1e-12)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    u = torch.rand(logits.shape[0], 1, generator=generator, dtype=torch.float64, device=logits.device)
    return torch.searchsorted(probs.cumsum(-1), u).squeeze(-1).clamp(max=logits.shape[-1] - 1)


def _check(model, prompt, max_new_tokens, temperature, max_len, placement, seed) -> None:
    if not isinstance(model, Transformer):
        raise ValueError(f"model={type(model).__name__} must be a burst_impl.model Transformer")
    if not isinstance(prompt, Tensor) or prompt.dim() != 2 or prompt.dtype != torch.int64 or prompt.shape[1] < 1:
        raise ValueError(f"prompt={getattr(prompt, 'shape', type(prompt).__name__)} must be an int64 tensor "
                         "(batch, prompt tokens) with at least one token")
    vocab = model.cfg.vocab_size
    if prompt.numel() and not 0 <= int(prompt.min()) <= int(prompt.max()) < vocab:
        raise ValueError(f"prompt holds token ids outside [0, vocab_size={vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature={temperature!r} must be a number >= 0 (0: greedy)")
    total = prompt.shape[1] + max_new_tokens
    if max_len is not None and total > max_len:
        raise ValueError(f"prompt length {prompt.shape[1]} + max_new_tokens={max_new_tokens} = {total} exceeds "
                         f"max_len={max_len}, the tokens per sequence the cache may hold")
    check_placement(placement)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an int >= 0")
    window_of(model.cfg)


def window_of(cfg: ModelConfig) -> int | None:
    """The sliding window L of the model's mask (keys p-L .. p), None for plain causal attention; a
    ValueError naming the mask for any other (the spec itself was checked when the config was made)."""
    kind, *args = cfg.mask.split(":") if cfg.mask else ("causal",)
    if kind in ("causal", "full"):        # intersected with causal: plain causal
        return None
    if kind == "window" and args[0].isdigit():
        return int(args[0])               # causal cuts the right side: keys p-L .. p
    raise ValueError(f"mask={cfg.mask!r} (model {cfg.name!r}): generation on the sharded cache supports a "
                     "causal sliding window ('window:L:R') or no mask, not this one")


def fingerprint(prompt) -> str:
    """The prompt's bytes hashed, so the agreement compares every token without sending them."""
    if not isinstance(prompt, Tensor):
        return repr(type(prompt))
    return hashlib.blake2b(prompt.detach().cpu().contiguous().numpy().tobytes(), digest_size=16).hexdigest()


@dataclass
class _Step:
    """What the bound cores do in the current forward: prefill a layout shard, or decode at ``positions``, with
    the sliding window ``window`` (None: causal)."""

    mode: str = "prefill"
    positions: Tensor | None = None
    window: int | None = None


@dataclass
class _CachedCore:
    """One layer's core: (q, k, v) of the forward's tokens -> their attention output, through the cache."""

    cache: ShardedKVCache
    layer: int
    step: _Step
    layout: str
    group: object

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.step.mode == "prefill":
            out, _ = prefill(q, k, v, self.cache, self.layer, layout=self.layout, window=self.step.window,
                             group=self.group)
        else:
            out, _ = decode(q, k, v, self.cache, self.layer, merge="all_gather", positions=self.step.positions,
                            window=self.step.window, group=self.group)
        return out


@contextlib.contextmanager
def _bound_cores(model, cache: ShardedKVCache, step: _Step, layout: str, group):
    """Every attention block's core bound to its layer of ``cache``; the original cores restored after."""
    blocks = [m for m in model.modules() if isinstance(m, Attention)]    # layer order, through any wrapper
    cache.check_layers(len(blocks))
    saved = [b.core for b in blocks]
    try:
        for i, b in enumerate(blocks):
            b.core = _CachedCore(cache, i, step, layout, group)
        yield
    finally:
        for b, core in zip(blocks, saved):
            b.core = core


def _prefill_len(n_prompt: int, layout: str, size: int) -> int:
    """Prompt tokens to prefill pass-KV: all but the last (decoded next, to give replicated logits), or none
    where they are too few for the layout's chunks."""
    try:
        layouts.check_seqlen(n_prompt - 1, layout, size)
    except ValueError:
        return 0
    return n_prompt - 1


def agreed_token(logits: Tensor, temperature: float, generator, group) -> Tensor:
    """Rank 0's draw, broadcast to the group (counted as rank 0 sending it to each other rank)."""
    rank, size = comm.world(group)
    token = sample(logits, temperature, generator) if rank == 0 else torch.empty(
        logits.shape[0], dtype=torch.int64, device=logits.device)
    if size > 1:
        dist.broadcast(token, src=comm.global_rank(group, 0), group=group)
        if rank == 0:
            comm.record("forward", "token", comm.nbytes(token) * (size - 1))
    return token


@torch.no_grad()
def generate(model, prompt: Tensor, max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
             max_len: int | None = None, layout: str = "zigzag", placement: str = "round_robin",
             group=None) -> Generation:
    """``max_new_tokens`` tokens after ``prompt`` (B, N) int64, the same on every rank of ``group``.

    temperature 0: greedy; else sampled with a generator seeded by ``seed`` (rank 0 draws). The
    cache holds at most ``max_len`` tokens per sequence (None: N + max_new_tokens); ``layout``: the
    prefill's shard layout; ``placement``: where new tokens go (``ShardedKVCache``)."""
    agree(group, lambda: _check(model, prompt, max_new_tokens, temperature, max_len, placement, seed),
          dict(op="generate", mask=getattr(getattr(model, "cfg", None), "mask", None), seed=seed,
               temperature=temperature, max_new_tokens=max_new_tokens, max_len=max_len,
               layout=str(layout), placement=placement, prompt=fingerprint(prompt),
               shape=tuple(getattr(prompt, "shape", ()))))
    rank, size = comm.world(group)
    cfg, weight, window = model.cfg, model.output.weight, window_of(model.cfg)
    batch, n_prompt = prompt.shape
    cache = ShardedKVCache.empty(cfg.n_layers, batch, cfg.n_kv_heads, cfg.head_dim, dtype=weight.dtype,
                                 device=weight.device, placement=placement, group=group)
    generator = torch.Generator(device=weight.device).manual_seed(seed) if temperature and rank == 0 else None
    step, tokens, logits = _Step(), [], []
    with _bound_cores(model, cache, step, layout, group):
        n_pre = _prefill_len(n_prompt, layout, size)
        # a window as wide as the prefilled prompt is plain causal there (masks.SlidingWindow takes at most N-1)
        step.window = window if window is not None and window < n_pre else None
        if n_pre:
            pos = layouts.positions(layout, rank, size, n_pre).to(prompt.device)
            model(prompt[:, pos], pos)
        feed = prompt[:, n_pre:]
        step.mode, step.window = "decode", window
        for _ in range(max_new_tokens):
            start = cache.lengths(0)[0]
            pos = torch.arange(start, start + feed.shape[1], device=prompt.device)
            step.positions = pos.expand(batch, -1)
            last = model(feed, pos, logits_at=feed.shape[1] - 1)
            token = agreed_token(last, temperature, generator, group)
            tokens.append(token)
            logits.append(last)
            feed = token[:, None]
    return Generation(torch.stack(tokens, 1), torch.stack(logits, 1), cache)
