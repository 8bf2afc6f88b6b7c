"""The errors of a workload run grouped by kind, each with the setting that lets it run.

A workload request that ends in error keeps its message in ``outputs.jsonl``; the
summary (``summary.json``'s ``error_kinds``, and the lines ``ringfence launch`` prints
under its table) says what went wrong once per kind, not once per request. A refusal of
the scheduler (``Scheduler.add``: a request that can never run) is grouped by what it
exceeded, whatever its numbers, shown by its largest example and named with the setting
to change; any other error is grouped by its text with the numbers taken out, and shown
by its first example.

The kinds are read from the refusals' messages (the scheduler's wording, held here as
patterns; ``tests/actors/engine/test_run_errors.py`` checks each against the scheduler's
own refusal, so a change of wording fails there). Pure and standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class _Record(Protocol):
    """What a grouping reads of a request's record (``summary.RequestRecord``)."""

    @property
    def id(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def error(self) -> str: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class RefusalKind:
    """One way the scheduler refuses a request that can never run."""

    kind: str  # its name in summary.json
    pattern: re.Pattern[str]  # the refusal's text past "request 'ID': "; named groups of digits
    size: str  # the group that orders examples: the largest one is shown
    text: str  # str.format of the groups (ints) and the record's ``prompt`` tokens
    setting: str  # what to change so that such a request runs


REFUSALS: tuple[RefusalKind, ...] = (
    RefusalKind(
        kind="device_pool",
        pattern=re.compile(
            r"(?P<tokens>\d+) tokens need (?P<blocks>\d+) blocks, "
            r"the device pool has (?P<pool>\d+)"
        ),
        size="tokens",
        text="a prompt of {prompt:,} tokens plus max_tokens {max_tokens:,} needs {blocks:,} "
        "blocks, the device pool has {pool:,}",
        setting="cache.device_blocks",
    ),
    RefusalKind(
        kind="max_model_len",
        pattern=re.compile(
            r"prompt \((?P<prompt>\d+) tokens\) plus max_tokens \((?P<max_tokens>\d+)\) is "
            r"(?P<tokens>\d+) tokens, more than max_model_len (?P<limit>\d+) \(.*\)"
        ),
        size="tokens",
        text="a prompt of {prompt:,} tokens plus max_tokens {max_tokens:,} is {tokens:,} "
        "tokens, more than max_model_len {limit:,}",
        setting="sched.max_model_len",
    ),
    RefusalKind(
        kind="vocabulary",
        pattern=re.compile(
            r"prompt token (?P<token>\d+) is outside the model's vocabulary of (?P<vocab>\d+)"
        ),
        size="token",
        text="prompt token {token:,} is outside the model's vocabulary of {vocab:,}",
        setting="model.path: the model the workload's token ids were made for",
    ),
)
_NUMBER = re.compile(r"\d+")


@dataclass(slots=True)
class _Group:
    refused: bool
    setting: str
    count: int = 0
    size: int = -1  # of the example shown (a refusal's largest)
    text: str = ""
    texts: int = 0  # distinct texts seen


def _reason(record: _Record) -> str:
    """The record's error without the scheduler's ``request 'ID': `` prefix."""
    return record.error.removeprefix(f"request {record.id!r}: ")


def _refusal(reason: str, prompt: int) -> tuple[RefusalKind, int, str] | None:
    """The kind of refusal ``reason`` is, its size and its text; None for another error."""
    for refusal in REFUSALS:
        if match := refusal.pattern.fullmatch(reason):
            groups = {name: int(value) for name, value in match.groupdict().items()}
            groups.setdefault("prompt", prompt)
            groups.setdefault("max_tokens", groups.get("tokens", prompt) - prompt)
            return refusal, groups[refusal.size], refusal.text.format(**groups)
    return None


def group_errors(records: Iterable[_Record]) -> list[dict[str, Any]]:
    """The records' errors by kind, most requests first (then by kind): for each its
    ``kind``, ``requests``, whether they were ``refused`` (never run) or failed while
    running, the ``text`` of its example and the ``setting`` to change ("" when none)."""
    groups: dict[str, _Group] = {}
    seen: dict[str, set[str]] = {}
    for record in records:
        if not record.error:
            continue
        reason = _reason(record)
        found = _refusal(reason, record.prompt_tokens)
        if found is not None:
            refusal, size, text = found
            key = refusal.kind
            group = groups.setdefault(key, _Group(refused=True, setting=refusal.setting))
        else:
            size, text = -1, reason
            key = _NUMBER.sub("N", reason)  # one kind whatever its numbers
            group = groups.setdefault(key, _Group(refused=False, setting=""))
        group.count += 1
        seen.setdefault(key, set()).add(text)
        if size > group.size or not group.text:
            group.size, group.text = size, text
        group.texts = len(seen[key])
    ordered = sorted(groups.items(), key=lambda item: (-item[1].count, item[0]))
    return [
        {
            "kind": kind,
            "requests": group.count,
            "refused": group.refused,
            "examples": group.texts,
            "text": group.text,
            "setting": group.setting,
        }
        for kind, group in ordered
    ]


def error_lines(kinds: object) -> list[str]:
    """One terminal line per kind of :func:`group_errors` (as read back from
    ``summary.json``): ``8 requests refused, the largest: a prompt of ... (the setting)``.
    Entries that are not such mappings are skipped."""
    lines = []
    for entry in kinds if isinstance(kinds, Sequence) else ():
        if not isinstance(entry, Mapping):
            continue
        count, refused = entry.get("requests"), bool(entry.get("refused"))
        if not isinstance(count, int):
            continue
        head = f"{count:,} request{'' if count == 1 else 's'} {'refused' if refused else 'failed'}"
        if entry.get("examples", 1) != 1:  # texts that differ: which one is shown
            head += ", the largest" if refused else ", the first"
        setting = entry.get("setting")
        tail = f" ({setting})" if setting else ""
        lines.append(f"{head}: {entry.get('text', '')}{tail}")
    return lines
