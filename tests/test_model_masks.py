"""The model with an attention mask (issue 37 item 5): the sequence-parallel model trains with
``ModelConfig.mask`` exactly as the single-process model with the same mask.

Reference: the single-process model in fp64 with materialised scores masked by ``Mask.allowed`` alone
(``LocalAttention(fused=False, mask=...)``), independent of the plans the ring methods compute from.
The distributed model runs in fp64 too, so the only differences are the order of fp64 sums (ring merges,
tile splits, the gradient all-reduce): GRAD_RTOL = 1e-12 and LOSS_RTOL = 1e-13 relative to each
tensor's largest value (fp64 rounds at 1.1e-16; ~20 chained steps over sums of <= 192 terms bound
it near 3e-13; measured: at most 2.1e-15 on gradients and 1.9e-16 on the loss, every case below).
The negative control (the mask dropped in the distributed model while the reference keeps it) misses
by far (measured 1.4 on gradients, 6.9e-3 on the loss), and so does the causal reference against the
masked one: the window changes the loss at this size.

Sizes: the tiny model (2 layers, 12 heads of 8), B = 2, N = 48, a causal window of 5 keys (shorter than
every rank's shard, so fully masked block pairs are skipped, and crossing shard boundaries), world
sizes 2, 3 and 4, each method's layouts (balanced = burst_impl.balance's chunks for this window).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from baselines.registry import get
from burst_impl import comm
from burst_impl.model import build_model, get_config, loss_and_grads, sequence_parallel
from burst_impl.model.checkpoint import check_checkpoint
from burst_impl.model.layers import LocalAttention
from burst_impl.model.sequence_parallel import layer_comm_bytes
from tests.model_refs import global_batch, grad_errors, one_thread

MASK = "window:5:0"
SEQLEN, BATCH = 48, 2
GRAD_RTOL, LOSS_RTOL = 1e-12, 1e-13


def _cfg(mask: str = MASK, checkpoint: str = "none", name: str = "tiny"):
    return replace(get_config(name), mask=mask, checkpoint=checkpoint)


@functools.lru_cache(maxsize=4)
def reference(mask: str, name: str = "tiny") -> dict:
    """fp64 single-process loss and every gradient, attention masked through ``Mask.allowed``."""
    with one_thread():
        model = build_model(_cfg(mask, name=name), dtype=torch.float64)
        for block in model.layers:
            block.attention.core = LocalAttention(fused=False, mask=mask)
        tokens, labels = global_batch(name, seqlen=SEQLEN, batch=BATCH)
        loss = loss_and_grads(model, tokens, labels).item()
        return dict(loss=loss, grads={n: p.grad.clone() for n, p in model.named_parameters()})


def masked_run(method: str, layouts: list[str], checkpoint: str = "none", drop_mask: bool = False,
               name: str = "tiny") -> dict:
    """On every rank, fp64: one loss and gradients per layout, with the counted bytes of the step."""
    tokens, labels = global_batch(name, seqlen=SEQLEN, batch=BATCH)
    out = {}
    for layout in layouts:
        cfg = _cfg(checkpoint=checkpoint, name=name)
        model = sequence_parallel(build_model(cfg, dtype=torch.float64), get(method), layout=layout)
        if drop_mask:      # negative control: the attention runs causal only
            for block in model.layers:
                block.attention.core.mask = ""
        with comm.count_bytes() as counted:
            loss = loss_and_grads(model, tokens, labels).item()
        attn = {k: v for k, v in counted.items() if k[1] not in ("loss", "grads")}
        out[layout] = dict(loss=loss, grads={n: p.grad for n, p in model.named_parameters()}, attn_bytes=attn)
    return out


def _errors(results: list[dict], layout: str, ref: dict) -> tuple[float, float, str]:
    loss_err = grad_err = 0.0
    worst = ""
    for res in results:
        r = res[layout]
        loss_err = max(loss_err, abs(r["loss"] - ref["loss"]) / abs(ref["loss"]))
        for n, e in grad_errors(r["grads"], ref["grads"]).items():
            if e >= grad_err:
                grad_err, worst = e, n
    return loss_err, grad_err, worst


CASES = [   # (method, G, layouts): every layout of the ring operator, an odd G, the all-to-all methods
    ("burst", 2, ["contiguous", "zigzag", "striped", "balanced"]),
    ("burst", 3, ["contiguous", "zigzag", "balanced"]),
    ("ring", 3, ["striped", "balanced"]),
    ("ulysses", 3, ["balanced"]),
    ("usp", 4, ["zigzag", "balanced"]),
]


@pytest.mark.parametrize("method,world_size,layouts", CASES)
def test_masked_model_parity(pools, method, world_size, layouts):
    ref = reference(MASK)
    results = pools.run(world_size, masked_run, method, layouts)
    cfg = _cfg()
    for layout in layouts:
        loss_err, grad_err, worst = _errors(results, layout, ref)
        what = f"{method} G={world_size} {layout} mask {MASK}"
        assert loss_err <= LOSS_RTOL, f"{what}: loss error {loss_err:.1e}"
        assert grad_err <= GRAD_RTOL, f"{what}: gradient error {grad_err:.1e} ({worst})"
        # a mask changes no byte (fully masked pairs are skipped, their blocks still travel)
        per_layer = layer_comm_bytes(cfg, get(method), BATCH, SEQLEN, world_size, layout, dtype="float64")
        want = {f"{p}/{k}": v * cfg.n_layers for (p, k), v in per_layer.items()}
        got = {f"{p}/{k}": v for (p, k), v in results[0][layout]["attn_bytes"].items()}
        assert got == want, f"{what}: counted {got} != formula {want}"


@pytest.mark.parametrize("checkpoint,layout", [("whole", "balanced"), ("seq", "zigzag"), ("full", "striped")])
def test_masked_checkpoint_parity(pools, checkpoint, layout):
    """The cached (O, lse) of ``whole``/``seq`` carry the mask; ``seq``'s recompute runs the window at N/2."""
    ref = reference(MASK)
    results = pools.run(3 if layout != "zigzag" else 2, masked_run, "burst", [layout], checkpoint)
    loss_err, grad_err, worst = _errors(results, layout, ref)
    assert loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL, f"{checkpoint} {layout}: {loss_err:.1e} {grad_err:.1e}"


def tp_masked_run(version: str, layout: str, fused: bool) -> dict:
    """On every rank, fp64: Megatron TP of the masked model (all N tokens in position order at the core)."""
    from baselines.tensor_parallel import tensor_parallel

    model = tensor_parallel(build_model(_cfg(), dtype=torch.float64), version, layout=layout, fused=fused)
    loss = loss_and_grads(model, *global_batch("tiny", seqlen=SEQLEN, batch=BATCH)).item()
    return dict(loss=loss, grads={n: (model.tp_index.get(n), p.grad) for n, p in model.named_parameters()})


@pytest.mark.parametrize("version,layout,fused", [("v1", "contiguous", True), ("v3", "zigzag", False)])
def test_masked_tensor_parallel_parity(pools, version, layout, fused):
    from tests.test_model_tp import _full

    ref = reference(MASK)
    results = pools.run(3, tp_masked_run, version, layout, fused)
    for res, full in zip(results, _full([r["grads"] for r in results], ref["grads"])):
        assert abs(res["loss"] - ref["loss"]) / abs(ref["loss"]) <= LOSS_RTOL
        assert max(grad_errors(full, ref["grads"]).values()) <= GRAD_RTOL


def test_mask_matters_and_dropping_it_fails(pools):
    """The test can fail: the causal reference differs from the masked one, and a distributed model
    whose attention silently drops the mask misses the tolerance by far."""
    ref, causal = reference(MASK), reference("")
    assert abs(ref["loss"] - causal["loss"]) / abs(causal["loss"]) > 1e3 * LOSS_RTOL
    results = pools.run(2, masked_run, "burst", ["zigzag"], drop_mask=True)
    loss_err, grad_err, _ = _errors(results, "zigzag", ref)
    assert grad_err > 1e6 * GRAD_RTOL and loss_err > 1e6 * LOSS_RTOL, (loss_err, grad_err)


def test_masked_single_process_fused_matches_math():
    """The default single-device core (fused kernel on the mask's tiles) equals the materialised one."""
    with one_thread():
        model = build_model(_cfg(), dtype=torch.float64)
        loss = loss_and_grads(model, *global_batch("tiny", seqlen=SEQLEN, batch=BATCH)).item()
    assert abs(loss - reference(MASK)["loss"]) / abs(loss) <= LOSS_RTOL


def test_bad_masks_are_value_errors():
    """A mask the config, a method or a checkpoint mode cannot take: a ValueError naming both, before any byte."""
    with pytest.raises(ValueError, match=r"mask='window:-3:0'"):
        _cfg("window:-3:0")
    with pytest.raises(ValueError, match=r"mask='nope'"):
        _cfg("nope")
    model = build_model(_cfg("docs:8:0", checkpoint="seq"))
    with pytest.raises(ValueError, match=r"checkpoint='seq' with mask='docs:8:0'"):
        check_checkpoint(model, SEQLEN)
    model = build_model(_cfg("window:30:0", checkpoint="seq"))
    with pytest.raises(ValueError, match=r"checkpoint='seq' recomputes the first N/2 = 24"):
        check_checkpoint(model, SEQLEN)


def test_method_without_masks_is_refused(monkeypatch):
    """``Method.masks`` False (e.g. ring-flash-attn's adapter): sequence_parallel names the method and the mask."""
    no_masks = replace(get("burst"), name="burst_nomask", masks=False)
    with pytest.raises(ValueError, match=r"mask='window:5:0'.*method 'burst_nomask' takes only the causal mask"):
        sequence_parallel(build_model(_cfg()), no_masks, layout="zigzag")
