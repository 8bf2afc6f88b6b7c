"""The commands that live with the actors: what their table holds, and where the runtime
finds it.

``ringfence`` runs ``launch`` and ``clean`` itself. Every other command (``serve``,
``router``, ``replay``, each ``bench NAME``) lives with the actors it runs, in a module
with ``add_arguments(parser)`` and ``main(args) -> int``; the actors list them in one
:class:`CommandTable` (``actors/commands.py``). The runtime names that one import path,
:data:`TABLE`, as it names the run's config schema (``runtime.config.SCHEMA``): it never
imports ``ringfence.actors`` statically, and it imports a command's module only when that
command is chosen, so ``ringfence --help`` answers at once and a command that needs an
optional extra fails alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ringfence.runtime.imports import import_target

# The actors' command table, by name: the runtime never imports the actors.
TABLE = "ringfence.actors.commands:TABLE"


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    """One command that lives with the actors."""

    module: str  # import path of a module with add_arguments(parser) and main(args) -> int
    help: str  # one plain line: the command's entry in its parent's list of commands
    # Its --help text until the module is imported, and after, unless the module has a
    # DESCRIPTION of its own; empty: ``help`` as a sentence.
    description: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandTable:
    """Every command of ``ringfence`` that lives with the actors, in the order ``--help``
    lists them, and what ``ringfence launch`` prints after a workload run."""

    commands: Mapping[str, Command]  # ringfence NAME (after launch, before clean)
    benchmarks: Mapping[str, Command]  # ringfence bench NAME
    # "module:FUNCTION": a workload run's summary.json (a mapping) -> the table launch prints.
    launch_summary: str


def command_table() -> CommandTable:
    """The actors' table (:data:`TABLE`), imported on first use; TypeError if it is none."""
    table = import_target(TABLE)
    if not isinstance(table, CommandTable):
        raise TypeError(f"{TABLE} is not a CommandTable")
    return table
