"""What the ranks of an inference call agree on before its first byte (``comm.agree_on_inputs``).

A rank sees only its own cache shard and its own arguments; a rank whose cache is a step behind,
or that passed another layer, window or merge, would otherwise exchange partials that do not
belong together. Each operator runs its local checks, then this one all-gather of hashed
arguments (the cache's layer count, lengths and shard lengths included); a local failure on any
rank, or a disagreement, is a ValueError on every rank, naming the parameter and every rank's value.
"""
from __future__ import annotations

from typing import Callable

from .. import comm
from ..attention import _hash

Checks = Callable[[], None]


def agree(group, checks: Checks, same: dict[str, object], varying: dict[str, int] | None = None
          ) -> list[dict[str, int]]:
    """Run ``checks`` (local ValueErrors), then agree over ``group`` on ``same`` (name -> value every rank
    must pass) and gather ``varying`` (name -> this rank's int, e.g. its local token count).

    Returns every rank's ``varying`` (rank order); with the agreement check off
    (``comm.check_shapes(False)``) or one rank, only this rank's is known: ``[varying]``."""
    varying = dict(varying or {})
    problem = None
    try:
        checks()
    except ValueError as e:
        problem = e
    _, size = comm.world(group)
    if size == 1 or not comm.shape_check_enabled():
        if problem is not None:
            raise problem
        return [varying]
    names = tuple(same) + tuple(varying)
    signature = [_hash(repr(v)) for v in same.values()] + [int(x) for x in varying.values()]
    readable = [repr(v) for v in same.values()] + [""] * len(varying)
    rows = comm.agree_on_inputs(group, signature, problem, lambda row: ", ".join(map(str, row)), names=names,
                                values=readable, vary=tuple(range(len(same), len(names))))
    if problem is not None:
        raise problem
    return [dict(zip(varying, row[len(same):])) for row in rows]
