"""The order the suite's files are handed to the xdist workers (tests/conftest.py sorts the
collection by it)."""

from __future__ import annotations

# The suite runs on two xdist workers a file at a time (scripts/test: --dist loadfile
# --no-loadscope-reorder), each worker taking the next file in collection order when it is
# free. Longest first keeps the two busy to the end (a long file taken last is run alone
# while the other worker idles), so these files, the longest in the suite (--durations=0 on
# the 2-core machine, 2026-11-29: every file of 10 s or more), are collected first, longest
# first; the rest keep their order. A stale list costs balance, never a result.
LONGEST_FIRST = (
    "tests/clients/test_lm_eval.py",  # with the rest of tests/clients/: one unit, ~140 s
    "tests/modelcheck/test_model.py",  # ~105 s, on the other worker while the first builds
    "tests/actors/model/test_gguf.py",  # the transformers reference, which this one waits on
    "tests/clients/test_guidellm.py",
    "tests/clients/test_openai_sdk.py",
    "tests/runtime/test_supervisor.py",
    "tests/actors/serve/test_serve_tools.py",
    "tests/actors/router/test_pd_runs.py",
    "tests/actors/router/test_route_runs.py",
    "tests/actors/tools/bench/test_bench_route.py",
    "tests/actors/engine/test_structured_runs.py",
    "tests/runtime/test_embed.py",
    "tests/actors/router/test_router_flow.py",
    "tests/actors/engine/test_storage_runs.py",
    "tests/actors/tools/bench/test_faults.py",
    "tests/actors/replay/test_replay_runs.py",
    "tests/actors/serve/test_serve_faults.py",
    "tests/actors/tools/bench/test_bench_ring.py",
    "tests/actors/engine/test_hosted_lane_runs.py",
    "tests/actors/client/test_client_slots.py",
    "tests/actors/router/test_pd_hosts.py",
    "tests/actors/tools/bench/test_bench_e2e.py",
    "tests/runtime/test_hosting.py",
    "tests/actors/model/test_families_launch.py",
    "tests/actors/engine/test_tp_runs.py",
    "tests/actors/engine/test_engine_clients.py",
    "tests/project/test_plain_install.py",
    "tests/actors/model/test_parallel.py",
    "tests/actors/replay/test_replay_profiles.py",
    "tests/actors/tools/bench/test_bench_serve.py",
    "tests/actors/serve/test_serve_api.py",
    "tests/actors/engine/test_steps_in_flight_runs.py",
)

# Folders whose files run as one unit on one worker (tests/conftest.py's scheduler), so
# that the package fixture they share starts once: tests/clients/ serves SmolLM2 (about
# 20 s a start) for lm-eval, guidellm and the openai SDK.
ONE_UNIT = ("tests/clients/",)
