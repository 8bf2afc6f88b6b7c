"""``engine.role``: what the launch refuses before a run exists, naming the keys."""

from __future__ import annotations

import pytest
from launching import ringfence

from ringfence.actors.config import Config
from ringfence.actors.engine.begin import sched_config
from ringfence.actors.engine.launch import check_role


def config(*sets: str) -> Config:
    return Config.load(None, list(sets))


@pytest.mark.parametrize(
    ("sets", "names"),
    [
        (("engine.role=prefill", "cache.storage.backend=none"), "'none': use 'local'"),
        (("engine.role=decode", "cache.storage.backend=memory"), "cache.storage.backend is"),
        (("engine.role=prefill", "cache.storage.backend=local"), "cache.storage.path is empty"),
        (
            ("engine.role=decode", "cache.storage.path=/tmp/tier"),
            "set sched.preemption = 'save' (it is 'recompute')",
        ),
        (
            (
                "engine.role=decode",
                "cache.storage.path=/tmp/tier",
                "sched.preemption=save",
                "engine.workload=synthetic:chat",
            ),
            "takes requests only by reservation",
        ),
    ],
)
def test_a_role_that_cannot_hand_over_is_refused_naming_the_keys(sets, names):
    with pytest.raises(ValueError, match=r"engine\.role") as e:
        check_role(config(*sets))
    assert names in str(e.value)


def test_roles_that_can_hand_over_pass_and_only_prefill_holds_its_finishes():
    tier = ("cache.storage.path=/tmp/tier",)
    check_role(config())
    check_role(config("engine.role=prefill", *tier))
    check_role(config("engine.role=decode", "sched.preemption=save", *tier))
    check_role(config("engine.role=prefill", "cache.storage.backend=redis"))
    made = {
        role: sched_config(config(f"engine.role={role}", *tier), "m", 2048).handover
        for role in ("both", "prefill", "decode")
    }
    assert made == {"both": False, "prefill": True, "decode": False}


def test_serve_refuses_a_decode_instance_without_save_before_a_run_exists():
    result = ringfence(
        "serve", "--set", "engine.role=decode", "--set", "cache.storage.path=/tmp/tier"
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "sched.preemption = 'save'" in result.stderr
    assert "run " not in result.stdout  # no run dir was made
