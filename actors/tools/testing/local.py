"""The in-process runner: the scheduler and the model in one loop, with no actors and no IPC.

:class:`LocalRunner` runs a workload with the same :class:`Scheduler` the Engine actor
drives, executing each op it issues at once, in issue order (``programs.Sequential``:
a step on the paged executor, block copies between the device and host tensors, a
dict as storage). It is two things:

- the plain single-process loop that ``ringfence bench e2e`` sets against the actor
  pipeline (what the control plane costs), and
- the sequential execution every correct run of the protocol equals: run with both
  tiers off and a device pool large enough that nothing is ever preempted, it is the
  reference the correctness tests compare the actor pipeline's tokens with.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from ringfence.actors.config import Config
from ringfence.actors.engine.begin import sched_config
from ringfence.actors.engine.intake import make_request
from ringfence.actors.engine.summary import RequestRecord
from ringfence.actors.model.dtypes import torch_dtype
from ringfence.actors.model.loader import LoadedModel, load_model
from ringfence.actors.model.paged import make_kv_cache
from ringfence.actors.protocol.worker import SampledToken
from ringfence.actors.tools.testing.programs import Sequential
from ringfence.cache.fences import Lane
from ringfence.sched.ops import Op, StepOp, StoreOp
from ringfence.sched.request import Request
from ringfence.sched.scheduler import Scheduler
from ringfence.sched.workload import WorkloadRequest


class LocalRunner:
    """One process: scheduler, model, device and host tensors. Not thread-safe."""

    def __init__(self, config: Config, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model)
        info = self.loaded.info
        settings = sched_config(config, info.model_id, info.max_position, info.vocab_size)
        self.scheduler = Scheduler(settings)
        model = self.loaded.model
        dtype = torch_dtype(config.model.dtype)
        shape = model.config
        tiers = settings.tiers
        device = make_kv_cache(
            shape, tiers.device_blocks, tiers.block_size, dtype, config.model.device
        )
        host = make_kv_cache(shape, tiers.host_blocks, tiers.block_size, dtype)
        if config.cache.poison_freed:
            device.fill_(float("nan"))
            host.fill_(float("nan"))
        self.machine = Sequential(model, device, host, config.model.path)

    def run(
        self, workload: Sequence[WorkloadRequest], *, arrivals: bool = True
    ) -> list[RequestRecord]:
        """Run every request to its end; one record each, in workload order.

        With ``arrivals``, a request is added once its ``arrival_s`` has passed (the
        loop sleeps until the next one when it has nothing to do); else all at once.
        """
        pending = sorted(workload, key=lambda w: w.arrival_s) if arrivals else list(workload)
        records: dict[str, dict[str, float | None]] = {}
        requests: dict[str, Request] = {}
        scheduler = self.scheduler
        start = time.perf_counter()
        index = 0
        with torch.inference_mode():
            while index < len(pending) or not scheduler.idle:
                now = time.perf_counter() - start
                while index < len(pending) and (not arrivals or pending[index].arrival_s <= now):
                    line = pending[index]
                    request = make_request(
                        line if arrivals else dataclasses.replace(line, arrival_s=0.0)
                    )
                    scheduler.add(request)
                    requests[line.id] = request
                    records[line.id] = {"arrival": request.arrival, "first": None, "finish": None}
                    index += 1
                ops = scheduler.schedule()
                if not ops and scheduler.idle and index < len(pending):
                    time.sleep(max(0.0, pending[index].arrival_s - now))  # the next arrival
                    continue
                if not ops:
                    raise RuntimeError(
                        f"the scheduler is stuck: {scheduler.num_live} live requests"
                    )
                self._execute(ops, records, start)
        return [_record(requests[w.id], records[w.id]) for w in workload]

    def _execute(
        self, ops: list[Op], records: dict[str, dict[str, float | None]], start: float
    ) -> None:
        scheduler = self.scheduler
        for op in ops:
            result = self.machine.run(op)
            if isinstance(op, StepOp):
                outputs = [
                    (t.seq_id, t.token_id) for t in result or () if isinstance(t, SampledToken)
                ]
                emitted, _ = scheduler.on_step(op.step, "ok", outputs)
                now = time.perf_counter() - start
                for e in emitted:
                    times = records[e.request.request_id]
                    if times["first"] is None:
                        times["first"] = now
                    if e.finished:
                        times["finish"] = now
            else:
                lane = Lane.STORE if isinstance(op, StoreOp) else Lane.SWAP
                missing = result if isinstance(op, StoreOp) and op.direction == "read" else ()
                scheduler.on_transfer(lane, op.number, "ok", missing or ())  # type: ignore[arg-type]


def _record(request: Request, times: dict[str, float | None]) -> RequestRecord:
    return RequestRecord(
        id=request.request_id,
        prompt_tokens=request.num_prompt_tokens,
        token_ids=tuple(request.output_token_ids),
        finish_reason=str(request.finish_reason or "abort"),
        arrival_s=request.arrival,
        first_token_s=times["first"],
        finish_s=times["finish"],
        cached_tokens=dict(request.cached_tokens),
    )
