"""TextStream: the text of a request's tokens, released whole, cut before a stop string."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringfence.actors.serve.text import TextStream
from ringfence.actors.text.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()


def released(stream: TextStream, chunks: list[list[int]]) -> list[str]:
    out = [stream.add(chunk) for chunk in chunks]
    out.append(stream.finish())
    return out


def test_a_character_split_across_tokens_is_released_once_whole():
    ids = list("é!".encode())  # 0xC3 0xA9 0x21: the first token alone is half a character
    stream = TextStream(BYTES.decode)
    assert released(stream, [[ids[0]], [ids[1]], [ids[2]]]) == ["", "é", "!", ""]


def test_an_unfinished_character_at_the_end_is_released_as_a_replacement():
    stream = TextStream(BYTES.decode)
    assert released(stream, [list(b"ab"), [0xC3]]) == ["ab", "", "\ufffd"]


def test_the_output_ends_before_a_stop_string_even_across_chunks():
    stream = TextStream(BYTES.decode, stop=["STOP"])
    out = released(stream, [list(b"hello S"), list(b"TO"), list(b"P and more")])
    assert "".join(out) == "hello "
    assert stream.stopped and stream.text == "hello "


def test_text_that_only_looks_like_a_stop_string_is_released_at_the_end():
    stream = TextStream(BYTES.decode, stop=["STOP"])
    out = released(stream, [list(b"a STO"), list(b"p")])
    assert out[0] == "a "  # "STO" held back: it may begin "STOP"
    assert "".join(out) == "a STOp" and not stream.stopped


def test_the_earliest_of_several_stop_strings_ends_the_output():
    stream = TextStream(BYTES.decode, stop=["xyz", "b"])
    assert "".join(released(stream, [list(b"aaxyzb")])) == "aa"


@given(
    text=st.text(max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
    stop=st.sampled_from([[], ["zz"], ["\n", "é"], ["abc"]]),
)
def test_released_text_is_the_decoded_text_cut_at_the_first_stop(text, cuts, stop):
    ids = list(text.encode())
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    chunks = [ids[a:b] for a, b in itertools.pairwise(bounds)]
    stream = TextStream(BYTES.decode, stop=stop)
    whole = "".join(released(stream, chunks))
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    assert whole == (text[: min(found)] if found else text)


@pytest.mark.parametrize("hold", [["a"], ["abcdef"]])
def test_nothing_is_released_after_the_stop(hold):
    stream = TextStream(BYTES.decode, stop=hold)
    stream.add(list(b"xx" + hold[0].encode()))
    assert stream.add(list(b"more")) == "" and stream.finish() == ""


def test_the_tokens_released_are_those_whose_text_went_out_never_a_stop_strings():
    stream = TextStream(BYTES.decode, stop=["STOP"])
    assert stream.add(list(b"hello S")) == "hell" and stream.tokens_released() == 4
    assert stream.add(list(b"TO")) == "o " and stream.tokens_released() == 6  # "STO" held
    assert stream.add(list(b"P and more")) == "" and stream.stopped
    assert stream.tokens_released() == 6  # "STOP" and what came after it: none


def test_the_tokens_of_a_character_are_released_with_it_whole():
    stream = TextStream(BYTES.decode)
    stream.add([0xC3])  # half of "é"
    assert stream.tokens_released() == 0
    stream.add([0xA9, 0x21])
    assert stream.text == "é!" and stream.tokens_released() == 3


@given(
    text=st.text(max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
    stop=st.sampled_from([[], ["zz"], ["\n", "é"], ["abc"], ["é!"]]),
)
def test_the_tokens_released_make_the_text_released_at_every_point(text, cuts, stop):
    ids = list(text.encode())
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    stream = TextStream(BYTES.decode, stop=stop)
    for a, b in itertools.pairwise(bounds):
        stream.add(ids[a:b])
        made = BYTES.decode(ids[: stream.tokens_released()])
        assert stream.text.startswith(made)  # never a token whose text is still held back
    stream.finish()
    assert BYTES.decode(ids[: stream.tokens_released()]) == stream.text
