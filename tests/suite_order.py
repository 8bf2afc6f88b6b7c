"""The order the suite's files are handed to the xdist workers (tests/conftest.py sorts the
collection by it)."""

from __future__ import annotations

# The suite runs on two xdist workers a file at a time (scripts/test: --dist loadfile
# --no-loadscope-reorder), each worker taking the next file in collection order when it is
# free. Longest first keeps the two busy to the end (a long file taken last is run alone
# while the other worker idles), so these files, the longest in the suite (--durations=0 on
# the 2-core machine, 2026-11-27: 100 down to 20 s each), are collected first, longest
# first; the rest keep their order. A stale list costs balance, never a result.
LONGEST_FIRST = (
    "tests/clients/test_lm_eval.py",  # with the rest of tests/clients/: one unit, ~150 s
    "tests/modelcheck/test_model.py",  # second: the first two both wait on hf_reference
    "tests/actors/model/test_gguf.py",
    "tests/actors/tools/bench/test_faults.py",
    "tests/actors/serve/test_serve_faults.py",
    "tests/actors/replay/test_replay_runs.py",
    "tests/actors/router/test_pd_runs.py",
    "tests/clients/test_guidellm.py",
    "tests/clients/test_openai_sdk.py",
    "tests/actors/engine/test_tp_runs.py",
    "tests/actors/model/test_families_launch.py",
    "tests/runtime/test_supervisor.py",
    "tests/actors/tools/testing/test_harness.py",
    "tests/actors/engine/test_engine.py",
    "tests/actors/tools/bench/test_bench_route.py",
    "tests/actors/client/test_client.py",
    "tests/runtime/test_embed.py",
    "tests/actors/model/test_parallel.py",
)

# Folders whose files run as one unit on one worker (tests/conftest.py's scheduler), so
# that the package fixture they share starts once: tests/clients/ serves SmolLM2 (about
# 20 s a start) for lm-eval, guidellm and the openai SDK.
ONE_UNIT = ("tests/clients/",)
