"""Generation through ``generate()`` of an unmodified HF ``LlamaForCausalLM`` on the sharded KV cache
(baselines.hf.generate) against the unmodified model's own ``generate()`` (its DynamicCache, SDPA).

generate() hands its logits on in fp32, so the fp64 logits are read at the LM head (a forward
hook, the last token of each call). 64 new tokens, greedy and sampled, at W = 2, 3, 4: the tokens
must be identical and the fp64 logits equal within 1e-12 relative on every rank.
"""
from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from baselines.hf.generate import one_draw, hf_generate
from baselines.hf.models import build
from burst_impl import comm
from tests.inference_refs import bad_input_log

NEW = 64
TOL = 1e-12
MODES = ((0.0, 0), (0.8, 7))        # (temperature, seed): greedy, then sampled


def _prompt(n: int = 11) -> torch.Tensor:
    return torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(3))


@functools.lru_cache(maxsize=None)
def _model():
    return build("llama", torch.float64).eval()


def _with_head_logits(run):
    """run()'s output and the fp64 logits of the last token of every forward, read at the LM head."""
    model, seen = _model(), []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out[:, -1].clone()))
    try:
        out = run()
    finally:
        hook.remove()
    return out, torch.stack(seen[:NEW], 1)


@functools.lru_cache(maxsize=None)
def _reference(temperature: float, seed: int):
    """The unmodified model's generate(): greedy, or the same one-draw rule on one process."""
    ids = _prompt()
    extra = dict(logits_processor=[one_draw(temperature, seed, None)]) if temperature else {}
    out, logits = _with_head_logits(lambda: _model().generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
        pad_token_id=0, eos_token_id=None, **extra))
    return out[:, ids.shape[1]:], logits


def _sharded(placement: str) -> list:
    out = []
    for t, s in MODES:
        gen, logits = _with_head_logits(lambda: hf_generate(_model(), _prompt(), NEW, temperature=t, seed=s,
                                                            placement=placement))
        out.append((gen.sequences[:, 11:], logits, gen.cache.lengths(0)))
    return out


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("world_size,placement", [(2, "round_robin"), (3, "shortest"), (4, "round_robin")])
def test_hf_generation_matches_the_unmodified_model(pools, world_size, placement):
    per_rank = pools.run(world_size, _sharded, placement, timeout=600)
    for (temperature, seed), outs in zip(MODES, zip(*per_rank)):
        want_tokens, want_logits = _reference(temperature, seed)
        for rank, (tokens, logits, lengths) in enumerate(outs):
            assert torch.equal(tokens, want_tokens), (temperature, rank)
            assert _rel(logits, want_logits) <= TOL, (temperature, rank, _rel(logits, want_logits))
            assert lengths == [11 + NEW - 1] * 2
    assert not torch.equal(per_rank[0][1][0], _reference(0.0, 0)[0]), "sampling drew the greedy tokens"


def _bad_inputs() -> list[str]:
    rank, _ = comm.world()
    model, ids = _model(), _prompt()
    calls = {
        "max_len": lambda: hf_generate(model, ids, 8, max_len=16),
        "seed": lambda: hf_generate(model, ids, 8, temperature=1.0, seed=int(rank == 1)),
    }
    return bad_input_log(calls)


def test_hf_bad_input_is_a_value_error_on_every_rank_before_any_byte(pools):
    for msgs in pools.run(3, _bad_inputs):
        text = "\n".join(msgs)
        assert "no error" not in text and all(m == "bytes 0" for m in msgs[1::2]), text
        assert "prompt length 11 + max_new_tokens=8 = 19 exceeds max_len=16" in msgs[0], text
        assert "seed: rank 0: 0, rank 1: 1, rank 2: 0" in msgs[2], text
