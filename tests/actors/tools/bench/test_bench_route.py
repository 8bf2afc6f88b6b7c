"""``ringfence bench route`` (actors/tools/bench/serving/route.py): the shared-prefix
workload, the report's figures and ratios, the option checks; and (slow) its quick form
on real instances, every policy giving every request the same tokens."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson
import pytest

from ringfence.actors.tools.bench.serving import route
from ringfence.actors.tools.bench.serving.stats import Timeline
from ringfence.runtime import cli


def test_every_turn_extends_its_users_conversation_behind_the_groups_system_prompt():
    requests = route.shared_prefix_requests(
        groups=2, users=2, turns=3, system_blocks=4, max_tokens=8, rate=5.0
    )
    assert len(requests) == 12
    by_id = {r.id: r for r in requests}
    system = by_id["g0-u0-t0"].prompt_token_ids[: 4 * route.BLOCK]
    assert by_id["g0-u1-t0"].prompt_token_ids[: 4 * route.BLOCK] == system
    assert by_id["g1-u0-t0"].prompt_token_ids[: 4 * route.BLOCK] != system
    for turn in (1, 2):
        before, now = by_id[f"g0-u0-t{turn - 1}"], by_id[f"g0-u0-t{turn}"]
        assert now.prompt_token_ids[: len(before.prompt_token_ids)] == before.prompt_token_ids
        assert len(now.prompt_token_ids) == len(before.prompt_token_ids) + 2 * route.BLOCK
    turns = [int(r.id.rsplit("t", 1)[1]) for r in requests]
    assert turns == sorted(turns)  # every turn of one index before the next index's
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0


def timeline(rid: str, sent: float, first: float, usage: dict[str, Any]) -> Timeline:
    return Timeline(id=rid, sent_s=sent, chunk_s=(first, first + 0.01), chunk_tokens=(1, 1),
                    end_s=first + 0.01, token_ids=(5, 6), usage=usage)  # fmt: skip


def test_the_report_gives_each_policys_figures_and_cache_against_the_others():
    usage = {"prompt_tokens": 100, "ringfence": {"cached_tokens": {"device": 60, "host": 0}}}
    fast = [timeline(f"r{n}", n, n + 0.1, usage) for n in range(10)]
    slow = [timeline(f"r{n}", n, n + 0.3, {"prompt_tokens": 100}) for n in range(10)]
    found = {"per_instance": {"i0": 6, "i1": 4}, "leaked_names": []}
    rounds = [{
        "cache": {"figures": route.figures(fast, found), "same_tokens": True},
        "round_robin": {"figures": route.figures(slow, found), "same_tokens": True},
    }]  # fmt: skip
    result = route.report(["round_robin", "cache"], rounds)
    cache = result["policies"]["cache"]
    assert cache["ttft_p90_s"] == pytest.approx(0.1)
    assert cache["cached_share"] == {"device": 0.6, "host": 0.0}
    assert result["ratios"]["ttft_p90 round_robin/cache"] == pytest.approx(3.0)
    assert result["ratios"]["throughput cache/round_robin"] == pytest.approx(9.31 / 9.11)  # spans
    text = route.table(result | {"policies": result["policies"]})
    assert "ttft_p90 round_robin/cache: 3.00x" in text and "device 60%" in text


def test_a_bad_option_is_named():
    parser = argparse.ArgumentParser()
    route.add_arguments(parser)
    args = parser.parse_args(["--policies", "cache,fastest"])
    with pytest.raises(ValueError, match="unknown \\['fastest'\\]"):
        route.main(args)
    args = parser.parse_args(["--turns", "0"])
    with pytest.raises(ValueError, match="--turns must be >= 1"):
        route.main(args)
    args = parser.parse_args(["--users", "2", "--direct", "2"])
    with pytest.raises(ValueError, match="--direct must be >= 0 and below --users"):
        route.main(args)
    args = parser.parse_args(["--overlap-weight", "-1"])
    with pytest.raises(ValueError, match="--overlap-weight must be >= 0"):
        route.main(args)


# The bench's quick form, in CI: two tiny instances a policy, about 25 s on 2 CPUs for the
# light case; the saturation case (54 requests, 6 a second) about twice that.
QUICK = {
    "light": ["--groups", "2", "--users", "2", "--turns", "2", "--system-blocks", "4",
              "--rate", "20"],
    "saturation": ["--case", "saturation"],
}  # fmt: skip


# Each policy runs on two fresh instances behind a fresh router. CI runs the light case on
# real instances with the cache policy alone (two instances, their KV events in the router's
# index); both policies side by side (same tokens under each: in CI through the router,
# test_route_runs.py's test_round_robin_takes_turns_and_every_policy_gives_the_same_greedy_tokens)
# and the saturation case on real instances run with the slow soaks. CI runs the saturation
# case with both policies on simulated instances (below), where the queues are the sim's and
# not two shared cores'.
@pytest.mark.parametrize(
    ("case", "policies", "requests"),
    [
        ("light", ("cache",), 8),
        pytest.param("light", ("round_robin", "cache"), 8, marks=pytest.mark.slow),
        pytest.param("saturation", ("round_robin", "cache"), 54, marks=pytest.mark.slow),
    ],
    ids=["light-cache", "light-both", "saturation-both"],
)
def test_the_quick_form_routes_on_real_instances_with_the_same_tokens_everywhere(
    tmp_path: Path, case: str, policies: tuple[str, ...], requests: int
):
    out = tmp_path / "route.json"
    status = cli.main([
        "bench", "route", "--instances", "2", "--policies", ",".join(policies),
        *QUICK[case], "--max-tokens", "4", "--set", "model.preset=tiny", "--json", str(out),
        "--plot", str(tmp_path / "route.png"),
    ])  # fmt: skip
    result = orjson.loads(out.read_bytes())
    assert status == 0, result
    assert result["requests"] == requests and result["instances_kind"] == "serve"
    assert sorted(result["policies"]) == sorted(policies)
    for policy in policies:
        figures = result["policies"][policy]
        assert figures["failed"] == 0 and figures["same_tokens"] and not figures["leaked_names"]
        assert sum(figures["per_instance"].values()) == requests
        assert figures["ttft_p90_s"] > 0 and figures["output_tokens_per_s"] > 0  # tokens came
    if "round_robin" in policies:
        half = requests // 2
        assert result["policies"]["round_robin"]["per_instance"] == {"i0": half, "i1": half}
    # The plot is of the cache policy's ratios to the others: none with one policy.
    assert (tmp_path / "route.png").exists() == (len(policies) > 1)


def test_a_case_names_a_workload_and_each_option_given_overrides_its_value():
    parser = argparse.ArgumentParser()
    route.add_arguments(parser)
    light = {"groups": 4, "users": 3, "turns": 3, "system_blocks": 12, "rate": 2.0}
    assert route.workload(parser.parse_args([])) == light
    saturation = route.workload(parser.parse_args(["--case", "saturation"]))
    assert saturation == {"groups": 6, "users": 3, "turns": 3, "system_blocks": 24, "rate": 6.0}
    flood = route.workload(parser.parse_args(["--case", "flood", "--users", "4"]))
    assert flood == {"groups": 1, "users": 4, "turns": 2, "system_blocks": 24, "rate": 8.0}
    with pytest.raises(SystemExit):  # argparse names the choices
        parser.parse_args(["--case", "heavy"])


def test_the_direct_users_of_each_group_go_to_their_groups_instance():
    requests = route.shared_prefix_requests(
        groups=4, users=3, turns=2, system_blocks=2, max_tokens=4, rate=10.0
    )
    where = {r.id: route.direct_instance(r, 1, 3) for r in requests}
    assert {i: n for i, n in where.items() if n is not None} == {
        f"g{g}-u0-t{t}": g % 3 for g in range(4) for t in range(2)
    }
    assert all(route.direct_instance(r, 0, 3) is None for r in requests)


def test_simulated_instances_take_the_cases_sim_rate_and_a_cost_model_set_by_field():
    parser = argparse.ArgumentParser()
    route.add_arguments(parser)
    assert route.workload(parser.parse_args(["--sim", "--case", "flood"]))["rate"] == 60.0
    assert route.workload(parser.parse_args(["--sim", "--rate", "3"]))["rate"] == 3.0
    model = route.sim_model(["blocks=64", "step_ms=4"])
    assert (model.blocks, model.step_ms) == (64, 4.0)
    assert model.prefill_ms_per_token == route.SIM_MODEL.prefill_ms_per_token
    with pytest.raises(ValueError, match="KEY one of step_ms"):
        route.sim_model(["tokens=3"])
    with pytest.raises(ValueError, match="'x' is not int"):
        route.sim_model(["blocks=x"])
    with pytest.raises(ValueError, match="--sim-set is for simulated instances"):
        route.main(parser.parse_args(["--sim-set", "blocks=64"]))


# The saturation case in CI: the light one on simulated instances (the same code, an eighth
# of the requests, nearly the same time: the sims' and routers' start) runs with the slow
# soaks, and on real instances in CI above.
@pytest.mark.parametrize(
    ("case", "requests"), [pytest.param("light", 8, marks=pytest.mark.slow), ("saturation", 54)]
)
def test_the_quick_form_on_simulated_instances_reports_them_with_the_same_tokens_everywhere(
    tmp_path: Path, case: str, requests: int
):
    out = tmp_path / "route.json"
    status = cli.main([
        "bench", "route", "--sim", "--instances", "2", "--policies", "round_robin,cache",
        *QUICK[case], "--max-tokens", "4", "--sim-set", "step_ms=4",
        "--sim-set", "prefill_ms_per_token=0.05", "--json", str(out),
        "--plot", str(tmp_path / "route.png"),
    ])  # fmt: skip
    result = orjson.loads(out.read_bytes())
    assert status == 0, result
    assert result["instances_kind"] == "sim" and result["requests"] == requests
    assert result["cost_model"] == route.SIM_MODEL.as_dict() | {
        "step_ms": 4.0, "prefill_ms_per_token": 0.05,
    }  # fmt: skip
    for policy in ("round_robin", "cache"):
        figures = result["policies"][policy]
        assert figures["failed"] == 0 and figures["same_tokens"] and not figures["leaked_names"]
        assert sum(figures["per_instance"].values()) == requests
        assert figures["ttft_p90_s"] > 0 and figures["output_tokens_per_s"] > 0  # tokens came
        assert 0 < figures["cached_share"]["device"] < 1  # the usage the sims give
    half = requests // 2
    assert result["policies"]["round_robin"]["per_instance"] == {"i0": half, "i1": half}
    assert (tmp_path / "route.png").exists()
