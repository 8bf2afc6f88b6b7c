"""The ``grammar`` check of ``ringfence replay`` (issue 38): every output token of a request
with a structured output was one its grammar allowed.

Read from the engine's trace alone: ``sched.add`` gives each request's sampling parameters
(its structured output among them), ``request.arrive`` its sequence id, and each
``sched.step`` of status ok the tokens the Worker sampled, by sequence, in the order they
were applied. Each request's tokens go through a fresh matcher of its grammar, compiled
with the tokenizer of the run's model (``config.toml``: the checkpoint's, or bytes for a
preset), as the Worker compiled it; the first token the matcher refuses is a violation
naming the request, the token and its place. Once the grammar has ended, only its end
tokens may follow (a request that ignores the end token goes on with it).

Each engine incarnation (a process id) starts afresh: its scheduler numbers sequences anew.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ringfence.actors.model.config import ModelConfig
from ringfence.actors.replay.findings import CheckResult, Violation
from ringfence.actors.replay.records import Entry, RunLog
from ringfence.actors.text.grammars import GrammarError, Grammars, model_grammars
from ringfence.runtime.config import loads_config
from ringfence.sched.sampling import SamplingParams
from ringfence.sched.structured import StructuredOutput

if TYPE_CHECKING:
    import llguidance


def check_grammars(log: RunLog, result: CheckResult) -> None:
    """Add a ``grammar`` violation for each constrained request's first forbidden token."""
    engine = log.sources.get("engine-0", [])
    if not any(
        e.event == "sched.add" and (e.get("params") or {}).get("structured") for e in engine
    ):
        return
    grammars = _grammars(log.run_dir, engine)
    if grammars is None:
        result.skipped.append("grammar (the run dir has no config.toml naming the model)")
        return
    for life in dict.fromkeys(e.life for e in engine):
        _incarnation([e for e in engine if e.life == life], grammars, result)


def _grammars(run_dir: Path, engine: list[Entry]) -> Grammars | None:
    config_file = run_dir / "config.toml"
    if not config_file.is_file():
        return None
    model = loads_config(config_file.read_text(), str(config_file)).sections(_Model).model
    ready = [e for e in engine if e.event == "engine.ready" and e.get("vocab_size")]
    vocab_size = int(ready[0].get("vocab_size")) if ready else 0
    return model_grammars(model.path, vocab_size)


@dataclass
class _Model:
    """The one section this check reads (``Config.sections`` fills it)."""

    model: ModelConfig


def _incarnation(entries: list[Entry], grammars: Grammars, result: CheckResult) -> None:
    specs: dict[str, StructuredOutput] = {}
    seqs: dict[int, _Follow] = {}
    for entry in entries:
        if entry.event == "sched.add":
            params = SamplingParams(**(entry.get("params") or {}))
            if params.structured is not None:
                specs[str(entry.get("request"))] = params.structured
        elif entry.event == "request.arrive" and str(entry.get("request")) in specs:
            rid = str(entry.get("request"))
            try:
                matcher = grammars.matcher(specs[rid])
            except GrammarError as e:
                result.violations.append(
                    Violation(
                        "grammar", f"request {rid}: its grammar does not compile: {e}", (entry,)
                    )
                )
                continue
            seqs[int(entry.get("seq_id"))] = _Follow(rid, matcher, entry)
        elif entry.event == "sched.step" and entry.get("status") == "ok":
            for seq_id, token in entry.get("outputs") or ():
                follow = seqs.get(int(seq_id))
                if follow is not None and not follow.failed:
                    result.counts["grammar"] += 1
                    follow.take(int(token), grammars, entry, result)


class _Follow:
    """One constrained request's matcher, fed its tokens as the steps gave them."""

    def __init__(self, request_id: str, matcher: llguidance.LLMatcher, arrive: Entry) -> None:
        self.request_id = request_id
        self.matcher = matcher
        self.arrive = arrive
        self.count = 0  # output tokens taken
        self.failed = False  # a violation was reported: the rest is not checked

    def take(self, token: int, grammars: Grammars, entry: Entry, result: CheckResult) -> None:
        matcher = self.matcher
        position = self.count
        self.count += 1
        if matcher.is_stopped():
            if token in grammars.tokenizer.eos_tokens:
                return
            why = "its grammar had ended: only its end token may follow"
        elif matcher.consume_token(token):
            return
        else:
            why = matcher.get_error() or "the grammar refused it"
        self.failed = True
        result.violations.append(
            Violation(
                "grammar",
                f"request {self.request_id}: output token {position} (id {token}) is not one "
                f"its structured output allowed: {why}",
                (entry, self.arrive),
            )
        )
