"""Fixtures of the cache's tests."""

from __future__ import annotations

import pytest

from ringfence.actors.tools.testing.redis_server import REDIS_SERVER, redis_server


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A redis-server of the test module's own on loopback (skipped where none is installed)."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url
