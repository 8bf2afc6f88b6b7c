"""The grammar backend's wrapper on the byte tokenizer: a matcher allows exactly the tokens
its grammar allows, the mask is applied to a row of logits as it says, bad specs are
refused with the backend's words, and compiled grammars are kept by spec."""

from __future__ import annotations

import pytest
import torch

from ringfence.actors.executors.constraints import Constraints, masked
from ringfence.actors.text.grammars import GrammarError, Grammars, model_grammars, problem
from ringfence.actors.text.tokenizer import EOS, VOCAB_SIZE
from ringfence.sched.checks import RequestError
from ringfence.sched.structured import StructuredOutput


def allowed(grammars: Grammars, matcher) -> set[int]:
    """The token ids the matcher's mask allows, read through the Worker's own path."""
    job = Constraints(grammars).start([(0, matcher)])
    assert job is not None
    row = job.apply(0, torch.zeros(VOCAB_SIZE, dtype=torch.float64))
    return set(torch.nonzero(row == 0).flatten().tolist())


def walk(grammars: Grammars, spec: StructuredOutput, text: str) -> list[set[int]]:
    """The allowed sets before each byte of ``text`` and after the last."""
    matcher = grammars.matcher(spec)
    sets = []
    for byte in text.encode():
        sets.append(allowed(grammars, matcher))
        assert matcher.consume_token(byte), matcher.get_error()
    sets.append(allowed(grammars, matcher))
    return sets


def test_a_choice_allows_exactly_the_next_bytes_of_its_strings_then_only_the_end():
    grammars = model_grammars("", VOCAB_SIZE)
    spec = StructuredOutput.choice(["yes", "no", "yeah"])
    sets = walk(grammars, spec, "yes")
    assert sets == [{ord("y"), ord("n")}, {ord("e")}, {ord("s"), ord("a")}, {EOS}]


def test_a_regex_allows_digits_while_it_may_go_on_and_the_end_once_it_may_stop():
    grammars = model_grammars("", VOCAB_SIZE)
    digits = {ord(c) for c in "0123456789"}
    sets = walk(grammars, StructuredOutput(kind="regex", source="[0-9]{1,2}-x"), "42-x")
    assert sets == [digits, digits | {ord("-")}, {ord("-")}, {ord("x")}, {EOS}]


def test_a_json_schema_opens_with_a_brace_and_names_its_property():
    grammars = model_grammars("", VOCAB_SIZE)
    spec = StructuredOutput.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
         "additionalProperties": False}
    )  # fmt: skip
    sets = walk(grammars, spec, '{"a":7}')
    assert ord("{") in sets[0] and sets[0] <= {ord(c) for c in "{ \t\n\r"}
    assert sets[2] == {ord("a")}
    assert sets[-1] == {EOS}


def test_a_lark_grammar_and_gbnf_compile_to_the_same_language():
    grammars = model_grammars("", VOCAB_SIZE)
    lark = StructuredOutput(kind="grammar", source='start: "a" ("b" | "c")')
    gbnf = StructuredOutput(kind="grammar", source='root ::= "a" ("b" | "c")')
    for spec in (lark, gbnf):
        assert walk(grammars, spec, "ab") == [{ord("a")}, {ord("b"), ord("c")}, {EOS}]


def test_a_token_the_grammar_forbids_leaves_the_matcher_allowing_only_the_end():
    grammars = model_grammars("", VOCAB_SIZE)
    matcher = grammars.matcher(StructuredOutput.choice(["yes"]))
    assert not matcher.consume_token(ord("x"))
    assert allowed(grammars, matcher) == {EOS}


def test_masked_logits_keep_the_allowed_values_and_forbid_the_rest_and_the_tail():
    words = torch.tensor([0b101, -(1 << 31)], dtype=torch.int32)  # tokens 0, 2 and 63 (sign)
    logits = torch.arange(70, dtype=torch.float64)
    out = masked(logits, words)
    assert torch.nonzero(torch.isfinite(out)).flatten().tolist() == [0, 2, 63]
    assert out[2] == 2.0 and out[63] == 63.0
    assert logits[1] == 1.0, "the row given is not changed"


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        (StructuredOutput(kind="json", source='{"type": "objekt"}'), "objekt"),
        (StructuredOutput(kind="regex", source="[a-"), "unclosed character class"),
        (StructuredOutput(kind="grammar", source="start: foo"), 'unknown name: "foo"'),
    ],
)
def test_a_spec_that_does_not_compile_is_refused_with_the_backends_words(spec, said):
    assert said in problem(spec)
    with pytest.raises(GrammarError, match=said):
        model_grammars("", VOCAB_SIZE).matcher(spec)


def test_a_compiled_grammar_is_kept_by_spec_and_each_matcher_is_its_own():
    grammars = model_grammars("", VOCAB_SIZE)
    one = grammars.matcher(StructuredOutput.choice(["ab", "ac"]))
    assert one.consume_token(ord("a"))
    two = grammars.matcher(StructuredOutput.choice(["ab", "ac"]))  # equal spec: the cached one
    assert len(grammars._compiled) == 1
    assert allowed(grammars, two) == {ord("a")}
    assert allowed(grammars, one) == {ord("b"), ord("c")}


@pytest.mark.parametrize(
    "value",
    [
        {"kind": "yaml", "source": "a: 1"},
        {"kind": "json", "source": "{"},
        {"kind": "json", "source": "[1]"},
        {"kind": "choice", "source": "[]"},
        {"kind": "choice", "source": '["a", 1]'},
        {"kind": "regex", "source": ""},
        {"kind": "regex"},
        "[0-9]",
    ],
)
def test_a_malformed_spec_is_a_request_error_naming_structured(value):
    with pytest.raises(RequestError) as caught:
        StructuredOutput.of(value)
    assert caught.value.field == "structured"
