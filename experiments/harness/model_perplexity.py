"""``measure.modes: [perplexity]``: BurstAttention's Table 4 (the methods are exact), at model level.

Each case trains the case's decoder (``model.name``, its method's parallelism, kernel, loss and
checkpoint mode) for ``model.train_steps`` AdamW steps at ``model.lr`` on global batches drawn from the
training part of the seeded corpus ``model.corpus`` (``burst_impl.model.data``; nothing is downloaded),
then evaluates the perplexity exp(mean token loss) over ``model.eval_tokens`` held-out tokens: windows
of N tokens from the corpus' last part, which no training batch touches. Rank 0 trains the
single-process model the same way (same seed, batches, optimizer; the default kernel, no
parallelism) and records both, their relative difference and whether it is within the dtype's
tolerance (``PPL_RTOL``). Nothing is timed: this is a correctness result.

Why a tolerance and not equality: every method sums the same products in another order (ring steps,
online softmax merges, all-reduced gradients), so the weights after T AdamW steps differ by rounding,
and AdamW divides by sqrt(v), which scales small gradient differences up. The tolerance is an fp
rounding bound per dtype, not fitted to the paper (whose Table 4 agrees to 3e-4).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from burst_impl.model import build_model as build_decoder
from burst_impl.model.data import batch_at, load_corpus
from burst_impl.model.step import forward_loss, train_step

from . import results as R
from .model_record import training_setup
from .model_steps import build_model, case_config
from .spec import Case
from .steps import kernel_used

# |ppl - ppl_reference| / ppl_reference allowed, by dtype (module docstring)
PPL_RTOL = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 2e-2, "float16": 1e-2}
TRAIN_SHARE = 0.9          # the corpus' first 90% feeds training batches, the rest is held out


def _corpus(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(training part, held-out part) of the case's corpus; the held-out part has ``eval_tokens`` + 1."""
    cfg = case_config(case)
    need = case.eval_tokens + 1
    n = max(1 << 14, math.ceil(need / (1 - TRAIN_SHARE)) + case.seqlen + 1)
    tokens = load_corpus(case.corpus, cfg.vocab_size, n_tokens=n, seed=case.seed)
    cut = int(tokens.numel() * TRAIN_SHARE)
    if tokens.numel() - cut < need or cut < case.seqlen + 1:
        raise ValueError(f"model.eval_tokens={case.eval_tokens} and seqlen={case.seqlen} do not fit corpus "
                         f"{case.corpus!r} of {tokens.numel()} tokens ({TRAIN_SHARE:.0%} for training)")
    return tokens[:cut], tokens[cut:]


def _train_and_eval(model, case: Case, device: torch.device) -> dict:
    """Train ``model`` (any parallelism) on the case's batches, then its held-out perplexity."""
    train, held = _corpus(case)
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr)
    windows = case.eval_tokens // case.seqlen       # whole windows of N tokens (the spec rule makes >= 1)

    def evaluate() -> float:
        total = 0.0
        with torch.no_grad():
            for w in range(windows):
                chunk = held[w * case.seqlen: (w + 1) * case.seqlen + 1].to(device)
                x, y = chunk[:-1].expand(case.batch, -1), chunk[1:].expand(case.batch, -1)
                total += float(forward_loss(model, x.contiguous(), y.contiguous()).double())
        return math.exp(total / windows)

    before = evaluate()
    losses = []
    for step in range(case.train_steps):
        x, y = batch_at(train, step, case.batch, case.seqlen, seed=case.seed)
        losses.append(float(train_step(model, opt, x.to(device), y.to(device))))
    return {"perplexity": evaluate(), "perplexity_before": before, "train_losses": losses,
            "eval_windows": windows}


_REFERENCES: dict[tuple, dict] = {}


def _reference(case: Case, device: torch.device) -> dict:
    """The single-process model trained and evaluated as ``case``, cached by what it depends on (every
    method's case of a spec shares it; not the method, kernel or weights)."""
    key = (case.model, case.loss, case.checkpoint, case.seqlen, case.batch, case.dtype, case.seed,
           case.train_steps, case.eval_tokens, case.lr, case.corpus, device.type)
    if key not in _REFERENCES:
        model = build_decoder(case_config(case), seed=case.seed, dtype=case.shape.torch_dtype, device=device)
        torch.manual_seed(case.seed)
        _REFERENCES[key] = _train_and_eval(model, case, device)
    return _REFERENCES[key]


def perplexity_record(case: Case, *, rank: int, world: int, device: torch.device) -> dict | None:
    """Train and evaluate ``case`` on every rank; on rank 0 its record with the single-process reference."""
    group = dist.group.WORLD if dist.is_initialized() else None
    torch.manual_seed(case.seed)
    _, model = build_model(case, group=group, device=device)
    got = _train_and_eval(model, case, device)
    if rank != 0:
        if world > 1:
            dist.barrier()       # wait while rank 0 trains the reference (a collective the pg timeout bounds)
        return None
    ref = _reference(case, device)
    if world > 1:
        dist.barrier()
    rtol = PPL_RTOL[case.dtype]
    rel = abs(got["perplexity"] - ref["perplexity"]) / ref["perplexity"]
    rec = R.base_record(case, "ok", extra_config={"device": device.type,
                                                   "backend": "nccl" if device.type == "cuda" else "gloo"})
    rec.update({
        "kernel": kernel_used(case, device), "model": case.model, "zero": case.zero,
        **training_setup(case, case_config(case)),
        **got, "perplexity_reference": ref["perplexity"], "perplexity_reference_before": ref["perplexity_before"],
        "reference_train_losses": ref["train_losses"], "perplexity_rel_diff": rel, "perplexity_rtol": rtol,
        "perplexity_equal": rel <= rtol, "train_steps": case.train_steps, "eval_tokens": case.eval_tokens,
        "corpus": case.corpus, "lr": case.lr,
        "reference": "single-process model (no parallelism, default kernel), same seed, batches and optimizer",
        "mem_measured_over": "not measured (perplexity)", "comm_measured_over": "not measured (perplexity)",
    })
    return rec
