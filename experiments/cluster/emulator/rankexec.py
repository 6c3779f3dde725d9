"""Start a rank inside its own network namespace (emulated cluster), then become the worker.

torchrun starts every rank in the node's namespace; an emulated rank must send
from its own ``eth0`` so that its link can be shaped on its own
(``netns.py``). torchrun runs this module in place of the worker:

    torchrun ... -m experiments.cluster.emulator.rankexec experiments.harness.worker --cases ...

and it replaces itself (exec, same pid: torchrun still watches and signals
the rank) with ``nsenter --net=<rank namespace> python -m <module> <args>``,
the namespace path being ``$BURST_EMU_RANK_NETNS`` with ``{node}`` =
``$GROUP_RANK`` (torchrun's node rank) and ``{local_rank}`` = ``$LOCAL_RANK``.
Without that variable (a real cluster) it simply execs the module. With
``$BURST_EMU_RANK_CGROUP`` (``experiments/harness/cpuquota.py``) it first moves itself into the
rank's cpu cgroup, so the worker computes at the rank's fixed CPU share.
"""
from __future__ import annotations

import os
import sys

from ...harness import cpuquota

ENV = "BURST_EMU_RANK_NETNS"


def command(module: str, args: list[str], environ=os.environ) -> list[str]:
    cmd = [sys.executable, "-m", module, *args]
    template = environ.get(ENV)
    if not template:
        return cmd
    path = template.format(node=environ.get("GROUP_RANK", "0"), local_rank=environ.get("LOCAL_RANK", "0"))
    if not os.path.exists(path):
        raise SystemExit(f"rankexec: {ENV}={template!r} names {path}, which does not exist "
                         "(is the emulated cluster up?)")
    return ["nsenter", f"--net={path}", *cmd]


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m experiments.cluster.emulator.rankexec <module> [args...]")
    cmd = command(sys.argv[1], sys.argv[2:])
    template = os.environ.get(cpuquota.ENV)
    if template:
        try:
            cpuquota.join(cpuquota.rank_dir(template))
        except OSError as e:
            raise SystemExit(f"rankexec: cannot join the rank's cpu cgroup ({cpuquota.ENV}={template!r}): {e}")
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
