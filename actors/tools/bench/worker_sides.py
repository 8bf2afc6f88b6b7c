"""The two sides ``ringfence bench worker`` times on the same inputs: the paged path
(``PagedExecutor.step`` over a block-major KV tensor, shuffled block tables) and
transformers' forward with its own cache, both on the model's device, and the logits check
between them. Each timed call returns seconds, to the end of the work it queued on a CUDA
device.

The paged side runs as the Worker runs it unless told otherwise: ``model.attention`` and
``model.cuda_graphs`` at their defaults (:data:`WORKER_PATH`: the Triton kernels and CUDA
graphs on a GPU with Triton, the torch attention elsewhere)."""

from __future__ import annotations

import importlib
import inspect
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ringfence.sched.ops import Piece

if TYPE_CHECKING:
    from ringfence.actors.model.decoder import Model
    from ringfence.actors.model.paged import PagedExecutor

BLOCK_SIZE = 16  # the runtime's default block_size
SEED = 0
# The paged path's options as the Worker takes them from [model] at its defaults.
WORKER_PATH: dict[str, Any] = {"attention": "auto", "cuda_graphs": True}


def _last_logits_only(hf: Any) -> dict[str, int]:
    """The forward keyword that limits the LM head to the last position (named
    ``num_logits_to_keep`` before transformers 4.50), or none when there is none."""
    parameters = inspect.signature(hf.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in parameters:
            return {name: 1}
    return {}


def _executor(
    model: Model, tables: int, positions: int, path: dict[str, Any] | None = None
) -> tuple[PagedExecutor, list[list[int]]]:
    """An executor over a KV tensor for ``tables`` sequences of ``positions`` positions each,
    and their block tables: disjoint, shuffled runs of block ids. ``path``: the executor's
    attention options (:data:`WORKER_PATH` when None)."""
    from ringfence.actors.model.paged import PagedExecutor, make_kv_cache

    per_table = -(-positions // BLOCK_SIZE)
    ids = list(range(tables * per_table))
    random.Random(SEED).shuffle(ids)
    kv = make_kv_cache(model.config, len(ids), BLOCK_SIZE, model.dtype, _device_of(model))
    options = WORKER_PATH if path is None else path
    return PagedExecutor(model, kv, **options), [
        ids[i * per_table : (i + 1) * per_table] for i in range(tables)
    ]


def logits_diff(
    model: Model, hf: Any, token_ids: list[int], path: dict[str, Any] | None = None
) -> tuple[float, bool]:
    """Max abs difference of the paged step's and transformers' logits of one sequence,
    and whether their argmax agree at every position."""
    import torch

    executor, tables = _executor(model, 1, len(token_ids), path)
    executor.kv.fill_(float("nan"))  # unwritten slots must never be read
    with torch.inference_mode():
        ours = executor.step([_piece(token_ids, 0, tables[0])], all_logits=True).all_logits
        ids = torch.tensor([token_ids], device=_device_of(model))
        theirs = hf(input_ids=ids, use_cache=False).logits[0]
    assert ours is not None
    diff = (ours.float() - theirs.float()).abs().max().item()
    return diff, bool(torch.equal(ours.argmax(-1), theirs.argmax(-1)))


def _piece(token_ids: Sequence[int], start: int, table: Sequence[int]) -> Piece:
    """A step's piece that samples nothing: the benchmark reads the logits itself."""
    return Piece(
        seq_id=0, token_ids=tuple(token_ids), start=start, block_table=tuple(table), sample=False
    )


def _device_of(model: Model) -> Any:
    return next(model.parameters()).device


def _timed(run: Callable[[], object], device: Any) -> float:
    """Seconds ``run`` takes, to the end of the work it queued on a CUDA device."""
    import torch

    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


class Sides:
    """Prefill and decode of both sides over the same prompts; each call returns seconds."""

    def __init__(
        self, model: Model, hf: Any, counts: dict[str, int], path: dict[str, Any] | None = None
    ) -> None:
        import torch

        self.torch = torch
        self.model, self.hf, self.n = model, hf, counts
        self.device = _device_of(model)
        gen = random.Random(SEED + 1)
        vocab = model.config.vocab_size
        self.prompts = [
            [gen.randrange(vocab) for _ in range(counts["prefill_tokens"])]
            for _ in range(counts["prefill_seqs"])
        ]
        self.contexts = [
            [gen.randrange(vocab) for _ in range(counts["decode_context"])]
            for _ in range(counts["decode_seqs"])
        ]
        self.prefill_executor, self.prefill_tables = _executor(
            model, counts["prefill_seqs"], counts["prefill_tokens"], path
        )
        self.decode_executor, self.decode_tables = _executor(
            model, counts["decode_seqs"], counts["decode_context"] + counts["decode_steps"], path
        )
        self.keep_last = _last_logits_only(hf)
        # The cache's keyword: ``cache`` since transformers 5.x, ``past_key_values`` before.
        parameters = inspect.signature(hf.forward).parameters
        self.cache_keyword = "cache" if "cache" in parameters else "past_key_values"
        self.paged_tokens: list[list[int]] = []  # the greedy tokens of the last decode
        self._next: tuple[list[int], int] = ([], 0)  # the next decode's tokens and position
        self.hf_tokens: list[list[int]] = []

    def _cache(self) -> Any:
        cache = importlib.import_module("transformers").DynamicCache
        if "config" in inspect.signature(cache).parameters:  # transformers >= 4.56
            return cache(config=self.hf.config)
        return cache()

    def paged_prefill(self) -> float:
        def run() -> None:
            pieces = [
                _piece(p, 0, t) for p, t in zip(self.prompts, self.prefill_tables, strict=True)
            ]
            self.prefill_executor.step(pieces)

        return _timed(run, self.device)

    def hf_prefill(self) -> float:
        def run() -> None:
            ids = self.torch.tensor(self.prompts, device=self.device)
            cache = {self.cache_keyword: self._cache()}
            self.hf(input_ids=ids, use_cache=True, **cache, **self.keep_last)

        return _timed(run, self.device)

    def paged_decode(self) -> float:
        """Seconds of ``decode_steps`` decode steps after an untimed step over the contexts;
        the greedy tokens are kept in ``paged_tokens``."""
        self.paged_tokens = [self.paged_context()]
        return self.paged_steps(self.n["decode_steps"])

    def paged_context(self) -> list[int]:
        """One step over every context (untimed): the first greedy tokens, from which
        :meth:`paged_steps` decodes."""
        executor, tables, context = self.decode_executor, self.decode_tables, self.contexts
        pieces = [_piece(c, 0, t) for c, t in zip(context, tables, strict=True)]
        self._next = (_greedy(executor, pieces), len(context[0]))
        return self._next[0]

    def paged_steps(self, steps: int) -> float:
        """Seconds of ``steps`` decode steps from where the last left off (its tables hold
        ``decode_steps`` positions past the context); the tokens appended to ``paged_tokens``."""
        executor, tables = self.decode_executor, self.decode_tables
        tokens, start = self._next

        def run() -> None:
            nonlocal tokens
            for pos in range(start, start + steps):
                pieces = [_piece([tok], pos, t) for tok, t in zip(tokens, tables, strict=True)]
                tokens = _greedy(executor, pieces)
                self.paged_tokens.append(tokens)

        seconds = _timed(run, self.device)
        self._next = (tokens, start + steps)
        return seconds

    def hf_decode(self) -> float:
        torch = self.torch
        cache = self._cache()
        out = self.hf(
            input_ids=torch.tensor(self.contexts, device=self.device),
            **{self.cache_keyword: cache},
            use_cache=True,
            **self.keep_last,
        )
        tokens: list[int] = out.logits[:, -1].argmax(-1).tolist()
        generated = [tokens]

        def run() -> None:
            nonlocal tokens
            for _ in range(self.n["decode_steps"]):
                ids = torch.tensor(tokens, device=self.device).unsqueeze(1)
                out = self.hf(input_ids=ids, use_cache=True, **{self.cache_keyword: cache})
                tokens = out.logits[:, -1].argmax(-1).tolist()
                generated.append(tokens)

        seconds = _timed(run, self.device)
        self.hf_tokens = generated
        return seconds


def _greedy(executor: Any, pieces: list[Any]) -> list[int]:
    """The greedy next token of every piece of one step."""
    tokens: list[int] = executor.step(pieces).last_logits.argmax(-1).tolist()
    return tokens
