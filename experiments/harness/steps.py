"""What one step of a case does: inputs, and the callables the timing and
memory modules run. Generic over the registry: op-level methods are called
through ``Method.fn``; layer-level measurements go through
``baselines.layer`` (attention layer: projections + attention + output);
model-level ones (a whole decoder trained or prefilled) through ``model_steps``.

Modes (docs/papers.md §3, "FLOP convention"):
* ``forward``: the forward under ``torch.no_grad`` (inference prefill);
* ``backward``: the backward only; the forward runs untimed in ``setup``;
* ``fwd_bwd``: forward then backward (a training step of the layer).
"""
from __future__ import annotations

from typing import Callable

import torch

from baselines import layer as attn_layer
from burst_impl.method import Method
from baselines.registry import METHODS
from burst_impl.kernels import resolve_backend

from .model_steps import build_model_step
from .inference_steps import build_inference_step
from .spec import Case
from .timed_step import Step, repeated


def kernel_options(case: Case) -> dict:
    """``backend=`` for the method when the case names a kernel (else the method's automatic choice)."""
    return {"backend": case.kernel} if case.kernel is not None else {}


def kernel_used(case: Case, device: torch.device) -> str:
    """The local kernel this case runs on ``device``: the method's own, the one asked for, or the
    automatic choice for the case's dtype and head dim (what ``burst_impl.kernels`` resolves); a decode
    step's choice for its few new-token rows (``kernels.CUDNN_MIN_ROWS``)."""
    fixed = METHODS[case.method].kernel
    if fixed is not None:
        return fixed
    rows = case.new_tokens if case.mode == "decode" else None
    return resolve_backend(device, case.kernel, case.shape.torch_dtype, case.head_dim, rows=rows)


def _randn(shape, gen, dtype, device):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def _generator(seed: int, rank: int) -> torch.Generator:
    # Each rank draws its own shard directly (a global tensor would not fit at
    # 1M tokens); values do not affect timing, only reproducibility does.
    return torch.Generator().manual_seed(seed * 1_000_003 + rank)


def _wrap_mode(mode: str, forward: Callable[[], torch.Tensor], params: list[torch.Tensor],
               dout_like: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Callable, Callable | None]:
    state: dict[str, torch.Tensor] = {}

    def zero_grads():
        for p in params:
            p.grad = None

    if mode == "forward":
        def step():
            with torch.no_grad():
                return forward()
        return step, None
    if mode == "backward":
        def setup():
            zero_grads()
            state["out"] = forward()
            state["dout"] = dout_like(state["out"])

        def step():
            out = state.pop("out")
            out.backward(state.pop("dout"))
        return step, setup
    if mode == "fwd_bwd":
        def step():
            zero_grads()
            out = forward()
            out.backward(dout_like(out))
        return step, None
    raise ValueError(f"mode={mode!r} is unknown")


def build_op_step(case: Case, method: Method, *, rank: int, group, device: torch.device) -> Step:
    """Local shards q (B, N/G, Z, d), k/v (B, N/G, Zkv, d) of ``case.layout``; calls ``method.fn``."""
    s = case.shape
    gen = _generator(case.seed, rank)
    dt = s.torch_dtype
    grad = case.mode != "forward"
    n = s.lengths[rank]          # N/G, or this rank's share of an uneven N (layout.lengths)
    q = _randn((s.batch, n, s.heads, s.head_dim), gen, dt, device).requires_grad_(grad)
    k = _randn((s.batch, n, s.kv_heads, s.head_dim), gen, dt, device).requires_grad_(grad)
    v = _randn((s.batch, n, s.kv_heads, s.head_dim), gen, dt, device).requires_grad_(grad)
    dout = _randn((s.batch, n, s.heads, s.head_dim), gen, dt, device)

    def forward():
        return method.call(q, k, v, causal=s.causal, mask=s.mask, group=group, layout=s.layout,
                           **kernel_options(case))

    step, setup = _wrap_mode(case.mode, forward, [q, k, v], lambda out: dout)
    start = sum(t.numel() * t.element_size() for t in (q, k, v, dout))
    return Step(step=step, setup=setup, start_bytes=start, forward=forward if grad else None)


def build_layer_step(case: Case, method: Method, *, rank: int, group, device: torch.device) -> Step:
    """The attention layer of ``method`` from ``baselines.layer``: hidden states (B, N/G or N, H) in,
    QKV projection, attention, output projection, hidden states out."""
    s = case.shape
    lay = attn_layer.make_layer(case.method, s, group=group, seed=case.seed, device=device,
                                **kernel_options(case))
    tokens = s.seqlen if lay.input == "replicated" else s.lengths[rank]   # this rank's share of N
    gen = _generator(case.seed, rank)
    hidden = s.heads * s.head_dim
    grad = case.mode != "forward"
    x = _randn((s.batch, tokens, hidden), gen, s.torch_dtype, device).requires_grad_(grad)
    params = [x, *lay.params.values()]
    # dY has the layer output's shape, which is the input's (B, tokens, H) for every method (TP V1:
    # replicated in and out); drawn up front so it counts among the step's inputs like the op's dout.
    douts: dict[tuple, torch.Tensor] = {} if not grad else {
        tuple(x.shape): _randn(tuple(x.shape), gen, s.torch_dtype, device)}

    def forward():
        return attn_layer.layer_forward(lay, x)

    def dout_like(out):
        key = tuple(out.shape)
        if key not in douts:
            douts[key] = _randn(key, gen, out.dtype, out.device)
        return douts[key]

    step, setup = _wrap_mode(case.mode, forward, params, dout_like)
    start = sum(t.numel() * t.element_size() for t in [*params, *douts.values()])
    return Step(step=step, setup=setup, start_bytes=start, forward=forward if grad else None,
                weights=tuple(lay.params.values()))


def build_step(case: Case, *, rank: int, group, device: torch.device) -> Step:
    if case.level == "model":
        return build_model_step(case, rank=rank, group=group, device=device)
    if case.level == "inference":
        return build_inference_step(case, rank=rank, group=group, device=device)
    method = METHODS[case.method]
    if case.level == "layer":
        step = build_layer_step(case, method, rank=rank, group=group, device=device)
    else:
        step = build_op_step(case, method, rank=rank, group=group, device=device)
    return consecutive(step, case.min_sample_s, device=device, group=group)


def consecutive(step: Step, min_s: float, *, device: torch.device, group) -> Step:
    """An op or layer step at ``measure.min_sample_s``: its calls back to back (``timed_step.repeated``). A step
    with an untimed setup before each call (backward: the forward it differentiates) stays one call a sample."""
    if min_s <= 0 or step.setup is not None:
        return step
    return repeated(step, min_s, device=device, group=group)
