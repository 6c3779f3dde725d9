"""Generation on the sharded KV cache (burst_impl.inference.generate) against single-process generation.

The reference recomputes the whole sequence with the plain model at every step (no cache, the
model's own attention core), so a token cached at a wrong position, a lost token or a wrong merge
changes the logits. 64 new tokens, greedy and sampled, at W = 2, 3, 4 in fp64: the tokens must be
identical and the logits equal within 1e-12 relative on every rank. The tiny GQA config (2 layers,
hidden 64) keeps W = 4 affordable on two cores.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from burst_impl import comm
from tests.inference_refs import bad_input_log
from burst_impl.inference.generate import generate, sample
from burst_impl.model import build_model, get_config

CFG = "tiny_gqa"
NEW = 64
TOL = 1e-12
MODES = ((0.0, 0), (0.8, 7))        # (temperature, seed): greedy, then sampled


def _prompt(n: int = 11) -> torch.Tensor:
    """Two prompts of n tokens (11: uneven over every W), the same on every rank."""
    return torch.randint(0, get_config(CFG).vocab_size, (2, n), generator=torch.Generator().manual_seed(3))


@functools.lru_cache(maxsize=None)
def _model(mask: str = ""):
    return build_model(dataclasses.replace(get_config(CFG), mask=mask), seed=0, dtype=torch.float64)


@functools.lru_cache(maxsize=None)
def _reference(temperature: float, seed: int, n_prompt: int = 11):
    """Single-process generation: the full forward of the sequence so far, logits of its last token."""
    model, seq = _model(), _prompt(n_prompt)
    gen = torch.Generator().manual_seed(seed) if temperature else None
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(NEW):
            last = model(seq, torch.arange(seq.shape[1]), logits_at=seq.shape[1] - 1)
            token = sample(last, temperature, gen)
            tokens.append(token)
            logits.append(last)
            seq = torch.cat([seq, token[:, None]], 1)
    return torch.stack(tokens, 1), torch.stack(logits, 1)


def _sharded(placement: str, n_prompt: int = 11) -> list:
    return [generate(_model(), _prompt(n_prompt), NEW, temperature=t, seed=s, placement=placement)
            for t, s in MODES]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("world_size,placement", [(2, "round_robin"), (3, "shortest"), (4, "round_robin")])
def test_generation_matches_single_process(pools, world_size, placement):
    per_rank = pools.run(world_size, _sharded, placement, timeout=600)
    for (temperature, seed), outs in zip(MODES, zip(*per_rank)):
        want_tokens, want_logits = _reference(temperature, seed)
        for rank, out in enumerate(outs):
            assert torch.equal(out.tokens, want_tokens), (temperature, rank)
            assert _rel(out.logits, want_logits) <= TOL, (temperature, rank, _rel(out.logits, want_logits))
            assert out.cache.lengths(0) == [11 + NEW - 1] * 2    # the last token is drawn, not cached
        assert all(torch.equal(o.logits, outs[0].logits) for o in outs), "ranks' logits differ"
    sampled = per_rank[0][1].tokens
    assert not torch.equal(sampled, _reference(0.0, 0)[0]), "sampling drew the greedy tokens"


def test_short_prompt_is_decoded_whole(pools):
    """3 tokens: too few for zigzag's 2W chunks at W = 3, so the prompt goes through one multi-token decode."""
    outs = pools.run(3, _sharded, "round_robin", 3, timeout=600)
    for (temperature, seed), per in zip(MODES, zip(*outs)):
        want_tokens, want_logits = _reference(temperature, seed, 3)
        for out in per:
            assert torch.equal(out.tokens, want_tokens) and _rel(out.logits, want_logits) <= TOL


WINDOW, WINDOW_NEW = "window:5:0", 12     # keys p-5 .. p: narrower than the 11-token prompt


@functools.lru_cache(maxsize=None)
def _greedy(mask: str):
    """Single-process greedy generation of WINDOW_NEW tokens with the model masked by ``mask``."""
    model, seq, logits = _model(mask), _prompt(), []
    with torch.no_grad():
        for _ in range(WINDOW_NEW):
            logits.append(model(seq, torch.arange(seq.shape[1]), logits_at=seq.shape[1] - 1))
            seq = torch.cat([seq, logits[-1].argmax(-1)[:, None]], 1)
    return seq[:, -WINDOW_NEW:], torch.stack(logits, 1)


def _window_sharded():
    return generate(_model(WINDOW), _prompt(), WINDOW_NEW)


def test_a_sliding_window_model_generates_as_the_single_process_one(pools):
    """ModelConfig.mask = window:5:0 reaches prefill and decode (window=5): tokens identical, logits within TOL
    of the plain model masked by Mask.allowed; the unmasked model's logits differ (the window matters)."""
    want_tokens, want_logits = _greedy(WINDOW)
    assert _rel(_greedy("")[1], want_logits) > 1e-3
    for out in pools.run(2, _window_sharded, timeout=300):
        assert torch.equal(out.tokens, want_tokens)
        assert _rel(out.logits, want_logits) <= TOL, _rel(out.logits, want_logits)


def _bad_inputs() -> list[str]:
    """Each bad call's message on this rank with the bytes it sent."""
    rank, _ = comm.world()
    model, prompt = _model(), _prompt()
    calls = {
        "max_len": lambda: generate(model, prompt, 8, max_len=16),
        "seed": lambda: generate(model, prompt, 8, temperature=1.0, seed=int(rank == 1)),
        "prompt": lambda: generate(model, prompt if rank else prompt + 1, 2),
        "empty": lambda: generate(model, prompt[:, :0], 2),
        "mask": lambda: generate(_model("docs:4"), prompt, 2),
    }
    return bad_input_log(calls)


def test_bad_input_is_a_value_error_on_every_rank_before_any_byte(pools):
    for msgs in pools.run(3, _bad_inputs):
        text = "\n".join(msgs)
        assert "no error" not in text, text
        assert all(m == "bytes 0" for m in msgs[1::2]), text
        assert "prompt length 11 + max_new_tokens=8 = 19 exceeds max_len=16" in msgs[0], text
        assert "seed: rank 0: 0, rank 1: 1, rank 2: 0" in msgs[2], text
        assert "prompt" in msgs[4] and "disagree" in msgs[4], text
        assert "at least one token" in msgs[6], text
        assert "mask='docs:4' (model 'tiny_gqa'): generation on the sharded cache supports" in msgs[8], text
