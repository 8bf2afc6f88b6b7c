"""One live ``ringfence serve`` (the tiny preset, a 256-token context, publishing KV events)
shared by the modules that only send it requests: each server costs seconds of startup on
this machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serving import Server, served

MAX_MODEL_LEN = 256  # short, so that the context limits are quick to reach


@pytest.fixture(scope="package")
def tiny_server(tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("serve")
    sets = ("model.preset=tiny", f"sched.max_model_len={MAX_MODEL_LEN}", "events.enabled=true")
    with served(tmp, *sets) as server:
        yield server
