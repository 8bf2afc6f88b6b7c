"""What the Worker keeps per sequence to sample it, and the sampling of a step's pieces.

The scheduler sends a sequence's :class:`~ringfence.sched.ops.Opening` (its
``SamplingParams``, and the tokens before the piece when a penalty must count them) with
its first piece after each admission, and lists it in a step's ``closed`` when it ends;
in between, the Worker keeps it here with the counts the penalties read, updated from
every piece's tokens, so neither is sent again each step. Every rank keeps the same
state (a plan is refused or run alike on every rank); rank 0 samples.

A sequence with a structured output (issue 38) also keeps its grammar's matcher, which
consumes the output's tokens as the pieces bring them: so after a restart, a preemption by
recompute or swap, or a failed step, the reopened sequence's matcher is rebuilt by replaying
its output (the Opening's ``history``, then its pieces), through the same path as the
penalties' counts. Only rank 0 keeps matchers (it alone samples); a sequence without a
grammar costs nothing more.

Owned by the Worker actor's thread; not thread-safe.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import llguidance
import torch

from ringfence.actors.executors.constraints import Constraints, MaskJob
from ringfence.actors.model.decoder import sample
from ringfence.actors.model.grammars import GrammarError, Grammars
from ringfence.actors.protocol.worker import PromptLogprobs, SampledToken
from ringfence.sched.ops import Opening, Piece
from ringfence.sched.sampling import LOGPROB_FLOOR, SamplingParams, TokenLogprobs


class NonFiniteLogits(ArithmeticError):
    """A step produced NaN or infinite logits: it read blocks it should not have, or blocks
    a failed op spoiled (``actors/executors/transfer.py``). The step fails; no token comes of it."""


@dataclass(slots=True)
class SeqSampling:
    """One open sequence: how to sample it, and (when a penalty asks) its token counts."""

    params: SamplingParams
    num_prompt_tokens: int
    num_tokens: int = 0  # positions seen so far (history, then every piece's tokens)
    output_counts: Counter[int] = field(default_factory=Counter)  # output token -> times
    seen: set[int] = field(default_factory=set)  # tokens in the prompt or the output
    # prompt_logprobs: the logits of the last token of its previous piece, which give the
    # log probability of this piece's first token (None before the first piece).
    pending: torch.Tensor | None = None
    # The grammar's matcher, standing after the output tokens seen (structured outputs).
    matcher: llguidance.LLMatcher | None = None

    def observe(self, tokens: Sequence[int]) -> None:
        """Count the tokens at positions num_tokens, num_tokens + 1, ... (only when a
        penalty reads the counts) and feed the output's to the grammar's matcher."""
        first_output = max(0, self.num_prompt_tokens - self.num_tokens)
        if self.params.needs_counts:
            self.seen.update(tokens)
            self.output_counts.update(tokens[first_output:])
        matcher = self.matcher
        if matcher is not None and first_output < len(tokens):
            for token in tokens[first_output:]:
                # A finished grammar allows only its end token; with ignore_eos the output
                # goes on past it and the matcher, stopped, stays where it ended. A token it
                # refuses (one it never allowed) leaves it in error: it then allows only the
                # end token, so the output ends rather than stray further.
                if matcher.is_stopped() or not matcher.consume_token(token):
                    break
        self.num_tokens += len(tokens)


class Sampler:
    """The open sequences of one Worker, by the scheduler's seq id."""

    def __init__(
        self, vocab_size: int, logprobs_mode: str = "raw_logprobs", grammars: Grammars | None = None
    ) -> None:
        """``grammars``: the structured outputs' compiler (None: this rank does not sample,
        or keeps no tokenizer; a grammar then fails the plan that opens its sequence)."""
        self.vocab_size = vocab_size
        self.constraints = Constraints(grammars) if grammars is not None else None
        # "raw_logprobs" (vLLM's default): of the model's logits; "processed_logprobs": of
        # the logits after bias, penalties and temperature, which the token was drawn from.
        self.logprobs_mode = logprobs_mode
        self.seqs: dict[int, SeqSampling] = {}
        self.constrained: set[int] = set()  # the open sequences with a matcher

    def problem(self, pieces: Sequence[Piece]) -> str:
        """Why these pieces cannot be sampled, or "": a piece to sample of a sequence that is
        neither open nor opened here, an opening whose history does not end at its piece, a token id
        its parameters name outside the vocabulary. Changes nothing."""
        opened: set[int] = set()
        for i, p in enumerate(pieces):
            o = p.opening
            if o is not None:
                if o.params.needs_history and len(o.history) != p.start:
                    return (
                        f"piece {i} opens sequence {p.seq_id} with {len(o.history)} history "
                        f"tokens, but starts at {p.start}"
                    )
                try:
                    o.params.check_vocab(self.vocab_size)
                    if o.params.structured is not None and self.constraints is not None:
                        self.constraints.grammars.matcher(o.params.structured)  # compiled, kept
                except ValueError as e:
                    return f"piece {i} (sequence {p.seq_id}): {e}"
                opened.add(p.seq_id)
            elif p.sample and p.seq_id not in self.seqs and p.seq_id not in opened:
                return f"piece {i}: sequence {p.seq_id} was never opened (no sampling params)"
        return ""

    def whole(self, pieces: Sequence[Piece]) -> list[int]:
        """The indices of the pieces whose every token's logits are needed: those holding
        prompt tokens of a sequence that asked for prompt_logprobs (call after advance)."""
        return [
            i
            for i, p in enumerate(pieces)
            if (state := self.seqs.get(p.seq_id)) is not None
            and state.params.prompt_logprobs is not None
            and p.start < state.num_prompt_tokens
        ]

    def prompt_logprobs(
        self, pieces: Sequence[Piece], piece_logits: Mapping[int, torch.Tensor]
    ) -> tuple[PromptLogprobs, ...]:
        """The log probabilities of the prompt tokens in the pieces :meth:`whole` named,
        under the raw logits (vLLM's prompt logprobs are never processed): the token at
        position q under the logits at q - 1, which for a piece's first token are the
        previous piece's last ones (kept as ``pending``)."""
        found = []
        for i, rows in piece_logits.items():
            p, state = pieces[i], self.seqs[pieces[i].seq_id]
            k = state.params.prompt_logprobs or 0
            logits = rows.to(device="cpu", dtype=torch.float64)
            end = min(p.end, state.num_prompt_tokens)
            first = max(p.start, 1)
            entries = []
            for q in range(first, end):
                before = logits[q - 1 - p.start] if q > p.start else state.pending
                if before is None:
                    raise RuntimeError(
                        f"sequence {p.seq_id}: no logits before position {q}: its prompt "
                        "was not computed from the start"
                    )
                token = p.token_ids[q - p.start]
                logprob, top, rank = token_logprobs(before, token, k)
                entries.append(TokenLogprobs(token_id=token, logprob=logprob, rank=rank, top=top))
            state.pending = logits[-1] if p.end < state.num_prompt_tokens else None
            if entries:
                found.append(PromptLogprobs(seq_id=p.seq_id, start=first, entries=tuple(entries)))
        return tuple(found)

    def close(self, seq_ids: Iterable[int]) -> None:
        """Forget ended sequences (unknown ids are ignored: a reset forgot them already)."""
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)
            self.constrained.discard(seq_id)

    def advance(self, pieces: Sequence[Piece]) -> None:
        """Open the sequences the pieces open (replacing what was kept: they start over) and
        count every piece's tokens; call once per plan, before sampling it."""
        for p in pieces:
            if p.opening is not None:
                opened = self.seqs[p.seq_id] = self._opened(p.opening)
                if opened.matcher is not None:
                    self.constrained.add(p.seq_id)
                else:
                    self.constrained.discard(p.seq_id)
                opened.observe(p.opening.history)
                opened.num_tokens = p.start
            if (state := self.seqs.get(p.seq_id)) is not None:  # (an opening may come later)
                state.observe(p.token_ids)

    def _opened(self, opening: Opening) -> SeqSampling:
        state = SeqSampling(params=opening.params, num_prompt_tokens=opening.num_prompt_tokens)
        spec = opening.params.structured
        if spec is not None and self.constraints is not None:
            state.matcher = self.constraints.grammars.matcher(spec)
        return state

    def start_masks(self, pieces: Sequence[Piece]) -> MaskJob | None:
        """Start computing the grammar masks of the pieces to sample (call after
        :meth:`advance`, before the forward: they are filled beside it); None if none has a
        grammar."""
        if self.constraints is None or not self.constrained:
            return None  # no grammar open: nothing to do, every step
        rows = [
            (row, state.matcher)
            for row, p in enumerate(pieces)
            if p.sample and (state := self.seqs.get(p.seq_id)) and state.matcher is not None
        ]
        return self.constraints.start(rows)

    def sample(
        self, pieces: Sequence[Piece], last_logits: torch.Tensor, masks: MaskJob | None = None
    ) -> tuple[SampledToken, ...]:
        """The next token of every piece that asks for one, from its row of ``last_logits``
        (on any device: sampled on the CPU in float64, so every device draws the same), each
        constrained row masked by its grammar (``masks`` from :meth:`start_masks`; computed
        here when not given)."""
        last_logits = last_logits.to(device="cpu", dtype=torch.float64)
        if masks is not None:
            return self._draw(pieces, last_logits, masks)
        masks = self.start_masks(pieces)
        try:
            return self._draw(pieces, last_logits, masks)
        finally:
            if masks is not None:  # its fill reads the matchers: over before they move
                masks.wait()

    def _draw(
        self, pieces: Sequence[Piece], last_logits: torch.Tensor, masks: MaskJob | None
    ) -> tuple[SampledToken, ...]:
        outputs = []
        for row, p in enumerate(pieces):
            if not p.sample:
                continue
            if not bool(torch.isfinite(last_logits[row]).all()):
                raise NonFiniteLogits(
                    f"the logits of sequence {p.seq_id} are not finite: the step read KV "
                    "that was never written, was freed and poisoned (a missing fence?), or "
                    "was spoiled by an op that failed"
                )
            state = self.seqs[p.seq_id]
            params = state.params
            position = p.start + len(p.token_ids)
            raw = last_logits[row]
            if params.structured is not None:
                if masks is None or row not in masks.rows:
                    raise GrammarError(f"sequence {p.seq_id} has a grammar but no matcher here")
                raw = masks.apply(row, raw)  # the grammar first: vLLM applies it to the logits
            logits = processed(raw, state, position) if params.processes_logits else raw
            constrained = params.structured is not None
            if constrained and logits is not raw and not bool(logits.isfinite().any()):
                # The knobs forbade every token the grammar allows (min_tokens holding off
                # the end it allows alone): the grammar wins, so the output stays valid.
                logits = raw
            token = sample(
                logits,
                temperature=params.temperature,
                seed=params.seed,
                position=position,
                top_p=params.top_p,
                top_k=params.top_k,
                min_p=params.min_p,
            )
            logprob, rank = token.logprob, 1
            top: tuple[tuple[int, float], ...] = ()
            if params.logprobs is not None or logits is not raw:
                chosen = raw if self.logprobs_mode == "raw_logprobs" else logits
                logprob, top, rank = token_logprobs(chosen, token.token_id, params.logprobs or 0)
            outputs.append(
                SampledToken(
                    seq_id=p.seq_id,
                    position=position,
                    token_id=token.token_id,
                    logprob=logprob,
                    rank=rank,
                    top=top,
                )
            )
        return tuple(outputs)


def processed(raw: torch.Tensor, state: SeqSampling, position: int) -> torch.Tensor:
    """The logits [vocab] (float64) the token at ``position`` is drawn from, in vLLM's
    order: logit_bias and the min_tokens mask, then the repetition penalty (over the
    prompt's and the output's tokens) and the frequency and presence penalties (over the
    output's). A new tensor; ``raw`` is not changed."""
    p = state.params
    x = raw.clone()
    if p.logit_bias:
        x[[token for token, _ in p.logit_bias]] += torch.tensor(
            [bias for _, bias in p.logit_bias], dtype=x.dtype
        )
    if p.min_tokens and position - state.num_prompt_tokens < p.min_tokens and p.stop_token_ids:
        x[list(p.stop_token_ids)] = -torch.inf  # the output is too short to stop yet
    if p.repetition_penalty != 1.0 and state.seen:
        seen = torch.tensor(sorted(state.seen))
        values = x[seen]
        x[seen] = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
    if (p.frequency_penalty or p.presence_penalty) and state.output_counts:
        ids = torch.tensor(list(state.output_counts))
        counts = torch.tensor(list(state.output_counts.values()), dtype=x.dtype)
        x[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return x


def token_logprobs(
    logits: torch.Tensor, token_id: int, k: int
) -> tuple[float, tuple[tuple[int, float], ...], int]:
    """log_softmax(logits) at ``token_id``, the ``k`` most probable (id, logprob) in
    descending order (ties by the lower id), and the token's rank (1: the most probable).
    A -inf is LOGPROB_FLOOR: JSON has no infinity."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = float(logprobs[token_id])
    rank = 1 + int((logprobs > chosen).sum())
    top: tuple[tuple[int, float], ...] = ()
    if k:
        # Not a sort of the whole vocabulary (most of a step's sampling time at 49k tokens):
        # every token at least as probable as the k-th best, ties at the boundary included,
        # then those few ordered by logprob and, among equals, by id, as a stable sort would.
        kth = torch.topk(logprobs, min(k, logprobs.numel())).values[-1]
        candidates = torch.nonzero(logprobs >= kth).flatten()
        if len(candidates) > 4 * k + 64:  # a wide tie (a mostly masked row): sort them all
            candidates = torch.sort(logprobs, descending=True, stable=True).indices[:k]
        pairs = zip(candidates.tolist(), logprobs[candidates].tolist(), strict=True)
        best = sorted(pairs, key=lambda pair: (-pair[1], pair[0]))[:k]
        top = tuple((int(i), max(float(v), LOGPROB_FLOOR)) for i, v in best)
    return max(chosen, LOGPROB_FLOOR), top, rank
