"""Block keys: stable across processes, chained, namespaced, only for full blocks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from ringfence.cache.block_hash import ExtraKey, Fingerprint, block_key, block_keys
from ringfence.cache.ids import BlockHash


def make_fingerprint(**changes: object) -> Fingerprint:
    fields: dict[str, object] = {
        "model_id": "org/model@rev1",
        "dtype": "bfloat16",
        "block_size": 4,
        "kv_layout": "block-major-v1",
        "tp_size": 2,
        "tp_rank": 0,
    }
    fields.update(changes)
    return Fingerprint(**fields)  # type: ignore[arg-type]


NAMESPACE = make_fingerprint().digest()
TOKENS = [5, 17, 2**32 - 1, 0, 9, 9, 9, 9, 100, 200, 300, 400, 7, 8]  # 3 full blocks of 4 + 2

# The digests of NAMESPACE and of two blocks keyed under it, fixed once: a change to
# the encoding silently invalidates every stored block, so it must show up here.
GOLDEN = [
    "4ad253abb07026aee50807ea8093fe8d",
    "aa015e45140cb3cd0ad624d79decdc37",
    "87df91d635dfa5863120d74a9501e0b0",
]
CHILD = """
import sys
from ringfence.cache.block_hash import Fingerprint, block_keys
fp = Fingerprint(model_id="org/model@rev1", dtype="bfloat16", block_size=4,
                 kv_layout="block-major-v1", tp_size=2, tp_rank=0)
keys = block_keys(list(range(8)), 4, namespace=fp.digest(), extra=("lora-1", 3, b"x"))
print(fp.digest().hex(), *(k.hex() for k in keys))
"""


def test_keys_are_equal_in_another_process_with_another_hash_seed():
    outputs = []
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
        )
        outputs.append(proc.stdout.split())
    assert outputs == [GOLDEN, GOLDEN]


def test_keys_match_the_digests_fixed_when_the_encoding_was_written():
    keys = block_keys(list(range(8)), 4, namespace=NAMESPACE, extra=("lora-1", 3, b"x"))
    assert [NAMESPACE.hex(), *(k.hex() for k in keys)] == GOLDEN


def test_the_fingerprint_digest_is_sixteen_bytes_and_the_same_for_equal_fingerprints():
    assert len(NAMESPACE) == 16
    assert make_fingerprint().digest() == NAMESPACE


def test_block_keys_equal_block_key_chained_block_by_block():
    first = block_key(None, TOKENS[0:4], namespace=NAMESPACE)
    second = block_key(first, TOKENS[4:8], namespace=NAMESPACE)
    third = block_key(second, TOKENS[8:12], namespace=NAMESPACE)
    assert block_keys(TOKENS, 4, namespace=NAMESPACE) == [first, second, third]
    assert all(len(k) == 16 for k in (first, second, third))


def test_the_same_tokens_under_a_different_parent_get_a_different_key():
    (_, second) = block_keys(TOKENS[:8], 4, namespace=NAMESPACE)
    other_first = block_key(None, [1, 2, 3, 4], namespace=NAMESPACE)
    assert block_key(other_first, TOKENS[4:8], namespace=NAMESPACE) != second
    assert block_key(None, TOKENS[4:8], namespace=NAMESPACE) != second


def test_sequences_with_an_equal_prefix_share_the_prefix_keys_and_then_differ():
    one = block_keys([*TOKENS[:8], 1, 1, 1, 1], 4, namespace=NAMESPACE)
    two = block_keys([*TOKENS[:8], 1, 1, 1, 2], 4, namespace=NAMESPACE)
    assert one[:2] == two[:2]
    assert one[2] != two[2]


def test_a_difference_in_an_early_block_changes_every_later_key():
    one = block_keys(TOKENS, 4, namespace=NAMESPACE)
    two = block_keys([6, *TOKENS[1:]], 4, namespace=NAMESPACE)
    assert [a != b for a, b in zip(one, two, strict=True)] == [True, True, True]


def test_parent_continues_a_chain_from_where_it_stopped():
    keys = block_keys(TOKENS, 4, namespace=NAMESPACE)
    assert block_keys(TOKENS[4:], 4, namespace=NAMESPACE, parent=keys[0]) == keys[1:]


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "org/model@rev2"},
        {"dtype": "float16"},
        {"block_size": 8},
        {"kv_layout": "layer-major-v1"},
        {"tp_size": 4},
        {"tp_rank": 1},
    ],
    ids=lambda change: next(iter(change)),
)
def test_changing_any_fingerprint_field_changes_the_namespace_and_every_key(change):
    other = make_fingerprint(**change).digest()
    assert other != NAMESPACE
    mine = block_keys(TOKENS, 4, namespace=NAMESPACE)
    theirs = block_keys(TOKENS, 4, namespace=other)
    assert [a != b for a, b in zip(mine, theirs, strict=True)] == [True, True, True]


def test_a_parent_from_another_namespace_gives_another_key():
    parent = block_key(None, TOKENS[:4], namespace=NAMESPACE)
    other = make_fingerprint(tp_rank=1).digest()
    assert block_key(parent, TOKENS[4:8], namespace=NAMESPACE) != block_key(
        parent, TOKENS[4:8], namespace=other
    )


def test_a_partial_tail_gets_no_key():
    assert len(block_keys(TOKENS, 4, namespace=NAMESPACE)) == 3
    assert block_keys(TOKENS[:3], 4, namespace=NAMESPACE) == []
    assert block_keys([], 4, namespace=NAMESPACE) == []
    assert block_keys(TOKENS[:12], 4, namespace=NAMESPACE) == block_keys(
        TOKENS, 4, namespace=NAMESPACE
    )


def test_the_token_list_is_not_mutated():
    tokens = list(TOKENS)
    block_keys(tokens, 4, namespace=NAMESPACE, extra=("a",))
    block_key(None, tokens[:4], namespace=NAMESPACE)
    assert tokens == TOKENS


def test_any_sequence_of_ints_keys_like_a_list():
    expected = block_keys(list(range(12)), 4, namespace=NAMESPACE)
    assert block_keys(tuple(range(12)), 4, namespace=NAMESPACE) == expected
    assert block_keys(range(12), 4, namespace=NAMESPACE) == expected


EXTRAS: list[tuple[ExtraKey, ...]] = [
    ("lora-1",),
    ("lora-2",),
    (1,),
    ("1",),
    (b"1",),
    ((1,),),
    (1, 2),
    ((1, 2),),
    ("a", "b"),
    ("ab",),
    (("a", "b"),),
]


@pytest.mark.parametrize("extra", EXTRAS)
def test_extra_keys_change_the_key_and_both_functions_agree_on_it(extra):
    plain = block_key(None, TOKENS[:4], namespace=NAMESPACE)
    keyed = block_key(None, TOKENS[:4], extra, namespace=NAMESPACE)
    assert keyed != plain
    assert keyed == block_keys(TOKENS[:4], 4, namespace=NAMESPACE, extra=extra)[0]


def test_distinct_extra_keys_give_distinct_keys():
    keys = {block_key(None, TOKENS[:4], extra, namespace=NAMESPACE) for extra in EXTRAS}
    assert len(keys) == len(EXTRAS)


def test_a_salt_changes_the_first_key_and_so_every_later_one():
    plain = block_keys(TOKENS, 4, namespace=NAMESPACE)
    salted = block_keys(TOKENS, 4, namespace=NAMESPACE, salt="tenant-a")
    assert len(salted) == len(plain) == 3
    assert not set(salted) & set(plain)
    assert salted == block_keys(TOKENS, 4, namespace=NAMESPACE, salt="tenant-a")
    assert not set(salted) & set(block_keys(TOKENS, 4, namespace=NAMESPACE, salt="tenant-b"))
    assert block_keys(TOKENS, 4, namespace=NAMESPACE, salt="") == plain


def test_the_salt_joins_the_first_block_only_as_vllms_cache_salt_does():
    salted = block_keys(TOKENS, 4, namespace=NAMESPACE, salt="s")
    first = block_key(None, TOKENS[:4], ("x",), namespace=NAMESPACE, salt="s")
    assert first == block_keys(TOKENS[:4], 4, namespace=NAMESPACE, extra=("x",), salt="s")[0]
    assert salted[0] == block_key(None, TOKENS[:4], (("cache_salt", "s"),), namespace=NAMESPACE)
    # Later blocks chain from the salted first key, unsalted themselves: a chain continued
    # from its parent with or without the salt gets the same keys.
    assert salted[1:] == block_keys(TOKENS[4:], 4, namespace=NAMESPACE, parent=salted[0])
    assert salted[1:] == block_keys(TOKENS[4:], 4, namespace=NAMESPACE, parent=salted[0], salt="s")
    with pytest.raises(TypeError, match="cache salt is a str"):
        block_keys(TOKENS, 4, namespace=NAMESPACE, salt=b"s")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 2**32, 2**64])
def test_a_token_id_outside_32_bits_raises(bad):
    with pytest.raises(ValueError, match=f"token id {bad} "):
        block_keys([1, 2, bad, 3], 4, namespace=NAMESPACE)
    with pytest.raises(ValueError, match=f"token id {bad} "):
        block_key(None, [bad], namespace=NAMESPACE)


def test_malformed_arguments_raise():
    with pytest.raises(ValueError, match="block_size"):
        block_keys(TOKENS, 0, namespace=NAMESPACE)
    with pytest.raises(ValueError, match="namespace must be 16 bytes"):
        block_keys(TOKENS, 4, namespace=b"short")
    with pytest.raises(ValueError, match="parent key must be 16 bytes"):
        block_key(BlockHash(b"short"), TOKENS[:4], namespace=NAMESPACE)
    with pytest.raises(ValueError, match="at least one token"):
        block_key(None, [], namespace=NAMESPACE)
    with pytest.raises(TypeError, match="not bool"):
        block_key(None, TOKENS[:4], (True,), namespace=NAMESPACE)
    with pytest.raises(TypeError, match="not float"):
        block_key(None, TOKENS[:4], (1.5,), namespace=NAMESPACE)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "field"),
    [({"block_size": 0}, "block_size"), ({"tp_size": 0}, "tp_size"), ({"tp_rank": 2}, "tp_rank")],
)
def test_a_fingerprint_out_of_range_names_its_field(change, field):
    with pytest.raises(ValueError, match=field):
        make_fingerprint(**change)


def test_a_fingerprint_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_fingerprint().tp_rank = 1  # type: ignore[misc]
