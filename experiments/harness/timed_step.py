"""``Step``: what the harness times for one case, whatever its level (op, layer, model)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .timing import autorange

MAX_STEPS_PER_SAMPLE = 64    # calls one sample runs back to back (decode: the cache's reserve, the context's drift)


@dataclass
class Step:
    step: Callable[[], object]              # what is timed
    setup: Callable[[], object] | None      # untimed, before each timed step
    start_bytes: int                        # bytes of the step's inputs and weights (its own, every method alike)
    forward: Callable[[], object] | None = None   # the forward with grad enabled (bytes kept for backward)
    weights: tuple = ()                           # parameters (not activations: not counted as saved)
    context: object = None                  # what the step holds, for its record (model level: model_steps.ModelRun)
    # ``step`` runs ``calls`` calls of ``single`` back to back (timing.autorange: a decode step of a few ms);
    # the harness divides its samples by ``calls``, and counts bytes and memory over one call
    calls: int = 1
    single: Callable[[], object] | None = None

    def live_bytes(self) -> int:
        """What is live before a step now (CPU memory base): model level adds weights, gradients and
        optimizer state, which exist only once a step has run."""
        return self.start_bytes + (self.context.state_bytes() if hasattr(self.context, "state_bytes") else 0)

    @property
    def one(self) -> Callable[[], object]:
        """One call of the step (``single`` where a sample runs several)."""
        return self.single or self.step

    def full(self) -> None:
        """setup + one call: the whole work of one measured step (memory and bytes are taken over it)."""
        if self.setup is not None:
            self.setup()
        self.one()


def back_to_back(call: Callable[[], object], calls: int,
                 between: Callable[[], object] | None = None) -> Callable[[], object]:
    """A callable running ``call`` ``calls`` times (``between()`` after each but the last), giving the last result."""
    def run():
        for _ in range(calls - 1):
            call()
            if between is not None:
                between()
        return call()
    return run


def repeated(step: Step, min_s: float, *, device, group, between: Callable[[], object] | None = None) -> Step:
    """``step`` with a sample of ``calls`` calls back to back, as many as ``min_s`` seconds take
    (``timing.autorange``, pilots after ``step.setup``; at most ``MAX_STEPS_PER_SAMPLE``; ``between`` runs between
    them, inside the timing). ``setup`` stays once a sample; the harness divides the sample by ``calls``, and takes
    bytes and memory over one call (``single``)."""
    calls = autorange(step.step, step.setup, min_s, cap=MAX_STEPS_PER_SAMPLE, device=device, group=group)
    return replace(step, step=back_to_back(step.step, calls, between), calls=calls, single=step.step)
