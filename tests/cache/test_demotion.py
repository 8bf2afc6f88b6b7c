"""Demotion policies: which blocks are copied down when they fill or are evicted."""

from __future__ import annotations

from typing import get_args

import pytest

from ringfence.cache.config import Eviction
from ringfence.cache.demotion import POLICIES, CopyDown, on_evicted, on_filled
from ringfence.cache.ids import BlockHash, BlockId

BLOCKS = [(BlockId(3), BlockHash(b"a" * 16)), (BlockId(1), BlockHash(b"b" * 16))]


def nothing_below(key: BlockHash) -> bool:
    return False


def test_the_policies_are_the_ones_the_config_accepts():
    assert get_args(Eviction) == POLICIES


@pytest.mark.parametrize(
    ("policy", "filled", "evicted"),
    [
        ("write_back", [], ["evicted", "evicted"]),
        ("write_through", ["filled", "filled"], []),
        ("none", [], []),
    ],
)
def test_each_policy_copies_down_on_its_own_event_only(policy, filled, evicted):
    copies = on_filled(policy, "device->host", BLOCKS, nothing_below)
    assert [c.reason for c in copies] == filled
    copies = on_evicted(policy, "device->host", BLOCKS, nothing_below)
    assert [c.reason for c in copies] == evicted


def test_copies_keep_the_given_order_and_name_block_key_and_boundary():
    assert on_evicted("write_back", "host->storage", BLOCKS, nothing_below) == [
        CopyDown("host->storage", BlockId(3), BlockHash(b"a" * 16), "evicted"),
        CopyDown("host->storage", BlockId(1), BlockHash(b"b" * 16), "evicted"),
    ]


def test_a_key_the_lower_tier_already_holds_is_not_copied_again():
    below = {BlockHash(b"a" * 16)}
    copies = on_evicted("write_back", "device->host", BLOCKS, below.__contains__)
    assert [c.block_id for c in copies] == [BlockId(1)]
    copies = on_filled("write_through", "device->host", BLOCKS, below.__contains__)
    assert [c.block_id for c in copies] == [BlockId(1)]


def test_an_unknown_policy_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"write_back, write_through, none, got 'lru'"):
        on_evicted("lru", "device->host", BLOCKS, nothing_below)
