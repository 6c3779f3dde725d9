"""Checkpoint modes and loss modes in the model's training step (issue 11 items 2-3).

Every checkpoint mode (none, full, seq, whole) with every loss mode that runs
on CPU (unfused, fused) gives the single-process fp64 loss and every
parameter gradient, for every op-level attention method we implement at
W = 1, 2, 4, and at W = 3 for burst and ulysses (zigzag at W > 1: the layout every method accepts and ``seq``
needs; striped for the burst operator at W = 4). Tolerances: those of
tests/test_model_parity.py (fp32 against fp64; the recompute adds no new
order of rounding: the first half's attention runs on half-length blocks, a
different but equally long chain of fp32 merges). The fused loss sums its
tiles in fp32 like the unfused one.

The bytes show what is recomputed: the forward's K/V ring runs again in
full under ``full``, for the first halves only (half the bytes) under
``seq``, and not at all under ``whole``.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from baselines.registry import get
from burst_impl import comm
from burst_impl.model import build_model, get_config, loss_and_grads, prefill_step, sequence_parallel
from burst_impl.model.checkpoint import effective_mode
from burst_impl.model.config import CHECKPOINT_MODES as MODES
from tests.model_refs import global_batch, grad_errors, reference
from tests.test_model_parity import GRAD_RTOL, LOSS_RTOL, SP_METHODS

WORLD_SIZES = (1, 2, 4)
LOSS = {m: "fused" if i % 2 else "unfused" for i, m in enumerate(SP_METHODS)}   # both loss modes covered
# On a loaded 2-core machine one W = 4 case (4 modes) takes about 2 minutes: the default run keeps
# W = 1 for every method, the burst operator (which caches) and Ulysses (which falls back) at W = 2,
# and the burst operator at W = 4; the rest is marked slow.
FAST = {("burst", 2), ("ulysses", 2), ("burst", 4)}
CASES = [pytest.param(m, LOSS[m], w, marks=() if w == 1 or (m, w) in FAST else pytest.mark.slow)
         for w in WORLD_SIZES for m in SP_METHODS]
# An odd world size (zigzag at G = 3, 12 heads): the operator that caches and one method that falls back.
CASES += [pytest.param(m, LOSS[m], 3) for m in ("burst", "ulysses")]
RUN_TIMEOUT_S = 900


def modes_run(cfg_name: str, method: str, layout: str, loss: str) -> dict:
    """On every rank: one step per checkpoint mode; loss, grads, forward bytes, effective mode."""
    tokens, labels = global_batch(cfg_name)
    out = {}
    for mode in MODES:
        cfg = replace(get_config(cfg_name), loss=loss, checkpoint=mode)
        model = sequence_parallel(build_model(cfg), get(method), layout=layout)
        with comm.count_bytes() as counted:
            value = loss_and_grads(model, tokens, labels).item()
        # burst_usp's cache also sends its lse back (a2a_lse): checked in tests/test_usp_variants.py
        fwd = sum(b for (phase, kind), b in counted.items() if phase == "forward" and kind != "a2a_lse")
        out[mode] = dict(loss=value, grads={n: p.grad for n, p in model.named_parameters()}, fwd_bytes=fwd,
                         effective=effective_mode(model.layers[0], mode),
                         ids=prefill_step(model, tokens) if mode == "seq" else None)   # no cache without grad
    return out


@pytest.mark.timeout(RUN_TIMEOUT_S)       # a loaded machine; a quiet one needs well under a minute
@pytest.mark.parametrize("method,loss,world_size", CASES)
def test_checkpoint_modes_exact(pools, method, loss, world_size):
    layout = "zigzag" if world_size > 1 else "contiguous"
    if method.startswith("burst") and world_size == 4 and "striped" in get(method).layouts:
        layout = "striped"
    ref = reference("tiny")
    results = pools.run(world_size, modes_run, "tiny", method, layout, loss, timeout=RUN_TIMEOUT_S)
    for rank, res in enumerate(results):
        for mode, r in res.items():
            what = f"{method} {loss} G={world_size} {layout} checkpoint={mode} rank {rank}"
            assert abs(r["loss"] - ref["loss"]) <= LOSS_RTOL * abs(ref["loss"]), what
            errs = grad_errors(r["grads"], ref["grads"])
            worst = max(errs, key=errs.get)
            assert errs[worst] <= GRAD_RTOL, f"{what}: gradient error {errs[worst]:.2e} ({worst})"
            if r["ids"] is not None:
                assert torch.equal(r["ids"], ref["next_ids"]), f"{what}: prefill"
        # What is recomputed, from the counted bytes (the loss all-reduce is the only other forward send).
        none, full, seq, whole = (res[m]["fwd_bytes"] for m in MODES)
        if world_size > 1:
            assert full > none, f"{method}: full recompute must send the forward again"
            if res["seq"]["effective"] == "seq":
                loss_ar = 2 * 16 * (world_size - 1) // world_size
                attn = none - loss_ar
                assert seq - none == attn // 2, \
                    f"{method}: seq must resend half the forward ring ({seq - none} != {attn // 2})"
                assert whole == none, f"{method}: whole must not recompute attention"


def test_effective_modes():
    """The burst operator's methods, burst_usp and the single-device kernels cache; others fall back to full."""
    # the methods that are the BurstAttention operator, and burst_usp with its own hook (stated here, not
    # read from Method.operator_backward / cached_attention, so that a wrong field fails the test)
    operator = {"burst", "burst_qring", "burst_double_ring", "ring", "loongtrain_double_ring", "burst_usp"}
    model = build_model(get_config("tiny"))
    assert effective_mode(model.layers[0], "seq") == "seq"
    for m in SP_METHODS:
        model = sequence_parallel(build_model(get_config("tiny")), get(m))
        want = "seq" if (get(m).variant_of or m) in operator else "full"
        assert effective_mode(model.layers[0], "seq") == want, m


def _bad_layout(layout: str, seqlen: int) -> str:
    model = sequence_parallel(build_model(replace(get_config("tiny"), checkpoint="seq")), get("burst"), layout=layout)
    tokens = global_batch("tiny", seqlen=seqlen)[0]
    with comm.count_bytes() as counted:
        try:
            loss_and_grads(model, tokens, tokens)
        except ValueError as e:
            assert not dict(counted), "must fail before any communication"
            return str(e)
    return "no error"


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_bad_input(pools):
    with pytest.raises(ValueError, match="checkpoint='bogus' is unknown"):
        replace(get_config("tiny"), checkpoint="bogus")
    with pytest.raises(ValueError, match="loss='bogus' is unknown"):
        replace(get_config("tiny"), loss="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="loss='liger' cannot run here"):
            build_model(replace(get_config("tiny"), loss="liger"))
    contiguous = pools.run(2, _bad_layout, "contiguous", 24, timeout=RUN_TIMEOUT_S)[0]
    odd = pools.run(2, _bad_layout, "striped", 18, timeout=RUN_TIMEOUT_S)[0]
    assert "zigzag' and 'striped' only" in contiguous, contiguous
    assert "must be even" in odd, odd
