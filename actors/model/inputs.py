"""A step's inputs that stay on the device: tokens a step drew that the next one reads
before they are read back (``actors/executors/pending.py``, ``model.launch_ahead``)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class DeviceInputs(NamedTuple):
    """The one input token of some of a step's pieces, where the step before drew it: on the
    device, not read back (their ``token_ids`` hold placeholders). A step launched so never
    waits for the device between the two (``actors/executors/pending.py``)."""

    pieces: tuple[int, ...]  # the pieces, by index in the step
    ids: Tensor  # [len(pieces)] int64 on the step's device: their tokens, in that order
