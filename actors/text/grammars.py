"""Structured outputs' grammars (issue 38): a request's :class:`StructuredOutput` compiled by
llguidance against the tokenizer the model samples with, cached by spec.

Why llguidance, not xgrammar (both run on the CPU; measured here on 2026-11-27, a 2-core VM
with another test run on it, SmolLM2-135M-Instruct's tokenizer of 49,152 tokens, a nested
JSON schema: six required properties, one an object holding an object, an array, an enum, a
string with a pattern; the mask computed before each of a 94-token instance's tokens and
its end, two runs each, the schema compiled afresh in each):

=================================  =========================  ===========================
                                   llguidance 1.9.1           xgrammar 0.2.8
=================================  =========================  ===========================
tokenizer info, once per model     280 ms                     256-315 ms
compile the schema, per request    1.4-1.5 ms                 354-408 ms
mask per token: median, p90, max   17-23 us, 66-106 us,       2-3 us, 10-12 us,
                                   0.5-1.9 ms                 90-136 us
what installing it adds            one 3.1 MB wheel, no       transformers (and its hub
                                   dependencies               client), triton (a 286 MB
                                                              wheel), apache-tvm-ffi
=================================  =========================  ===========================

xgrammar's masks are ten times cheaper, but a 20 us mask is lost in a decode step of tens of
milliseconds, computed beside the forward (``actors/executors/constraints.py``), whereas
its 0.4 s compile of every new schema would stall every running sequence on the Worker's
thread, and its dependencies would triple a plain install. llguidance's compile is cheap
enough to run again in the front end to refuse a bad schema with the backend's own words
(:func:`problem`).

No torch here: the front end imports this module. Not thread-safe (:class:`Grammars` is
owned by one Worker thread); compiled grammars are immutable and matchers are copied from
them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, ClassVar

from ringfence.actors.text.tokenizer import (
    NUM_BYTES,
    VOCAB_SIZE,
    ByteTokenizer,
    CheckpointTokenizer,
    Tokenizer,
    model_tokenizer,
)
from ringfence.sched.structured import StructuredOutput
from ringfence.shm.errors import RingfenceError

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

JSON_STYLE: JsonCompileOptions = {"whitespace_flexible": False}  # (see grammar_text)
CHECKED = 256  # specs whose verdict problem() keeps
CACHE_SIZE = 64  # compiled grammars kept per Worker, least recently used dropped first
BYTE_SPECIALS = (b"<s>", b"</s>", b"<pad>")  # ByteTokenizer's BOS, EOS and PAD, in id order


class GrammarError(RingfenceError, ValueError):
    """A spec the backend cannot compile; the message is the backend's complaint."""


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of ``spec`` (GrammarError with the backend's complaint).

    JSON is written compact (no whitespace between tokens, llguidance's
    ``whitespace_flexible`` off, as xgrammar's ``any_whitespace`` off): a model free to
    write whitespace anywhere may write nothing else until its tokens run out.
    """
    import llguidance

    try:
        if spec.kind == "json":
            text = llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_STYLE)
        else:
            text = llguidance.grammar_from(spec.kind, spec.source)
    except ValueError as e:  # a schema llguidance refuses while translating it
        raise GrammarError(str(e)) from None
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise GrammarError(error)
    return text


@lru_cache(maxsize=CHECKED)
def problem(spec: StructuredOutput) -> str:
    """Why ``spec`` does not compile ("" if it does); what the front end answers 400 with.
    Verdicts are kept by spec (thread-safe: the cache is, and compiling changes nothing)."""
    try:
        grammar_text(spec)
    except GrammarError as e:
        return str(e)
    return ""


def backend_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` over a model of ``vocab_size`` logits; generation
    ends at its stop ids (its eos when it has none, as the byte tokenizer of the presets)."""
    import llguidance

    stops = list(tokenizer.stop_ids) or ([tokenizer.eos] if tokenizer.eos is not None else [])
    if isinstance(tokenizer, CheckpointTokenizer):
        return llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=stops or None
        )
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), eos_token=stops)
    raise TypeError(f"no grammar backend for a {type(tokenizer).__name__}")


class _Bytes:
    """The byte tokenizer in the shape ``llguidance.TokenizerWrapper`` reads."""

    eos_token_id = ByteTokenizer.eos
    bos_token_id = ByteTokenizer.bos
    tokens: ClassVar[list[bytes]] = [bytes([i]) for i in range(NUM_BYTES)] + list(BYTE_SPECIALS)
    special_token_ids: ClassVar[list[int]] = list(range(NUM_BYTES, VOCAB_SIZE))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class Grammars:
    """One Worker's compiled grammars, by spec, and the matchers made from them.

    The tokenizer is loaded on the first grammar (a Worker that never sees one never reads
    it). Owned by the Worker's thread.
    """

    def __init__(self, tokenizer: Callable[[], Tokenizer], vocab_size: int) -> None:
        self._load = tokenizer
        self.vocab_size = vocab_size  # the model's logits per row
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = backend_tokenizer(self._load(), self.vocab_size)
        return self._tokenizer

    @property
    def mask_words(self) -> int:
        """32-bit words of one token mask (tokens past the tokenizer's are never allowed)."""
        return (self.tokenizer.vocab_size + 31) // 32

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for ``spec``, at the start of the output (GrammarError if it does
        not compile). A compiled grammar is kept; a matcher is a copy of it."""
        import llguidance

        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
            if compiled.is_error():
                raise GrammarError(compiled.get_error())
            self._compiled[spec] = compiled
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return compiled.deep_copy()


def model_grammars(path: str, vocab_size: int) -> Grammars:
    """The grammars of the model at ``path`` (a checkpoint's tokenizer; bytes for a preset,
    ``path`` empty): the tokenizer the model samples with, as the Engine encodes with it."""
    return Grammars(lambda: model_tokenizer(path), vocab_size)
