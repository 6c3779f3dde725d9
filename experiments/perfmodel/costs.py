"""How long one piece of work takes on a hardware profile: kernels, GEMMs, memory-bound ops, transfers.

Everything here is read from the hardware profile (``experiments/hardware/*.yaml``)
and the suite's one FLOP formula (``burst_impl.flops``); nothing is
fitted to a paper's results.

* A flash-attention kernel on a (rows x cols) block pair does
  ``entries_flops(B, Z, d, entries, mode)`` FLOPs for its live score entries
  (the suite's convention: 4*entries*Z*d forward, a causal block counting
  rows*cols/2, a band, document or block-sparse tile its live entries, x2.5
  backward). Its time is that of the attention problems the call holds
  (``kernel_problems``), each at ``peak x efficiency(its length)``: a plain
  (full or causal) tile is one problem, padded to whole thread-block tiles
  (``FLASH_BLOCKS``: a partial tile costs a whole one), looked up at the
  geometric mean of its padded sides (the profile's table is measured on square
  problems); a varlen tile (``TileMask`` kind varlen / varlen_full: packed
  documents, ``burst_impl.plan``) is one such problem per document, each at its
  own length, since the kernel runs every document as its own sequence; a band
  tile (a sliding window) runs at the length of its longest row's keys, the keys
  each query tile loops over. Forward uses the forward-only table when the
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
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

from ..profiles.hardware import Hardware, Link
from .simulator import Schedule
from burst_impl.flops import MODE_FACTOR, entries_flops
from burst_impl.kernels.common import VARLEN, TileMask

FP32 = 4
# FlashAttention-2's thread-block tile (query rows, key columns) at head dim 128 on A100 and H100, the kernel whose
# measured speed every GPU profile's efficiency table is: forward Flash_fwd_kernel_traits<128, 128, 64, 4>
# (csrc/flash_attn/src/flash_fwd_launch_template.h, run_mha_fwd_hdim128, the sm80 / sm90 branch), backward
# Flash_bwd_kernel_traits<128, 64, 128, 8, ...> (flash_bwd_launch_template.h, run_mha_bwd_hdim128, >= 144 KB of
# shared memory per block: A100, H100); Dao-AILab/flash-attention at 01afd16. A problem whose side is not a
# multiple of its tile runs the last tile whole.
FLASH_BLOCKS = {"forward": (128, 64), "backward": (64, 128)}


def padded_area(rows: int, cols: int, mode: str) -> float:
    """Score entries a flash kernel sweeps on a rows x cols problem: both sides padded to whole
    ``FLASH_BLOCKS`` tiles (``fwd_bwd``: the two passes weighted by the convention's factors)."""
    def area(m: str) -> int:
        bm, bn = FLASH_BLOCKS[m]
        return -(-rows // bm) * bm * (-(-cols // bn) * bn)
    if mode != "fwd_bwd":
        return float(area(mode))
    return (MODE_FACTOR["forward"] * area("forward") + MODE_FACTOR["backward"] * area("backward")) / MODE_FACTOR[mode]


def band_span(mask: TileMask) -> int:
    """Live keys of the longest row of a band ``lo <= j - i <= hi`` on its (n_rows x n_cols) tile: the keys a
    query tile loops over. A row's count min(n_cols - 1, i + hi) - max(0, i + lo) + 1 is concave in i, so its
    maximum is at an end of the rows or where a bound starts to bind."""
    nr, nc, lo, hi = mask.n_rows, mask.n_cols, mask.lo, mask.hi

    def width(i: int) -> int:
        last = nc - 1 if hi is None else min(nc - 1, i + hi)
        return last - (0 if lo is None else max(0, i + lo)) + 1
    cands = {0, nr - 1} | {min(nr - 1, max(0, x)) for x in (None if lo is None else -lo,
                                                            None if hi is None else nc - 1 - hi) if x is not None}
    return max(0, max(width(i) for i in cands))


def kernel_problems(rows: int, cols: int, causal: bool, mode: str, entries: float,
                    mask: TileMask | None = None) -> list[tuple[float, float, bool]]:
    """(score entries it costs, length its efficiency is read at, whether it is a causal problem) of each
    attention problem in one flash call on a rows x cols tile under ``mask`` (``burst_impl.plan``'s tile mask;
    None or causal: the plain kernel):

    * plain (full, causal): one problem, padded to whole tiles, half when causal (the suite's convention);
    * varlen, varlen_full: one per document of ``mask.cu``, each a plain problem of its own length: the
      varlen kernel runs each document as its own sequence (its own query tiles, its last tile partial);
    * band: its live entries at the length of its longest row (``band_span``), never above the tile's;
    * dense: its live entries at the tile's size (on a GPU the exact path's plain math, not a flash call)."""
    kind = mask.kind if mask is not None else ("causal" if causal else "full")
    if kind in ("full", "causal"):
        area = padded_area(rows, cols, mode)
        return [(area / (2.0 if kind == "causal" else 1.0), math.sqrt(area), kind == "causal")]
    if kind in VARLEN:
        half = 2.0 if kind == "varlen" else 1.0
        out = []
        for length, n in Counter(b - a for a, b in zip(mask.cu, mask.cu[1:])).items():
            area = padded_area(length, length, mode)
            out.append((n * area / half, math.sqrt(area), kind == "varlen"))
        return out
    size = math.sqrt(rows * cols)
    return [(entries, min(size, band_span(mask)) if kind == "band" else size, False)]


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

    def attn_efficiency(self, tokens: float, mode: str, causal: bool = False) -> float:
        """The flash kernel's fraction of peak on a problem of ``tokens``; ``causal``: a causal problem,
        at the profile's causal tables where it has them (``Accelerator.attn_efficiency_causal``)."""
        acc = self.hw.accelerator
        if mode == "forward":
            return acc.forward_efficiency(tokens, causal)
        fb = acc.efficiency(tokens, causal)
        if mode == "fwd_bwd" or acc.tables(causal)[1] is None:
            return fb
        f = acc.forward_efficiency(tokens, causal)
        # the backward's efficiency, from the forward's and the combined one at the convention's factors
        return MODE_FACTOR["backward"] / (MODE_FACTOR["fwd_bwd"] / fb - MODE_FACTOR["forward"] / f)

    def attention(self, batch: int, heads: int, head_dim: int, rows: int, cols: int, causal: bool,
                  mode: str, entries: float | None = None, mask: TileMask | None = None) -> tuple[float, float]:
        """(seconds, FLOPs) of a flash kernel on a rows x cols block pair with ``entries`` live score
        entries (default: all of them, half when ``causal``: the suite's convention) under the plan's tile
        ``mask`` (None: the plain kernel; its time from ``kernel_problems``)."""
        if rows <= 0 or cols <= 0:
            return 0.0, 0.0
        if entries is None:
            entries = rows * cols / (2.0 if causal else 1.0)
        flops = entries_flops(batch, heads, head_dim, entries, mode)
        seconds = sum(entries_flops(batch, heads, head_dim, work, mode) / (self.peak * self.attn_efficiency(n, mode, c))
                      for work, n, c in kernel_problems(rows, cols, causal, mode, entries, mask))
        return seconds / self.wave_efficiency(batch, heads, rows, mask), flops

    def wave_efficiency(self, batch: int, heads: int, rows: int, mask: TileMask | None = None) -> float:
        """The busy fraction of the GPU under a flash kernel's grid on (B, heads, rows) queries (1 without
        the profile's ``attn_grid``): ``Accelerator.wave_efficiency`` of B x heads x ceil(rows / tile_rows),
        summed over the documents of a varlen tile (each its own query tiles)."""
        grid = self.hw.accelerator.attn_grid
        if grid is None:
            return 1.0
        if mask is not None and mask.kind in VARLEN:
            tiles = sum(math.ceil((b - a) / grid.tile_rows) for a, b in zip(mask.cu, mask.cu[1:]))
        else:
            tiles = math.ceil(rows / grid.tile_rows)
        return self.hw.accelerator.wave_efficiency(batch * heads * tiles)

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

    def schedules(self):
        """The schedules a prediction is built on, in turn (``model._predict`` keeps the last): one on every hardware
        profile. An emulated cluster's opt-in CFS model builds it again with each pass's running ranks
        (``emulated.cfs``)."""
        yield Schedule()

    def step_seconds(self) -> float:
        """Compute-stream seconds a ring step holds its rank for beside its ops, whatever its tiles: none (a GPU's
        host posts the step and runs ahead of its stream)."""
        return 0.0

    def sender_seconds(self, nbytes: float, same_node: bool, messages: int = 1, two_way: bool = True,
                       beside: float | None = None) -> float:
        """Compute-stream seconds a transfer of ``nbytes`` in ``messages`` equal messages (an all-to-all's
        pieces to the peers on one link class) takes from its sender while it runs: none. ``two_way``: the
        sender also receives over the same link class meanwhile (a pair exchange), not only sends (a flat
        ring's hop across nodes). ``beside``: the compute-stream seconds the sender runs while the transfer is
        in flight (a ring step's work after its post); None: a blocking send, beside nothing."""
        return 0.0

    def sender_release(self, nbytes: float, seconds: float, same_node: bool) -> float | None:
        """Seconds from a non-blocking send's rendezvous until the wait on it returns to its sender, for a
        transfer of ``nbytes`` that takes ``seconds`` on its link; None: when the transfer lands (NCCL's send
        ends with its transfer). A CPU rank's gloo send returns once its bytes fit the socket buffers
        (``emulated.send_buffer``)."""
        return None
