"""The events of a run's machinery: the supervisor, every actor instance, the storage
tier, the Worker and the Transfer lanes (the executors), and the demo pipeline.
"""

from __future__ import annotations

from typing import Final

from ringfence.runtime.events.event import Event, event

RUN_EVENTS: Final[dict[str, Event]] = {
    # The supervisor (actor "supervisor", rank 0). ``instance`` is "<name>-<rank>";
    # ``instance_pid`` its process (``pid`` is always the writer's own).
    "run.start": event("info", "run_id run_dir topology instances", "a launch began"),
    "run.clean": event(
        "info", "run_id", "names a dead earlier run left in this run dir were removed"
    ),
    "run.resolve_defaults": event(
        "info",
        "notes",
        "the topology's defaults functions chose settings the config left to the machine "
        "(on a GPU: the device pool, the batch limits), one note each; config.toml holds them",
    ),
    "run.signal": event("info", "signal during", "SIGINT/SIGTERM received (during='stop': a 2nd)"),
    "run.stop": event("info", "reason stop_timeout_s", "the ordered stop of every actor began"),
    "run.error": event("error", "error", "the supervisor itself failed; the run is torn down"),
    "run.end": event("info", "reason exit_code duration_s names", "every name unlinked; exiting"),
    "actor.spawn": event("info", "instance instance_pid incarnation", "a child process started"),
    "actor.await": event("info", "instance incarnation", "waiting for an external actor to attach"),
    "actor.ready": event(
        "info", "instance instance_pid incarnation startup_s", "on_start returned; serving"
    ),
    "actor.exit": event(
        "info",
        "instance instance_pid exitcode incarnation clean where at error",
        "a child ended; clean: exit 0 after it reported exited; a failed child's record "
        "(runtime/failure.py) adds where (on_start, a handler, ...), at (the innermost "
        "frame, file:line in function) and error (type: message)",
    ),
    "actor.detach": event(
        "info", "instance instance_pid clean", "an external or hosted actor went away"
    ),
    "actor.hung": event("warning", "instance instance_pid heartbeat_age_s", "heartbeat stale"),
    "actor.late": event("error", "instance instance_pid ready_timeout_s", "not ready in time"),
    "actor.kill": event("warning", "instance instance_pid reason", "SIGKILL sent to a child"),
    "actor.restart": event(
        "info", "instance restarts backoff_s new_epoch", "a failed child will be spawned again"
    ),
    "actor.group_restart": event(
        "info",
        "group instance siblings killed restarts backoff_s new_epoch",
        "a rank of a restart_together actor (group) failed (instance): its live siblings "
        "(killed, of siblings) are SIGKILLed, the epoch bumped once, and every rank spawned "
        "again after the backoff, once every old rank process has exited",
    ),
    "actor.group_stuck": event(
        "error",
        "group instances reap_timeout_s",
        "ranks killed for a group restart were still alive reap_timeout_s after; the run stops",
    ),
    "actor.gave_up": event(
        "error",
        "instance restarts restart ever_ready",
        "restart policy exhausted, or a start that raised before the actor was ever ready "
        "(ever_ready false: it would raise again); the run stops",
    ),
    # Every actor instance.
    "actor.start": event(
        "info", "incarnation placement target inboxes outboxes", "attached; on_start is next"
    ),
    "actor.stop": event(
        "info",
        "reason handled failures deferred error cpu_s",
        "the instance closed; cpu_s: its process's CPU seconds since it was ready",
    ),
    "actor.failed": event("error", "where error", "on_start, on_stop or the loop raised"),
    "msg.recv": event("trace", "peer seq type", "a message is handed to its handler"),
    "msg.send": event("trace", "peer seq type", "a message was published to a peer"),
    "msg.failed": event(
        "error",
        "peer seq type error message replied",
        "a handler raised or a frame could not be decoded; replied: a Failed was sent back",
    ),
    "msg.deferred": event(
        "warning",
        "peer seq type error message",
        "a handler found a ring full or a peer dead; the message is handed over again",
    ),
    "msg.reply_lost": event("warning", "peer seq error", "the Failed reply could not be sent"),
    "msg.refused": event(
        "warning", "peer seq type error message", "a peer answered our message with Failed"
    ),
    "run.shutdown_requested": event("info", "reason", "this actor asked to end the run"),
    "supervisor.lost": event("warning", "supervisor_pid", "the supervisor is gone; stopping"),
    # The storage tier (ringfence.cache.storage), through the log of the actor whose client
    # it is: the store lane's (reads and writes) or the engine's (presence questions).
    "storage.corrupt": event(
        "error",
        "backend key reason",
        "a stored block of the reader's own key space (its fingerprint and storage secret) "
        "failed its checks: a miss, deleted; another secret's blocks are never read",
    ),
    "storage.forged": event(
        "error",
        "backend key count",
        "with cache.storage.secret set, a stored block of the reader's own key space (its "
        "secret's) whose tag did not verify (or it had none): a forgery or damage, a miss, "
        "deleted (another secret's blocks are never read, so never deleted); at most one "
        "event per 10 s per client, `count` forged since the last (stats().forged counts all)",
    ),
    "storage.read_failed": event(
        "error", "backend key error", "reading a stored block raised an OSError: a miss, kept"
    ),
    "storage.write_failed": event(
        "error",
        "backend failed written error",
        "a put could not write `failed` blocks (full disk, quota, I/O error): none of them is "
        "visible, the put raised (the write-back fails)",
    ),
    "storage.unavailable": event(
        "warning",
        "backend error retry_s",
        "the engine's presence question failed: nothing counts as stored until a retry after "
        "the back-off (retry_s, doubling) succeeds; once per outage",
    ),
    "storage.unreachable": event(
        "warning",
        "backend where error",
        "a storage server was down when its client opened: calls fail (misses) until it is up",
    ),
    "storage.restored": event(
        "info", "backend outage_s failures", "the storage tier answered again after an outage"
    ),
    # The Worker (ringfence.actors.executors.worker): the step lane's executor.
    "worker.ready": event(
        "info",
        "model_id device kv_shm num_blocks block_bytes step_done threads tp_size group",
        "the model (this rank's shard) is loaded and the device KV tensor is mapped; step_done "
        "it resumes from; group: the generation of the ranks' process group",
    ),
    "worker.graphs": event(
        "info",
        "buckets splits capture_s",
        "the decode step's CUDA graphs captured at start, one per batch-size bucket (largest "
        "first) reading each context whole, and a second for long contexts where splits "
        "(bucket: programs a context's keys are split among) says so; the seconds it took",
    ),
    "worker.group": event(
        "info",
        "tp_size generation backend join_s",
        "this Worker rank joined its instance's process group (gloo or nccl) of this generation",
    ),
    "step.done": event(
        "info",
        "step plan_epoch status fence_swap fence_store seen_swap seen_store pieces tokens poison "
        "wait_ns exec_ns reduce_ns reduces forward_ns sample_ns checked_ahead launched_ahead "
        "error",
        "step_done reached step; status ok, rejected (malformed, nothing touched) or cancelled "
        "(stale epoch); seen_* are the watermarks observed once the fence was reached; "
        "forward_ns and sample_ns split exec_ns (CUDA events on a GPU; None for a step that "
        "failed part way); checked_ahead: its plan was checked while the step before it ran "
        "(model.look_ahead); launched_ahead: its kernels were queued before the step before "
        "it was reported (model.launch_ahead; its seen_* read then, its exec_ns from then): "
        "'early' before that step's tokens were read back (its inputs taken on the device), "
        "'late' after",
    ),
    "step.failed": event(
        "error",
        "step error spoiled",
        "a step raised while it ran; the blocks it wrote (spoiled of them) were filled with NaN, "
        "then it is reported failed and the lane moves on",
    ),
    "step.refused": event(
        "error", "step plan_epoch error", "a plan out of lane order, answered; step_done unchanged"
    ),
    "step.repeat": event(
        "warning",
        "step plan_epoch resent",
        "a plan at or below step_done came again (redelivery); resent: its result went again",
    ),
    # The Transfer lanes (ringfence.actors.executors.transfer): "swap" and "store" actors.
    "op.touched": event(
        "trace",
        "lane op op_epoch reads writes",
        "the blocks an op that ran (ok or failed) read and wrote, as its executor indexed them, "
        "{tier: blocks}; replay checks them against op.issue's declared",
    ),
    "lane.ready": event(
        "info",
        "lane done host_shm host_blocks block_bytes",
        "a Transfer lane mapped the host tier; done is the watermark it resumes from",
    ),
    "lane.repeat": event(
        "warning",
        "lane op op_epoch resent",
        "an op at or below the lane's watermark came again; resent: its completion went again",
    ),
    "legacy.lock": event(
        "info",
        "waits wait_ms",
        "transfer.mode=lock (a baseline): at stop, how often the executor found the legacy "
        "lock held and how long it waited for it",
    ),
    "lane.failed": event(
        "error",
        "lane op error spoiled",
        "a copy or storage call raised; its destination blocks (spoiled) were filled with NaN, "
        "then it is reported failed and the lane moves on",
    ),
    "lane.refused": event(
        "error", "lane op op_epoch error", "an op out of lane order, answered; watermark unchanged"
    ),
    "swap.tier_lost": event(
        "warning", "tier_epoch error", "a restarted swap lane could not reopen its device tier"
    ),
    "swap.tier": event(
        "info", "tier_epoch device kv_shm num_blocks", "the swap lane opened a (new) device tier"
    ),
    "lane.done": event(
        "info",
        "lane op op_epoch status direction fence_step fence_swap fence_store seen_step "
        "seen_swap seen_store error missing blocks wait_ns copy_ns",
        "the lane's watermark reached op: a swap-in (in), swap-out (out), write-back (write) "
        "or prefetch (read), ok, rejected or cancelled; missing: positions storage lacked",
    ),
    # The demo pipeline (ringfence.actors.tools.testing.demo).
    "demo.sent": event("info", "messages", "the source sent its last item"),
    "demo.done": event(
        "info",
        "messages received elapsed_s per_s repeats",
        "the sink applied the last item; received and per_s count this incarnation",
    ),
}
