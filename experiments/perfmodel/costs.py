"""How long one piece of work takes on a hardware profile: kernels, GEMMs, memory-bound ops, transfers.

Everything here is read from the hardware profile (``experiments/hardware/*.yaml``)
and the suite's one FLOP formula (``burst_impl.flops``); nothing is
fitted to a paper's results.

* A flash-attention kernel on a (rows x cols) block pair does
  ``entries_flops(B, Z, d, entries, mode)`` FLOPs for its live score entries
  (the suite's convention: 4*entries*Z*d forward, a causal block counting
  rows*cols/2, a band, document or block-sparse tile its live entries, x2.5
  backward) at ``peak x efficiency(sqrt(rows * cols))``: the profile's table is
  measured on square problems, so a rectangular block is looked up at the
  geometric mean of its sides. Forward uses the forward-only table when the
  profile has one; backward then gets the efficiency that makes forward +
  backward match the combined table: 2.5 / (3.5/e_fb - 1/e_f).
* A materialised-scores attention (no flash kernel: ``ring_rsa``, TP without
  FlashAttention, Burst without LAO) does its matmuls at the GEMM efficiency
  over the FULL block (masking does not skip work) and moves its score tensors
  through HBM.
* GEMMs run at ``gemm_efficiency`` (a ceiling measured on the best shape).
* Elementwise work (online-softmax merges, accumulator adds) is HBM-bound.
* A transfer takes ``latency + bytes / rate``; a collective's ring steps after
  its first take the link's ``step_latency_us`` where the profile gives one
  (NCCL's tuning model: base latency once per collective, hop latency per step).
  Inside a node the rate is the profile's per-rank intra rate (its transport's:
  ``intra.transport``, e.g. NCCL's SHM staging through host memory). Between nodes, the flows that cross on one
  NIC at the same time share it (``Placement.crossing`` counts them per node
  and NIC, the rank -> NIC map being the profile's): with k such flows one gets
  ``NIC rate / k`` (a lone flow, a flat ring's one crossing hop, gets the whole
  NIC; every rank of the node crossing gives exactly the profile's per-rank
  convention), and on PCIe nodes no more than its own PCIe link (the GPU
  reaches the NIC through it).
* Nothing else: the compute stream holds the work alone (a GPU's host runs
  ahead of its stream, and a copy engine or NCCL's kernel moves the bytes, so
  a hidden transfer takes nothing from it). The schedules ask every op's and
  every transfer's compute-stream time of the two hooks ``op_seconds`` and
  ``sender_seconds``, so a model of another machine adds its own terms there
  without the schedules knowing them (``experiments.perfmodel.emulated``: the
  emulated cluster's CPU ranks, their host work per op and their transfers'
  overlap excess).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from ..profiles.hardware import Hardware, Link
from burst_impl.flops import MODE_FACTOR, entries_flops

FP32 = 4


@dataclass(frozen=True)
class CostModel:
    hw: Hardware
    dtype: str = "bfloat16"
    # Costs a schedule builder derived from this model, keyed by everything they depend on besides it
    # (ring_family's per-step kernel costs): every method of a case, and every case of a spec on this
    # profile, asks for the same block pairs again.
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    # A collective issued on a side stream runs beside the compute stream (CUDA streams + NCCL), so FSDP2's
    # prefetched all-gathers and its reduce-scatters can hide under compute (``schedules/zero3.py``).
    side_streams: ClassVar[bool] = True
    # The process group's backend, for collectives whose algorithm differs by backend (gloo has no
    # reduce-scatter: burst_impl.model.fsdp.REDUCE_SCATTER_STEPS)
    collectives_backend: ClassVar[str] = "nccl"

    def __post_init__(self):
        if self.dtype not in self.hw.accelerator.peak_tflops:
            raise ValueError(f"dtype={self.dtype!r}: hardware profile {self.hw.name!r} has no peak for it "
                             f"(accelerator.peak_tflops has {sorted(self.hw.accelerator.peak_tflops)})")

    @property
    def peak(self) -> float:
        return self.hw.accelerator.peak_tflops[self.dtype] * 1e12

    # ------------------------------------------------------------ compute

    def attn_efficiency(self, tokens: float, mode: str) -> float:
        acc = self.hw.accelerator
        if mode == "forward":
            return acc.forward_efficiency(tokens)
        fb = acc.efficiency(tokens)
        if mode == "fwd_bwd" or acc.attn_efficiency_forward is None:
            return fb
        f = acc.forward_efficiency(tokens)
        # the backward's efficiency, from the forward's and the combined one at the convention's factors
        return MODE_FACTOR["backward"] / (MODE_FACTOR["fwd_bwd"] / fb - MODE_FACTOR["forward"] / f)

    def attention(self, batch: int, heads: int, head_dim: int, rows: int, cols: int, causal: bool,
                  mode: str, entries: float | None = None) -> tuple[float, float]:
        """(seconds, FLOPs) of a flash kernel on a rows x cols block pair with ``entries`` live score
        entries (default: all of them, half when ``causal``: the suite's convention)."""
        if rows <= 0 or cols <= 0:
            return 0.0, 0.0
        if entries is None:
            entries = rows * cols / (2.0 if causal else 1.0)
        flops = entries_flops(batch, heads, head_dim, entries, mode)
        eff = self.attn_efficiency(math.sqrt(rows * cols), mode) * self.wave_efficiency(batch, heads, rows)
        return flops / (self.peak * eff), flops

    def wave_efficiency(self, batch: int, heads: int, rows: int) -> float:
        """The busy fraction of the GPU under a flash kernel's grid on (B, heads, rows) queries (1 without
        the profile's ``attn_grid``): ``Accelerator.wave_efficiency`` of B x heads x ceil(rows / tile_rows)."""
        grid = self.hw.accelerator.attn_grid
        if grid is None:
            return 1.0
        return self.hw.accelerator.wave_efficiency(batch * heads * math.ceil(rows / grid.tile_rows))

    def gemm_efficiency(self) -> float:
        g = self.hw.accelerator.gemm_efficiency
        if g is None:
            raise ValueError(f"hardware profile {self.hw.name!r} has no accelerator.gemm_efficiency; "
                             "the attention-layer model (projections) and materialised attention need it")
        return g

    def gemm(self, m: int, n: int, k: int, *, dtype: str | None = None) -> tuple[float, float]:
        """(seconds, FLOPs) of an (m x k) @ (k x n) matmul."""
        flops = 2.0 * m * n * k
        peak = self.hw.accelerator.peak_tflops.get(dtype or self.dtype)
        if peak is None:
            raise ValueError(f"dtype={dtype!r}: hardware profile {self.hw.name!r} has no peak for it")
        return flops / (peak * 1e12 * self.gemm_efficiency()), flops

    def hbm(self, nbytes: float) -> float:
        """Seconds to stream ``nbytes`` through HBM (read + write counted by the caller)."""
        return nbytes / (self.hw.accelerator.hbm_gbytes_s * 1e9)

    def score_block(self, heads: int, rows: int, cols: int, head_dim: int, total_cols: int, *,
                    nbytes: float, dtype: str | None = None) -> tuple[float, float]:
        """(seconds, FLOPs) of one (rows x cols) score block per head, ``heads`` = B x Z, computed as
        (rows x d) @ (d x cols) and stored into its columns of (rows x ``total_cols``) score rows, with
        ``nbytes`` of HBM traffic for the stores (output, scaling, the strided copy): the GEMM plus
        memory-bound passes on an accelerator; ``emulated.EmulatedCosts`` times the work itself."""
        t, f = self.gemm(heads * rows, cols, head_dim, dtype=dtype)
        return t + self.hbm(nbytes), f

    def softmax_rows(self, batch: int, rows: int, cols: int, mode: str, *, nbytes: float) -> float:
        """Seconds of a materialised softmax over ``batch`` (rows x cols) fp32 score matrices (``mode``
        "forward": mask, softmax, cast; "backward": P * (dP - rowsum(dP * P))), ``nbytes`` being the
        HBM traffic the schedule counts for it: memory-bound on an accelerator. (On a CPU the exp and
        the row reductions are not: ``emulated.EmulatedCosts`` times the work itself.)"""
        if mode not in ("forward", "backward"):
            raise ValueError(f"mode={mode!r}: a materialised softmax is 'forward' or 'backward'")
        return self.hbm(nbytes)

    def materialised_attention(self, batch: int, heads: int, head_dim: int, rows: int, cols: int,
                               mode: str, *, elem: int, matmul_dtype: str | None = None,
                               score_passes: float) -> tuple[float, float]:
        """(seconds, FLOPs) of attention that writes its (rows x cols) scores to HBM.

        The two forward matmuls (QK^T, PV; five backward at the x2.5 convention)
        over the whole block, plus ``score_passes`` reads/writes of a score-sized
        tensor of ``elem`` bytes per element.
        """
        if rows <= 0 or cols <= 0:
            return 0.0, 0.0
        # Every matmul of the mode at the rate of one QK^T (a measured table times that GEMM only).
        t, gemm_flops = self.gemm(batch * heads * rows, cols, head_dim, dtype=matmul_dtype)
        flops = entries_flops(batch, heads, head_dim, rows * cols, mode)
        return t * flops / gemm_flops + self.hbm(score_passes * batch * heads * rows * cols * elem), flops

    # ------------------------------------------------------------ communication

    def link(self, same_node: bool) -> Link:
        return self.hw.link(same_node)

    def rate(self, same_node: bool, concurrent: int = 1) -> float:
        """Bytes/s one rank gets on a transfer; ``concurrent`` = inter-node flows on its NIC at once
        (itself included): a lone flow gets the NIC's rate, k flows 1/k of it (``Hardware.inter_flow_bytes_per_s``)."""
        if same_node or self.hw.inter is None:
            return self.hw.intra.bytes_per_s
        return self.hw.inter_flow_bytes_per_s(max(1, int(concurrent)))

    def transfer(self, nbytes: float, same_node: bool, concurrent: int = 1, *, step: bool = False) -> float:
        """Seconds for one message (latency + size / rate); 0 for an empty one. ``step``: a collective's ring
        step after its first, which pays the link's ``step_latency_us`` (NCCL: the hop alone) where it has one."""
        if nbytes <= 0:
            return 0.0
        link = self.link(same_node)
        lat = link.step_latency_us if step and link.step_latency_us is not None else link.latency_us
        return lat * 1e-6 + nbytes / self.rate(same_node, concurrent)

    # ------------------------------------------------------------ the compute stream's hooks

    def op_seconds(self, seconds: float) -> float:
        """Compute-stream seconds of an op whose work takes ``seconds``: the work alone."""
        return seconds

    def sender_seconds(self, nbytes: float, same_node: bool) -> float:
        """Compute-stream seconds a transfer of ``nbytes`` takes from its sender while it runs: none."""
        return 0.0
