"""A scripted engine for launched Worker tests: ``runtime.topology=fixture_worker:NAME``.

``ScriptedEngine`` plays the Engine's part against a real Worker process: seeded
sequences, prefilled in random chunks and decoded greedily in mixed steps, one plan
in flight at a time. At the end it checks every generated token (and logprob, within
1e-9) against a contiguous forward of the same model in its own process, writes
``verdict.json`` into the run dir and asks the run to end.

``RestartEngine`` additionally, after ``PAUSE_AT`` steps, posts a plan whose fence
names a swap op that nobody will ever do (no Transfer actor here): the worker waits
on it until the test kills the worker. The restarted worker announces itself
(incarnation 2, a later epoch), is handed the unfinished plan again by its ring, and
cancels it (issued before it started). The engine then re-prefills every sequence on
the new device tier, in the new epoch, and the outputs must be the same.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import orjson
import torch

from ringfence.actors.model.config import ModelConfig
from ringfence.actors.model.decoder import Model
from ringfence.actors.protocol.lanes import LANE_SLOTS, LANES
from ringfence.actors.protocol.worker import StepResult, WorkerReady
from ringfence.cache.config import CacheConfig
from ringfence.cache.fences import Fence
from ringfence.cache.ids import Seq as SeqNo
from ringfence.runtime.actor import Actor, handles
from ringfence.runtime.topology import ActorSpec, ChannelSpec, CounterSpec, Topology
from ringfence.sched.ops import Opening, Piece, StepOp
from ringfence.sched.sampling import SamplingParams

SEQUENCES = 5
DECODE = 6
PAUSE_AT = 4  # RestartEngine: the step after which it posts the plan that never runs
VERDICT = "verdict.json"
GREEDY = SamplingParams()


@dataclass
class Sequence:
    seq_id: int
    prompt: list[int]
    blocks: list[int]
    done: int = 0
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def restart(self) -> None:
        self.done, self.generated, self.logprobs = 0, [], []


@dataclass(frozen=True, slots=True, kw_only=True)
class ScriptedSettings:
    """The sections the scripted engine reads (its config_section)."""

    model: ModelConfig
    cache: CacheConfig


class ScriptedEngine(Actor):
    config_section = ScriptedSettings

    def on_start(self) -> None:
        config = self.ctx.config
        assert isinstance(config, ScriptedSettings)
        self.config = config
        self.rng = random.Random(config.model.seed)
        block = config.cache.block_size
        free = list(range(config.cache.device_blocks))
        self.rng.shuffle(free)
        self.seqs = []
        for i in range(SEQUENCES):
            prompt = [self.rng.randrange(256) for _ in range(self.rng.randint(4, 40))]
            need = -(-(len(prompt) + DECODE) // block)
            blocks = [free.pop() for _ in range(need)]
            self.seqs.append(Sequence(seq_id=i, prompt=prompt, blocks=blocks))
        self.readies: list[WorkerReady] = []
        self.results: list[StepResult] = []
        self.epoch = 0
        self.next_step = 1
        self.in_flight: StepOp | None = None
        self.paused = False

    @handles(WorkerReady)
    def on_ready(self, msg: WorkerReady) -> None:
        self.readies.append(msg)
        self.epoch = msg.epoch
        self.next_step = max(self.next_step, msg.step_done + 1)
        if msg.incarnation > 1:  # a fresh device tier: everything is prefilled again
            for seq in self.seqs:
                seq.restart()
            self.paused = False
        self.in_flight = None
        self.send_next()

    @handles(StepResult)
    def on_result(self, msg: StepResult) -> None:
        self.results.append(msg)
        self.next_step = max(self.next_step, msg.step + 1)
        if msg.epoch != self.epoch or self.in_flight is None or msg.step != self.in_flight.step:
            return  # stale: of an older epoch or a plan given up
        plan, self.in_flight = self.in_flight, None
        if msg.status != "ok":
            self.finish(f"step {msg.step} {msg.status}: {msg.error}")
            return
        outputs = {out.seq_id: out for out in msg.sampled.tokens()}
        for piece in plan.pieces:
            seq = self.seqs[piece.seq_id]
            seq.done = piece.start + len(piece.token_ids)
            if piece.sample:
                out = outputs[piece.seq_id]
                seq.generated.append(out.token_id)
                seq.logprobs.append(out.logprob)
        self.send_next()

    def pause_now(self) -> bool:
        return False

    def send_next(self) -> None:
        if self.paused or self.in_flight is not None:
            return
        if self.pause_now():
            self.paused = True
            piece = self.piece(self.seqs[0])
            fence = Fence(swap=SeqNo(1))  # no swap op 1 will ever be done
            self.send(
                "worker",
                StepOp(step=self.next_step, epoch=self.epoch, fence=fence, pieces=(piece,)),
            )
            self.next_step += 1
            return
        active = [s for s in self.seqs if len(s.generated) < DECODE]
        if not active:
            self.finish("")
            return
        pieces = tuple(self.piece(s) for s in active)
        self.in_flight = StepOp(step=self.next_step, epoch=self.epoch, fence=Fence(), pieces=pieces)
        self.send("worker", self.in_flight)
        self.next_step += 1

    def piece(self, seq: Sequence) -> Piece:
        if seq.done < len(seq.prompt):
            size = self.rng.randint(1, len(seq.prompt) - seq.done)
            ids, last = seq.prompt[seq.done : seq.done + size], seq.done + size == len(seq.prompt)
        else:
            ids, last = [seq.generated[-1]], True
        return Piece(
            seq_id=seq.seq_id,
            token_ids=tuple(ids),
            start=seq.done,
            block_table=tuple(seq.blocks),
            sample=last,
            opening=Opening(params=GREEDY, num_prompt_tokens=len(seq.prompt))
            if not seq.done
            else None,
        )

    def finish(self, failure: str) -> None:
        mismatches = [] if failure else self.mismatches()
        verdict = {
            "failure": failure,
            "mismatches": mismatches,
            "generated": {str(s.seq_id): s.generated for s in self.seqs},
            "readies": [
                {"incarnation": r.incarnation, "epoch": r.epoch, "step_done": r.step_done}
                for r in self.readies
            ],
            "results": [
                {"step": r.step, "epoch": r.epoch, "status": r.status, "error": r.error}
                for r in self.results
            ],
        }
        assert self.ctx.run_dir is not None
        (self.ctx.run_dir / VERDICT).write_bytes(orjson.dumps(verdict))
        self.request_shutdown("scripted program done")

    def mismatches(self) -> list[str]:
        model = Model.from_preset(self.config.model.preset, torch.float64, self.config.model.seed)
        found = []
        for seq in self.seqs:
            logits = model.forward_contiguous(torch.tensor(seq.prompt + seq.generated))
            logprobs = torch.log_softmax(logits, dim=-1)
            for k, (token, logprob) in enumerate(zip(seq.generated, seq.logprobs, strict=True)):
                row = len(seq.prompt) + k - 1
                expected = int(torch.argmax(logits[row]))
                if token != expected or abs(logprob - float(logprobs[row, token])) > 1e-9:
                    found.append(f"seq {seq.seq_id} token {k}: {token} != {expected}")
        return found


class RestartEngine(ScriptedEngine):
    def pause_now(self) -> bool:
        return len(self.readies) == 1 and self.next_step == PAUSE_AT + 1


def _topology(engine: str) -> Topology:
    return Topology(
        actors=(
            ActorSpec(name="engine", target=f"{__name__}:{engine}"),
            ActorSpec(name="worker", target="ringfence.actors.executors.worker:Worker"),
        ),
        channels=(
            ChannelSpec(
                src="engine", dst="worker", protocol="ringfence.actors.protocol.worker:TO_WORKER"
            ),
            ChannelSpec(
                src="worker", dst="engine", protocol="ringfence.actors.protocol.worker:FROM_WORKER"
            ),
        ),
        counters=(CounterSpec(name=LANES, count=LANE_SLOTS),),
    )


SCRIPTED = _topology("ScriptedEngine")
RESTART = _topology("RestartEngine")
