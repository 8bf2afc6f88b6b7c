"""Fake instances for the router's tests, stopped after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_instance import FakeInstance, Knobs

from ringfence.actors.http.tls import ListenerTls


@pytest.fixture
def fakes() -> Iterator[Callable[..., FakeInstance]]:
    """``fakes(name, role=..., tls=None, **knobs)``: a started fake instance (HTTPS with
    ``tls``), stopped after the test; every fake of the test shares one journal."""
    made: list[FakeInstance] = []
    journal: list[tuple[str, str]] = []

    def make(name: str, tls: ListenerTls | None = None, **knobs: Any) -> FakeInstance:
        fake = FakeInstance(name, Knobs(**knobs), journal=journal, tls=tls).start()
        made.append(fake)
        return fake

    yield make
    for fake in made:
        fake.stop()
