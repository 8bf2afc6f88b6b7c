"""The engine's events: the engine actor, prefill/decode hand-overs, its calls into the
scheduler (trace, what replay repeats) and its clients.
"""

from __future__ import annotations

from typing import Final

from ringfence.runtime.events.event import Event, event

ENGINE_EVENTS: Final[dict[str, Event]] = {
    # The protocol harness (ringfence.actors.tools.testing.harness), as actor "engine".
    # The engine (actors/engine/actor.py). ``request`` is the request id (a client's is
    # "<client instance>/<incarnation>/<id>"); ``op`` a lane number; ``fence`` the waits.
    "engine.ready": event(
        "info",
        "model_id max_position vocab_size workload first_ops",
        "every executor answered the engine's Resync; the scheduler is built; first_ops: the "
        "number of each lane's first op (1 unless an engine before this one left them further)",
    ),
    "engine.restart": event(
        "warning", "incarnation", "the engine restarted: it resyncs with its executors"
    ),
    "engine.lane_restart": event(
        "warning", "lane instance done", "a transfer lane restarted (it redoes its op)"
    ),
    "engine.tier_reset": event(
        "warning",
        "incarnation new_epoch step_done requeued worker_rank waiting",
        "the worker restarted with a fresh device tier: every op in flight is lost, the running "
        "requests (requeued) are computed again; new_epoch: the engine's from now on; worker_rank: "
        "the first rank of the new generation to announce; waiting: the ranks still to come "
        "(nothing is issued until none is left)",
    ),
    "engine.rank_rejoined": event(
        "info",
        "worker_rank waiting",
        "a Worker rank of the restarted group announced itself; waiting: the ranks still to come",
    ),
    "engine.stale": event(
        "warning",
        "lane op msg_epoch why",
        "a result or completion not applied: a repeat, one of an op never sent, or of an older "
        "epoch",
    ),
    "engine.step_failed": event("error", "step status error", "a step did not finish ok"),
    "engine.op_failed": event("warning", "lane op status", "a transfer op did not finish ok"),
    "engine.workload_done": event("info", "requests duration_s", "the workload ran to its end"),
    "engine.workload_failed": event(
        "error", "workload error", "the workload could not be loaded: the run ends"
    ),
    "engine.config_failed": event(
        "error", "error", "a setting does not fit the model the Worker loaded: the run ends"
    ),
    "engine.drain_timeout": event(
        "warning",
        "store_done last_sent gone",
        "at stop, the store lane's writes were not all done: by engine.drain_timeout_s, or "
        "the lanes not done were gone (gone: their watermarks)",
    ),
    "request.arrive": event(
        "info", "request seq_id prompt_tokens max_tokens arrival_s", "a request was queued"
    ),
    "request.refused": event(
        "warning", "request error", "a workload request that can never run ended before it began"
    ),
    "request.finish": event(
        "info",
        "request reason output_tokens cached_tokens error stored_blocks",
        "a request ended (or aborted); stored_blocks: a prefill instance's hand-over (the "
        "leading full blocks storage holds), else -1",
    ),
    # Prefill/decode disaggregation (actors/engine/disaggregation.py). ``reservation`` is the
    # engine-wide key "<peer>/<incarnation>/<id>", as ``request`` is.
    "reservation.grant": event(
        "info",
        "reservation prompt_tokens max_tokens blocks ttl_s free_blocks headroom",
        "a decode instance holds room for a request (blocks of free_blocks, beside headroom "
        "kept for running requests' growth)",
    ),
    "reservation.refuse": event(
        "info", "reservation prompt_tokens error retry", "no reservation (retry: no room now)"
    ),
    "reservation.claim": event("info", "reservation request", "a request took its reservation"),
    "reservation.expire": event(
        "warning", "reservation blocks", "a reservation unclaimed for engine.reservation_ttl_s"
    ),
    "handover.hold": event(
        "info",
        "request blocks store_op",
        "a prefill instance's request finished: its full blocks are written to storage and its "
        "finish held until store op store_op is complete on every rank",
    ),
    "handover.done": event(
        "info",
        "request blocks stored_blocks wait_ms",
        "the writes are complete: the request finishes, stored_blocks of its blocks durable",
    ),
    "events.ready": event(
        "info",
        "endpoint replay_endpoint layout",
        "the engine publishes KV events (events.enabled): subscribe at endpoint, ask for a "
        "replay at replay_endpoint",
    ),
    "events.stop": event(
        "info",
        "batches events published dropped replays bad_replays degraded",
        "the KV event publisher stopped: batches and events made, published, dropped (the "
        "pipe to its thread was full), replays answered and refused, keys stored with no "
        "tokens (their lineage was gone)",
    ),
    "op.issue": event(
        "trace",
        "lane op fence sync pieces poison direction reason device_blocks host_blocks declared",
        "an op was sent to its lane; fence: the scheduler's (sync: the engine waited for it and "
        "sent none); steps: pieces [seq_id, start, tokens, sample, block_table] and poison; "
        "declared: the blocks it gave the fence tracker, {reads, writes: {tier: blocks}}",
    ),
    # The engine's calls into its scheduler, in order (trace): enough for `ringfence replay
    # --redrive` to repeat them on a fresh scheduler and compare every decision.
    "sched.add": event(
        "trace", "request prompt params cache_salt", "a request is handed to the scheduler"
    ),
    "sched.abort": event("trace", "request", "a request is aborted in the scheduler"),
    "sched.schedule": event(
        "trace",
        "ops decisions",
        "a scheduling round: ops [[lane, op]] in issue order; decisions [[kind, seq_id, detail]]",
    ),
    "sched.step": event(
        "trace", "step msg_epoch status outputs", "a step result applied: [[seq_id, token]]"
    ),
    "sched.transfer": event(
        "trace", "lane op msg_epoch status missing", "a transfer completion applied"
    ),
    "sched.reset": event("trace", "tier_epoch", "the device tier was reset (the worker restarted)"),
    "sched.storage": event(
        "trace", "asked found", "the storage tier held the first `found` of `asked` blocks"
    ),
    "harness.mismatch": event(
        "warning",
        "program differences",
        "a program's outcome differs from its sequential interpretation (or an op failed)",
    ),
    "harness.done": event(
        "info", "programs ops mismatched busy_s", "every program ran; see harness.json"
    ),
    "harness.stray": event(
        "info",
        "lane op status",
        "a completion of no op in flight (one resent after a restart, or an executor's answer "
        "to a message that was not a program op): ignored",
    ),
    # The engine's clients (ringfence.actors.engine.clients), through the engine's log. ``peer``
    # is the client instance ("client-2"), ``incarnation`` its attach count.
    "client.hello": event(
        "info",
        "peer incarnation client_pid aborted",
        "a client attached; aborted: live requests of its previous incarnation, dropped",
    ),
    "client.lost": event(
        "warning",
        "peer incarnation reason aborted",
        "a client's process is gone or it stopped reading its output; its requests end",
    ),
}
