"""Value checks shared by the request and its sampling parameters: each raises
:class:`RequestError` naming the field."""

from __future__ import annotations

import math
from typing import TypeGuard

from ringfence.shm.errors import RingfenceError


class RequestError(RingfenceError, ValueError):
    """A request, its sampling parameters or a state change is invalid.

    ``field`` names the offending field when one is to blame, so a caller that
    parsed the value from a file can point at the key.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass, but True is never a meaningful token id or count.
    return isinstance(value, int) and not isinstance(value, bool)


_INT = {int}


def check_token_ids(field: str, value: object, *, allow_empty: bool = True) -> tuple[int, ...]:
    """A tuple copy of ``value``, a list or tuple of non-negative ints; RequestError otherwise.

    The copy keeps the caller's list out of the request: token lists are copied,
    never shared and mutated (docs/design.md, "Blocks and tiers").
    """
    if not isinstance(value, list | tuple):
        raise RequestError(
            f"{field} must be a list of token ids, got {type(value).__name__}", field=field
        )
    # Every token a plain int and none negative, checked in C (a 512-token prompt in a
    # third of the loop's time); the loop only finds what is wrong, or allows an int
    # subclass (not a bool).
    if value and set(map(type, value)) == _INT and min(value) >= 0:
        return tuple(value)
    for position, token in enumerate(value):
        if not is_int(token) or token < 0:
            raise RequestError(
                f"{field}[{position}] must be a non-negative int token id, got {token!r}",
                field=field,
            )
    if not value and not allow_empty:
        raise RequestError(f"{field} must not be empty", field=field)
    return tuple(value)


def check_number(field: str, value: object, *, minimum: float = 0.0) -> float:
    """``value`` as a float if a finite int or float >= ``minimum``; RequestError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{field} must be a number, got {value!r}", field=field)
    if not math.isfinite(value) or value < minimum:
        raise RequestError(f"{field} must be finite and >= {minimum:g}, got {value!r}", field=field)
    return float(value)


MAX_SALT_CHARS = 1024  # a cache salt's length limit (a salt is an identity, not a payload)


def check_salt(value: object) -> str:
    """A cache salt: a str of at most :data:`MAX_SALT_CHARS` characters; RequestError otherwise."""
    if not isinstance(value, str):
        raise RequestError(f"cache_salt must be a string, got {value!r}", field="cache_salt")
    if len(value) > MAX_SALT_CHARS:
        raise RequestError(
            f"cache_salt has {len(value)} characters, at most {MAX_SALT_CHARS}", field="cache_salt"
        )
    return value
