"""Model pieces without a process group, bad input, and the hooks issue 11 builds on."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from baselines.registry import get
from burst_impl import comm
from burst_impl.layout import positions, shard
from burst_impl.model import (CONFIGS, build_model, get_config, loss_and_grads, num_params, sequence_parallel,
                              wrap_blocks)
from burst_impl.model.data import batch_at, load_corpus, markov_tokens
from burst_impl.model.flops import model_flops
from burst_impl.model.layers import apply_rope, rope_tables
from burst_impl.model.model import cross_entropy_sum
from burst_impl.model.sequence_parallel import check_method
from baselines.tensor_parallel import check_tp
from burst_impl.shape import AttnShape
from burst_impl.flops import attention_flops
from tests.model_refs import global_batch, math_model, one_thread, rel_err

# ---------------------------------------------------------------- configs


def test_paper_configs():
    # LLaMA-2's published parameter counts (untied head): 6,738,415,616 and 13,015,864,320.
    assert num_params(get_config("llama2_7b")) == 6_738_415_616
    assert num_params(get_config("llama2_13b")) == 13_015_864_320
    b14 = get_config("burstengine_14b")
    assert replace(b14, name="x", vocab_size=32000) == replace(get_config("llama2_13b"), name="x")
    assert b14.vocab_size == 122880 and 13.5e9 < num_params(b14) < 14.5e9


@pytest.mark.parametrize("kw,match", [
    (dict(hidden=100), "hidden=100 must be divisible by n_heads=12"),
    (dict(n_kv_heads=5), "n_heads=12 must be a multiple of n_kv_heads=5"),
    (dict(hidden=60), "head_dim=5 .* must be even"),
    (dict(n_layers=0), "n_layers=0 must be a positive integer"),
])
def test_config_rules(kw, match):
    with pytest.raises(ValueError, match=match):
        replace(get_config("tiny"), **kw)


def test_unknown_names():
    with pytest.raises(ValueError, match="model='llama9' is unknown"):
        get_config("llama9")
    cfg = get_config("tiny")
    with pytest.raises(ValueError, match="method='nope' is unknown"):
        check_method(cfg, get("nope"), 2, "contiguous")
    with pytest.raises(ValueError, match="method='tp_v1' is a layer-level method"):
        check_method(cfg, get("tp_v1"), 2, "contiguous")
    with pytest.raises(ValueError, match="layout='striped' is not supported by method 'usp'"):
        check_method(cfg, get("usp"), 4, "striped")
    with pytest.raises(ValueError, match="layout='diagonal' is unknown"):
        check_method(cfg, get("burst"), 2, "diagonal")
    with pytest.raises(ValueError, match="corpus='wiki' is unknown"):
        load_corpus("wiki", 64)
    with pytest.raises(ValueError, match="mode='infer' is unknown"):
        model_flops(cfg, 1, 8, mode="infer")


def test_heads_and_group_rules():
    cfg = get_config("tiny")                       # 12 heads, F = 192
    with pytest.raises(ValueError, match="heads=12 .*5"):
        check_method(cfg, get("ulysses"), 5, "contiguous")
    with pytest.raises(ValueError, match="seqlen=3 must be >= 4"):     # any N >= 2G chunks splits (issue 22)
        check_method(cfg, get("burst"), 2, "zigzag", seqlen=3)
    with pytest.raises(ValueError, match="n_heads=12 must be divisible by the tensor-parallel size 5"):
        check_tp(cfg, "v1", 5)
    with pytest.raises(ValueError, match="n_kv_heads=2 must be divisible by the tensor-parallel size 4"):
        check_tp(get_config("tiny_gqa"), "v3", 4)
    with pytest.raises(ValueError, match="ffn_hidden=200 must be divisible"):
        check_tp(replace(cfg, ffn_hidden=200), "v3", 3)
    with pytest.raises(ValueError, match="version='v2' is unknown"):
        check_tp(cfg, "v2", 2)


def _bad_sequence(seqlen: int) -> tuple[str, dict]:
    model = sequence_parallel(build_model(get_config("tiny")), get("burst"), layout="zigzag")
    tokens, labels = global_batch("tiny", seqlen=seqlen)
    with comm.count_bytes() as sent:
        try:
            loss_and_grads(model, tokens, labels)
        except ValueError as e:
            return str(e), dict(sent)
    return "no error", dict(sent)


def test_sequence_that_does_not_split_fails_before_communication(pools):
    for msg, sent in pools.run(2, _bad_sequence, 3):   # 3 tokens, 4 zigzag chunks (N = 10 runs since issue 22)
        assert "seqlen=3 must be >= 4" in msg and sent == {}
    for msg, sent in pools.run(2, _bad_sequence, 12):    # the group is still usable
        assert msg == "no error" and sent


# ---------------------------------------------------------------- layers


def test_rope_uses_global_positions():
    """Rotating a zigzag shard at its global positions = the shard of the rotated sequence; and
    q.k after RoPE depends only on the position difference."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 3, 8, generator=g, dtype=torch.float64)
    full = apply_rope(x, rope_tables(torch.arange(16), 8, 10000.0, torch.float64))
    for r in range(4):
        pos = positions("zigzag", r, 4, 16)
        local = apply_rope(shard(x, "zigzag", r, 4), rope_tables(pos, 8, 10000.0, torch.float64))
        torch.testing.assert_close(local, shard(full, "zigzag", r, 4), rtol=0, atol=1e-12)
    q, k = x[:, :1], x[:, 1:2]
    dots = []
    for p in (0, 5, 1000):
        rq = apply_rope(q, rope_tables(torch.tensor([p + 3]), 8, 10000.0, torch.float64))
        rk = apply_rope(k, rope_tables(torch.tensor([p]), 8, 10000.0, torch.float64))
        dots.append((rq * rk).sum(-1))
    torch.testing.assert_close(dots[0], dots[1], rtol=0, atol=1e-10)
    torch.testing.assert_close(dots[0], dots[2], rtol=0, atol=1e-10)


def test_fused_and_materialised_attention_agree():
    with one_thread():
        tokens, labels = global_batch("tiny_gqa")
        ref = math_model("tiny_gqa", torch.float32)
        fused = build_model(get_config("tiny_gqa"))
        assert abs(loss_and_grads(ref, tokens, labels) - loss_and_grads(fused, tokens, labels)) < 1e-5
        for (n, a), b in zip(fused.named_parameters(), ref.parameters()):
            assert rel_err(a.grad, b.grad) < 2e-5, n


# ---------------------------------------------------------------- hooks for issue 11


def test_block_wrapper_and_loss_hooks_keep_the_gradients():
    """A per-block checkpoint wrapper (``wrap_blocks``) and a chunked loss (``model.loss_fn``) give
    the plain model's loss and gradients."""

    class Checkpointed(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x, rope):
            return checkpoint(self.block, x, rope, use_reentrant=False)

    def chunked_loss(hidden, weight, labels, ignore_index):
        parts = [cross_entropy_sum(h, weight, y, ignore_index) for h, y in zip(hidden.chunk(3, 1), labels.chunk(3, 1))]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    with one_thread():
        tokens, labels = global_batch("tiny")
        labels[0, :5] = -100                                       # ignored tokens
        plain = math_model("tiny")
        hooked = wrap_blocks(math_model("tiny"), lambda i, block: Checkpointed(block))
        hooked.loss_fn = chunked_loss
        a, b = loss_and_grads(plain, tokens, labels), loss_and_grads(hooked, tokens, labels)
        assert abs(a - b) < 1e-12
        grads = {n.replace(".block", ""): p.grad for n, p in hooked.named_parameters()}
        for n, p in plain.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- data and FLOPs


def test_data_is_seeded_and_shifted():
    a, b = markov_tokens(64, 500, seed=3), markov_tokens(64, 500, seed=3)
    assert torch.equal(a, b) and not torch.equal(a, markov_tokens(64, 500, seed=4))
    assert a.min() >= 0 and a.max() < 64
    x, y = batch_at(a, 7, 3, 20)
    assert x.shape == y.shape == (3, 20) and torch.equal(x[:, 1:], y[:, :-1])
    text = load_corpus("pydoc", 256)
    assert text.numel() > 100_000 and text.max() < 256
    with pytest.raises(ValueError, match="vocab_size=64 must be at least 256"):
        load_corpus("pydoc", 64)


def test_flop_convention():
    cfg = get_config("llama2_7b")
    B, N = 2, 4096
    P = (cfg.n_layers * (4 * cfg.hidden ** 2 + 3 * cfg.hidden * cfg.ffn_hidden) + cfg.vocab_size * cfg.hidden)
    attn_fwd = 4 * B * N * N * cfg.hidden / 2                        # per layer, causal halved
    train = model_flops(cfg, B, N)
    assert train["matmul"] == 6 * P * B * N
    assert train["attention"] == cfg.n_layers * 3.5 * attn_fwd
    assert train["attention"] == cfg.n_layers * attention_flops(
        AttnShape(B, N, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 1, causal=True), mode="fwd_bwd")
    full = model_flops(cfg, B, N, causal_halved=False)
    assert full["attention"] == 2 * train["attention"] and full["matmul"] == train["matmul"]
    pre = model_flops(cfg, B, N, mode="prefill")
    head = cfg.vocab_size * cfg.hidden
    assert pre["matmul"] == 2 * (P - head) * B * N + 2 * head * B
    assert pre["attention"] == cfg.n_layers * attn_fwd
    assert all(c.name == n for n, c in CONFIGS.items())
