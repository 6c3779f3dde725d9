"""What every rank of an emulator probe runs (``overlap_probe``, ``message_probe``): gloo, the cases, one line.

Each rank joins the gloo group (one thread, as the runs' ranks), checks that the cluster's shape pairs every
case, probes them all, and rank 0 prints ``<MARKER> <json>``: every rank's results, in rank order, which
``burst-bench cluster`` reads from the ranks' log (``experiments/cluster/__main__.py``, ``_launch_probe``).
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Callable

import torch
import torch.distributed as dist


def pattern_bytes(text: str, patterns: tuple) -> list[tuple[str, int]]:
    """``pattern:bytes`` items of ``text``, comma-separated, as (pattern, bytes): a pattern of ``patterns`` and a
    positive multiple of 4 bytes (float32 elements); ValueError naming the item otherwise (``message_probe``,
    ``send_probe``)."""
    out = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 2 or parts[0] not in patterns or not (parts[1].isdigit() and int(parts[1]) > 0):
            raise ValueError(f"case={item!r} must be <pattern>:<bytes> with pattern in {patterns} and a positive "
                             "integer")
        if int(parts[1]) % 4:
            raise ValueError(f"case={item!r}: bytes must be a multiple of 4 (float32 elements)")
        out.append((parts[0], int(parts[1])))
    return out


def rank_main(argv: list[str], *, marker: str, doc: str, parse_cases: Callable, check_shape: Callable,
              probe_case: Callable) -> int:
    """``argv`` = [repeats, cases]; ``probe_case(case, repeats, per_node)`` -> this rank's JSON-able result."""
    if len(argv) != 2:
        print(doc)
        return 2
    repeats, cases = int(argv[0]), parse_cases(argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    check_shape(cases, dist.get_world_size() // per_node, per_node)
    mine = {c.name: probe_case(c, repeats, per_node) for c in cases}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        print(f"{marker} " + json.dumps(every), flush=True)
    dist.destroy_process_group()
    return 0
