import pytest

from tests.distpool import Pools


@pytest.fixture(scope="session")
def pools():
    """``pools.run(world_size, fn, *args)`` runs a module-level fn on every rank of a gloo group."""
    p = Pools()
    yield p
    p.close()
