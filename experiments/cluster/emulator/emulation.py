"""The scaling rule: emulated link rates that keep the target's compute : communication ratio.

On the target, one ring step on a block of n tokens takes F(n) / C_t of
compute (F from ``burst_impl.flops``, C_t = peak FLOP/s x the
kernel's efficiency at n tokens, ``../hardware.py``) and b / B_t of
communication per link class (b bytes, B_t the per-rank bytes/s of the
class). On this machine the same step computes at C_l, measured here with the
suite's own kernel (``burst_impl.kernels``, fwd+bwd of one n x n block) in as
many concurrent processes, with as many threads each, as the run will use.
Keeping compute : communication equal means

    B_emulated = B_t x C_l / C_t        (per link class)

i.e. this machine is a copy of the target slowed down by the time dilation
D = C_t / C_l, links included. Latency scales the same way (L x D), capped:
the dilated latency of a 5 us link is tens of ms, where TCP's ACK clock, not
the link, would bound every message (RDMA has no such clock). Where the
kernel has no ``sch_netem`` latency is not applied at all, and records say so.

Limits (docs/emulator.md): the compute rate is measured once per
bring-up at one block size and shape (the memory rate beside it, which
the model's validation carries memory-bound work by), while ranks sharing cores compute
slower when their neighbours compute and faster when they wait; gloo adds
per-message overheads a GPU collective does not have; attention only (no
projections, norms or optimizer) sets the ratio.

    python -m experiments.cluster.emulator.emulation bench <tokens> <heads> <head_dim> <dtype> <threads> <dir> <id> \
        <s> [<memory s>]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...cli import ToolFailed
from ...profiles.hardware import Hardware
from .shaping import LinkShape
from burst_impl.flops import attention_flops
from burst_impl.shape import AttnShape
from ...harness.cpuquota import join
# the calibration's work (also each group's reference), and the memory-bound work timed beside it
from ...harness.reference import STREAM_BYTES, block_step, stream_step

DEFAULT_LATENCY_CAP_US = 2000.0
# the memory rate's timing after the compute's: ten of CFS's default 100 ms periods, so a capped rank's quota
# burst does not set it (harness/reference.py, MIN_SAMPLE_S)
MEMORY_SECONDS = 1.0


@dataclass(frozen=True)
class Calibration:
    """Per-rank attention throughput of this machine with ``procs`` ranks running at once."""
    tokens: int
    heads: int
    head_dim: int
    dtype: str
    procs: int
    threads: int
    flops_per_s: tuple[float, ...]      # one per process
    # seconds per byte of memory traffic (``stream_step``, the kernel table's ("hbm",) work) per process, timed
    # after the block as it: the validation carries memory-bound work by it (docs/findings.md, "The memory rate
    # apart from the compute rate"); empty for a calibration taken before 2026-12-06
    memory_s_per_byte: tuple[float, ...] = ()

    @property
    def per_rank(self) -> float:
        return statistics.median(self.flops_per_s)

    @property
    def memory_per_rank(self) -> float | None:
        return statistics.median(self.memory_s_per_byte) if self.memory_s_per_byte else None


@dataclass(frozen=True)
class EmulatedLink:
    klass: str                  # "intra" | "inter"
    kind: str                   # the target's link kind (pcie, roce, ...)
    target_bytes_s: float       # per rank, hardware profile convention
    target_latency_us: float
    bytes_s: float              # emulated, per rank
    latency_dilated_us: float   # target latency x time dilation (before the cap)
    latency_us: float           # what is applied (0 where not emulated)
    latency_note: str = ""
    # inter only: ranks sharing one emulated NIC, and what a lone flow gets (0: the NIC's rate)
    ranks_per_nic: int = 1
    lone_bytes_s: float = 0.0

    @property
    def shape(self) -> LinkShape:
        return LinkShape(self.bytes_s, self.latency_us)

    @property
    def nic_bytes_s(self) -> float:
        """The emulated NIC: ``ranks_per_nic`` per-rank shares, split by the flows crossing on it."""
        return self.bytes_s * self.ranks_per_nic

    @property
    def lone_shape(self) -> LinkShape:
        """What one rank's own inter class is shaped at: a lone flow's rate (the NIC, or less on PCIe nodes)."""
        return LinkShape(self.lone_bytes_s or self.nic_bytes_s, self.latency_us)


@dataclass(frozen=True)
class Scaling:
    hardware: str
    mode: str                                 # "calibrated" (the rule above) or "fixed" (rates given)
    links: dict[str, EmulatedLink]
    dilation: float | None = None             # target compute rate / local compute rate
    target_flops_s: float | None = None
    calibration: Calibration | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.calibration is not None:
            d["calibration"]["per_rank_flops_s"] = self.calibration.per_rank
            d["calibration"]["per_rank_memory_s_per_byte"] = self.calibration.memory_per_rank
        return d

    def summary(self) -> str:
        rates = ", ".join(f"{k} {v.bytes_s / 1e6:.3g} MB/s" + (
            f" per rank ({v.ranks_per_nic} per NIC of {v.nic_bytes_s / 1e6:.3g} MB/s)" if v.ranks_per_nic > 1 else "")
            for k, v in self.links.items())
        dil = f", time dilation {self.dilation:.0f}x" if self.dilation else ""
        mem = self.calibration and self.calibration.memory_per_rank
        mem = f", memory {1e-9 / mem:.3g} GB/s per rank" if mem else ""
        return f"{rates}{dil}{mem}"


def _target_flops(hw: Hardware, dtype: str, tokens: int) -> float:
    if dtype not in hw.accelerator.peak_tflops:
        raise ValueError(f"dtype={dtype!r}: hardware {hw.name!r} has no peak for it "
                         f"(has {sorted(hw.accelerator.peak_tflops)})")
    return hw.accelerator.attention_flops_per_s(dtype, tokens)


def scale(hw: Hardware, calib: Calibration, *, latency_cap_us: float = DEFAULT_LATENCY_CAP_US,
          netem: bool = False, ranks_per_nic: int = 1) -> Scaling:
    """Emulated per-rank link rates for ``hw`` given this machine's measured compute rate.

    ``ranks_per_nic``: ranks of an emulated node sharing one NIC, whose rate is that many per-rank
    shares (the node is a slice of the target's: every rank crossing at once still gets the target's
    per-rank rate, a lone flow the NIC's, capped on PCIe nodes as ``Hardware.inter_flow_bytes_per_s``)."""
    c_t = _target_flops(hw, calib.dtype, calib.tokens)
    c_l = calib.per_rank
    if not c_l > 0:
        raise ValueError(f"calibration measured {c_l!r} FLOP/s per rank; it must be positive")
    dil = c_t / c_l
    links = {}
    for klass, link in (("intra", hw.intra), ("inter", hw.inter)):
        if link is None:
            continue
        lat = link.latency_us * dil
        applied = min(lat, latency_cap_us) if netem else 0.0
        note = ("" if netem and lat <= latency_cap_us else
                f"capped at {latency_cap_us:.0f} us" if netem else
                "not emulated: this kernel has no sch_netem")
        nic = dict(ranks_per_nic=ranks_per_nic, lone_bytes_s=hw.inter_flow_bytes_per_s(
            1, ranks_per_nic=ranks_per_nic) / dil) if klass == "inter" else {}
        links[klass] = EmulatedLink(klass=klass, kind=link.kind, target_bytes_s=link.bytes_per_s,
                                    target_latency_us=link.latency_us, bytes_s=link.bytes_per_s / dil,
                                    latency_dilated_us=lat, latency_us=applied, latency_note=note, **nic)
    return Scaling(hardware=hw.name, mode="calibrated", links=links, dilation=dil, target_flops_s=c_t,
                   calibration=calib)


def fixed(hardware: str, rates: dict[str, float], latency_us: dict[str, float] | None = None, *,
          netem: bool = False, ranks_per_nic: int = 1) -> Scaling:
    """Given per-rank rates (bytes/s per class, the inter one = a rank's share when all cross at once),
    no calibration: for tests and manual experiments. A NIC of ``ranks_per_nic`` ranks carries that
    many inter shares; a lone flow gets all of it."""
    latency_us = latency_us or {}
    links = {}
    for klass, r in rates.items():
        lat = float(latency_us.get(klass, 0.0))
        links[klass] = EmulatedLink(klass=klass, kind="veth", target_bytes_s=r, target_latency_us=lat, bytes_s=r,
                                    latency_dilated_us=lat, latency_us=lat if netem else 0.0,
                                    latency_note="" if netem or not lat else "not emulated: no sch_netem",
                                    ranks_per_nic=ranks_per_nic if klass == "inter" else 1)
    return Scaling(hardware=hardware, mode="fixed", links=links)


# ---------------------------------------------------------------- calibration


def _wait(sync: Path, name: str) -> None:
    while not (sync / name).exists():
        time.sleep(0.01)


def _timed(fn, seconds: float) -> tuple[int, float]:
    """(calls, seconds) of ``fn`` back to back for at least ``seconds`` and two calls."""
    t0, n = time.perf_counter(), 0
    while True:
        fn()
        n += 1
        el = time.perf_counter() - t0
        if el >= seconds and n >= 2:
            return n, el


def _bench(tokens: int, heads: int, head_dim: int, dtype: str, threads: int, sync: Path, ident: str,
           seconds: float, memory_seconds: float = MEMORY_SECONDS) -> dict:
    """FLOP/s of fwd+bwd of one full tokens x tokens block, then seconds per byte of ``stream_step``, each timed
    while the other processes run it too (released together: ``go``, then ``mgo``)."""
    torch.set_num_threads(threads)
    step, stream = block_step(tokens, heads, head_dim, dtype), stream_step()
    step()                                        # warm-up (allocations, kernel selection)
    stream()
    (sync / f"ready.{ident}").touch()
    _wait(sync, "go")
    n, el = _timed(step, seconds)
    flops = n * attention_flops(AttnShape(1, tokens, heads, heads, head_dim, 1, causal=False), mode="fwd_bwd") / el
    (sync / f"mready.{ident}").touch()
    _wait(sync, "mgo")
    n, el = _timed(stream, memory_seconds)
    return {"flops_per_s": flops, "memory_s_per_byte": el / n / STREAM_BYTES}


def _release(sync: Path, ready: str, go: str, procs: int, ps: list, deadline: float, what: str) -> None:
    """Touch ``go`` once every process has touched its ``ready`` file; ToolFailed if one died or time ran out."""
    while len(list(sync.glob(f"{ready}.*"))) < procs:
        if any(p.poll() not in (None, 0) for p in ps) or time.monotonic() > deadline:
            errs = [p.stderr.read()[-500:] for p in ps if p.poll() not in (None, 0)]
            raise ToolFailed(f"calibration benchmark did not reach its {what}: {errs or 'timeout'}")
        time.sleep(0.05)
    (sync / go).touch()


def calibrate(*, procs: int, threads: int, tokens: int, heads: int, head_dim: int, dtype: str,
              seconds: float = 3.0, memory_seconds: float = MEMORY_SECONDS, python: str = sys.executable,
              timeout_s: float = 300, cgroups: list[str] | None = None) -> Calibration:
    """Run ``procs`` benchmark processes at once (released together) and collect their FLOP/s and memory
    seconds per byte; with ``cgroups`` (one per process, ``experiments/harness/cpuquota.py``) each runs in its
    rank's cpu cgroup, as the rank will."""
    with tempfile.TemporaryDirectory(prefix="bemu-calib-") as d:
        sync = Path(d)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="")
        cmd = [python, "-m", "experiments.cluster.emulator.emulation", "bench", str(tokens), str(heads), str(head_dim),
               dtype, str(threads), str(sync), "{id}", str(seconds), str(memory_seconds)]
        ps = []
        for i in range(procs):
            ps.append(subprocess.Popen([c.replace("{id}", str(i)) for c in cmd], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=env))
            if cgroups:           # before the benchmark starts timing (it waits for "go")
                join(cgroups[i], ps[-1].pid)
        try:
            deadline = time.monotonic() + timeout_s
            _release(sync, "ready", "go", procs, ps, deadline, "start")
            _release(sync, "mready", "mgo", procs, ps, deadline, "memory timing")
            rates = []
            for p in ps:
                out, err = p.communicate(timeout=max(10.0, deadline - time.monotonic()))
                if p.returncode:
                    raise ToolFailed(f"calibration benchmark failed: {err[-500:]}")
                rates.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in ps:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return Calibration(tokens=tokens, heads=heads, head_dim=head_dim, dtype=dtype, procs=procs, threads=threads,
                       flops_per_s=tuple(float(r["flops_per_s"]) for r in rates),
                       memory_s_per_byte=tuple(float(r["memory_s_per_byte"]) for r in rates))


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "bench":
        print(__doc__)
        return 2
    tokens, heads, head_dim, dtype, threads, sync, ident, seconds = argv[1:9]
    memory_seconds = float(argv[9]) if len(argv) > 9 else MEMORY_SECONDS
    print(json.dumps(_bench(int(tokens), int(heads), int(head_dim), dtype, int(threads), Path(sync), ident,
                            float(seconds), memory_seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
