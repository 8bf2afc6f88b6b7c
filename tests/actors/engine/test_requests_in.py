"""RequestsIn, the engine's handlers of requests coming in, held by the engine and run here
against a fake engine side: what a client's Submit, Abort and Hello become, and when the
engine is asked to issue (kick) or only to flush."""

from __future__ import annotations

from dataclasses import dataclass, field

from ringfence.actors.config import Config
from ringfence.actors.engine.begin import sched_config
from ringfence.actors.engine.clients import ClientHub
from ringfence.actors.engine.disaggregation import HandOverDesk
from ringfence.actors.engine.intake import Intake
from ringfence.actors.engine.outputs import Outputs
from ringfence.actors.engine.requests_in import EngineSide, RequestsIn
from ringfence.actors.engine.stats import no_stats
from ringfence.actors.protocol.client import Abort, Hello, Rejected, Stats, Submit, Tokens
from ringfence.runtime.log import ActorLog
from ringfence.sched.request import SamplingParams
from ringfence.sched.scheduler import Scheduler
from ringfence.shm.liveness import ProcessStamp

CLIENT = "client-0"
MAX_MODEL_LEN = 64


@dataclass
class FakeEngine:
    """An :class:`EngineSide` that counts what the handlers ask of it."""

    scheduler: Scheduler | None = None
    calls: list[str] = field(default_factory=list)

    def now(self) -> float:
        return 1.0

    def stats(self) -> Stats:
        self.calls.append("stats")
        return no_stats()

    def kick(self) -> None:
        self.calls.append("kick")

    def flush(self) -> None:
        self.calls.append("flush")


@dataclass
class Rig:
    engine: FakeEngine
    requests: RequestsIn
    sent: list[tuple[str, object]]
    clients: ClientHub

    def delivered(self) -> list[object]:
        """What the client got once the hub flushed (the engine's flush does it)."""
        self.clients.flush()
        return [m for peer, m in self.sent if peer == CLIENT]


def make_rig(*, began: bool = True) -> Rig:
    config = Config.load(None, [f"sched.max_model_len={MAX_MODEL_LEN}"])
    log = ActorLog(None, actor="engine", rank=0, epoch=0)
    sent: list[tuple[str, object]] = []
    clients = ClientHub(lambda to, m: sent.append((to, m)), log, max_live=4)
    engine = FakeEngine()
    if began:
        settings = sched_config(config, "m", max_position=MAX_MODEL_LEN, vocab_size=256)
        engine.scheduler = Scheduler(settings, None)
    outputs = Outputs(clients, log, engine.now)
    desk = HandOverDesk(config.engine, clients, outputs, log, lambda s, m: None, now=engine.now)
    requests = RequestsIn(
        engine,
        intake=Intake(config),
        outputs=outputs,
        clients=clients,
        desk=desk,
        log=log,
        schedule=lambda s, m: None,
    )
    stamp = ProcessStamp.current()
    requests.hello(CLIENT, Hello(incarnation=1, pid=stamp.pid, start_ticks=stamp.start_ticks))
    engine.calls.clear()
    return Rig(engine, requests, sent, clients)


def submit(request_id: str, num_tokens: int = 4) -> Submit:
    return Submit(
        request_id=request_id,
        prompt_token_ids=tuple(range(1, num_tokens + 1)),
        params=SamplingParams(max_tokens=2),
    )


def test_the_engine_side_of_a_fake_is_the_protocol_the_handlers_call_back_through():
    side: EngineSide = FakeEngine()  # mypy checks the fake against the Protocol
    assert side.scheduler is None


def test_a_submit_before_the_engine_began_is_refused_at_once_and_nothing_is_issued():
    rig = make_rig(began=False)
    rig.requests.submit(CLIENT, submit("a"))
    assert rig.engine.calls == ["flush"]
    [rejected] = rig.delivered()
    assert isinstance(rejected, Rejected)
    assert (rejected.request_id, rejected.error) == (
        "a",
        "the engine is starting: its worker is not ready yet",
    )


def test_a_submit_becomes_the_schedulers_request_and_the_engine_is_kicked():
    rig = make_rig()
    rig.requests.submit(CLIENT, submit("a"))
    assert rig.engine.calls == ["kick"]
    assert rig.engine.scheduler is not None
    assert (rig.engine.scheduler.num_waiting, rig.engine.scheduler.num_running) == (1, 0)
    assert rig.delivered() == []


def test_a_submit_longer_than_the_model_ends_at_once_with_its_error():
    rig = make_rig()
    rig.requests.submit(CLIENT, submit("long", num_tokens=MAX_MODEL_LEN + 1))
    assert rig.engine.calls == ["kick"]
    assert rig.engine.scheduler is not None and rig.engine.scheduler.num_waiting == 0
    [ended] = rig.delivered()
    assert isinstance(ended, Tokens)
    assert (ended.request_id, ended.finish_reason) == ("long", "abort")
    assert str(MAX_MODEL_LEN) in ended.error


def test_an_abort_ends_the_request_with_no_error_and_kicks_the_engine():
    rig = make_rig()
    rig.requests.submit(CLIENT, submit("a"))
    rig.requests.abort(CLIENT, Abort(request_id="a"))
    assert rig.engine.calls == ["kick", "kick"]
    assert rig.engine.scheduler is not None and rig.engine.scheduler.num_waiting == 0
    [ended] = rig.delivered()
    assert isinstance(ended, Tokens)
    assert (ended.request_id, ended.finish_reason, ended.error) == ("a", "abort", "")


def test_a_client_that_attaches_again_ends_what_its_last_incarnation_left_and_gets_stats():
    rig = make_rig()
    rig.requests.submit(CLIENT, submit("a"))
    stamp = ProcessStamp.current()
    again = Hello(incarnation=2, pid=stamp.pid, start_ticks=stamp.start_ticks, stats=True)
    rig.requests.hello(CLIENT, again)
    assert rig.engine.calls == ["kick", "stats", "flush"]
    assert rig.engine.scheduler is not None and rig.engine.scheduler.num_waiting == 0
    assert [type(m).__name__ for m in rig.delivered()] == ["Stats"]
