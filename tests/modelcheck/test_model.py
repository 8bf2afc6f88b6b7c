"""The protocol model-checked (tests/modelcheck/protocol.pml, pd.pml): the small
configurations pass every interleaving, each mutant fails with a counterexample naming
the property it breaks, and the model's fence rule equals cache/fences.py's on ops the
real scheduler issued. ``scripts/modelcheck`` runs the larger configurations too."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from modelcheck import run, spin
from modelcheck.configs import CONFIGS, MUTANTS, PROTOCOL, config
from modelcheck.tables import record, table_pml

pytestmark = pytest.mark.skipif(
    shutil.which("spin") is None or shutil.which("gcc") is None,
    reason="spin and gcc are needed (scripts/test installs spin with apt-get)",
)
SMALL = [c for c in CONFIGS if c.ci]
CAUGHT = [m for m in MUTANTS if config(m.config).ci and not m.equivalent]


@pytest.mark.parametrize("c", SMALL, ids=[c.name for c in SMALL])
def test_a_small_configuration_holds_in_every_interleaving(c, tmp_path: Path) -> None:
    result = spin.verify(tmp_path, c.model, c.defines)
    assert result.errors == 0, f"{result.violation}\n{result.output[-3000:]}"
    assert result.complete and result.states > 1000, result.output[-3000:]


@pytest.mark.parametrize(
    "c", [c for c in SMALL if c.liveness], ids=[c.name for c in SMALL if c.liveness]
)
def test_every_op_completes_or_is_cancelled_under_weak_fairness(c, tmp_path: Path) -> None:
    result = spin.verify(tmp_path, c.model, c.defines, liveness=True)
    assert result.errors == 0, f"{result.violation}\n{result.output[-3000:]}"


@pytest.mark.parametrize("m", CAUGHT, ids=[m.flag for m in CAUGHT])
def test_a_mutant_fails_with_a_counterexample_naming_what_it_breaks(m, tmp_path: Path) -> None:
    c = config(m.config)
    result = spin.verify(tmp_path, c.model, {**c.defines, m.flag: True})
    assert result.errors >= 1, f"{m.flag} survived {c.name}: {m.what}"
    assert any(name in result.violation for name in m.caught_by), result.violation
    assert result.trail_steps is not None and result.trail_steps > 0


def test_the_equivalent_mutant_passes_because_steps_and_store_ops_share_no_tier(
    tmp_path: Path,
) -> None:
    (m,) = [m for m in MUTANTS if m.equivalent]
    c = config(m.config)
    assert spin.verify(tmp_path, c.model, {**c.defines, m.flag: True}).errors == 0


def test_the_models_fences_equal_cache_fences_on_ops_the_real_scheduler_issued(
    tmp_path: Path,
) -> None:
    found = run.fence_traces(5, tmp_path)
    assert found["failed"] == [] and found["ops"] > 100, found


def test_a_fence_that_differs_from_the_codes_is_reported_with_the_op(
    tmp_path: Path, rng: random.Random
) -> None:
    rows = record(rng.randrange(1000))
    k = rng.randrange(len(rows))
    text = table_pml(rows).replace(f"t_f[{3 * k}] = ", f"t_f[{3 * k}] = 1 + ", 1)
    spin.prepare(tmp_path, PROTOCOL, {"table.pml": text})
    out = spin.simulate(tmp_path, PROTOCOL, {"TABLE": True, "NOPS": 1, "ND": 16, "NH": 16}, 60)
    assert f"F violated: table op {k} " in out, out[-2000:]


def test_the_runner_exits_1_when_a_mutant_survives(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (m,) = [m for m in MUTANTS if m.equivalent]
    survivor = type(m)(flag=m.flag, config=m.config, what=m.what)  # claimed to fail
    monkeypatch.setattr(run, "MUTANTS", (survivor,))
    assert run.main(["--only", m.flag, "--traces", "0", "--jobs", "1"]) == 1
    assert "PASSED: the mutant survived" in capsys.readouterr().out
