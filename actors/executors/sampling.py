"""What the Worker keeps per sequence to sample it, and the sampling of a step's pieces.

The scheduler sends a sequence's :class:`~ringfence.sched.ops.Opening` (its
``SamplingParams``, and the tokens before the piece when a penalty must count them) with
its first piece after each admission, and lists it in a step's ``closed`` when it ends;
in between, the Worker keeps it here with the counts the penalties read, updated from
every piece's tokens, so neither is sent again each step. Every rank keeps the same
state (a plan is refused or run alike on every rank); rank 0 samples.

The counts live on the device the Worker samples on (``counts.py``: a slot per sequence
with a penalty), and a step is sampled there by batched tensor ops (``model/sampler.py``,
each knob of every row at once, with the one-row ``reference_sampling.sample`` as its definition):
only the sampled ids and the asked-for log probabilities come back to the host, in one
copy. A step's parameters go the other way in one copy too (``knobs.py``).

A sequence with a structured output (issue 38) also keeps its grammar's matcher, which
consumes the output's tokens as the pieces bring them: so after a restart, a preemption by
recompute or swap, or a failed step, the reopened sequence's matcher is rebuilt by replaying
its output (the Opening's ``history``, then its pieces), through the same path as the
penalties' counts. Only rank 0 keeps matchers (it alone samples); a sequence without a
grammar costs nothing more.

Owned by the Worker actor's thread; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import llguidance
import torch

from ringfence.actors.executors.constraints import Constraints, MaskJob
from ringfence.actors.executors.counts import DeviceCounts
from ringfence.actors.executors.knobs import SeqKnobs, build_knobs
from ringfence.actors.model.host import to_device, to_host
from ringfence.actors.model.inputs import DeviceInputs
from ringfence.actors.model.sampler import sample_rows
from ringfence.actors.protocol.worker import PromptLogprobs, Sampled, SampledToken
from ringfence.actors.text.grammars import GrammarError, Grammars
from ringfence.sched.ops import Opening, Piece
from ringfence.sched.sampling import LOGPROB_FLOOR, SamplingParams, TokenLogprobs


class NonFiniteLogits(ArithmeticError):
    """A step produced NaN or infinite logits: it read blocks it should not have, or blocks
    a failed op spoiled (``actors/executors/transfer.py``). The step fails; no token comes of it."""


@dataclass(slots=True)
class SeqSampling:
    """One open sequence: how to sample it, and (when a penalty asks) its counts' slot."""

    params: SamplingParams
    num_prompt_tokens: int
    knobs: SeqKnobs  # what its params put in each step's row
    slot: int = 0  # its row of the device counts (0: it keeps none)
    num_tokens: int = 0  # positions seen so far (history, then every piece's tokens)
    # prompt_logprobs: the logits of the last token of its previous piece, which give the
    # log probability of this piece's first token (None before the first piece).
    pending: torch.Tensor | None = None
    # The grammar's matcher, standing after the output tokens seen (structured outputs).
    matcher: llguidance.LLMatcher | None = None

    def observe(self, tokens: Sequence[int], counts: DeviceCounts | None) -> None:
        """Count the tokens at positions num_tokens, num_tokens + 1, ... in its slot (when
        it holds one) and feed the output's to the grammar's matcher."""
        first_output = max(0, self.num_prompt_tokens - self.num_tokens)
        if self.slot and counts is not None:
            counts.add(self.slot, tokens, first_output)
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

    def observe_on_device(self, ids: torch.Tensor, index: int, counts: DeviceCounts | None) -> None:
        """Count one output token still on the device, ``ids[index]`` (a decode launched
        before the step that sampled its input was read back; a sequence with a matcher
        needs its tokens on the host, so it is never launched so)."""
        if self.matcher is not None:
            raise RuntimeError("a sequence with a grammar needs its tokens on the host")
        if self.slot and counts is not None:
            counts.add_on_device(self.slot, ids, index)
        self.num_tokens += 1


@dataclass(frozen=True, slots=True)
class Draw:
    """A step's draw queued on the device (:meth:`Sampler.queue`), not yet read back."""

    pieces: Sequence[Piece]
    rows: list[int]  # the pieces that sample
    states: list[SeqSampling]  # theirs, in that order
    out: torch.Tensor  # ids, logprobs, ranks, non-finite flags, top logprobs (sample_rows)
    top_k: int  # top logprobs a row
    host: torch.Tensor  # ``out``'s copy on the host, landed once ``ready`` is reached
    ready: torch.cuda.Event | None  # on CUDA: after the draw's kernels and the copy


class Sampler:
    """The open sequences of one Worker, by the scheduler's seq id."""

    def __init__(
        self,
        vocab_size: int,
        logprobs_mode: str = "raw_logprobs",
        grammars: Grammars | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """``grammars``: the structured outputs' compiler (None: this rank does not sample,
        or keeps no tokenizer; a grammar then fails the plan that opens its sequence).
        ``device``: where the counts live and the logits are sampled (logits elsewhere are
        moved there)."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.constraints = Constraints(grammars) if grammars is not None else None
        # "raw_logprobs" (vLLM's default): of the model's logits; "processed_logprobs": of
        # the logits after bias, penalties and temperature, which the token was drawn from.
        self.logprobs_mode = logprobs_mode
        self.seqs: dict[int, SeqSampling] = {}
        self.constrained: set[int] = set()  # the open sequences with a matcher
        self._counts: DeviceCounts | None = None  # made when a penalty first needs it

    @property
    def counts(self) -> DeviceCounts:
        if self._counts is None:
            self._counts = DeviceCounts(self.vocab_size, self.device)
        return self._counts

    def counts_of(self, seq_id: int) -> tuple[dict[int, int], set[int]]:
        """An open sequence's output counts and seen tokens, read back from the device
        (empty when it keeps none)."""
        slot = self.seqs[seq_id].slot
        return self.counts.of(slot) if slot else ({}, set())

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
        """Forget ended sequences and free their slots (unknown ids are ignored: a reset
        forgot them already)."""
        for seq_id in seq_ids:
            state = self.seqs.pop(seq_id, None)
            if state is not None and state.slot:
                self.counts.release(state.slot)
            self.constrained.discard(seq_id)

    def advance(self, pieces: Sequence[Piece], tokens: DeviceInputs | None = None) -> None:
        """Open the sequences the pieces open (replacing what was kept: they start over) and
        count every piece's tokens (one copy to the device for the plan); call once per
        plan, before sampling it. ``tokens``: the inputs of those pieces that are still on
        the device (their ``token_ids`` are placeholders), counted there."""
        on_device = {piece: j for j, piece in enumerate(tokens.pieces)} if tokens else {}
        for i, p in enumerate(pieces):
            if p.opening is not None:
                self.close([p.seq_id])
                opened = self.seqs[p.seq_id] = self._opened(p.opening)
                if opened.matcher is not None:
                    self.constrained.add(p.seq_id)
                opened.observe(p.opening.history, self._counts)
                opened.num_tokens = p.start
            if (state := self.seqs.get(p.seq_id)) is None:  # (an opening may come later)
                continue
            if tokens is not None and (index := on_device.get(i)) is not None:
                state.observe_on_device(tokens.ids, index, self._counts)
            else:
                state.observe(p.token_ids, self._counts)
        if self._counts is not None:
            self._counts.flush()

    def _opened(self, opening: Opening) -> SeqSampling:
        params = opening.params
        state = SeqSampling(
            params=params,
            num_prompt_tokens=opening.num_prompt_tokens,
            knobs=SeqKnobs.of(params, opening.num_prompt_tokens, self.vocab_size),
            slot=self.counts.take() if params.needs_counts else 0,
        )
        spec = params.structured
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
        [pieces, vocab] (on this sampler's device, else moved there), each constrained row
        masked by its grammar (``masks`` from :meth:`start_masks`; computed here when not
        given). On CUDA the one copy of the results back waits for the stream."""
        if masks is not None:
            return self.collect(self.queue(pieces, last_logits, masks)).tokens()
        masks = self.start_masks(pieces)
        try:
            return self.collect(self.queue(pieces, last_logits, masks)).tokens()
        finally:
            if masks is not None:  # its fill reads the matchers: over before they move
                masks.wait()

    def queue(
        self, pieces: Sequence[Piece], last_logits: torch.Tensor, masks: MaskJob | None
    ) -> Draw | None:
        """:meth:`sample`'s first half: the draw's tensor ops, queued on the device (run, on
        the CPU), None when no piece asks for a token; :meth:`collect` reads them back."""
        rows = [i for i, p in enumerate(pieces) if p.sample]
        if not rows:
            return None
        states = [self.seqs[pieces[i].seq_id] for i in rows]
        masked: list[tuple[int, int]] = []  # (row, row of the bitmask) of constrained rows
        for j, state in enumerate(states):
            if state.params.structured is not None:
                if masks is None or rows[j] not in masks.rows:
                    seq_id = pieces[rows[j]].seq_id
                    raise GrammarError(f"sequence {seq_id} has a grammar but no matcher here")
                masked.append((j, masks.rows[rows[j]]))
        knobs = build_knobs(
            [state.knobs for state in states],
            [pieces[i].start + len(pieces[i].token_ids) for i in rows],
            [state.slot for state in states],
            self.device,
            masked,
        )
        logits = last_logits.to(self.device)
        if len(rows) < len(logits):  # the rows' ids copied without waiting (a list would)
            logits = logits.index_select(0, to_device(torch.tensor(rows), self.device))
        x = logits.to(torch.float64)
        bits = masks.bits_on(self.device) if masks is not None and masked else None
        counts = seen = None
        if knobs.any_penalty:
            counts = self.counts.counts.index_select(0, knobs.slot)
            seen = self.counts.seen.index_select(0, knobs.slot)
        out, top_k = sample_rows(
            x, knobs, bits=bits, counts=counts, seen=seen,
            raw_logprobs=self.logprobs_mode == "raw_logprobs",
        )  # fmt: skip
        host, ready = to_host(out)  # queued now; read by collect, behind this step alone
        return Draw(pieces, rows, states, out, top_k, host, ready)

    def collect(self, draw: Draw | None) -> Sampled:
        """:meth:`sample`'s second half: the tokens of a queued draw as columns, from its one
        copy back (on CUDA it waits for that copy, not for kernels queued after it).
        NonFiniteLogits names a row whose logits were not finite."""
        if draw is None:
            return Sampled()
        pieces, rows, states, top_k = draw.pieces, draw.rows, draw.states, draw.top_k
        if draw.ready is not None:
            draw.ready.synchronize()
        found = draw.host.tolist()  # ids, logprobs, ranks, flags, tops
        n = len(rows)
        if any(found[3 * n : 4 * n]):
            j = next(j for j in range(n) if found[3 * n + j])
            raise NonFiniteLogits(
                f"the logits of sequence {pieces[rows[j]].seq_id} are not finite: the step "
                "read KV that was never written, was freed and poisoned (a missing "
                "fence?), or was spoiled by an op that failed"
            )
        chosen = [pieces[i] for i in rows]
        tops: list[tuple[tuple[int, float], ...]] = [()] * n
        values = found[4 * n :]
        t = 0  # the next row of the top logprobs
        for j, state in enumerate(states):
            if state.params.logprobs:
                ids = values[2 * t * top_k : (2 * t + 1) * top_k]
                logprobs = values[(2 * t + 1) * top_k : (2 * t + 2) * top_k]
                tops[j] = tuple(
                    (int(i), max(v, LOGPROB_FLOOR)) for i, v in zip(ids, logprobs, strict=True)
                )[: state.params.logprobs]
                t += 1
        return Sampled(
            seq_ids=tuple(p.seq_id for p in chosen),
            positions=tuple(p.start + len(p.token_ids) for p in chosen),
            token_ids=tuple(map(int, found[:n])),
            logprobs=tuple(max(v, LOGPROB_FLOOR) for v in found[n : 2 * n]),
            ranks=tuple(map(int, found[2 * n : 3 * n])),
            tops=tuple(tops),
        )


def processed(
    raw: torch.Tensor,
    params: SamplingParams,
    *,
    position: int,
    num_prompt_tokens: int,
    output_counts: Mapping[int, int],
    seen: Collection[int],
) -> torch.Tensor:
    """The one-row reference of what the batched sampler applies before the draw: the
    logits [vocab] (float64) the token at ``position`` is drawn from, in vLLM's order:
    logit_bias and the min_tokens mask, then the repetition penalty (over ``seen``, the
    prompt's and the output's tokens) and the frequency and presence penalties (over
    ``output_counts``, the output's). A new tensor; ``raw`` is not changed."""
    p = params
    x = raw.clone()
    if p.logit_bias:
        x[[token for token, _ in p.logit_bias]] += torch.tensor(
            [bias for _, bias in p.logit_bias], dtype=x.dtype
        )
    if p.min_tokens and position - num_prompt_tokens < p.min_tokens and p.stop_token_ids:
        x[list(p.stop_token_ids)] = -torch.inf  # the output is too short to stop yet
    if p.repetition_penalty != 1.0 and seen:
        ids = torch.tensor(sorted(seen))
        values = x[ids]
        x[ids] = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
    counted = [(t, c) for t, c in output_counts.items() if c]
    if (p.frequency_penalty or p.presence_penalty) and counted:
        ids = torch.tensor([t for t, _ in counted])
        counts = torch.tensor([c for _, c in counted], dtype=x.dtype)
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
