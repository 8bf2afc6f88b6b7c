"""Every log event ringfence writes, with its fields: the contract log replay depends on.

Each line of ``<run dir>/<actor>-<rank>.jsonl`` carries the :data:`COMMON` fields
(see log.py), then the fields listed here for its event; an event logged with an
exception also carries ``exception`` (the formatted traceback). Names are
``noun.verb``. Add fields freely; renaming or removing one breaks replay. A test
parses the code and fails if it logs an event or a field not listed here.
"""

from __future__ import annotations

from typing import Final, NamedTuple

COMMON: Final = ("ts", "mono_ns", "level", "actor", "rank", "pid", "epoch", "event")
EXCEPTION_FIELD: Final = "exception"


class Event(NamedTuple):
    level: str  # "info", "trace", "warning" or "error"
    fields: tuple[str, ...]
    doc: str


def _e(level: str, fields: str, doc: str) -> Event:
    return Event(level, tuple(fields.split()), doc)


EVENTS: Final[dict[str, Event]] = {
    # The supervisor (actor "supervisor", rank 0). ``instance`` is "<name>-<rank>";
    # ``instance_pid`` its process (``pid`` is always the writer's own).
    "run.start": _e("info", "run_id run_dir topology instances", "a launch began"),
    "run.clean": _e("info", "run_id", "names a dead earlier run left in this run dir were removed"),
    "run.signal": _e("info", "signal during", "SIGINT/SIGTERM received (during='stop': a 2nd)"),
    "run.stop": _e("info", "reason stop_timeout_s", "the ordered stop of every actor began"),
    "run.error": _e("error", "error", "the supervisor itself failed; the run is torn down"),
    "run.end": _e("info", "reason exit_code duration_s names", "every name unlinked; exiting"),
    "actor.spawn": _e("info", "instance instance_pid incarnation", "a child process started"),
    "actor.await": _e("info", "instance incarnation", "waiting for an external actor to attach"),
    "actor.ready": _e(
        "info", "instance instance_pid incarnation startup_s", "on_start returned; serving"
    ),
    "actor.exit": _e(
        "info",
        "instance instance_pid exitcode incarnation clean where at error",
        "a child ended; clean: exit 0 after it reported exited; a failed child's record "
        "(runtime/failure.py) adds where (on_start, a handler, ...), at (the innermost "
        "frame, file:line in function) and error (type: message)",
    ),
    "actor.detach": _e("info", "instance instance_pid clean", "an external actor went away"),
    "actor.hung": _e("warning", "instance instance_pid heartbeat_age_s", "heartbeat stale"),
    "actor.late": _e("error", "instance instance_pid ready_timeout_s", "not ready in time"),
    "actor.kill": _e("warning", "instance instance_pid reason", "SIGKILL sent to a child"),
    "actor.restart": _e(
        "info", "instance restarts backoff_s new_epoch", "a failed child will be spawned again"
    ),
    "actor.group_restart": _e(
        "info",
        "group instance siblings killed restarts backoff_s new_epoch",
        "a rank of a restart_together actor (group) failed (instance): its live siblings "
        "(killed, of siblings) are SIGKILLed, the epoch bumped once, and every rank spawned "
        "again after the backoff, once every old rank process has exited",
    ),
    "actor.group_stuck": _e(
        "error",
        "group instances reap_timeout_s",
        "ranks killed for a group restart were still alive reap_timeout_s after; the run stops",
    ),
    "actor.gave_up": _e(
        "error",
        "instance restarts restart ever_ready",
        "restart policy exhausted, or a start that raised before the actor was ever ready "
        "(ever_ready false: it would raise again); the run stops",
    ),
    # Every actor instance.
    "actor.start": _e(
        "info", "incarnation placement target inboxes outboxes", "attached; on_start is next"
    ),
    "actor.stop": _e(
        "info",
        "reason handled failures deferred error cpu_s",
        "the instance closed; cpu_s: its process's CPU seconds since it was ready",
    ),
    "actor.failed": _e("error", "where error", "on_start, on_stop or the loop raised"),
    "msg.recv": _e("trace", "peer seq type", "a message is handed to its handler"),
    "msg.send": _e("trace", "peer seq type", "a message was published to a peer"),
    "msg.failed": _e(
        "error",
        "peer seq type error message replied",
        "a handler raised or a frame could not be decoded; replied: a Failed was sent back",
    ),
    "msg.deferred": _e(
        "warning",
        "peer seq type error message",
        "a handler found a ring full or a peer dead; the message is handed over again",
    ),
    "msg.reply_lost": _e("warning", "peer seq error", "the Failed reply could not be sent"),
    "msg.refused": _e(
        "warning", "peer seq type error message", "a peer answered our message with Failed"
    ),
    "run.shutdown_requested": _e("info", "reason", "this actor asked to end the run"),
    "supervisor.lost": _e("warning", "supervisor_pid", "the supervisor is gone; stopping"),
    # The storage tier (ringfence.cache.storage), through the log of the actor whose client
    # it is: the store lane's (reads and writes) or the engine's (presence questions).
    "storage.corrupt": _e(
        "error", "backend key reason", "a stored block failed its checks: a miss, deleted"
    ),
    "storage.read_failed": _e(
        "error", "backend key error", "reading a stored block raised an OSError: a miss, kept"
    ),
    "storage.write_failed": _e(
        "error",
        "backend failed written error",
        "a put could not write `failed` blocks (full disk, quota, I/O error): none of them is "
        "visible, the put raised (the write-back fails)",
    ),
    "storage.unavailable": _e(
        "warning",
        "backend error retry_s",
        "the engine's presence question failed: nothing counts as stored until a retry after "
        "the back-off (retry_s, doubling) succeeds; once per outage",
    ),
    "storage.unreachable": _e(
        "warning",
        "backend where error",
        "a storage server was down when its client opened: calls fail (misses) until it is up",
    ),
    "storage.restored": _e(
        "info", "backend outage_s failures", "the storage tier answered again after an outage"
    ),
    # The Worker (ringfence.actors.executors.worker): the step lane's executor.
    "worker.ready": _e(
        "info",
        "model_id device kv_shm num_blocks block_bytes step_done threads tp_size group",
        "the model (this rank's shard) is loaded and the device KV tensor is mapped; step_done "
        "it resumes from; group: the generation of the ranks' process group",
    ),
    "worker.group": _e(
        "info",
        "tp_size generation backend join_s",
        "this Worker rank joined its instance's process group (gloo or nccl) of this generation",
    ),
    "step.done": _e(
        "info",
        "step plan_epoch status fence_swap fence_store seen_swap seen_store pieces tokens poison "
        "wait_ns exec_ns reduce_ns reduces error",
        "step_done reached step; status ok, rejected (malformed, nothing touched) or cancelled "
        "(stale epoch); seen_* are the watermarks observed once the fence was reached",
    ),
    "step.failed": _e(
        "error",
        "step error spoiled",
        "a step raised while it ran; the blocks it wrote (spoiled of them) were filled with NaN, "
        "then it is reported failed and the lane moves on",
    ),
    "step.refused": _e(
        "error", "step plan_epoch error", "a plan out of lane order, answered; step_done unchanged"
    ),
    "step.repeat": _e(
        "warning",
        "step plan_epoch resent",
        "a plan at or below step_done came again (redelivery); resent: its result went again",
    ),
    # The Transfer lanes (ringfence.actors.executors.transfer): "swap" and "store" actors.
    "op.touched": _e(
        "trace",
        "lane op op_epoch reads writes",
        "the blocks an op that ran (ok or failed) read and wrote, as its executor indexed them, "
        "{tier: blocks}; replay checks them against op.issue's declared",
    ),
    "lane.ready": _e(
        "info",
        "lane done host_shm host_blocks block_bytes",
        "a Transfer lane mapped the host tier; done is the watermark it resumes from",
    ),
    "lane.repeat": _e(
        "warning",
        "lane op op_epoch resent",
        "an op at or below the lane's watermark came again; resent: its completion went again",
    ),
    "legacy.lock": _e(
        "info",
        "waits wait_ms",
        "transfer.mode=lock (a baseline): at stop, how often the executor found the legacy "
        "lock held and how long it waited for it",
    ),
    "lane.failed": _e(
        "error",
        "lane op error spoiled",
        "a copy or storage call raised; its destination blocks (spoiled) were filled with NaN, "
        "then it is reported failed and the lane moves on",
    ),
    "lane.refused": _e(
        "error", "lane op op_epoch error", "an op out of lane order, answered; watermark unchanged"
    ),
    "swap.tier_lost": _e(
        "warning", "tier_epoch error", "a restarted swap lane could not reopen its device tier"
    ),
    "swap.tier": _e(
        "info", "tier_epoch device kv_shm num_blocks", "the swap lane opened a (new) device tier"
    ),
    "lane.done": _e(
        "info",
        "lane op op_epoch status direction fence_step fence_swap fence_store seen_step "
        "seen_swap seen_store error missing blocks wait_ns copy_ns",
        "the lane's watermark reached op: a swap-in (in), swap-out (out), write-back (write) "
        "or prefetch (read), ok, rejected or cancelled; missing: positions storage lacked",
    ),
    # The protocol harness (ringfence.actors.tools.testing.harness), as actor "engine".
    # The engine (actors/engine/actor.py). ``request`` is the request id (a client's is
    # "<client instance>/<incarnation>/<id>"); ``op`` a lane number; ``fence`` the waits.
    "engine.ready": _e(
        "info",
        "model_id max_position vocab_size workload first_ops",
        "every executor answered the engine's Resync; the scheduler is built; first_ops: the "
        "number of each lane's first op (1 unless an engine before this one left them further)",
    ),
    "engine.restart": _e(
        "warning", "incarnation", "the engine restarted: it resyncs with its executors"
    ),
    "engine.lane_restart": _e(
        "warning", "lane instance done", "a transfer lane restarted (it redoes its op)"
    ),
    "engine.tier_reset": _e(
        "warning",
        "incarnation new_epoch step_done requeued worker_rank waiting",
        "the worker restarted with a fresh device tier: every op in flight is lost, the running "
        "requests (requeued) are computed again; new_epoch: the engine's from now on; worker_rank: "
        "the first rank of the new generation to announce; waiting: the ranks still to come "
        "(nothing is issued until none is left)",
    ),
    "engine.rank_rejoined": _e(
        "info",
        "worker_rank waiting",
        "a Worker rank of the restarted group announced itself; waiting: the ranks still to come",
    ),
    "engine.stale": _e(
        "warning",
        "lane op msg_epoch why",
        "a result or completion not applied: a repeat, one of an op never sent, or of an older "
        "epoch",
    ),
    "engine.step_failed": _e("error", "step status error", "a step did not finish ok"),
    "engine.op_failed": _e("warning", "lane op status", "a transfer op did not finish ok"),
    "engine.workload_done": _e("info", "requests duration_s", "the workload ran to its end"),
    "engine.workload_failed": _e(
        "error", "workload error", "the workload could not be loaded: the run ends"
    ),
    "engine.config_failed": _e(
        "error", "error", "a setting does not fit the model the Worker loaded: the run ends"
    ),
    "engine.drain_timeout": _e(
        "warning", "store_done last_sent", "at stop, the store lane's writes were not all done"
    ),
    "request.arrive": _e(
        "info", "request seq_id prompt_tokens max_tokens arrival_s", "a request was queued"
    ),
    "request.refused": _e(
        "warning", "request error", "a workload request that can never run ended before it began"
    ),
    "request.finish": _e(
        "info",
        "request reason output_tokens cached_tokens error stored_blocks",
        "a request ended (or aborted); stored_blocks: a prefill instance's hand-over (the "
        "leading full blocks storage holds), else -1",
    ),
    # Prefill/decode disaggregation (actors/engine/disaggregation.py). ``reservation`` is the
    # engine-wide key "<peer>/<incarnation>/<id>", as ``request`` is.
    "reservation.grant": _e(
        "info",
        "reservation prompt_tokens max_tokens blocks ttl_s free_blocks headroom",
        "a decode instance holds room for a request (blocks of free_blocks, beside headroom "
        "kept for running requests' growth)",
    ),
    "reservation.refuse": _e(
        "info", "reservation prompt_tokens error retry", "no reservation (retry: no room now)"
    ),
    "reservation.claim": _e("info", "reservation request", "a request took its reservation"),
    "reservation.expire": _e(
        "warning", "reservation blocks", "a reservation unclaimed for engine.reservation_ttl_s"
    ),
    "handover.hold": _e(
        "info",
        "request blocks store_op",
        "a prefill instance's request finished: its full blocks are written to storage and its "
        "finish held until store op store_op is complete on every rank",
    ),
    "handover.done": _e(
        "info",
        "request blocks stored_blocks wait_ms",
        "the writes are complete: the request finishes, stored_blocks of its blocks durable",
    ),
    "events.ready": _e(
        "info",
        "endpoint replay_endpoint layout",
        "the engine publishes KV events (events.enabled): subscribe at endpoint, ask for a "
        "replay at replay_endpoint",
    ),
    "events.stop": _e(
        "info",
        "batches events published dropped replays bad_replays degraded",
        "the KV event publisher stopped: batches and events made, published, dropped (the "
        "pipe to its thread was full), replays answered and refused, keys stored with no "
        "tokens (their lineage was gone)",
    ),
    "op.issue": _e(
        "trace",
        "lane op fence sync pieces poison direction reason device_blocks host_blocks declared",
        "an op was sent to its lane; fence: the scheduler's (sync: the engine waited for it and "
        "sent none); steps: pieces [seq_id, start, tokens, sample, block_table] and poison; "
        "declared: the blocks it gave the fence tracker, {reads, writes: {tier: blocks}}",
    ),
    # The engine's calls into its scheduler, in order (trace): enough for `ringfence replay
    # --redrive` to repeat them on a fresh scheduler and compare every decision.
    "sched.add": _e("trace", "request prompt params", "a request is handed to the scheduler"),
    "sched.abort": _e("trace", "request", "a request is aborted in the scheduler"),
    "sched.schedule": _e(
        "trace",
        "ops decisions",
        "a scheduling round: ops [[lane, op]] in issue order; decisions [[kind, seq_id, detail]]",
    ),
    "sched.step": _e(
        "trace", "step msg_epoch status outputs", "a step result applied: [[seq_id, token]]"
    ),
    "sched.transfer": _e(
        "trace", "lane op msg_epoch status missing", "a transfer completion applied"
    ),
    "sched.reset": _e("trace", "tier_epoch", "the device tier was reset (the worker restarted)"),
    "sched.storage": _e(
        "trace", "asked found", "the storage tier held the first `found` of `asked` blocks"
    ),
    "harness.mismatch": _e(
        "warning",
        "program differences",
        "a program's outcome differs from its sequential interpretation (or an op failed)",
    ),
    "harness.done": _e(
        "info", "programs ops mismatched busy_s", "every program ran; see harness.json"
    ),
    "harness.stray": _e(
        "info",
        "lane op status",
        "a completion of no op in flight (one resent after a restart, or an executor's answer "
        "to a message that was not a program op): ignored",
    ),
    # The engine's clients (ringfence.actors.engine.clients), through the engine's log. ``peer``
    # is the client instance ("client-2"), ``incarnation`` its attach count.
    "client.hello": _e(
        "info",
        "peer incarnation client_pid aborted",
        "a client attached; aborted: live requests of its previous incarnation, dropped",
    ),
    "client.lost": _e(
        "warning",
        "peer incarnation reason aborted",
        "a client's process is gone or it stopped reading its output; its requests end",
    ),
    # The HTTP front end of ringfence serve (actor "frontend", actors/serve/frontend.py);
    # ``request`` is its own request id (the engine's key is "frontend-0/<inc>/<request>").
    "server.listening": _e("info", "host port", "the HTTP server accepts connections here"),
    "server.ready": _e("info", "", "every actor is live and the engine began: requests are served"),
    "server.abort": _e(
        "info",
        "request output_tokens",
        "the client went away or a stop string ended it: the request's Abort went to the engine "
        "after output_tokens tokens (its request.finish says how many the engine made)",
    ),
    "server.unsendable": _e(
        "warning", "request error", "the codec refused a request's Submit: it ends with a 400"
    ),
    "server.fields_ignored": _e(
        "warning",
        "path fields",
        "a request held fields the API does not know (escaped to printable ASCII): ignored, "
        "as vLLM does, and named in its answer's X-Ringfence-Ignored-Fields header",
    ),
    "server.requests_lost": _e(
        "warning",
        "requests error",
        "the engine died or was replaced: its requests end with an error event",
    ),
    # ringfence router (actors/router/; no actor of a run: its lines go to its stderr, with
    # "actor": "router"). ``request`` is the router's own id, sent to the prefill instance.
    "router.started": _e(
        "info", "host port instances", "every instance answered and the pool was checked"
    ),
    "router.instance_down": _e(
        "warning",
        "request instance error",
        "an aggregated instance could not be reached: the request goes to the next choice, "
        "and the policy routes around the instance and forgets what its index held",
    ),
    "router.instance_up": _e(
        "info",
        "instance",
        "an aggregated instance found dead answers again as the same model, serving: it is "
        "followed afresh and routed to again",
    ),
    "router.instance_refused": _e(
        "warning",
        "instance why",
        "an aggregated instance found dead answered again, but not as the pool's instance "
        "(another role or model) or not serving yet: it stays routed around, asked again",
    ),
    "router.no_load": _e(
        "warning",
        "instance",
        "an aggregated instance has no GET /ringfence/load: the policy weighs it by the "
        "router's own count of requests in flight there alone",
    ),
    "router.no_events": _e(
        "warning",
        "instance",
        "an aggregated instance publishes no KV events (events.enabled false): the cache "
        "policy scores it as holding nothing",
    ),
    "router.routed": _e(
        "info",
        "request kind outcome status total_s instance policy prompt_blocks cached_blocks "
        "first_byte_s",
        "a request sent to an aggregated instance ended: the instance the policy chose, the "
        "prompt's full blocks and the weighted blocks of it the instance held",
    ),
    "router.answered": _e(
        "info",
        "request kind outcome status total_s decode prefill retries claims fallback prefill_s "
        "stored_blocks first_byte_s prompt_blocks decode_cached prefill_cached prefill_skipped",
        "a request ended (outcome as the requests metric counts it: ok, relayed_error, "
        "no_room, decode_failed, client_closed, error); retries: reserve calls after the "
        "first; claims: 1 unless a reservation expired; fallback: why the prefill failed; "
        "under the cache policy, the prompt's full blocks and the weighted blocks of them the "
        "chosen decode and prefill instances held (prefill_skipped: the decode instance held "
        "them all)",
    ),
    "router.reserve_failed": _e(
        "warning",
        "request decode error",
        "a decode instance failed a reserve call (unreachable, a bad answer, an unexpected "
        "status): the request tries the other decode instances, then again",
    ),
    "router.gave_up": _e(
        "warning",
        "request waited_s last retries",
        "no decode instance had room within reserve_timeout_s: the client got a 503",
    ),
    "router.fell_back": _e(
        "warning",
        "request why error prefill decode prompt_tokens",
        "the prefill failed or was not tried (why: no_instance, refused, timeout, "
        "http_error, bad_answer, transport): the decode instance computes the prompt itself",
    ),
    "router.expired": _e(
        "info",
        "request decode reservation",
        "a claim found its reservation expired: reserving again",
    ),
    "router.decode_lost": _e(
        "error",
        "request decode error",
        "the decode instance failed during the claim: a 502, or a stream's last error event",
    ),
    # The demo pipeline (ringfence.actors.tools.testing.demo).
    "demo.sent": _e("info", "messages", "the source sent its last item"),
    "demo.done": _e(
        "info",
        "messages received elapsed_s per_s repeats",
        "the sink applied the last item; received and per_s count this incarnation",
    ),
}
