"""A launched run whose prompts exceed the device pool says so under its table, with the
setting to change, reports no throughput for work it never did, and exits 1."""

from __future__ import annotations

import orjson
from engine_runs import MODEL
from launching import QUICK, launched

PROMPTS = (100, 170, 140)  # tokens; each plus max_tokens 4 needs 7 to 11 blocks of 16
DEVICE_BLOCKS = 6


def test_a_run_of_prompts_past_the_device_pool_names_the_setting_and_exits_1(tmp_path):
    workload = tmp_path / "long.jsonl"
    lines = [
        {"id": f"long-{n}", "prompt_token_ids": [n % 200] * n, "max_tokens": 4} for n in PROMPTS
    ]
    workload.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    sets = (*MODEL, *QUICK, f"cache.device_blocks={DEVICE_BLOCKS}")
    with launched(tmp_path, *sets, command=("launch", "--workload", str(workload))) as run:
        code = run.wait(120)
        printed = run.stdout().splitlines()
        summary = orjson.loads((run.run_dir / "summary.json").read_bytes())
        run_id = run.run_id
    assert code == 1, run.tail()
    assert printed[-2:] == [
        "3 requests refused, the largest: a prompt of 170 tokens plus max_tokens 4 needs 11 "
        "blocks, the device pool has 6 (cache.device_blocks)",
        f"ringfence launch: run {run_id} ended (shutdown requested by engine-0), exit status 1",
    ]
    assert "requests     3 total, 0 finished, 3 aborted, 3 errors" in printed
    assert "throughput   0.0 output tok/s, 0.0 total tok/s, 0.00 req/s" in printed
    assert summary["throughput"] == {
        "output_tokens_per_s": 0.0,
        "total_tokens_per_s": 0.0,
        "requests_per_s": 0.0,
    }
    assert summary["error_kinds"] == [
        {
            "kind": "device_pool",
            "requests": 3,
            "refused": True,
            "examples": 3,
            "text": "a prompt of 170 tokens plus max_tokens 4 needs 11 blocks, "
            "the device pool has 6",
            "setting": "cache.device_blocks",
        }
    ]
