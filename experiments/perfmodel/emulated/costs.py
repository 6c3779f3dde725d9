"""The emulated cluster's cost model: the hardware cost model with this machine's measured terms.

Three things differ from an accelerator, each measured on this machine apart from the run:

* compute: every kernel (a band or varlen tile as itself, ``measured.masked_key``), GEMM, score block,
  softmax and byte of memory traffic a schedule asks for is read from a ``KernelTimes`` table
  (``measured.py``) x ``scale`` (``validate.load_scale``: the
  run's own calibration over the table's time for the same work; the machine's load differs). Memory
  traffic, and work bound by it (``memory_bound``: a decode step's attention over its cache), go at
  ``mem_scale`` where one is given (``validate.loads_of``'s memory rules: a stream's load), else at ``scale``
  (the default rule since 2026-12-07, docs/findings.md, "Memory-bound work at the group's compute load");
* host: every op on a rank's compute stream costs ``host_s`` more (``host_cost.host_per_op``): a
  CPU rank runs Python, the dispatcher and the method's bookkeeping in series with its kernels; and
  every kernel call ``call_host_s`` more (``host_cost.per_call_host``): a plan's tile is selected
  before its kernel and merged after it (``burst_impl.attention.forward_tiles``), work the kernel
  table does not time; and every ring step ``step_host_s``, a skipped one too (``host_cost.split_host``):
  posting its hops, waiting on them, planning it;
* excess: a transfer takes ``a + k x bytes`` of its sender's compute while it runs, ``+ c x`` the compute
  it runs beside where the probe measured that (``excess.fit_excess``, per link class, and across nodes
  per pattern: a hop whose sender also receives across is the probe's pair exchange, one whose sender
  receives inside its node its one-way case):
  gloo's threads and the kernel's TCP work run out of the rank's capped share;
* small messages: a transfer of messages no larger than the message probe measured holds its sender
  ``held(bytes)`` per message instead (``message.fit_messages``): a rank that waits for a message of a
  few KiB is held by its own send and receive path and its wake-up, not by the bytes;
* a ring's send: its sender's wait on it returns once the bytes fit the socket buffers
  (``send_buffer.SendBuffers.hold``), not when they land (``CostModel.sender_release``).

Host and excess reach the schedules through the hardware model's hooks (``CostModel.op_seconds``,
``CostModel.sender_seconds``), which are the work alone and nothing on every hardware profile.
Transfers themselves keep the hardware model's ``latency + bytes / rate`` on the emulated links
(``hardware.emulated_hardware``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..costs import CostModel
from .cfs import CfsShare
from .measured import HBM, KernelTimes, masked_key
from .message import MessageCost
from .send_buffer import SendBuffers
from burst_impl.flops import entries_flops


@dataclass(frozen=True)
class EmulatedCosts(CostModel):
    times: KernelTimes | None = None
    scale: float = 1.0
    mem_scale: float | None = None       # memory-bound work's load (validate.loads_of's rule); None: ``scale``
    host_s: float = 0.0                  # host seconds per op on the compute stream
    call_host_s: float = 0.0             # host seconds per attention kernel call (a tile's selects and merge)
    step_host_s: float = 0.0             # host seconds per ring step, whatever its tiles (its posts, waits, plan)
    # {"intra" | "inter" | "inter_oneway": (seconds, seconds per byte[, seconds per second of compute beside it])}
    # a transfer takes from its sender's compute
    excess: dict = field(default_factory=dict)
    messages: MessageCost | None = None     # small blocking messages (message.py); None: the excess line for all
    sends: SendBuffers | None = None        # what a ring's send holds its sender for (send_buffer.py); None: until
                                            # the transfer lands, as on a GPU
    cfs: CfsShare | None = None             # the ranks' compute under CFS as a fluid (cfs.py, opt-in); None: at the cap
    # A CPU rank has no side streams: torch.cpu.Stream is a stub and gloo's synchronous collectives block the
    # Python thread (FSDP2's all-gathers and reduce-scatters, ``parallel.sync_grads``' all-reduce after the
    # backward), so ``schedules/zero3.py`` and the gradient sync expose every such collective.
    side_streams: ClassVar[bool] = False
    collectives_backend: ClassVar[str] = "gloo"     # the emulated cluster's ranks run gloo

    def op_seconds(self, seconds: float) -> float:
        return seconds + self.host_s

    def step_seconds(self) -> float:
        return self.step_host_s

    def schedules(self):
        return super().schedules() if self.cfs is None else self.cfs.schedules()

    def sender_seconds(self, nbytes: float, same_node: bool, messages: int = 1, two_way: bool = True,
                       beside: float | None = None) -> float:
        if nbytes <= 0:
            return 0.0
        if self.messages is not None and self.messages.covers(nbytes / messages):
            return messages * self.messages.held(nbytes / messages)
        klass = "intra" if same_node or self.hw.inter is None else "inter" if two_way else "inter_oneway"
        if klass not in self.excess and klass == "inter_oneway":
            klass = "inter"         # a probe without the one-way case: every inter hop on the pair line
        a, k, *per_beside = self.excess.get(klass, (0.0, 0.0))
        # a plane (excess.fit_excess): the hop's excess grows with the compute it runs beside
        return a + k * nbytes + (per_beside[0] * (beside or 0.0) if per_beside else 0.0)

    def sender_release(self, nbytes: float, seconds: float, same_node: bool) -> float | None:
        return None if self.sends is None else self.sends.hold(nbytes, seconds, same_node)

    def _table(self, key: tuple) -> float:
        """The table's seconds of ``key``, as timed (KeyError naming a key that was not)."""
        if self.times is None or key not in self.times.seconds:
            raise KeyError(f"no measured time for {key}; measure it first (experiments.perfmodel.emulated.measured)")
        return self.times.seconds[key]

    def _get(self, key: tuple) -> float:
        return self._table(key) * self.scale

    def attention(self, batch, heads, head_dim, rows, cols, causal, mode, entries=None, mask=None):
        if rows <= 0 or cols <= 0:
            return 0.0, 0.0
        if entries is None:
            entries = rows * cols / (2.0 if causal else 1.0)
        flops = entries_flops(batch, heads, head_dim, entries, mode)
        # a band or varlen tile (burst_impl.plan): its own measured time, the exact masked path on its mask
        key = masked_key(batch, heads, head_dim, rows, cols, mask, mode, self.dtype)
        if key is not None:
            return self._get(key) + self.call_host_s, flops
        t = self._get(("attention", batch, heads, head_dim, rows, cols, bool(causal), mode, self.dtype))
        # a plain tile, or a dense one: the measured tile scaled to its live entries (for a dense tile an
        # approximation: the exact masked path is slower per entry than the fused kernel). The key was
        # timed with this ``causal``, so the scale is against the live entries of THAT work (half the
        # tile when causal): a causal call with its convention's entries is the measured time itself.
        return t * entries / (rows * cols / (2.0 if causal else 1.0)) + self.call_host_s, flops

    def gemm(self, m, n, k, *, dtype=None):
        return self._get(("gemm", m, n, k, dtype or self.dtype)), 2.0 * m * n * k

    def hbm(self, nbytes):
        return nbytes * self.memory_bound(HBM)

    def memory_bound(self, key: tuple) -> float:
        """Seconds of ``key``, work that streams memory (a byte of traffic; a decode step's attention over its cache,
        whole, its GQA rows' arithmetic included): at ``mem_scale`` where given, else at ``scale`` (which of the
        two, and why: ``validate.loads_of``'s memory rule)."""
        return self._table(key) * (self.scale if self.mem_scale is None else self.mem_scale)

    def score_block(self, heads, rows, cols, head_dim, total_cols, *, nbytes, dtype=None):
        key = ("scores", heads, rows, cols, head_dim, total_cols, dtype or self.dtype)
        return self._get(key), 2.0 * heads * rows * cols * head_dim

    def softmax_rows(self, batch, rows, cols, mode, *, nbytes):
        return self._get(("softmax", batch, rows, cols, mode, self.dtype))
