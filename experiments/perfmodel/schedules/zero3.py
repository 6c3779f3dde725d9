"""ZeRO-3's collectives in a whole model's training step, as FSDP2 and BMTrain run them (one rank's timeline).

Every decoder block is one unit whose weights are sharded over the G sequence-parallel ranks, and so is
the root (embedding, final norm, LM head). Per step (bytes: ``burst_impl.model.fsdp``, the one formula):

* forward: the root's all-gather, then each block's all-gather before its forward. The next block's is
  issued when the current block's compute starts, one block ahead: FSDP2's implicit forward prefetch
  (torch ``distributed/fsdp/_fully_shard/_fsdp_param_group.py``, "[Note: Overlapping all-gather copy-in
  and all-gather]", ``FSDPCommContext.get_all_gather_streams``: copy-in and all-gather streams apart from
  the compute stream; pytorch/pytorch#117973), and BMTrain's ``ZeroContext.enter`` (all-gather on the
  ``load_stream``) behind ``wait_loader`` (``BMTrain/bmtrain/synchronize.py``: the CPU waits for the
  previous block's compute before it issues the next gather, so one block ahead at most);
* backward (``reshard_after_forward``, as ``fsdp.shard_weights`` and BMTrain's ZeRO-3 ``zero_pre_backward``
  run it): the root's all-gather again at the start, then each block's again, prefetched when the later
  block's backward starts (FSDP2: ``FSDPParamGroup._backward_prefetch`` from ``pre_backward``; the root's
  pre-backward prefetches the last block, over the LM head's backward; BMTrain: ``zero_pre_backward``
  gathers block i while ``release_next_module`` reduce-scatters block i+1); each block's gradients
  reduce-scattered after its backward on a side stream (FSDP2: ``foreach_reduce`` on
  ``reduce_scatter_stream``; BMTrain: ``ZeroContext.exit(backward=True)`` on the ``load_stream``), the
  root's after the embedding's; the step ends when the last reduce-scatter lands (FSDP2's
  ``finalize_backward`` waits for it).

Collectives run one after another in issue order (one queue: BMTrain has one load stream; FSDP2's two
streams share the links), each as NCCL's ring over the G ranks alone on the links (``ring_collective``,
bytes taken from the formula). While a compute op runs, the method's own transfers hold the collectives'
bottleneck channel for ``Window.busy`` of its seconds, and a collective advances at the rest of the rate
(a fluid share, the attention's transfers first). The copies FSDP2 makes around each collective
(``foreach_all_gather``'s copy-in, ``foreach_all_gather_copy_out``, ``foreach_reduce``'s chunk-cat copy-in)
are memory traffic on the compute stream. On gloo (the emulated cluster, ``CostModel.collectives_backend``)
a reduce-scatter is a ring all-reduce of the whole unit (``fsdp.REDUCE_SCATTER_STEPS``). Without side
streams (a CPU rank: ``torch.cpu.Stream`` is a stub and gloo's synchronous collectives block the Python
thread, ``CostModel.side_streams``) every collective is exposed.
"""
from __future__ import annotations

from dataclasses import dataclass

from burst_impl.model.fsdp import REDUCE_SCATTER_STEPS, padded_bytes, unit_comm_bytes, unit_shapes

from ..simulator import Schedule
from .common import Ctx, ring_collective


@dataclass(frozen=True)
class Window:
    """A compute op of the step on one rank's stream: its seconds, and how many of them the method's own
    transfers hold the collectives' bottleneck channel (``Collectives.channel``)."""
    seconds: float
    busy: float = 0.0

    @property
    def share(self) -> float:
        return min(1.0, self.busy / self.seconds) if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Collectives:
    """Seconds of one unit's collectives alone on the links, and the compute-stream seconds of their copies."""
    block_gather: float
    block_scatter: float
    root_gather: float
    root_scatter: float
    block_copies: tuple[float, float]     # (around an all-gather, around a reduce-scatter)
    root_copies: tuple[float, float]
    channel: str                          # the resource class the collectives are bound by ("send.inter")
    bytes: dict                           # {(phase, kind): bytes} one rank sends per step


def _ring(cost, place, shape, kind: str, nbytes: int, steps: int) -> Schedule:
    G = shape.world_size
    phase = "forward" if kind == "params" else "backward"
    ctx = Ctx(sch=Schedule(), cost=cost, place=place, shape=shape, mode=phase, level="layer",
              table={(phase, f"fsdp.{kind}"): nbytes})
    ring_collective(ctx, list(range(G)), phase=phase, name=f"fsdp.{kind}", steps=steps,
                    nbytes=ctx.take(phase, (f"fsdp.{kind}",)), ready={g: None for g in range(G)})
    return ctx.sch


def collectives(cfg, shape, cost, place) -> Collectives:
    """One block's and the root's all-gather and reduce-scatter over the G ranks (bytes: ``unit_comm_bytes``
    of the units' padded bytes, parameters and gradients in the shape's dtype, as ``shard_weights`` keeps
    them, on the cost model's ``collectives_backend``: gloo runs the reduce-scatter as a ring all-reduce,
    ``fsdp.REDUCE_SCATTER_STEPS``), and their copies (read + write of the gathered unit and of the shard;
    on gloo also its all-gather's flat output copied out and its reduce-scatter's clone of the input)."""
    G, e, backend = shape.world_size, shape.elem_size, cost.collectives_backend
    block, root = (padded_bytes(s, G, e) for s in unit_shapes(cfg))
    out, sent, channel = {}, {}, ("", -1.0)
    for name, unit, count in (("block", block, cfg.n_layers), ("root", root, 1)):
        b = unit_comm_bytes(unit, G, backend)
        for kind, label in (("params", "gather"), ("grads", "scatter")):
            steps = (G - 1) * (REDUCE_SCATTER_STEPS[backend] if kind == "grads" else 1)
            sch = _ring(cost, place, shape, kind, b[kind], steps)
            out[f"{name}_{label}"] = sch.makespan
            busy = {k: v for k, v in sch.breakdown()["busy_max_s"].items() if k.startswith("send")}
            top = max(busy.items(), key=lambda kv: kv[1], default=("", 0.0))
            channel = max(channel, top, key=lambda kv: kv[1])
            for phase in ("forward", "backward") if kind == "params" else ("backward",):
                sent[(phase, f"fsdp.{kind}")] = sent.get((phase, f"fsdp.{kind}"), 0) + count * b[kind]
        own = 2 * unit if backend == "gloo" else 0
        out[f"{name}_copies"] = (cost.op_seconds(cost.hbm(2 * (unit + unit // G) + own)),) * 2
    return Collectives(**out, channel=channel[0], bytes=sent)


class _Timeline:
    """One rank's compute stream and collective queue (module docstring). A collective is added once every
    compute op that can run while it does has been added (``step_seconds`` adds them in that order)."""

    def __init__(self):
        self.compute_free = self.comm_free = 0.0
        self.windows: list[tuple[float, float, float]] = []     # (start, end, share of the channel taken)

    def compute(self, ready: float, w: Window) -> tuple[float, float]:
        start = max(self.compute_free, ready)
        self.compute_free = start + w.seconds
        self.windows.append((start, self.compute_free, w.share))
        return start, self.compute_free

    def collective(self, issued: float, seconds: float) -> float:
        """End of a collective of ``seconds`` alone on the links, issued at ``issued``: it starts when the
        queue is free and advances at (1 - share) of its rate inside compute windows, at its rate outside."""
        t = max(issued, self.comm_free)
        left = seconds
        for start, end, share in self.windows:
            if left <= 0 or end <= t:
                continue
            if start > t:                              # idle links before this window
                step = min(left, start - t)
                t, left = t + step, left - step
                if left <= 0:
                    break
            rate = 1.0 - share
            if rate > 0 and left <= (end - t) * rate:
                t, left = t + left / rate, 0.0
            else:
                left -= (end - t) * rate
                t = end
        self.comm_free = t + max(left, 0.0)
        return self.comm_free


def step_seconds(forward: Window, backward: Window, head_fwd: Window, head_bwd: Window, layers: int,
                 coll: Collectives, side_streams: bool) -> float:
    """Seconds of the whole step's compute and ZeRO-3 collectives (module docstring); the step's compute
    alone is ``layers x (forward + backward) + head``, so the exposed collectives are the difference."""
    ag_copy, rs_copy = coll.block_copies
    fwd = Window(forward.seconds + ag_copy, forward.busy)
    bwd = Window(backward.seconds + ag_copy + rs_copy, backward.busy)
    head_f = Window(head_fwd.seconds + coll.root_copies[0], head_fwd.busy)
    head_b = Window(head_bwd.seconds + sum(coll.root_copies), head_bwd.busy)
    if not side_streams:            # every collective blocks the rank's only thread
        comm = 2 * (coll.root_gather + layers * coll.block_gather) + coll.root_scatter + layers * coll.block_scatter
        return layers * (fwd.seconds + bwd.seconds) + head_f.seconds + head_b.seconds + comm
    tl = _Timeline()
    root = tl.collective(0.0, coll.root_gather)
    gathered = tl.collective(0.0, coll.block_gather)
    for k in range(layers):
        start, _ = tl.compute(max(root, gathered), fwd)
        if k + 1 < layers:
            gathered = tl.collective(start, coll.block_gather)      # the next block's, one ahead
    _, end = tl.compute(0.0, head_f)
    root = tl.collective(end, coll.root_gather)                     # pre-backward: the root again ...
    tl.compute(root, head_b)
    gathered = tl.collective(end, coll.block_gather)                # ... and the last block's, prefetched
    start, end = tl.compute(gathered, bwd)
    for k in range(layers - 1, -1, -1):
        if k > 0:
            gathered = tl.collective(start, coll.block_gather)      # block k-1's, issued as block k starts
            nxt = tl.compute(gathered, bwd)
        tl.collective(end, coll.block_scatter)                      # block k's gradients
        if k > 0:
            start, end = nxt
    tl.collective(end, coll.root_scatter)                           # the embedding's (root's) last
    return max(tl.compute_free, tl.comm_free)
