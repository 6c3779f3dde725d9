"""One measurement of a spec: a method, a shape, a mode (``Case``), built by ``experiments.harness.plan``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from burst_impl.shape import AttnShape

from . import axes

AUTO_KERNEL = "auto"     # in ``kernels:``: the method's automatic choice (Case.kernel None)


@dataclass(frozen=True)
class Case:
    """One measurement: one method, one shape, one mode. One record in the results."""

    experiment: str
    method: str
    level: str
    mode: str
    shape: AttnShape
    warmup: int
    repeats: int
    seed: int
    measure_memory: bool = True
    measure_comm: bool = True
    case_timeout_s: float = 600.0
    pg_timeout_s: float = 120.0
    kernel: str | None = None        # local kernel (burst_impl.kernels name) passed as backend=; None: automatic
    # level "model" only (model_cases.py): the decoder config, FSDP2 weights, the optimizer
    model: str | None = None
    zero: bool = False
    optimizer: str = "adamw"
    # model level: the training setup (model_cases.ModelVariant); ``variant`` names the row and leads the case id
    variant: str | None = None
    variant_label: str = ""
    loss: str = "unfused"
    checkpoint: str = "none"
    # measure.modes: [perplexity] only (model_perplexity.py)
    train_steps: int = 0
    eval_tokens: int = 0
    lr: float = 1e-3
    corpus: str = "markov"
    loss_parity: bool = False        # train: each step's loss against the unsharded model's (model_parity.py)
    max_repeats: int | None = None   # adaptive repeats up to this cap (None: exactly ``repeats``)
    ci_target: float = 0.05          # stop when the median's 95% interval is within +-ci_target
    interleave: bool = True          # time with the other methods of the same shape, in rounds
    # level "inference" only (inference_cases.py): the context-parallel merge, tokens per decode step, placement
    merge: str | None = None
    new_tokens: int = 1
    placement: str = "round_robin"
    min_sample_s: float = 0.0        # consecutive calls per sample until it lasts this long (0: one; not model level)

    @property
    def repeat_cap(self) -> int:
        return max(self.repeats, self.max_repeats or self.repeats)

    @property
    def group_key(self) -> tuple:
        """Cases with equal keys are timed together in interleaved rounds (methods of one case shape).
        Model-level cases run alone: a whole decoder per method at once would not fit where one does."""
        if not self.interleave or self.level == "model":
            return (self.case_id,)
        return (self.experiment, self.level, self.mode, self.shape, self.kernel)

    def __getattr__(self, name: str):
        # case.seqlen, case.world_size, ...: the sweep axes are the shape's fields
        if name in axes.AXES:
            return getattr(self.shape, name)
        raise AttributeError(name)

    @property
    def case_id(self) -> str:
        base = axes.case_id(self.method, self.level, self.mode, self.shape)
        if self.model is not None:
            base += f".{self.model}" + (".zero" if self.zero else "")
            if self.variant is not None:        # the row's name replaces the method's (summary.series)
                base = self.variant + base[len(self.method):]
            else:                               # a spec-wide setup other than the default
                base += (f".{self.loss}" if self.loss != "unfused" else "") + (
                    f".ck_{self.checkpoint}" if self.checkpoint != "none" else "")
        if self.level == "inference" and self.mode != "ttft":   # the row's merge, and q and placement if not 1 / rr
            base += "".join((f".{self.merge}" if self.merge else "", f".q{self.new_tokens}" * (self.new_tokens != 1),
                             f".{self.placement}" * (self.placement != "round_robin")))
        return f"{base}.{self.kernel}" if self.kernel else base

    def to_dict(self) -> dict:
        """Flat: the shape's fields next to the case's own (the records' ``config``)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "shape"}
        d.update(dataclasses.asdict(self.shape))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        shape = axes.shape_from(d)
        return cls(shape=shape, **{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})
