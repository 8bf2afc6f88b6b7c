"""Clients of a running instance (``Client.connect(run_dir)``); see :mod:`.shm`."""

from __future__ import annotations

from ringfence.actors.client.shm import Client, ClientError, Completion

__all__ = ["Client", "ClientError", "Completion"]
