"""The commands of ``ringfence`` that live with the actors: each one's module and help.

The runtime finds :data:`TABLE` by import path (``runtime.commands.TABLE``) and imports a
command's module only when that command is chosen; this module therefore names them as
strings and imports none of them. A new command is a module with ``add_arguments(parser)``
and ``main(args) -> int`` plus one entry here; a new benchmark, one in
``actors/tools/bench/`` plus one entry in ``_BENCHMARKS``. ``launch`` and ``clean`` are the
runtime's own.
"""

from __future__ import annotations

import types

from ringfence.runtime.commands import Command, CommandTable

_TOOLS = "ringfence.actors.tools.bench"

# ``ringfence NAME``, in the order ``ringfence --help`` lists them (after launch).
_COMMANDS = {
    "serve": Command(
        module="ringfence.actors.serve.cli",
        help="serve the OpenAI API over HTTP (completions, chat, models, health, metrics)",
    ),
    "router": Command(
        module="ringfence.actors.router.cli",
        help="one OpenAI endpoint over prefill and decode instances (disaggregated serving)",
    ),
    "replay": Command(
        module="ringfence.actors.replay.cli",
        help="check, explain and visualize a run from its logs (exit 1: a violation)",
        description=(
            "Check a run from its logs alone: exit 0 when every protocol check holds, 1 with "
            "the first violation and the events around it, 2 when the run dir cannot be read."
        ),
    ),
}

# ``ringfence bench NAME``: one plain line each, for ``ringfence bench --help`` and its own.
_BENCHMARKS = {
    "ring": Command(
        module=f"{_TOOLS}.transport.ring",
        help="ringfence rings against multiprocessing queues and pipes",
    ),
    "hop": Command(
        module=f"{_TOOLS}.transport.hop",
        help="messages per second through a supervised actor hop against the bare ring",
    ),
    "cache": Command(
        module=f"{_TOOLS}.cache",
        help="the cache's bookkeeping per block, and storage put/get against a plain write",
    ),
    "sched": Command(
        module=f"{_TOOLS}.sched",
        help="the scheduler's host work per decode step, against the device step it must hide in",
    ),
    "worker": Command(
        module=f"{_TOOLS}.worker",
        help="prefill and decode speed of the paged model against transformers",
    ),
    "attention": Command(
        module=f"{_TOOLS}.attention",
        help="the paged attention kernel alone, each context read whole or split, vs the roofline",
    ),
    "decode": Command(
        module=f"{_TOOLS}.decode",
        help="a decode step of a launch, split, beside the forward, transformers and the roofline",
    ),
    "transfer": Command(
        module=f"{_TOOLS}.transfer",
        help="block copies between the tiers, and the transfer harness in fence vs sync mode",
    ),
    "e2e": Command(
        module=f"{_TOOLS}.e2e",
        help="whole runs side by side: fence vs sync, tiers on vs off, actors vs one loop",
    ),
    "tp": Command(
        module=f"{_TOOLS}.tp",
        help="the same workload at tensor-parallel sizes 1 and 2: throughput and all-reduce time",
    ),
    "replay": Command(
        module=f"{_TOOLS}.replay",
        help="the cost of trace logging, and how fast replay reads a run",
    ),
    "faults": Command(
        module=f"{_TOOLS}.faults.cli",
        help="the fault matrix: one real run per injected fault, and what survived it",
    ),
    "serve": Command(
        module=f"{_TOOLS}.serving.cli",
        help="load over HTTP against ringfence serve, beside the same requests through launch",
    ),
    "pd": Command(
        module=f"{_TOOLS}.serving.pd",
        help="prefill and decode instances behind the router against one instance doing both",
    ),
    "route": Command(
        module=f"{_TOOLS}.serving.route",
        help="the router's policies side by side on a shared-prefix workload (cache-aware)",
    ),
    "router-latency": Command(
        module=f"{_TOOLS}.serving.router_latency",
        help="the latency the router adds to a request, before stubs that answer at once",
    ),
}

TABLE = CommandTable(
    commands=types.MappingProxyType(_COMMANDS),
    benchmarks=types.MappingProxyType(_BENCHMARKS),
    # The table of a workload run lives with the engine's launch summary.
    launch_summary="ringfence.actors.engine.summary:format_summary",
)
