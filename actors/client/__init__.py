"""Clients of a running instance (``Client.connect(run_dir)``): :mod:`.client` is the
client, :mod:`.slot` the slot actor it drives."""

from __future__ import annotations

from ringfence.actors.client.client import Client, ClientError, Completion

__all__ = ["Client", "ClientError", "Completion"]
