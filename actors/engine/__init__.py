"""The Engine: the scheduler driven as an actor, issuing fenced ops to the executors.

``ringfence.actors.engine:TOPOLOGY``, the default ``runtime.topology``, is
:data:`.launch.TOPOLOGY`, imported when first asked for: importing a module of this
package (its config section, say) imports nothing else.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "TOPOLOGY":
        from ringfence.actors.engine.launch import TOPOLOGY

        return TOPOLOGY
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
