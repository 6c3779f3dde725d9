import os
from pathlib import Path

import pytest

# DeepSpeed JIT-compiles a CPU extension when its comm starts (about 35 s); the tests start it without
# (tests/_helpers.deepspeed_comm_without_shm_op), so none should build it. Should one, a per-checkout build
# folder keeps checkouts of different paths from rebuilding each other's copy, and a build killed half-way
# in one checkout from leaving a stale lock that hangs the others.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))

from tests.distpool import Pools


@pytest.fixture(scope="session")
def pools():
    """``pools.run(world_size, fn, *args)`` runs a module-level fn on every rank of a gloo group."""
    p = Pools()
    yield p
    p.close()
