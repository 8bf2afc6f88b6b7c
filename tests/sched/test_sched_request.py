"""Requests: sampling-parameter validation, the lifecycle table, output and finish reasons."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ringfence.sched.checks import check_token_ids
from ringfence.sched.request import (
    TRANSITIONS,
    FinishReason,
    Request,
    RequestError,
    RequestState,
    SamplingParams,
)
from ringfence.shm.errors import RingfenceError

ROOT = Path(__file__).resolve().parents[2]
S = RequestState


def make_request(
    prompt: tuple[int, ...] = (1, 2, 3, 4),
    *,
    request_id: str = "r1",
    max_tokens: int = 16,
    stop_token_ids: tuple[int, ...] = (),
    state: RequestState = S.WAITING,
) -> Request:
    """A request with the given prompt, moved to ``state`` along legal transitions."""
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids)
    request = Request(request_id=request_id, prompt_token_ids=prompt, params=params)
    path = {
        S.WAITING: [],
        S.WAITING_FOR_PREFETCH: [S.WAITING_FOR_PREFETCH],
        S.RUNNING: [S.RUNNING],
        S.PREEMPTED: [S.RUNNING, S.PREEMPTED],
        S.FINISHED: [S.RUNNING, S.FINISHED],
        S.ABORTED: [S.ABORTED],
    }[state]
    for step in path:
        request.transition(step)
    return request


# Sampling parameters


def test_sampling_params_default_to_16_greedy_tokens_with_seed_0_and_no_stop_tokens():
    assert SamplingParams() == SamplingParams(
        max_tokens=16, temperature=0.0, top_p=1.0, seed=0, stop_token_ids=()
    )


def test_sampling_params_are_frozen_and_keyword_only():
    params = SamplingParams(max_tokens=3)
    with pytest.raises(AttributeError):
        params.max_tokens = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        SamplingParams(3)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, r"^max_tokens must be >= 1, got 0$"),
        ("max_tokens", True, r"^max_tokens must be an int, got True$"),
        ("max_tokens", 2.0, r"^max_tokens must be an int, got 2\.0$"),
        ("temperature", -0.5, r"^temperature must be finite and >= 0, got -0\.5$"),
        ("temperature", math.inf, r"^temperature must be finite and >= 0, got inf$"),
        ("temperature", math.nan, r"^temperature must be finite and >= 0, got nan$"),
        ("temperature", "hot", r"^temperature must be a number, got 'hot'$"),
        ("temperature", False, r"^temperature must be a number, got False$"),
        ("top_p", 0, r"^top_p must be in \(0, 1\], got 0$"),
        ("top_p", -0.5, r"^top_p must be in \(0, 1\], got -0\.5$"),
        ("top_p", 1.01, r"^top_p must be in \(0, 1\], got 1\.01$"),
        ("top_p", math.nan, r"^top_p must be in \(0, 1\], got nan$"),
        ("top_p", math.inf, r"^top_p must be in \(0, 1\], got inf$"),
        ("top_p", "0.9", r"^top_p must be a number, got '0\.9'$"),
        ("top_p", True, r"^top_p must be a number, got True$"),
        ("seed", -1, r"^seed must be >= 0, got -1$"),
        ("seed", None, r"^seed must be an int, got None$"),
        ("stop_token_ids", (1, -2), r"^stop_token_ids\[1\] must be a non-negative int .* -2$"),
        ("stop_token_ids", (True,), r"^stop_token_ids\[0\] must be a non-negative int .* True$"),
        ("stop_token_ids", 7, r"^stop_token_ids must be a list of token ids, got int$"),
    ],
)
def test_an_invalid_sampling_param_is_a_request_error_naming_the_field_and_value(
    field, value, message
):
    with pytest.raises(RequestError, match=message) as caught:
        SamplingParams(**{field: value})
    assert caught.value.field == field
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, RingfenceError)


def test_an_integer_temperature_is_accepted_as_a_float():
    assert SamplingParams(temperature=1).temperature == 1.0
    assert isinstance(SamplingParams(temperature=1).temperature, float)


def test_a_top_p_in_zero_to_one_is_kept_as_a_float():
    assert SamplingParams(top_p=1).top_p == 1.0 and isinstance(SamplingParams(top_p=1).top_p, float)
    assert SamplingParams(top_p=1e-9).top_p == 1e-9


def test_stop_token_ids_given_as_a_list_are_copied_into_a_tuple():
    stops = [5, 6]
    params = SamplingParams(stop_token_ids=stops)  # type: ignore[arg-type]
    stops.append(7)
    assert params.stop_token_ids == (5, 6)


# Construction


def test_a_new_request_waits_with_nothing_computed_cached_or_output():
    request = Request(request_id="a", prompt_token_ids=[7, 8, 9], arrival=1.5)
    assert request.state is S.WAITING
    assert request.prompt_token_ids == (7, 8, 9)
    assert request.params == SamplingParams()
    assert request.arrival == 1.5
    assert request.output_token_ids == []
    assert request.num_computed_tokens == 0
    assert request.cached_tokens == {"device": 0, "host": 0, "storage": 0}
    assert request.finish_reason is None
    assert (request.num_tokens, request.remaining_prefill) == (3, 3)
    assert repr(request) == "Request('a', state=waiting, prompt=3, output=0, computed=0)"


def test_the_prompt_is_copied_so_the_callers_list_can_change_without_effect():
    prompt = [1, 2, 3]
    request = Request(request_id="a", prompt_token_ids=prompt)
    prompt.append(4)
    assert request.prompt_token_ids == (1, 2, 3)


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"request_id": ""}, "request_id", r"^request_id must be a non-empty string, got ''$"),
        ({"request_id": 5}, "request_id", r"^request_id must be a non-empty string, got 5$"),
        ({"prompt_token_ids": ()}, "prompt_token_ids", r"^prompt_token_ids must not be empty$"),
        ({"prompt_token_ids": (1, -1)}, "prompt_token_ids", r"^prompt_token_ids\[1\] must be"),
        ({"arrival": -0.1}, "arrival", r"^arrival must be finite and >= 0, got -0\.1$"),
        ({"arrival": math.nan}, "arrival", r"^arrival must be finite and >= 0, got nan$"),
    ],
)
def test_an_invalid_request_is_a_request_error_naming_the_field(kwargs, field, message):
    args = {"request_id": "r", "prompt_token_ids": (1,), **kwargs}
    with pytest.raises(RequestError, match=message) as caught:
        Request(**args)
    assert caught.value.field == field


# Lifecycle


ALLOWED = sorted((a, b) for a, nexts in TRANSITIONS.items() for b in nexts)
FORBIDDEN = sorted((a, b) for a, b in itertools.product(S, S) if b not in TRANSITIONS[a])


def test_the_transition_table_covers_every_state_and_only_finished_and_aborted_are_terminal():
    assert set(TRANSITIONS) == set(S)
    assert {s for s, nexts in TRANSITIONS.items() if not nexts} == {S.FINISHED, S.ABORTED}
    assert TRANSITIONS[S.RUNNING] == {S.PREEMPTED, S.FINISHED, S.ABORTED}


@pytest.mark.parametrize(("source", "target"), ALLOWED)
def test_every_allowed_transition_moves_the_request_to_the_target_state(source, target):
    request = make_request(state=source)
    request.transition(target)
    assert request.state is target


@pytest.mark.parametrize(("source", "target"), FORBIDDEN)
def test_every_other_transition_raises_naming_both_states_and_the_request(source, target):
    request = make_request(state=source, request_id="req-9")
    expected = f"^request 'req-9': illegal transition {source.value} -> {target.value}$"
    with pytest.raises(RequestError, match=expected):
        request.transition(target)
    assert request.state is source


def test_there_are_as_many_forbidden_transitions_as_pairs_minus_allowed_ones():
    assert len(ALLOWED) + len(FORBIDDEN) == len(S) ** 2
    assert (S.WAITING, S.WAITING) in FORBIDDEN  # no self loops
    assert (S.PREEMPTED, S.WAITING) in FORBIDDEN


def test_is_finished_holds_exactly_for_the_terminal_states():
    assert [s for s in S if make_request(state=s).is_finished] == [S.FINISHED, S.ABORTED]


# Output


def test_append_output_finishes_with_stop_when_a_stop_token_is_sampled():
    request = make_request(stop_token_ids=(0, 9), state=S.RUNNING)
    assert request.append_output(5) is None
    assert (request.state, request.finish_reason) == (S.RUNNING, None)
    assert request.append_output(9) is FinishReason.STOP
    assert (request.state, request.finish_reason) == (S.FINISHED, FinishReason.STOP)
    assert request.output_token_ids == [5, 9]  # the stop token is kept


def test_append_output_finishes_with_length_at_max_tokens():
    request = make_request(max_tokens=3, state=S.RUNNING)
    assert [request.append_output(t) for t in (4, 5, 6)] == [None, None, FinishReason.LENGTH]
    assert (request.state, request.finish_reason) == (S.FINISHED, FinishReason.LENGTH)
    assert request.num_output_tokens == 3


def test_a_stop_token_at_max_tokens_finishes_with_stop():
    request = make_request(max_tokens=1, stop_token_ids=(2,), state=S.RUNNING)
    assert request.append_output(2) is FinishReason.STOP


@pytest.mark.parametrize("state", [s for s in S if s is not S.RUNNING])
def test_append_output_outside_running_raises_and_appends_nothing(state):
    request = make_request(state=state)
    with pytest.raises(
        RequestError, match=f"^request 'r1': cannot append output in state {state}$"
    ):
        request.append_output(1)
    assert request.output_token_ids == []


@pytest.mark.parametrize("token", [-1, True, 1.0])
def test_append_output_rejects_a_token_that_is_not_a_non_negative_int(token):
    request = make_request(state=S.RUNNING)
    with pytest.raises(RequestError, match="token id must be a non-negative int"):
        request.append_output(token)
    assert request.output_token_ids == []


def test_all_token_ids_is_prompt_then_output_as_a_copy():
    request = make_request((1, 2), state=S.RUNNING)
    request.append_output(3)
    snapshot = request.all_token_ids
    assert snapshot == (1, 2, 3)
    request.append_output(4)
    assert snapshot == (1, 2, 3)
    assert request.all_token_ids == (1, 2, 3, 4)
    assert request.num_tokens == 4


def test_remaining_prefill_excludes_the_newest_output_which_is_the_next_decode_input():
    request = make_request((1, 2, 3, 4), state=S.RUNNING)
    request.num_computed_tokens = 3
    assert request.remaining_prefill == 1
    request.num_computed_tokens = 4
    request.append_output(5)
    request.append_output(6)
    assert request.remaining_prefill == 1  # token 5 has no KV yet; 6 is the decode input
    request.num_computed_tokens = 5
    assert request.remaining_prefill == 0
    request.num_computed_tokens = 0  # a recompute preemption prefills the outputs too
    assert request.remaining_prefill == 5


@pytest.mark.parametrize("value", [-1, 5, True])
def test_num_computed_tokens_outside_0_to_num_tokens_raises_and_keeps_the_old_value(value):
    request = make_request((1, 2, 3, 4))
    request.num_computed_tokens = 2
    with pytest.raises(RequestError, match=r"num_computed_tokens must lie in 0\.\.4"):
        request.num_computed_tokens = value
    assert request.num_computed_tokens == 2


def test_one_more_computed_token_counts_up_to_num_tokens_and_no_further():
    request = make_request((1, 2, 3, 4))
    request.num_computed_tokens = 2
    assert request.num_uncomputed_tokens == 2
    request.computed_one()
    request.computed_one()
    assert (request.num_computed_tokens, request.num_uncomputed_tokens) == (4, 0)
    with pytest.raises(RequestError, match=r"num_computed_tokens must lie in 0\.\.4, got 5"):
        request.computed_one()
    assert request.num_computed_tokens == 4


@pytest.mark.parametrize("state", [S.WAITING, S.WAITING_FOR_PREFETCH, S.RUNNING, S.PREEMPTED])
def test_abort_from_a_live_state_sets_aborted_and_the_abort_reason(state):
    request = make_request(state=state)
    request.abort()
    assert (request.state, request.finish_reason) == (S.ABORTED, FinishReason.ABORT)


@pytest.mark.parametrize("state", [S.FINISHED, S.ABORTED])
def test_abort_of_a_finished_or_aborted_request_raises_and_keeps_its_reason(state):
    request = make_request(state=state)
    before = request.finish_reason
    with pytest.raises(RequestError, match="illegal transition"):
        request.abort()
    assert (request.state, request.finish_reason) == (state, before)


def test_states_and_finish_reasons_are_the_strings_the_logs_and_outputs_use():
    assert [r.value for r in FinishReason] == ["stop", "length", "abort"]
    assert [s.value for s in S] == [
        "waiting",
        "waiting_for_prefetch",
        "running",
        "preempted",
        "finished",
        "aborted",
    ]
    assert f"{S.WAITING_FOR_PREFETCH}" == "waiting_for_prefetch"  # StrEnum formats as its value


# Dependency direction


def test_importing_ringfence_sched_pulls_in_no_torch_orjson_ipc_or_runtime():
    code = (
        "import sys, ringfence.sched.request, ringfence.sched.workload, ringfence.sched.synthetic\n"
        "print(' '.join(sorted(sys.modules)))"
    )
    # Run from the checkout's parent so the folder sched/ cannot shadow anything.
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    loaded = set(proc.stdout.split())
    tops = {name.split(".")[0] for name in loaded}
    assert tops & {"torch", "orjson", "posix_ipc", "multiprocess", "structlog", "numpy"} == set()
    assert not {m for m in loaded if m.startswith(("ringfence.runtime", "ringfence.actors"))}
    assert {"ringfence.sched.workload", "ringfence.sched.synthetic"} <= loaded


class TokenKind(int):
    """An int subclass (as an IntEnum member is): a token id, unlike a bool."""


@pytest.mark.parametrize(
    ("tokens", "error"),
    [
        ([5, 0, 7], None),
        ((5, TokenKind(3)), None),  # the checked-in-C way refuses it; the loop allows it
        ([], None),
        ([5, -1, 7], r"^p\[1\] must be a non-negative int token id, got -1$"),
        ([5, 6, True], r"^p\[2\] must be a non-negative int token id, got True$"),
        ([5.0, 6], r"^p\[0\] must be a non-negative int token id, got 5\.0$"),
        ([5, "6"], r"^p\[1\] must be a non-negative int token id, got '6'$"),
        ([2**70, -1], r"^p\[1\] must be a non-negative int token id, got -1$"),
        ("56", r"^p must be a list of token ids, got str$"),
    ],
)
def test_token_ids_are_checked_whole_and_a_bad_one_is_named_by_its_position(tokens, error):
    if error is None:
        got = check_token_ids("p", tokens)
        assert got == tuple(tokens) and type(got) is tuple
    else:
        with pytest.raises(RequestError, match=error):
            check_token_ids("p", tokens)


def test_an_empty_token_list_is_refused_where_one_is_needed():
    with pytest.raises(RequestError, match=r"^p must not be empty$"):
        check_token_ids("p", [], allow_empty=False)
