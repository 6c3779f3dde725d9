"""Training data without downloads: a seeded synthetic corpus, or text CPython ships, tokenised here.

* ``"markov"``: a token stream from a seeded first-order Markov chain over the
  vocabulary, each token followed by one of ``branching`` successors (random
  probabilities). Learnable (the loss falls from about log V towards the
  chain's entropy, <= log(branching)) and identical on every machine for a
  seed. Any vocabulary size.
* ``"pydoc"``: the English help texts in ``pydoc_data.topics`` (part of the
  Python standard library, ~0.5 MB), byte-level tokens (ids 0..255; the
  model's vocabulary must be at least 256).

``batch_at(corpus, step, batch, seqlen, seed)`` returns the global batch
(inputs, labels) (B, N), labels = inputs shifted by one token; every rank
draws the same batch for the same arguments and keeps its own tokens.
"""
from __future__ import annotations

import functools
from pydoc_data.topics import topics

import torch

Tensor = torch.Tensor
CORPORA = ("markov", "pydoc")


def markov_tokens(vocab_size: int, n_tokens: int, *, seed: int = 0, branching: int = 4) -> Tensor:
    """(n_tokens,) int64 from a seeded Markov chain with ``branching`` successors per token."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(vocab_size, (vocab_size, branching), generator=g).tolist()  # successors of each token
    probs = torch.rand(vocab_size, branching, generator=g, dtype=torch.float64).add_(0.1)
    cum = (probs.cumsum(1) / probs.sum(1, keepdim=True)).tolist()                  # (V, branching) CDFs
    draws = torch.rand(n_tokens, generator=g, dtype=torch.float64).tolist()
    out = [int(torch.randint(vocab_size, (1,), generator=g))]
    for u in draws[1:]:         # plain Python: CPU corpora are ~1e5 tokens
        row = cum[out[-1]]
        j = next((i for i, c in enumerate(row) if u < c), branching - 1)
        out.append(succ[out[-1]][j])
    return torch.tensor(out, dtype=torch.int64)


@functools.lru_cache(maxsize=1)
def pydoc_tokens() -> Tensor:
    """The bytes of CPython's pydoc topic texts (sorted by topic) as int64 token ids."""
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)


def load_corpus(name: str, vocab_size: int, *, n_tokens: int = 1 << 16, seed: int = 0) -> Tensor:
    """The token stream of corpus ``name`` for a model with ``vocab_size`` tokens."""
    if name == "markov":
        return markov_tokens(vocab_size, n_tokens, seed=seed)
    if name == "pydoc":
        if vocab_size < 256:
            raise ValueError(f"vocab_size={vocab_size} must be at least 256 for corpus='pydoc' (byte tokens)")
        return pydoc_tokens()
    raise ValueError(f"corpus={name!r} is unknown; choose one of {CORPORA}")


def batch_at(corpus: Tensor, step: int, batch: int, seqlen: int, *, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Global batch ``step``: B random windows of N+1 tokens -> (inputs, labels), each (B, N)."""
    if seqlen + 1 > corpus.numel():
        raise ValueError(f"seqlen={seqlen} must be below the corpus length {corpus.numel()}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(corpus.numel() - seqlen, (batch,), generator=g)
    windows = torch.stack([corpus[s:s + seqlen + 1] for s in starts.tolist()])    # (B, N+1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
