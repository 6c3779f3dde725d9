"""The measured records the emulated validation predicts: one class per kind of step.

A kind reads what the model needs from a measured record (method, shape and its own settings) and
predicts the record's step with a given cost model (``costs.EmulatedCosts`` for the validation,
``measured.RecordingCosts`` to list the kernel keys): ``predict(hardware, costs)`` returns a
``Predicted`` (the step's seconds and what is on its critical path).

* ``AttentionCase``: an attention op or layer (``level`` "op"/"layer"), ``model.predict_case``;
* ``TrainCase``: a whole model's training step (``level`` "model", ``mode`` "train"),
  ``model_level.predict_model`` with the record's model, loss, checkpoint mode and weights
  (FSDP2 when ``zero``), i.e. the layers' attention and MLP schedules, the LM head, the recompute
  of the checkpoint mode and the exposed weight sync (the gradient all-reduce, or FSDP2's all-gathers and
  reduce-scatters: ``schedules/zero3.py``, all blocking on the CPU ranks' ``EmulatedCosts``), as the model
  predicts the papers' runs.

Another kind (a decode step, say) is a class with ``accepts(rec)``, ``__init__(rec)`` and
``predict(hardware, costs)``, listed in ``KINDS`` before the ones it must win over.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from baselines import AttnShape

from ..model import predict_case
from ..model_level import predict_model
from ..schedules.common import EXCESS_SUFFIX

SHAPE_KEYS = ("batch", "seqlen", "heads", "kv_heads", "head_dim", "world_size", "dtype", "causal", "layout", "mask")


def row_label(rec) -> str:
    """A record's row in the reports: its method, or a model-level table's row name (``variant``: the
    main table's, the ablation's, each with its one ZeRO setting), else the method with "+zero" for
    FSDP2 (Fig. 3's Burst and Burst+ZeRO are one method, two rows)."""
    if rec.get("level") != "model":
        return rec["method"]
    variant = rec.get("variant")            # a pandas row holds NaN where a record has none
    if isinstance(variant, str) and variant:
        return variant
    return rec["method"] + ("+zero" if rec.get("zero") in (True,) else "")


@dataclass(frozen=True)
class Predicted:
    time_s: float
    critical_comm_s: float
    critical_compute_s: float                 # nan where the step is not one schedule (a whole model)
    parts: dict = field(default_factory=dict)   # seconds by part of the step (whole models)
    # each rank's compute stream (rank order), split as a CPU rank's threads split it: the work its timing thread
    # runs (kernels, host terms), and what its transfers hold it by (the excess, run by gloo's threads); () where
    # the step is not one schedule
    work_s_per_rank: tuple = ()
    held_s_per_rank: tuple = ()


def compute_split(schedule) -> tuple[tuple, tuple]:
    """(work, held) seconds per rank on the compute streams of ``schedule``, rank order (``Predicted``)."""
    work: dict[int, float] = {}
    held: dict[int, float] = {}
    for t in schedule.tasks:
        if t.kind == "compute" and t.rank is not None:
            to = held if t.name.endswith(EXCESS_SUFFIX) else work
            to[t.rank] = to.get(t.rank, 0.0) + t.duration
    ranks = sorted(set(work) | set(held))
    return tuple(work.get(r, 0.0) for r in ranks), tuple(held.get(r, 0.0) for r in ranks)


class AttentionCase:
    """An attention op or layer: method, shape, mode (forward, backward, fwd_bwd), level."""

    kind = "attention"

    @staticmethod
    def accepts(rec) -> bool:
        return rec["level"] in ("op", "layer")

    def __init__(self, rec):
        self.rec = rec
        self.method, self.mode, self.level = rec["method"], rec["mode"], rec["level"]
        self.label = row_label(rec)
        self.shape = AttnShape(**{k: rec[k] for k in SHAPE_KEYS})

    def predict(self, hardware, costs) -> Predicted:
        p = predict_case(self.method, self.shape, mode=self.mode, level=self.level, hardware=hardware, costs=costs,
                         keep_schedule=True)
        b = p.breakdown
        work, held = compute_split(p.schedule)
        return Predicted(p.time_s, b["critical_comm_s"], b["critical_compute_s"], work_s_per_rank=work,
                         held_s_per_rank=held)


class TrainCase(AttentionCase):
    """A whole model's training step (``measure.level: model``, ``mode: train``)."""

    kind = "model"

    @staticmethod
    def accepts(rec) -> bool:
        return rec["level"] == "model" and rec["mode"] == "train"

    def __init__(self, rec):
        super().__init__(rec)
        self.mode = "fwd_bwd"
        self.model, self.loss, self.checkpoint = rec["model"], rec["loss"], rec["checkpoint"]
        self.weights = "fsdp2" if rec.get("zero") else None      # None: TP's own, else replicated

    def predict(self, hardware, costs) -> Predicted:
        mp = predict_model(self.method, self.model, self.shape, mode="fwd_bwd", hardware=hardware,
                           checkpoint=self.checkpoint, weights=self.weights, loss=self.loss, costs=costs)
        return Predicted(mp.time_s, mp.critical_comm_s, math.nan, dict(mp.parts))


KINDS = (TrainCase, AttentionCase)


def case_of(rec):
    """The case of an ok record from an emulated cluster, of the first kind that accepts it; else None."""
    if rec.get("status") != "ok" or not (rec.get("cluster") or {}).get("emulated"):
        return None
    return next((kind(rec) for kind in KINDS if kind.accepts(rec)), None)
