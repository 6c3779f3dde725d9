"""This machine as the emulated cluster of a run: its links as the emulator shaped them.

Links: the per-rank rates (and applied latency) the emulator shaped, read from the records'
``cluster`` block (``experiments/cluster/emulator/emulation.py``: the hardware profile's rates x
this machine's compute / the target's), with the run's NICs: ``ranks_per_nic`` ranks share one
emulated NIC of ``ranks_per_nic`` x the per-rank inter rate (1, every rank its own, for runs
recorded before NICs were shaped), as ``emulator/shaping.py`` builds them. The accelerator is a
placeholder: ``EmulatedCosts`` reads compute from the measured kernel table.
"""
from __future__ import annotations

import os

from ...profiles.hardware import Accelerator, Hardware, Link


def emulated_hardware(cluster: dict, dtype: str) -> Hardware:
    """This machine as the emulated cluster of ``cluster`` (a record's ``cluster`` block).

    The accelerator's numbers are placeholders (peak = the run's calibrated FLOP/s, efficiency 1):
    ``EmulatedCosts`` answers every compute question from measured times instead."""
    if not cluster.get("emulated") or not cluster.get("links"):
        raise ValueError(f"cluster={cluster.get('summary', cluster)!r}: not an emulated run with shaped links "
                         "(a loopback fallback has no link rates to model)")
    nodes, per_node = int(cluster["nodes"]), int(cluster["ranks_per_node"])
    cal = (cluster.get("calibration") or {}).get("per_rank_flops_s") or 1e9
    links = {}
    per_nic = int((cluster["links"].get("inter") or {}).get("ranks_per_nic") or 1)
    for klass, d in cluster["links"].items():
        # inter: one NIC of per_nic x the per-rank rate, shared by per_nic ranks (Link.bytes_per_s = per rank)
        share = per_nic if klass == "inter" else 1
        # the target's intra kind: on PCIe nodes a lone inter flow is capped at the (emulated) PCIe rate,
        # as the emulator shapes it (Hardware.inter_flow_bytes_per_s)
        kind = "pcie" if klass == "intra" and d.get("kind") == "pcie" else "veth"
        links[klass] = Link(kind=kind, gbits_s=float(d["bytes_per_s"]) * share * 8 / 1e9,
                            latency_us=float(d.get("latency_us") or 0.0), shared_by=share,
                            source=f"emulated {d.get('kind', '?')} link, shaped per "
                                   f"{'NIC' if share > 1 else 'rank'} ({klass})")
    if "intra" not in links:                          # one rank per node: no intra hop is ever used
        links["intra"] = Link(kind="veth", gbits_s=8e3, latency_us=0.0, source="unused")
    acc = Accelerator(name="CPU rank (emulated)", peak_tflops={dtype: cal / 1e12},
                      hbm_gib=(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30 / (nodes * per_node),
                      hbm_gbytes_s=1.0, attn_efficiency=((1, 1.0),), gemm_efficiency=1.0,
                      source="placeholders: compute times are measured per key (emulated.measured)")
    return Hardware(name=f"emulated_{cluster.get('profile', 'cluster')}",
                    description=f"this machine as emulated: {cluster.get('summary', '')}", accelerator=acc,
                    nodes=nodes, devices_per_node=per_node, intra=links["intra"],
                    inter=links.get("inter") if nodes > 1 else None,
                    nics_per_node=per_node // per_nic if nodes > 1 else per_node)
