"""The identifiers the cache deals in: block ids, block keys and op sequence numbers."""

from __future__ import annotations

from typing import NewType

BlockId = NewType("BlockId", int)  # index of a block in one pool (device or host), 0-based
BlockHash = NewType("BlockHash", bytes)  # a full block's chained key: a 16-byte digest
Seq = NewType("Seq", int)  # an op's number in its lane (step s, swap t, store u): 1, 2, ...
