"""The HF integration beyond the plain causal batch (issue 23): packed documents, a model with
sliding-window layers, right padding, FSDP2, bad input, registration and the example.

Every parity check is fp64 against the unmodified single-process model on the whole batch, whose
masks HF builds itself (packing detected from position-id resets, its sliding-window and padding
masks): the same 1e-9 relative bound as tests/test_hf_parity.py (measured there <= 2.1e-15). Each
mask feature has a negative control: the reference without it differs by > 1e-3, so a parallel run
that ignored it could not pass. Bad input: a ValueError naming the parameter, the value and the
rule, on every rank, with ``burst_impl.comm.count_bytes`` showing that nothing was sent.
"""
from __future__ import annotations

import contextlib
import functools
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (the [hf] extra: pip install -e '.[hf]')")

from tests.test_hf_parity import FP64_RTOL, SEQLEN, check_pool_results, global_ids, options, rel_errors, run_cases

CU = (0, 5, 13, 14, 24)          # four packed documents, one of a single token
QWEN_SLIDING = (("sliding_window", 8), ("max_window_layers", 1))   # layer 0 full, layer 1 a window of 8


def positions_of(cu) -> torch.Tensor:
    """(B, N) HF packing convention: positions restart at 0 at every document."""
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])
    return pos.expand(2, -1).clone()


def right_padding() -> torch.Tensor:
    m = torch.ones(2, SEQLEN, dtype=torch.long)
    m[1, 17:] = 0
    return m


def batch_kw(kind: str) -> dict:
    return {"cu": dict(cu_seqlens=CU), "pos": dict(position_ids=positions_of(CU)),
            "pad": dict(attention_mask=right_padding()),
            "offset": dict(position_ids=torch.arange(SEQLEN) + torch.tensor([[0], [7]])), "": {}}[kind]


@functools.lru_cache(maxsize=16)
def reference(family: str, kind: str = "", variant: tuple = ()):
    from baselines.hf import single_loss_and_grads
    from baselines.hf.models import build

    loss, grads = single_loss_and_grads(build(family, torch.float64, **dict(variant)), global_ids(), **batch_kw(kind))
    return loss.item(), {n: g.double() for n, g in grads.items()}


def _case(family, method, layout, world_size, variant=(), fsdp=False):
    return (family, method, layout, torch.float64, tuple(options(method, world_size).items()), variant, fsdp)


# ---------------------------------------------------------------- packed documents, window, padding


@pytest.mark.parametrize("kind", ["cu", "pos"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_documents(pools, world_size, kind):
    """Packed documents given as cu_seqlens or as restarting position_ids: the suite's document mask."""
    cases = [_case(f, m, l, world_size) for f, m, l in
             [("llama", "burst", "zigzag"), ("qwen2", "ulysses", "zigzag"), ("llama", "usp", "contiguous"),
              ("qwen2", "ring", "zigzag"), ("llama", "burst_double_ring", "zigzag")]]
    results = pools.run(world_size, run_cases, cases, batch_kw(kind))
    for case in cases:
        check_pool_results(results, case, reference(case[0], kind), FP64_RTOL, FP64_RTOL)


def test_striped_layout(pools):
    """The striped layout (token t on rank t mod W), for the methods that take it, plain and packed."""
    for kind in ("", "cu"):   # Mistral's window with documents is refused (test_bad_input...): Llama for Ulysses
        uly = "mistral" if kind == "" else "llama"
        cases = [_case(f, m, "striped", 4) for f, m in [("llama", "burst"), ("qwen2", "ring"), (uly, "ulysses")]]
        results = pools.run(4, run_cases, cases, batch_kw(kind))
        for case in cases:
            check_pool_results(results, case, reference(case[0], kind), FP64_RTOL, FP64_RTOL)


def test_masks_matter():
    """Negative controls: packing, the sliding window and padding each change the reference by > 1e-3."""
    for family, a, b in [("llama", ("cu", ()), ("", ())), ("mistral", ("", ()), ("", (("sliding_window", None),))),
                         ("qwen2", ("", QWEN_SLIDING), ("", ())), ("llama", ("pad", ()), ("", ()))]:
        _, grad_err, _ = rel_errors(reference(family, *a), reference(family, *b))
        assert grad_err > 1e-3, f"{family} {a} vs {b}: only {grad_err:.1e}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_sliding_window_layers(pools, world_size):
    """Qwen2 with a full layer 0 and a sliding layer 1 (HF passes sliding_window per layer)."""
    cases = [_case("qwen2", m, l, world_size, QWEN_SLIDING) for m, l in
             [("burst", "zigzag"), ("ulysses", "contiguous"), ("usp", "zigzag"), ("ring_rsa", "zigzag")]]
    results = pools.run(world_size, run_cases, cases)
    for case in cases:
        tol = (2e-6, 2e-5) if case[1] == "ring_rsa" else (FP64_RTOL, FP64_RTOL)   # fp32 backward, as in parity
        check_pool_results(results, case, reference("qwen2", "", QWEN_SLIDING), *tol)


@pytest.mark.parametrize("kind", ["pad", "offset"])
def test_right_padding_and_offsets(pools, kind):
    """A right-padded row (no mask needed under causal attention, its pad labels ignored); rows whose
    positions start at different offsets (one document each, accepted per row; RoPE scores depend on
    position differences only, so this checks that such input is taken, not that offsets matter)."""
    cases = [_case("llama", "burst", "zigzag", 3), _case("mistral", "ulysses", "zigzag", 3)]
    results = pools.run(3, run_cases, cases, batch_kw(kind))
    for case in cases:
        check_pool_results(results, case, reference(case[0], kind), FP64_RTOL, FP64_RTOL)


# ---------------------------------------------------------------- FSDP2


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_equals_replicated(pools, world_size):
    """FSDP2 over the sequence group: the same loss and full gradients as replicated weights."""
    pairs = [("llama", "burst", "zigzag"), ("qwen2", "usp", "zigzag"), ("mistral", "ulysses", "contiguous")]
    cases = [_case(f, m, l, world_size, fsdp=s) for f, m, l in pairs for s in (False, True)]
    results = pools.run(world_size, run_cases, cases)
    for f, m, l in pairs:
        rep, sharded = results[0][_case(f, m, l, world_size)], results[0][_case(f, m, l, world_size, fsdp=True)]
        check_pool_results(results, _case(f, m, l, world_size, fsdp=True), reference(f), FP64_RTOL, FP64_RTOL)
        assert abs(rep[0] - sharded[0]) <= 1e-12 * abs(rep[0])
        for n, g in rep[1].items():
            assert torch.allclose(sharded[1][n], g, rtol=0, atol=1e-12 * g.abs().max().item()), n


# ---------------------------------------------------------------- bad input: ValueError before any byte


def _no_backend_model():
    """A model class whose attention does not go through AttentionInterface (as HF marks such classes)."""
    from transformers import LlamaForCausalLM

    from baselines.hf.models import tiny_config

    class OwnAttentionLM(LlamaForCausalLM):
        _supports_attention_backend = False

    return OwnAttentionLM(tiny_config("llama").hf_config())


def _bad_inputs() -> dict:
    """{what: callable} of user errors; each must raise ValueError before communicating."""
    from baselines import hf
    from baselines.hf.models import build

    ids = global_ids()

    def forward(model, method="burst", **kw):
        hf.use_method(model, method)
        b = hf.shard_batch(ids)
        return model(**{**b.model_inputs(), **kw})

    left = torch.ones(2, SEQLEN, dtype=torch.long)
    left[0, :3] = 0
    rows = positions_of(CU)
    rows[1] = torch.arange(SEQLEN)
    return {
        "heads": lambda: hf.use_method(build("llama", num_attention_heads=3, num_key_value_heads=3, head_dim=16),
                                       "ulysses"),
        "backend": lambda: hf.use_method(_no_backend_model(), "burst"),
        "left_padding": lambda: hf.shard_batch(ids, attention_mask=left),
        "seqlen": lambda: hf.shard_batch(global_ids(seqlen=3)),
        "rows_differ": lambda: hf.shard_batch(ids, position_ids=rows),
        "cu_seqlens": lambda: hf.shard_batch(ids, cu_seqlens=(0, 5, 5, 24)),
        "mask_to_model": lambda: forward(build("llama"), attention_mask=torch.ones(2, SEQLEN // 2, dtype=torch.long)),
        "dropout": lambda: hf.use_method(_with_dropout(build("llama")), "burst"),
        "window_and_docs": lambda: _packed_forward(build, hf, "mistral"),
        "layer_method": lambda: hf.register("tp_v1"),
        "balanced": lambda: hf.register("burst", layout="balanced"),
    }


def _with_dropout(model):
    model.config.attention_dropout = 0.1
    return model


def _packed_forward(build, hf, family):
    model = build(family)
    hf.use_method(model, "burst")
    return model(**hf.shard_batch(global_ids(), cu_seqlens=CU).model_inputs())


def run_bad_inputs() -> dict:
    """On every rank: {what: (ValueError message or None, bytes sent)}."""
    from burst_impl import comm

    torch.set_num_threads(1)
    out = {}
    for what, fn in _bad_inputs().items():
        with comm.count_bytes() as sent:
            try:
                fn()
                out[what] = (None, sent.total())
            except ValueError as e:
                out[what] = (str(e), sent.total())
    return out


# what -> words the message must contain: the parameter, its value, the rule
BAD_INPUT_WORDS = {
    "heads": ("num_attention_heads=3", "divisible by the Ulysses degree 2"),
    "backend": ("OwnAttentionLM", "AttentionInterface", "_supports_attention_backend"),
    "left_padding": ("attention_mask", "[0]", "right-padded"),
    "seqlen": ("input_ids.shape[1] (global N)=3", ">= 4"),
    "rows_differ": ("position_ids", "every row must pack the same documents"),
    "cu_seqlens": ("cu_seqlens=(0, 5, 5, 24)", "strictly increasing"),
    "mask_to_model": ("attention_mask of shape (2, 12)", "shard_batch"),
    "dropout": ("config.attention_dropout=0.1", "no attention dropout"),
    "window_and_docs": ("sliding_window=8", "documents"),
    "layer_method": ("method='tp_v1'", "level 'op'"),
    "balanced": ("layout='balanced'", "named layouts"),
}


def test_bad_input_raises_before_any_byte(pools):
    results = pools.run(2, run_bad_inputs)
    for rank, res in enumerate(results):
        assert res.keys() == BAD_INPUT_WORDS.keys()
        for what, (msg, sent) in res.items():
            assert msg is not None, f"{what}: no ValueError on rank {rank}"
            assert sent == 0, f"{what}: {sent} bytes sent before the ValueError on rank {rank}"
            for word in BAD_INPUT_WORDS[what]:
                assert word in msg, f"{what}: {word!r} not in {msg!r}"


# ---------------------------------------------------------------- registration, the double ring, the example


def test_register_all_names_and_single_process():
    """Every sequence-parallel method here is registered under burst:<method>; at W = 1 each is the
    model's own attention (adapters around peer packages, bytes by formula, are registered, not run)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from baselines import hf
    from baselines.hf.models import build
    from baselines.registry import METHODS

    names = hf.register_all()
    assert set(names) == {m for m in hf.sp_methods() if "zigzag" in METHODS[m].layouts}
    assert {"burst", "burst_qring", "ring", "ring_rsa", "ulysses", "usp", "burst_double_ring"} <= set(names)
    assert hf.register("usp", layout="contiguous", ulysses_degree=1) == "burst:usp:contiguous:ulysses_degree=1"
    model = build("qwen2", torch.float64, **dict(QWEN_SLIDING))
    ids = global_ids()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for method, name in names.items():
            assert name == f"burst:{method}" and name in ALL_ATTENTION_FUNCTIONS.valid_keys()
            if METHODS[method].bytes_by_formula:
                continue
            model.set_attn_implementation(name)
            got = model(**hf.shard_batch(ids).model_inputs()).logits
            # ring_rsa's softmax runs in fp32 (its probabilities, measured 9e-8 here): fp32's bound for it
            tol = 1e-6 if method.startswith("ring_rsa") else 1e-12
            assert (got - want).abs().max() <= tol * want.abs().max(), method


def run_double_ring_topology() -> str:
    from baselines import hf
    from baselines.hf.models import build
    from burst_impl import comm

    model = build("llama", torch.float64)
    hf.use_method(model, "burst_double_ring", node_size=2)
    with comm.count_bytes() as sent:
        model(**hf.shard_batch(global_ids()).model_inputs())
    return str(sent.notes.get("burst.topology"))


def test_double_ring_is_double_at_w4(pools):
    """burst_double_ring with node_size=2 at W = 4 (the parity options) really runs the double ring."""
    for note in pools.run(4, run_double_ring_topology):
        assert note.startswith("double ring over 2 nodes x 2 ranks"), note


def run_example(argv: list[str]) -> tuple[int, str, str]:
    from baselines.hf import example

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = example.main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_example_in_a_pool(pools):
    """The example at W = 2 (a pool's group stands in for torchrun's): rank 0 prints each step's
    loss next to the single-process loss; they agree to fp32 rounding."""
    results = pools.run(2, run_example, ["--method", "usp", "--model", "mistral", "--steps", "3", "--fsdp"])
    (rc, out, err), (rc1, out1, _) = results
    assert rc == 0 and rc1 == 0 and out1 == "", (err, out1)
    steps = [line.split() for line in out.splitlines() if line.startswith("step")]
    assert len(steps) == 3, out
    for s in steps:
        loss, single = float(s[3]), float(s[5])
        assert abs(loss - single) <= 1e-5 * abs(single), out     # fp32, 3 AdamW steps


def test_example_user_error_exits_2():
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-m", "baselines.hf.example", "--method", "tp_v1"], cwd=root,
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: method='tp_v1' is level 'layer'"), p.stderr
