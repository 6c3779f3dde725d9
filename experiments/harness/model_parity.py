"""Loss parity of a timed training run (``model.loss_parity: true``): each step's loss against the unsharded model's.

A model-level training case records the loss of every step it ran (``losses``: warm-up, timed rounds
and the untimed step that counts bytes and memory, all on the same seeded global batch). With
``model.loss_parity`` rank 0 then trains the single-process model the same number of steps: the same
config (loss and checkpoint mode), seed, weights, batch, optimizer and learning rate, no parallelism
and the default kernel (``model_steps.build_model_run(parallel=False)``), and the record carries its
losses (``reference_train_losses``), the largest relative difference over the steps
(``loss_rel_diff``), the tolerance (``loss_rtol``, its reason in ``loss_rtol_reason``) and whether
they agree (``loss_equal``). The reference is kept between the cases of one worker that share it
(every method of a spec's shape), and trained further when a case ran more steps.

The tolerance is a rounding bound per dtype, not fitted to any paper. float32: one step of the tiny
model in fp32 against fp64 agrees to ``tests/test_model_parity.LOSS_RTOL`` = 2e-6; here both sides
round (x 2), the longest sums (the loss' mean and the attention's over N <= 2048 tokens, the LM head's
over the vocabulary) are up to sqrt(2048 / 192) = 3.3x longer than that test's, and the steps' AdamW
updates (learning rate ``model_steps.LEARNING_RATE``) carry the differences on: 2e-6 x 2 x 3.3 = 1.3e-5,
rounded up to 2e-5. ``tests/test_loss_parity_record.py`` scales the LM head's weights by 1.02 (a 2%
error in every logit) and misses the bound by > 100x; at initialisation the loss is close to log V
and moves little, so smaller errors deep in a block (1% of one MLP weight: 2e-6) pass unseen here
and are the per-gradient parity tests' to catch (``tests/test_model_parity.py``). float64: rounding at
1e-16, 1e-9 leaves room for any order. Half precisions round at 4e-3 (bfloat16, 8 bits) and 5e-4 (float16, 11 bits) per
operation, and their loss is the mean of fp32 log-sums over values rounded that much: a few of those
roundings, 2e-2 and 1e-2 (the bounds of the perplexity check, ``model_perplexity.PPL_RTOL``).
"""
from __future__ import annotations

import torch

from burst_impl.model.step import train_step

from .model_steps import ModelRun, build_model_run
from .spec import Case

# |loss - reference| / |reference| allowed at every step, by dtype (module docstring)
LOSS_RTOL = {"float64": 1e-9, "float32": 2e-5, "bfloat16": 2e-2, "float16": 1e-2}
LOSS_RTOL_REASON = ("rounding only: the methods sum the same products in another order and the steps' AdamW "
                    "updates carry it on; float32: 2e-6 (one step of the tiny model against fp64, "
                    "tests/test_model_parity.py) x 2 (both sides round) x 3.3 (sums up to 2048 terms, not 192), "
                    "rounded up; half precisions a few roundings of their unit (experiments/harness/model_parity.py)")
REFERENCE = "single-process model (no parallelism, default kernel), same config, seed, batch, optimizer and steps"

_REFERENCES: dict[tuple, ModelRun] = {}


def _key(case: Case, device: torch.device) -> tuple:
    """What the reference depends on: not the method, kernel, weights' sharding, or the number of steps."""
    return (case.model, case.loss, case.checkpoint, case.shape.mask, case.seqlen, case.batch, case.dtype, case.seed,
            case.optimizer, device.type)


def reference_losses(case: Case, steps: int, device: torch.device) -> list[float]:
    """The first ``steps`` losses of the single-process model trained as ``case`` (kept and extended)."""
    key = _key(case, device)
    if key not in _REFERENCES:
        torch.manual_seed(case.seed)
        _REFERENCES[key] = build_model_run(case, group=None, device=device, parallel=False)
    run = _REFERENCES[key]
    while len(run.losses) < steps:
        run.losses.append(train_step(run.model, run.optimizer, run.tokens, run.labels))
    return [float(x) for x in run.losses[:steps]]


def parity(losses: list[float], reference: list[float], dtype: str) -> dict:
    """The record's loss-parity fields: the largest relative difference over the steps and the verdict."""
    if not losses or len(losses) != len(reference):
        raise ValueError(f"losses: {len(losses)} steps against {len(reference)} of the reference; they must be "
                         "the same number of steps, at least one")
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    rtol = LOSS_RTOL[dtype]
    return {"reference_train_losses": list(reference), "loss_rel_diff": rel, "loss_rtol": rtol,
            "loss_rtol_reason": LOSS_RTOL_REASON, "loss_equal": rel <= rtol, "reference": REFERENCE}


def parity_fields(case: Case, run: ModelRun, device: torch.device) -> dict:
    """The loss-parity fields of a training case that asked for them (``model.loss_parity``), else none."""
    if not case.loss_parity or case.mode != "train":
        return {}
    losses = [float(x) for x in run.losses]
    return parity(losses, reference_losses(case, len(losses), device), case.dtype)
