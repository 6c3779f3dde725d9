"""Kernel times measured on this machine at exactly the work a schedule asks for.

Validating the model on the emulated cluster (``validate.py``) needs this
machine's per-rank compute, not a GPU's efficiency table: the CPU kernel's
rate depends on the block shape (a causal diagonal block runs well below a
full one at the suite's halved FLOP count, a rectangular block below a
square one), so one calibrated FLOP/s would carry that error into every
prediction. Instead:

1. ``needed(cases, hardware)`` runs each case's schedule once with a
   recording cost model and collects every distinct piece of work it asks
   for: flash-kernel calls ``("attention", B, Z, d, rows, cols, causal, mode,
   dtype)``, masked tiles ``("masked", B, Z, d, rows, cols, kind, lo, hi, cu, mode,
   dtype)`` (a plan's band and varlen tiles, ``masked_key``), GEMMs
   ``("gemm", m, n, k, dtype)``, materialised score blocks
   ``("scores", B*Z, rows, cols, d, N, dtype)`` and softmaxes
   ``("softmax", batch, rows, cols, mode, dtype)`` (on a CPU the exp and row
   sums, not the memory, set their time), and the memory bandwidth
   (``("hbm",)``) that the other elementwise steps use;
2. ``measure(keys, procs=, threads=)`` times each one with the suite's kernels
   (``burst_impl.kernels``, the code the ring methods call) in ``procs``
   processes released together, with ``threads`` threads each: the ranks of
   the run share this machine's cores the same way. Under a CPU cap a call's
   time is its process CPU over the cap (``clock="cpu"``), not its wall time:
   a capped process's wall time per call moves with the quota's periods and
   with which neighbour the scheduler ran, so keys timed a second apart differ
   by more than the kernels do (docs/findings.md, "The kernel table in CPU
   seconds at the cap");
3. ``costs.EmulatedCosts`` answers the model's cost questions from that table
   (``KeyError`` naming the key for work that was not measured).

A backward key times ``attn_backward`` alone (its forward runs once, outside
the timing); the schedule charges the delta = rowsum(dO * O) step separately.

    python -m experiments.perfmodel.emulated.measured bench <keys.json> <sync dir> <id> <seconds> <threads> <rounds>
"""
from __future__ import annotations

import itertools
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...harness import cpuquota
from ...harness.reference import STREAM_BYTES, stream_step
from ..costs import CostModel
from ..decode_costs import elem_size
from burst_impl import kernels, masks
from burst_impl.inference import partial_attention
from burst_impl.kernels.common import TileMask
from burst_impl.shape import DTYPES

HBM = ("hbm",)


def _key(k) -> tuple:
    """A key as a tuple, lists inside it too (a masked tile's document boundaries, read back from JSON)."""
    return tuple(_key(x) if isinstance(x, list) else x for x in k)


def masked_key(batch: int, heads: int, head_dim: int, rows: int, cols: int, mask: TileMask | None, mode: str,
               dtype: str) -> tuple | None:
    """The key of a masked tile timed as itself: ``("masked", B, Z, d, rows, cols, kind, lo, hi, cu, mode,
    dtype)`` for a band, varlen or varlen_full tile (``burst_impl.plan``; the CPU's exact masked path runs it
    in row blocks over each block's live span, so its time is not the unmasked kernel's per live entry).
    None for the plain kernel (no mask, causal: the ``"attention"`` key) and for a dense tile, whose mask is
    a function of positions; it keeps the unmasked tile scaled to its live entries."""
    if mask is None or mask.kind not in ("band", "varlen", "varlen_full"):
        return None
    return ("masked", batch, heads, head_dim, rows, cols, mask.kind, mask.lo, mask.hi,
            None if mask.cu is None else tuple(mask.cu), mode, dtype)


@dataclass(frozen=True)
class RecordingCosts(CostModel):
    """The profile's costs, noting every piece of work asked for (``needed``)."""

    seen: set = field(default_factory=set, compare=False, hash=False)

    def attention(self, batch, heads, head_dim, rows, cols, causal, mode, entries=None, mask=None):
        # a band or varlen tile is timed as itself (``masked_key``); a dense one as its whole unmasked tile, scaled
        if rows > 0 and cols > 0:
            self.seen.add(masked_key(batch, heads, head_dim, rows, cols, mask, mode, self.dtype)
                          or ("attention", batch, heads, head_dim, rows, cols, bool(causal), mode, self.dtype))
        return super().attention(batch, heads, head_dim, rows, cols, causal, mode, entries=entries, mask=mask)

    def gemm(self, m, n, k, *, dtype=None):
        self.seen.add(("gemm", m, n, k, dtype or self.dtype))
        return super().gemm(m, n, k, dtype=dtype)

    def hbm(self, nbytes):
        self.seen.add(HBM)
        return super().hbm(nbytes)

    def score_block(self, heads, rows, cols, head_dim, total_cols, *, nbytes, dtype=None):
        self.seen.add(("scores", heads, rows, cols, head_dim, total_cols, dtype or self.dtype))
        # the profile's cost, without noting its GEMM and bytes as work of their own (the block is timed whole)
        t, f = CostModel.gemm(self, heads * rows, cols, head_dim, dtype=dtype)
        return t + CostModel.hbm(self, nbytes), f

    def softmax_rows(self, batch, rows, cols, mode, *, nbytes):
        self.seen.add(("softmax", batch, rows, cols, mode, self.dtype))   # fp32 scores, cast to the input dtype
        return super().softmax_rows(batch, rows, cols, mode, nbytes=nbytes)


@dataclass(frozen=True)
class KernelTimes:
    """Seconds per call of each key, measured with ``procs`` concurrent processes x ``threads`` threads."""

    procs: int
    threads: int
    seconds: dict                      # {key tuple: seconds per call}; ("hbm",): seconds per byte
    samples: dict = field(default_factory=dict)   # {key: [seconds per process and round]}
    host: str = ""
    cpus: float | None = None          # each process's CPU cap while timing (None: uncapped)
    clock: str = "wall"                # "cpu": seconds are process CPU / cpus (a capped table); "wall": wall time
    wall: dict = field(default_factory=dict)      # {key: median wall seconds per call} of a "cpu" table

    def to_json(self) -> dict:
        return {"procs": self.procs, "threads": self.threads, "host": self.host, "cpus": self.cpus,
                "clock": self.clock,
                "entries": [{"key": list(k), "seconds": v, "samples": self.samples.get(k, []),
                             **({"wall_s": self.wall[k]} if k in self.wall else {})}
                            for k, v in sorted(self.seconds.items(), key=lambda kv: str(kv[0]))]}

    @classmethod
    def from_json(cls, d: dict) -> "KernelTimes":
        ents = d["entries"]
        return cls(procs=int(d["procs"]), threads=int(d["threads"]), host=d.get("host", ""),
                   cpus=None if d.get("cpus") is None else float(d["cpus"]), clock=d.get("clock", "wall"),
                   seconds={_key(e["key"]): float(e["seconds"]) for e in ents},
                   samples={_key(e["key"]): list(e.get("samples", [])) for e in ents},
                   wall={_key(e["key"]): float(e["wall_s"]) for e in ents if "wall_s" in e})

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    @classmethod
    def load(cls, path: Path) -> "KernelTimes":
        return cls.from_json(json.loads(Path(path).read_text()))

    def missing(self, keys) -> list[tuple]:
        return [k for k in keys if k not in self.seconds]


def needed(cases, hardware, *, predict=None) -> set:
    """Every distinct piece of work the schedules of ``cases`` ask for: through ``predict`` (predict_case)
    when given, else each case's own ``predict(hardware, costs)`` (``cases.py``: a whole model's step too)."""
    seen: set = set()
    for case in cases:
        rec = RecordingCosts(hardware, case.shape.dtype, seen=seen)
        costs = lambda hw, dtype, rec=rec: rec     # noqa: E731
        if predict is None:
            case.predict(hardware, costs)
        else:
            predict(case.method, case.shape, mode=case.mode, level=case.level, hardware=hardware, costs=costs)
    return seen


# ---------------------------------------------------------------- timing (one process)


def _decode_parts(key: tuple) -> tuple:
    """(q, keys, Z, Zkv, d, dtype, B) of a decode key (``decode_costs.decode_key``: B 1 has no batch part)."""
    _, q, keys, z, zkv, d, dtype, *rest = key
    return q, keys, z, zkv, d, dtype, rest[0] if rest else 1


def _runner(key: tuple):
    """A zero-argument callable doing the work of ``key`` once (tensors made here, outside the timing)."""
    g = torch.Generator().manual_seed(0)
    if key[0] == "attention":
        _, b, z, d, rows, cols, causal, mode, dtype = key
        return _attention_runner(g, b, z, d, rows, cols, mode, dtype, causal=causal, mask=None)
    if key[0] == "masked":
        # the plan's tile mask, as the ring methods pass it to the kernels (its row segments made once, in the
        # warm-up: plans are cached, so a run derives them once per tile too)
        _, b, z, d, rows, cols, kind, lo, hi, cu, mode, dtype = key
        tm = TileMask(kind, rows, cols, lo=lo, hi=hi, cu=cu)
        return _attention_runner(g, b, z, d, rows, cols, mode, dtype, causal=False, mask=tm)
    if key[0] == "gemm":
        _, m, n, kk, dtype = key
        dt = DTYPES[dtype]
        a, bm = torch.randn(m, kk, generator=g).to(dt), torch.randn(kk, n, generator=g).to(dt)
        return lambda: a @ bm
    if key[0] == "scores":
        # baselines/ring_rsa.py's score block: a batched (rows x d) @ (d x cols) per head, scaled, stored
        # into its columns of the (heads, rows, total_cols) fp32 score rows
        _, bh, rows, cols, d, total, dtype = key
        dt = DTYPES[dtype]
        a, bm = torch.randn(1, rows, bh, d, generator=g).to(dt), torch.randn(1, cols, bh, d, generator=g).to(dt)
        rows_out = torch.empty(1, bh, rows, total)

        def store():
            rows_out[..., :cols] = torch.einsum("bqhd,bkhd->bhqk", a.float(), bm.float()) * 0.125
        return store
    if key[0] == "softmax":
        # the materialised softmax of baselines/ring_rsa.py over (batch, rows, cols) fp32 scores: forward
        # masks (a causal-like (rows, cols) pattern broadcast over batch), normalises, zeroes fully masked
        # rows and casts; backward forms P * (dP - rowsum(dP * P)) from the kept probabilities
        _, b, rows, cols, mode, dtype = key
        x = torch.randn(b, rows, cols, generator=g)
        if mode == "forward":
            hidden = torch.arange(cols).unsqueeze(0) > torch.arange(rows).unsqueeze(1) * (cols // rows)

            def fwd():
                p = torch.softmax(x.masked_fill_(hidden, float("-inf")), dim=-1)
                return p.masked_fill_(hidden.all(1).view(1, rows, 1), 0.0).to(DTYPES[dtype])
            return fwd
        probs, dp = torch.softmax(x, dim=-1).to(DTYPES[dtype]), torch.randn(b, rows, cols, generator=g)

        def bwd():
            p = probs.float()
            return p * (dp - (dp * p).sum(-1, keepdim=True))
        return bwd
    if key[0] == "decode":
        # a decode step's attention of one sequence (burst_impl.inference.partial_attention: the mask built from
        # positions, the kernel over the rank's cached keys), as experiments/perfmodel/decode_costs.py asks for it
        q, keys, z, zkv, d, dtype, batch = _decode_parts(key)
        dt = DTYPES[dtype]
        qs = torch.randn(q, z, d, generator=g).to(dt)
        # the step's B sequences' caches, one call each in turn (decode_costs.decode_key): a call's K and V are
        # as cold as the step leaves them, not hot from the call before
        kvs = [tuple(torch.randn(keys, zkv, d, generator=g).to(dt) for _ in range(2)) for _ in range(batch)]
        q_pos, k_pos = torch.arange(keys, keys + q), torch.arange(keys)
        turn = itertools.cycle(kvs)

        def step():
            k, v = next(turn)
            # one new token: every cached key live, which the decode step knows on the host (decode_all_live)
            return partial_attention(qs, q_pos, k, v, k_pos, masks.Causal(), d ** -0.5, all_live=q == 1)
        return step
    if key == HBM:
        return stream_step()                # reads two fp32 arrays, writes one (STREAM_BYTES a call)
    raise ValueError(f"key={key!r}: unknown kind of work; expected attention, masked, gemm, scores, softmax, decode "
                     "or hbm")


def _attention_runner(g, b, z, d, rows, cols, mode, dtype, *, causal: bool, mask: TileMask | None):
    """The flash kernel (``burst_impl.kernels``) of one tile in ``mode``, its inputs made here."""
    dt = DTYPES[dtype]
    q, do = (torch.randn(b, rows, z, d, generator=g).to(dt) for _ in range(2))
    k, v = (torch.randn(b, cols, z, d, generator=g).to(dt) for _ in range(2))
    sc = kernels.default_scale(d, None)
    kw = dict(causal=causal, scale=sc, mask=mask)
    if mode == "forward":
        return lambda: kernels.attn_forward(q, k, v, **kw)
    out, lse = kernels.attn_forward(q, k, v, **kw)
    delta = kernels.compute_delta(do, out)
    if mode == "backward":
        return lambda: kernels.attn_backward(do, q, k, v, lse, delta, **kw)

    def fwd_bwd():
        o, l_ = kernels.attn_forward(q, k, v, **kw)
        kernels.attn_backward(do, q, k, v, l_, kernels.compute_delta(do, o), **kw)
    return fwd_bwd


def _bench(keys: list[tuple], threads: int, sync: Path, ident: str, seconds: float,
           rounds: int) -> list[list[list[float]]]:
    """[wall, process CPU] seconds per call of each key in each round; before each (round, key) every process
    waits for the others (``go.<round>.<i>``). Rounds spread every key over the measurement's length, so a
    change of this machine's load while it runs (other jobs) falls on every key alike instead of on a few."""
    torch.set_num_threads(threads)
    fns = [_runner(key) for key in keys]
    for fn in fns:
        fn()                                        # warm-up (allocations, kernel selection)
    out: list[list[float]] = [[] for _ in keys]
    for r in range(rounds):
        for i, (key, fn) in enumerate(zip(keys, fns)):
            (sync / f"ready.{r}.{i}.{ident}").touch()
            while not (sync / f"go.{r}.{i}").exists():
                time.sleep(0.005)
            t0, c0, n = time.perf_counter(), time.process_time(), 0
            while True:
                fn()
                n += 1
                if time.perf_counter() - t0 >= seconds:
                    break
            per = [(time.perf_counter() - t0) / n, (time.process_time() - c0) / n]
            out[i].append([x / STREAM_BYTES for x in per] if key == HBM else per)
    return out


# a timing process holds every key's inputs of its chunk at once: at most this many bytes of decode caches each
CHUNK_BYTES = 1 << 30


def footprint(key: tuple) -> int:
    """Bytes of a decode key's caches (``_runner``: B caches of K and V); 0 for other keys (their inputs are the
    schedules' tiles, all measured together before decode keys existed)."""
    if key[0] != "decode":
        return 0
    q, keys, z, zkv, d, dtype, batch = _decode_parts(key)
    return batch * 2 * keys * zkv * d * elem_size(dtype)


def chunks(keys: list[tuple], budget: int = CHUNK_BYTES) -> list[list[tuple]]:
    """``keys`` in order, cut where a chunk's ``footprint`` would pass ``budget`` (a key over it alone)."""
    out: list[list[tuple]] = [[]]
    held = 0
    for k in keys:
        if out[-1] and held + footprint(k) > budget:
            out.append([])
            held = 0
        out[-1].append(k)
        held += footprint(k)
    return out


def measure(keys, *, procs: int, threads: int, seconds: float = 0.2, rounds: int = 3, python: str = sys.executable,
            timeout_s: float = 900, cpus: float | None = None, clock: str | None = None) -> KernelTimes:
    """``measure_chunk`` of each of ``chunks(keys)`` in turn, merged: eight processes each holding every decode
    cache of a sweep at once do not fit this machine's memory (1M tokens of one KV head are 512 MiB)."""
    parts = [measure_chunk(c, procs=procs, threads=threads, seconds=seconds, rounds=rounds, python=python,
                           timeout_s=timeout_s, cpus=cpus, clock=clock)
             for c in chunks(sorted({_key(k) for k in keys}, key=str))]
    first = parts[0] if parts else KernelTimes(procs, threads, {}, host=os.uname().nodename, cpus=cpus,
                                               clock=clock or default_clock(cpus))
    return KernelTimes(procs=procs, threads=threads, host=first.host, cpus=first.cpus, clock=first.clock,
                       seconds={k: v for p in parts for k, v in p.seconds.items()},
                       samples={k: v for p in parts for k, v in p.samples.items()},
                       wall={k: v for p in parts for k, v in p.wall.items()})


CLOCKS = ("cpu", "wall")


def default_clock(cpus: float | None) -> str:
    """A capped table's clock is the CPU's (``measure_chunk``); an uncapped process's rate is what cores it gets,
    so its wall time is the measure."""
    return "cpu" if cpus is not None else "wall"


def measure_chunk(keys, *, procs: int, threads: int, seconds: float = 0.2, rounds: int = 3,
                  python: str = sys.executable, timeout_s: float = 900, cpus: float | None = None,
                  clock: str | None = None) -> KernelTimes:
    """Time every key in ``procs`` processes at once, ``rounds`` times round-robin (at least ``seconds``
    each); the table keeps the median over processes and rounds.

    ``clock``: ``"cpu"`` (the default under a cap) keeps each call's process CPU / ``cpus``, the wall time it
    takes a rank that gets its whole quota, and the wall medians beside it (``KernelTimes.wall``); ``"wall"``
    (the default uncapped, and tables before 2026-12-07) the wall time. Why: docs/findings.md, "The kernel table
    in CPU seconds at the cap".

    ``cpus``: cap each process at that many CPUs (``harness.cpuquota``), as the emulated cluster caps
    its ranks. Uncapped, a process whose neighbours have finished their calls of a key gets their
    cores, so a key whose calls last about ``seconds`` is timed at two rates at once
    (docs/findings.md#kernel-table-under-the-ranks-caps). Where no cgroup can be made the processes run
    uncapped and the table says so (``cpus`` None)."""
    if procs < 1 or threads < 1:
        raise ValueError(f"procs={procs} and threads={threads} must be >= 1")
    clock = clock or default_clock(cpus)
    if clock not in CLOCKS or (clock == "cpu" and cpus is None):
        raise ValueError(f"clock={clock!r} must be one of {', '.join(CLOCKS)}; 'cpu' only with a cap (cpus={cpus})")
    keys = sorted({_key(k) for k in keys}, key=str)
    run_id = "bemukt" + secrets.token_hex(3)          # named like the emulator's rank groups
    template = (cpuquota.create(run_id, [f"{run_id}-n0r{i}" for i in range(procs)], cpus)[0]
                if cpus is not None else None)
    with tempfile.TemporaryDirectory(prefix="perfmodel-kernels-") as d:
        sync = Path(d)
        (sync / "keys.json").write_text(json.dumps([list(k) for k in keys]))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="")
        ps = []
        try:
            for i in range(procs):
                ps.append(subprocess.Popen([python, "-m", "experiments.perfmodel.emulated.measured", "bench",
                                            str(sync / "keys.json"), str(sync), str(i), str(seconds), str(threads),
                                            str(rounds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True, env=env))
                if template is not None:      # before it times anything: it warms up, then waits for "go"
                    cpuquota.join(template.format(node=0, local_rank=i), ps[-1].pid)
            deadline = time.monotonic() + timeout_s
            for r in range(rounds):
                for i in range(len(keys)):
                    while len(list(sync.glob(f"ready.{r}.{i}.*"))) < procs:
                        if any(p.poll() not in (None, 0) for p in ps) or time.monotonic() > deadline:
                            errs = [p.stderr.read()[-800:] for p in ps if p.poll() not in (None, 0)]
                            raise RuntimeError(f"kernel timing did not reach key {keys[i]}: {errs or 'timeout'}")
                        time.sleep(0.01)
                    (sync / f"go.{r}.{i}").touch()
            per_proc = []
            for p in ps:
                out, err = p.communicate(timeout=max(10.0, deadline - time.monotonic()))
                if p.returncode:
                    raise RuntimeError(f"kernel timing failed: {err[-800:]}")
                per_proc.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in ps:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if template is not None:
                cpuquota.remove(run_id)
    # no cgroup here: the processes ran uncapped, on the wall clock (docstring)
    return table_of(keys, per_proc, procs=procs, threads=threads, cpus=float(cpus) if template is not None else None,
                    clock=clock if template is not None else "wall")


def table_of(keys: list[tuple], per_proc: list, *, procs: int, threads: int, cpus: float | None,
             clock: str) -> KernelTimes:
    """The table of ``_bench``'s output of every process (``per_proc[p][i]``: key i's [wall, CPU] per round): on the
    ``"cpu"`` clock each sample is the CPU over ``cpus``, the wall medians kept beside (``measure_chunk``)."""
    walls = {k: [t[0] for pp in per_proc for t in pp[i]] for i, k in enumerate(keys)}
    samples = walls if clock == "wall" else {k: [t[1] / cpus for pp in per_proc for t in pp[i]]
                                             for i, k in enumerate(keys)}
    return KernelTimes(procs=procs, threads=threads, host=os.uname().nodename, cpus=cpus, clock=clock,
                       seconds={k: statistics.median(v) for k, v in samples.items()}, samples=samples,
                       wall={} if clock == "wall" else {k: statistics.median(v) for k, v in walls.items()})


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "bench":
        print(__doc__)
        return 2
    keys_file, sync, ident, seconds, threads, rounds = argv[1:7]
    keys = [_key(k) for k in json.loads(Path(keys_file).read_text())]
    print(json.dumps(_bench(keys, int(threads), Path(sync), ident, float(seconds), int(rounds))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
