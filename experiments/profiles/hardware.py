"""Hardware profiles: what a cluster is made of, as data (``experiments/hardware/<name>.yaml``).

A hardware profile describes real machines: the accelerator (peak dense
FLOP/s per dtype, HBM size and bandwidth, how close an attention kernel gets
to peak as a function of its block size) and the two link classes a rank
talks over (inside a node: NVLink or PCIe; between nodes: InfiniBand or
RoCE), with the sources of every number in the file. Two consumers read it:

* the cluster emulator (``experiments.cluster``) scales its shaped links so
  that compute time : communication time per ring step on this machine equals
  the target's;
* the performance model (``experiments.perfmodel``) predicts step times and
  memory at the papers' sizes.

A *cluster profile* (``experiments/clusters/<name>.yaml``, ``profile.py``) is
where a spec runs (scheduler, nodes, partition, setup); it names the hardware
profile it is made of with ``hardware: <name>``.

Link bandwidth convention. ``gbits_s`` is the nominal rate vendors quote for
one link (one NIC, one PCIe x16 slot, one GPU's NVLink in one direction);
``shared_by`` is how many ranks share one such link when every rank of a node
sends at once (e.g. 8 GPUs behind 4 HCAs: 2); ``efficiency`` is the fraction
of nominal a collective or a point-to-point transfer achieves in practice
(NCCL bus bandwidth over nominal). The rate one rank gets is
``gbits_s * 1e9 / 8 * efficiency / shared_by`` bytes per second, per direction.

NICs. ``nics_per_node`` is how many inter-node links (NICs, HCAs) a node has;
``inter.shared_by`` must then equal ``devices_per_node / nics_per_node`` (the
ranks behind one NIC), and the rank -> NIC map is derived: local rank k uses NIC
``k // ranks_per_nic`` (consecutive GPUs share an HCA, as on DGX-style nodes
where each pair of GPUs and its HCA sit under one PCIe switch). A NIC is shared
by the flows that cross on it at once: a lone flow gets the whole NIC
(``nic_bytes_per_s``), k concurrent flows 1/k each (``inter_flow_bytes_per_s``),
so ``bytes_per_s`` above is the case k = ranks_per_nic. On PCIe nodes a GPU
reaches its NIC through its own PCIe link, so no flow exceeds the intra rate.

Optional, for profiles that source them (absent: the model ignores them, so older profiles keep
their meaning):

* ``intra.transport``: how NCCL moves a node's bytes, ``p2p`` (CUDA peer access over NVLink or
  PCIe) or ``shm`` (staged through host memory, NCCL_P2P_DISABLE=1); the rate above is then that
  transport's, so this names what ``efficiency`` measures, and ``shm`` is refused on anything but
  ``pcie``/``nvlink``.
* ``step_latency_us``: the latency of each ring step after a collective's first (NCCL's tuning
  model: a collective costs a base latency once plus a per-hop latency per step, so ``latency_us``
  is base + hop and this is the hop alone).
* ``accelerator.attn_grid``: the flash kernel's launch grid (SMs, query rows per thread block,
  blocks resident per SM), for the tail of a kernel with few thread blocks (wave quantisation,
  ``Accelerator.wave_efficiency``).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

HARDWARE_DIR = Path(__file__).resolve().parents[1] / "hardware"
LINK_KINDS = ("nvlink", "pcie", "infiniband", "roce", "ethernet", "veth")
TRANSPORTS = ("p2p", "shm")          # intra-node NCCL transports a profile may name (``Link.transport``)


def _interp(pts: tuple[tuple[int, float], ...], tokens: float) -> float:
    """Linear in log2(tokens) between the table's points, clamped at both ends."""
    xs = [t for t, _ in pts]
    if tokens <= xs[0]:
        return pts[0][1]
    if tokens >= xs[-1]:
        return pts[-1][1]
    i = bisect.bisect_right(xs, tokens)
    (t0, e0), (t1, e1) = pts[i - 1], pts[i]
    w = (math.log2(tokens) - math.log2(t0)) / (math.log2(t1) - math.log2(t0))
    return e0 + w * (e1 - e0)


@dataclass(frozen=True)
class KernelGrid:
    """How a flash kernel's thread blocks fill the GPU: ``blocks = B x heads x ceil(rows / tile_rows)``
    over ``sms x blocks_per_sm`` slots at once."""
    sms: int                  # streaming multiprocessors
    tile_rows: int            # query rows per thread block (the kernel's BLOCK_M)
    blocks_per_sm: int = 1    # thread blocks resident on one SM at once
    source: str = ""


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_tflops: dict[str, float]            # dense peak per dtype name ("bfloat16", "float16", "float32")
    hbm_gib: float                           # memory per device
    hbm_gbytes_s: float                      # memory bandwidth, 1e9 bytes/s
    # (tokens per block, fraction of peak) of a flash-attention kernel, forward + backward,
    # head dim 128; interpolated linearly in log2(tokens), clamped at both ends.
    attn_efficiency: tuple[tuple[int, float], ...]
    source: str = ""
    # Optional, same form, forward pass only (None: the forward + backward table serves every
    # mode). With it the performance model derives the backward efficiency from the two.
    attn_efficiency_forward: tuple[tuple[int, float], ...] | None = None
    # Optional, same forms, for a causal problem (the diagonal's partly masked tiles; FLOPs of the half
    # area, the suite's convention): where given, causal problems (causal tiles, the documents of a
    # varlen-causal tile) are charged at these; without them, at the tables above.
    attn_efficiency_causal: tuple[tuple[int, float], ...] | None = None
    attn_efficiency_causal_forward: tuple[tuple[int, float], ...] | None = None
    # Optional: fraction of peak a large dense GEMM reaches (projections of the attention block).
    gemm_efficiency: float | None = None
    # Optional: the flash kernel's launch grid; with it a kernel of few thread blocks pays its last
    # wave's idle SMs (``wave_efficiency``); without it, none.
    attn_grid: KernelGrid | None = None

    def wave_efficiency(self, blocks: int) -> float:
        """The busy fraction of the SM-slots a kernel of ``blocks`` equal thread blocks occupies:
        w = (blocks / slots) / ceil(blocks / slots), slots = sms x blocks_per_sm (1 without a grid)."""
        if self.attn_grid is None or blocks <= 0:
            return 1.0
        waves = blocks / (self.attn_grid.sms * self.attn_grid.blocks_per_sm)
        return waves / math.ceil(waves)

    def tables(self, causal: bool = False) -> tuple[tuple, tuple | None]:
        """(forward + backward table, forward table or None) of a problem: the causal pair for a causal
        problem where the profile has one, else the plain pair."""
        if causal and self.attn_efficiency_causal:
            return self.attn_efficiency_causal, self.attn_efficiency_causal_forward
        return self.attn_efficiency, self.attn_efficiency_forward

    def efficiency(self, tokens: int, causal: bool = False) -> float:
        return _interp(self.tables(causal)[0], tokens)

    def forward_efficiency(self, tokens: int, causal: bool = False) -> float:
        both, forward = self.tables(causal)
        return _interp(forward or both, tokens)

    def attention_flops_per_s(self, dtype: str, tokens: int) -> float:
        """FLOP/s a flash kernel sustains on blocks of ``tokens`` rows (peak x efficiency)."""
        return self.peak_tflops[dtype] * 1e12 * self.efficiency(tokens)


@dataclass(frozen=True)
class Link:
    kind: str                # one of LINK_KINDS
    gbits_s: float           # nominal rate of one link, per direction
    latency_us: float        # one-way latency of a small message
    shared_by: int = 1       # ranks sharing one link when all send at once
    efficiency: float = 1.0  # achieved / nominal
    source: str = ""
    transport: str | None = None          # intra-node NCCL transport the rate is for (TRANSPORTS); None: unstated
    step_latency_us: float | None = None  # a collective's later ring steps (None: latency_us for every step)

    @property
    def bytes_per_s(self) -> float:
        """What one rank gets, per direction, when every rank of the node uses this link class."""
        return self.gbits_s * 1e9 / 8 * self.efficiency / self.shared_by

    @property
    def nic_bytes_per_s(self) -> float:
        """What one link (one NIC) carries, per direction: a lone flow on it gets all of it."""
        return self.gbits_s * 1e9 / 8 * self.efficiency

    def transfer_s(self, nbytes: float) -> float:
        """Time for one message of ``nbytes`` on this link (latency + size / rate)."""
        return self.latency_us * 1e-6 + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    accelerator: Accelerator
    nodes: int
    devices_per_node: int
    intra: Link                      # between ranks of one node
    inter: Link | None = None        # between nodes (None: single node)
    nics_per_node: int = 0           # inter-node NICs per node (0: devices_per_node / inter.shared_by)
    path: str = "<memory>"

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def nics(self) -> int:
        """NICs per node (resolved: the profile's ``nics_per_node``, else one per ``inter.shared_by`` ranks)."""
        if self.nics_per_node:
            return self.nics_per_node
        shared = self.inter.shared_by if self.inter is not None else 1
        return max(1, self.devices_per_node // shared)

    @property
    def ranks_per_nic(self) -> int:
        return max(1, self.devices_per_node // self.nics)

    def nic_of(self, local_rank: int) -> int:
        """The NIC local rank ``local_rank`` crosses nodes on (consecutive ranks share one)."""
        if not 0 <= local_rank < self.devices_per_node:
            raise ValueError(f"local_rank={local_rank} must be in 0..{self.devices_per_node - 1} "
                             f"(devices_per_node of hardware {self.name!r})")
        return local_rank // self.ranks_per_nic

    def inter_flow_bytes_per_s(self, flows: int = 1, ranks_per_nic: int | None = None) -> float:
        """Bytes/s of one inter-node flow while ``flows`` flows (itself included) cross on its NIC: the
        NIC's rate split evenly, and on PCIe nodes at most the GPU's own PCIe link.

        ``ranks_per_nic`` (default: the profile's): a NIC behind that many ranks, carrying that many
        per-rank shares (an emulated node slice, ``experiments.cluster``; at the profile's own value
        it is the physical NIC, ``inter.nic_bytes_per_s``)."""
        if self.inter is None:
            raise ValueError(f"hardware {self.name!r} has no inter-node link")
        q = self.ranks_per_nic if ranks_per_nic is None else ranks_per_nic
        for key, v in (("flows", flows), ("ranks_per_nic", q)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key}={v!r} must be an integer >= 1")
        rate = q * self.inter.bytes_per_s / min(flows, q)
        if self.intra.kind == "pcie":
            rate = min(rate, self.intra.bytes_per_s)
        return rate

    def link(self, same_node: bool) -> Link:
        if same_node or self.inter is None:
            return self.intra
        return self.inter


def _err(path, key: str, rule: str) -> ValueError:
    return ValueError(f"{path}: key {key!r}: {rule}")


def _positive(path, key: str, value, *, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
        value >= 0 if allow_zero else value > 0)
    if not ok:
        raise _err(path, key, f"{value!r} must be a {'non-negative' if allow_zero else 'positive'} number")
    return value


def _keys(path, where: str, raw, cls) -> dict:
    if not isinstance(raw, dict):
        raise _err(path, where, "must be a mapping")
    allowed = {f.name for f in fields(cls)} - {"path"}
    unknown = set(raw) - allowed
    if unknown:
        raise _err(path, f"{where}.{sorted(unknown)[0]}" if where else sorted(unknown)[0],
                   f"unknown key; allowed: {sorted(allowed)}")
    return dict(raw)


def _link(path, where: str, raw) -> Link:
    d = _keys(path, where, raw, Link)
    for key in ("kind", "gbits_s", "latency_us"):
        if key not in d:
            raise _err(path, f"{where}.{key}", "is required")
    if d["kind"] not in LINK_KINDS:
        raise _err(path, f"{where}.kind", f"{d['kind']!r} must be one of {LINK_KINDS}")
    _positive(path, f"{where}.gbits_s", d["gbits_s"])
    _positive(path, f"{where}.latency_us", d["latency_us"], allow_zero=True)
    if not isinstance(d.get("shared_by", 1), int) or d.get("shared_by", 1) < 1:
        raise _err(path, f"{where}.shared_by", f"{d.get('shared_by')!r} must be an integer >= 1")
    eff = d.get("efficiency", 1.0)
    if not isinstance(eff, (int, float)) or not 0 < eff <= 1:
        raise _err(path, f"{where}.efficiency", f"{eff!r} must be in (0, 1]")
    if d.get("step_latency_us") is not None:
        step = _positive(path, f"{where}.step_latency_us", d["step_latency_us"], allow_zero=True)
        if step > d["latency_us"]:
            raise _err(path, f"{where}.step_latency_us", f"{step!r} must not exceed latency_us={d['latency_us']!r} "
                                                         "(a collective's first step pays its base latency too)")
    t = d.get("transport")
    if t is not None:
        if t not in TRANSPORTS:
            raise _err(path, f"{where}.transport", f"{t!r} must be one of {TRANSPORTS}")
        if where != "intra" or d["kind"] not in ("pcie", "nvlink"):
            raise _err(path, f"{where}.transport", f"{t!r} names an intra-node NCCL transport: only intra links of "
                                                   f"kind pcie or nvlink have one (this is {where}, {d['kind']!r})")
    return Link(**d)


def _grid(path, raw) -> KernelGrid:
    d = _keys(path, "accelerator.attn_grid", raw, KernelGrid)
    for key in ("sms", "tile_rows"):
        if key not in d:
            raise _err(path, f"accelerator.attn_grid.{key}", "is required")
    for key in ("sms", "tile_rows", "blocks_per_sm"):
        v = d.get(key, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise _err(path, f"accelerator.attn_grid.{key}", f"{v!r} must be an integer >= 1")
    return KernelGrid(**d)


def _efficiency_table(path, key: str, pts) -> tuple[tuple[int, float], ...]:
    if not isinstance(pts, list) or not pts or not all(isinstance(p, list) and len(p) == 2 for p in pts):
        raise _err(path, key, "must be a non-empty list of [tokens, fraction]")
    pts = tuple((int(t), float(e)) for t, e in pts)
    if any(t <= 0 or not 0 < e <= 1 for t, e in pts) or [t for t, _ in pts] != sorted({t for t, _ in pts}):
        raise _err(path, key, "tokens must be positive and strictly increasing, fractions in (0, 1]")
    return pts


def _accelerator(path, raw) -> Accelerator:
    d = _keys(path, "accelerator", raw, Accelerator)
    for key in ("name", "peak_tflops", "hbm_gib", "hbm_gbytes_s", "attn_efficiency"):
        if key not in d:
            raise _err(path, f"accelerator.{key}", "is required")
    if not isinstance(d["peak_tflops"], dict) or not d["peak_tflops"]:
        raise _err(path, "accelerator.peak_tflops", "must map dtype names to TFLOP/s")
    for k, v in d["peak_tflops"].items():
        _positive(path, f"accelerator.peak_tflops.{k}", v)
    _positive(path, "accelerator.hbm_gib", d["hbm_gib"])
    _positive(path, "accelerator.hbm_gbytes_s", d["hbm_gbytes_s"])
    d["attn_efficiency"] = _efficiency_table(path, "accelerator.attn_efficiency", d["attn_efficiency"])
    for key in ("attn_efficiency_forward", "attn_efficiency_causal", "attn_efficiency_causal_forward"):
        if d.get(key) is not None:
            d[key] = _efficiency_table(path, f"accelerator.{key}", d[key])
    if d.get("attn_efficiency_causal_forward") is not None and d.get("attn_efficiency_causal") is None:
        raise _err(path, "accelerator.attn_efficiency_causal_forward", "needs accelerator.attn_efficiency_causal "
                   "(the forward + backward table of causal problems) beside it")
    if d.get("gemm_efficiency") is not None:
        g = d["gemm_efficiency"]
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1:
            raise _err(path, "accelerator.gemm_efficiency", f"{g!r} must be in (0, 1]")
        d["gemm_efficiency"] = float(g)
    if d.get("attn_grid") is not None:
        d["attn_grid"] = _grid(path, d["attn_grid"])
    d["peak_tflops"] = {str(k): float(v) for k, v in d["peak_tflops"].items()}
    return Accelerator(**d)


def parse_hardware(raw, path: str | Path = "<memory>") -> Hardware:
    d = _keys(path, "", raw, Hardware)
    for key in ("name", "accelerator", "nodes", "devices_per_node", "intra"):
        if key not in d:
            raise _err(path, key, "is required")
    for key in ("nodes", "devices_per_node"):
        if not isinstance(d[key], int) or isinstance(d[key], bool) or d[key] < 1:
            raise _err(path, key, f"{d[key]!r} must be an integer >= 1")
    d["accelerator"] = _accelerator(path, d["accelerator"])
    d["intra"] = _link(path, "intra", d["intra"])
    if d.get("inter") is not None:
        d["inter"] = _link(path, "inter", d["inter"])
    elif d["nodes"] > 1:
        raise _err(path, "inter", f"is required when nodes={d['nodes']} > 1")
    _check_nics(path, d)
    d.setdefault("description", "")
    return Hardware(**d, path=str(path))


def _check_nics(path, d: dict) -> None:
    """``nics_per_node`` against the node's devices and the inter link's ``shared_by`` (both say how many
    ranks share one NIC, so they must agree); filled in from ``shared_by`` when absent."""
    per_node = d["devices_per_node"]
    nics = d.get("nics_per_node", 0)
    if isinstance(nics, bool) or not isinstance(nics, int) or nics < 0:
        raise _err(path, "nics_per_node", f"{nics!r} must be an integer >= 0 (0: derived from inter.shared_by)")
    inter = d.get("inter")
    if nics == 0:
        if inter is None:
            return
        if per_node % inter.shared_by:
            raise _err(path, "inter.shared_by", f"{inter.shared_by} must divide devices_per_node={per_node} "
                                                "(every NIC is shared by the same number of ranks)")
        d["nics_per_node"] = per_node // inter.shared_by
        return
    if nics > per_node or per_node % nics:
        raise _err(path, "nics_per_node", f"{nics} must divide devices_per_node={per_node} (every NIC is "
                                          "shared by the same number of ranks, at least one)")
    if inter is not None and inter.shared_by != per_node // nics:
        raise _err(path, "inter.shared_by", f"{inter.shared_by} disagrees with devices_per_node={per_node} / "
                                            f"nics_per_node={nics} = {per_node // nics} ranks per NIC")


def load_hardware(name_or_path: str) -> Hardware:
    """A hardware profile by name (``experiments/hardware/<name>.yaml``) or path; ValueError if absent
    or invalid (naming the file, the key and the rule)."""
    p = Path(name_or_path)
    if not p.suffix:
        p = HARDWARE_DIR / f"{name_or_path}.yaml"
    if not p.exists():
        known = sorted(x.stem for x in HARDWARE_DIR.glob("*.yaml"))
        raise ValueError(f"hardware={name_or_path!r}: no such hardware profile; known: {known}")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from None
    return parse_hardware(raw, p)


def known_hardware() -> list[str]:
    return sorted(x.stem for x in HARDWARE_DIR.glob("*.yaml"))
