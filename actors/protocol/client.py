"""The protocol between clients and the Engine: one registry per direction.

``CLIENT_TO_ENGINE`` carries a client's announcement and its requests;
``ENGINE_TO_CLIENT`` carries the output of each request, as it is produced, and the
engine's :class:`Stats` to a client whose Hello asked for them. A
client names its requests with ids of its own choosing; the engine keys them by
client instance and incarnation (see ``actors/engine/clients.py``), so two clients may use the same
id. Every engine -> client message carries the client incarnation it answers: the
ring to a client slot outlives the process attached to it, and a newly attached
client drops what was meant for its predecessor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ringfence.runtime.codec import Registry, message
from ringfence.sched.request import check_messages
from ringfence.sched.sampling import SamplingParams, TokenLogprobs

CLIENT_TO_ENGINE = Registry("client-to-engine")
ENGINE_TO_CLIENT = Registry("engine-to-client")

FINISH_REASONS = ("stop", "length", "abort")  # a Tokens.finish_reason other than ""


@message(CLIENT_TO_ENGINE, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """Sent by a client once it attached, before any Submit of this incarnation."""

    incarnation: int  # the client slot's incarnation (1, 2, ... per attach)
    pid: int  # the client process, with start_ticks: the engine checks it is alive
    start_ticks: int  # its start time, so a recycled pid is not taken for it
    # Whether the client wants the engine's Stats (each Tick, and once after this Hello).
    # Sent with every Hello, so an engine that restarted and hears it again goes on.
    stats: bool = False


@message(CLIENT_TO_ENGINE, tag=2)
@dataclass(frozen=True, slots=True, kw_only=True)
class Submit:
    """A new request. Exactly one of ``prompt_token_ids``, ``prompt`` and ``messages`` is
    non-empty."""

    # An engine handler that raises on it answers Failed (with this frame's seq), so the
    # client learns of the failure instead of waiting for output that never comes.
    expects_reply: ClassVar[bool] = True
    request_id: str  # unique among this client's unfinished requests
    prompt_token_ids: tuple[int, ...] = ()
    prompt: str = ""  # text, tokenized by the engine
    params: SamplingParams = field(default_factory=SamplingParams)  # checked when built
    # A chat (role, content and any other string keys per message), rendered by the
    # engine through the model's chat template with the assistant's turn opened.
    messages: tuple[dict[str, str], ...] = ()
    # A decode instance's claim: the Reserve's reservation_id this request takes the room
    # of (its prompt_token_ids must be the reserved ones). "" everywhere else.
    reservation_id: str = ""
    # vLLM's cache_salt: joins the hash of the prompt's first block, so requests with another
    # salt share none of its cached blocks, on any tier ("": none).
    cache_salt: str = ""


def check_submit(msg: Submit) -> None:
    """ValueError naming the field if ``msg`` cannot be a request (checked by both ends).

    Not a ``__post_init__``: a bad Submit that reached the engine is answered with
    Rejected naming its request, which a frame the codec refused could not be. Its
    ``params`` check themselves when built (:class:`SamplingParams`), at the sender; a
    frame carrying bad ones anyway is refused by the codec and answered ``Failed``.
    """
    if not msg.request_id:
        raise ValueError("request_id must not be empty")
    if sum(map(bool, (msg.prompt_token_ids, msg.prompt, msg.messages))) != 1:
        raise ValueError("exactly one of prompt_token_ids, prompt and messages must be non-empty")
    if msg.messages:
        check_messages(msg.messages)
    if any(t < 0 for t in msg.prompt_token_ids):
        raise ValueError("prompt_token_ids must hold non-negative token ids")


@message(CLIENT_TO_ENGINE, tag=3)
@dataclass(frozen=True, slots=True, kw_only=True)
class Abort:
    """Stop a request of this client; it then finishes with "abort" (if not finished before)."""

    request_id: str


@message(CLIENT_TO_ENGINE, tag=4)
@dataclass(frozen=True, slots=True, kw_only=True)
class Reserve:
    """Ask a decode instance for room for a request; answered by a :class:`Reservation` of
    the same ``reservation_id`` (docs/design.md, "Instances (prefill/decode disaggregation)")."""

    expects_reply: ClassVar[bool] = True
    reservation_id: str  # unique among this client's live reservations and requests
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def no_cached_tokens() -> dict[str, int]:
    return {"device": 0, "host": 0, "storage": 0}


@message(ENGINE_TO_CLIENT, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class Tokens:
    """New output tokens of a request; the last message of a request has a finish_reason."""

    request_id: str
    incarnation: int  # the client incarnation whose request this is
    token_ids: tuple[int, ...]  # the tokens produced since the previous Tokens, in order
    finish_reason: str = ""  # "": still running; else "stop", "length" or "abort"
    error: str = ""  # why the engine ended the request abnormally ("" if it did not)
    # Prompt tokens served from each cache tier ("device", "host", "storage"); set on the
    # first Tokens of a request.
    cached_tokens: dict[str, int] = field(default_factory=no_cached_tokens)
    ttft_s: float = -1.0  # seconds from submit to the first token; -1 until known
    # A prefill instance's last Tokens: the leading full blocks of the request that storage
    # holds now (written and complete on every rank, or there already); -1 elsewhere.
    stored_blocks: int = -1
    # The request asked for logprobs: one per token of token_ids, in order.
    logprobs: tuple[TokenLogprobs, ...] = ()
    # It asked for prompt_logprobs: one per prompt token from the second (the first has
    # none), all on the first Tokens of the request.
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@message(ENGINE_TO_CLIENT, tag=2)
@dataclass(frozen=True, slots=True, kw_only=True)
class Rejected:
    """A Submit or Abort the engine refused; the request (if any) never ran."""

    request_id: str
    incarnation: int  # the client incarnation that sent it
    error: str  # why, for the user
    # What kind of refusal, for a front end to answer by: "" (a bad request),
    # "reservation" (a claim whose reservation is not live: reserve again), "role" (not
    # what this instance's engine.role takes).
    code: str = ""


@message(ENGINE_TO_CLIENT, tag=3)
@dataclass(frozen=True, slots=True, kw_only=True)
class Stats:
    """The engine's state now, for a client whose current Hello asked (``Hello.stats``).

    Sent on every engine Tick and once right after such a Hello; the engine keeps at most
    one queued per client, the newest. The counts since start are this engine process's
    (a restarted engine counts from zero again). Every dict holds every key named below,
    zeros included. Before the scheduler began (the executors have not all answered the
    engine yet) ``began`` is False and every figure is zero.
    """

    incarnation: int  # the client incarnation it is for
    began: bool  # False: the engine is up but its scheduler has not begun (all figures 0)
    running: int  # requests the scheduler runs now (admitted, with device blocks)
    waiting: int  # requests waiting for admission: new, prefetching and preempted ones
    steps: int  # steps the scheduler issued (summary.json's engine.steps), in flight included
    # Running requests pushed out, by the policy used: "recompute", "swap", "save" (a swap
    # or save that found no room is counted as "recompute").
    preemptions: dict[str, int]
    # Ops complete on every rank, by lane: "step", "swap", "store" (whatever their status;
    # ops a restart cancelled included).
    ops: dict[str, int]
    # KV bytes copied, summed over ranks: "swap_out" (device to host), "swap_in" (host to
    # device), "store_write" (host to storage), "store_read" (storage to host).
    bytes: dict[str, int]
    # Ops sent and not yet complete on every rank, by lane: "step", "swap", "store".
    in_flight: dict[str, int]
    # Blocks referenced by a request or an op in flight, per tier: "device", "host"
    # (free blocks that still hold cached KV are not counted).
    blocks_used: dict[str, int]
    # Pool size per tier: "device", "host" (without a host tier, its staging blocks).
    blocks_total: dict[str, int]
    # Prompt tokens served from each tier instead of being computed, over every
    # admission (preempted requests resuming included): "device", "host", "storage".
    hit_tokens: dict[str, int]
    # Device blocks free now (cached ones included: they can be taken), and the live
    # reservations of a decode instance with the blocks counted for them.
    free_blocks: int = 0
    reservations: int = 0
    reserved_blocks: int = 0
    # Where the engine publishes its KV events (events.enabled), as bound: "" for none.
    events_endpoint: str = ""
    events_replay_endpoint: str = ""


@message(ENGINE_TO_CLIENT, tag=4)
@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    """A decode instance's answer to :class:`Reserve`: granted (claim it with a Submit of
    that ``reservation_id`` within ``ttl_s``) or not, and why."""

    reservation_id: str
    incarnation: int  # the client incarnation that asked
    granted: bool
    ttl_s: float = 0.0  # granted: seconds it stays live unclaimed
    blocks: int = 0  # granted: device blocks counted for it
    error: str = ""  # not granted: why
    retry: bool = False  # not granted for now (no room): the same Reserve may fit later
