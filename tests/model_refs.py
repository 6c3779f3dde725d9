"""Single-process references and comparisons shared by the model tests (tests/test_model_*.py)."""
from __future__ import annotations

import contextlib
import functools

import torch

from baselines.registry import get
from burst_impl import comm
from burst_impl.model import build_model, get_config, loss_and_grads, prefill_step, sequence_parallel, train_step
from burst_impl.model.parallel import grad_sync_bytes
from burst_impl.model.data import batch_at, load_corpus
from burst_impl.model.layers import LocalAttention

BATCH, SEQLEN = 2, 24      # N = 24 splits for every layout at G = 1, 2, 3, 4 (zigzag needs 2G | N)
LR = 1e-2


@contextlib.contextmanager
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def global_batch(cfg_name: str, step: int = 0, seqlen: int = SEQLEN, batch: int = BATCH):
    cfg = get_config(cfg_name)
    return batch_at(load_corpus("markov", cfg.vocab_size, n_tokens=4096), step, batch, seqlen)


def math_model(cfg_name: str, dtype=torch.float64):
    """The single-device model with materialised-score attention (exact in its dtype)."""
    model = build_model(get_config(cfg_name), dtype=dtype)
    for block in model.layers:
        block.attention.core = LocalAttention(fused=False)
    return model


@functools.lru_cache(maxsize=8)
def reference(cfg_name: str, seqlen: int = SEQLEN) -> dict:
    """fp64 single-process loss, every parameter gradient, and the prefill's next tokens."""
    with one_thread():
        model = math_model(cfg_name)
        tokens, labels = global_batch(cfg_name, seqlen=seqlen)
        loss = loss_and_grads(model, tokens, labels).item()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        ids = prefill_step(model, tokens)
    return dict(loss=loss, grads=grads, next_ids=ids)


@functools.lru_cache(maxsize=4)
def reference_curve(cfg_name: str, steps: int, dtype=torch.float64) -> tuple[float, ...]:
    """Losses of ``steps`` AdamW steps of the single-process model (batch ``step`` at step ``step``)."""
    with one_thread():
        model = math_model(cfg_name, dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        return tuple(train_step(model, opt, *global_batch(cfg_name, s)).item() for s in range(steps))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: the error relative to the tensor's scale."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def grad_errors(grads: dict, ref: dict) -> dict[str, float]:
    assert grads.keys() == ref.keys(), f"parameters differ: {sorted(set(grads) ^ set(ref))}"
    return {n: rel_err(grads[n], ref[n]) for n in ref}


# ---------------------------------------------------------------- run on every rank of a pool


def sp_run(cfg_name: str, method: str, layouts: list[str], positions_bug: bool = False,
            skip_sync: bool = False) -> dict:
    """On every rank: one step and one prefill per layout; loss, grads, next ids, counted bytes."""
    tokens, labels = global_batch(cfg_name)
    out = {}
    for layout in layouts:
        model = sequence_parallel(build_model(get_config(cfg_name)), get(method), layout=layout)
        if positions_bug:   # negative control: RoPE at local positions 0..N/G-1 instead of global ones
            model.parallel.positions = lambda n, device=None, _p=model.parallel: torch.arange(n // _p.world_size)
        if skip_sync:       # negative control: no gradient all-reduce
            model.parallel.reduce_grads = ()
        with comm.count_bytes() as step_bytes:
            loss = loss_and_grads(model, tokens, labels).item()
        with comm.count_bytes() as prefill_bytes:
            ids = prefill_step(model, tokens)
        out[layout] = dict(loss=loss, grads={n: p.grad for n, p in model.named_parameters()}, ids=ids,
                           step_bytes=dict(step_bytes), prefill_bytes=dict(prefill_bytes),
                           sync_bytes=grad_sync_bytes(model))
    return out


def tp_run(cfg_name: str, version: str, layouts: list[str], fused: bool) -> dict:
    """On every rank: one TP step and one prefill per layout; loss, this rank's gradient slices
    ``{name: (index or None, grad)}``, next ids, counted bytes."""
    from baselines.tensor_parallel import tensor_parallel

    tokens, labels = global_batch(cfg_name)
    out = {}
    for layout in layouts:
        model = tensor_parallel(build_model(get_config(cfg_name)), version, layout=layout, fused=fused)
        with comm.count_bytes() as step_bytes:
            loss = loss_and_grads(model, tokens, labels).item()
        with comm.count_bytes() as prefill_bytes:
            ids = prefill_step(model, tokens)
        out[layout] = dict(loss=loss, ids=ids, step_bytes=dict(step_bytes), prefill_bytes=dict(prefill_bytes),
                           sync_bytes=grad_sync_bytes(model),
                           grads={n: (model.tp_index.get(n), p.grad) for n, p in model.named_parameters()})
    return out


def fsdp_run(cfg_name: str, method: str, layout: str, steps: int) -> dict:
    """On every rank: the same training with replicated weights and with FSDP2-sharded weights;
    the losses of ``steps`` AdamW steps and the (full) gradients of the first step for both."""
    from burst_impl.model.fsdp import full_grads, shard_weights

    out = {}
    for weights in ("replicated", "fsdp2"):
        model = sequence_parallel(build_model(get_config(cfg_name)), get(method), layout=layout)
        if weights == "fsdp2":
            shard_weights(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, grads = [], None
        for s in range(steps):
            opt.zero_grad(set_to_none=True)
            losses.append(loss_and_grads(model, *global_batch(cfg_name, s)).item())
            if s == 0:
                grads = {n: g.clone() for n, g in full_grads(model).items()}
            opt.step()
        out[weights] = dict(losses=losses, grads=grads, ids=prefill_step(model, global_batch(cfg_name, 0)[0]),
                            sharded=[type(p).__name__ for p in model.parameters()][:1])
    return out


def curve_run(cfg_name: str, method: str, layout: str, steps: int) -> list[float]:
    """On every rank: the losses of ``steps`` AdamW steps of the sequence-parallel model."""
    model = sequence_parallel(build_model(get_config(cfg_name)), get(method), layout=layout)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return [train_step(model, opt, *global_batch(cfg_name, s)).item() for s in range(steps)]
