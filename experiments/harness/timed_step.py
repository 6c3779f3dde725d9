"""``Step``: what the harness times for one case, whatever its level (op, layer, model)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


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

    def full(self) -> None:
        """setup + one call: the whole work of one measured step (memory and bytes are taken over it)."""
        if self.setup is not None:
            self.setup()
        (self.single or self.step)()
