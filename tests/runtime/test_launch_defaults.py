"""A topology's defaults functions run at launch, before the preflight: the value they choose
is what the actors run with (config.toml), said on the terminal and logged; a key the file
or --set wrote, whatever its value, is left as given. The fixture chooses demo.messages."""

from __future__ import annotations

import signal
import tomllib

from fixture_actors import DEFAULT_MESSAGES
from launching import QUICK, launched

DEFAULTED = "runtime.topology=fixture_actors:DEFAULTED"


def test_a_default_the_topology_chooses_is_written_to_the_run_dir_printed_and_logged(tmp_path):
    with launched(tmp_path, DEFAULTED, *QUICK) as run:
        assert run.wait() == 0, run.tail()
        config = tomllib.loads((run.run_dir / "config.toml").read_text())
        assert config["demo"]["messages"] == DEFAULT_MESSAGES
        note = f"demo.messages = {DEFAULT_MESSAGES} (the fixture's default)"
        assert f"ringfence launch: {note}\n" in run.stdout()
        (logged,) = run.events("run.resolve_defaults")
        assert logged["notes"] == [note]


def test_a_key_given_with_set_is_left_as_given_even_at_its_built_in_default(tmp_path):
    with launched(tmp_path, DEFAULTED, "demo.messages=100000", *QUICK) as run:  # the default
        # Resolved, written and said before the run starts: it is stopped there, not left to
        # stream its 100,000 items (most of a finished run's CPU).
        run.wait_for_event("run.start")
        run.send_signal(signal.SIGTERM)
        assert run.wait() == 143, run.tail()
        config = tomllib.loads((run.run_dir / "config.toml").read_text())
        assert config["demo"]["messages"] == 100000
        assert "the fixture's default" not in run.stdout()
        assert run.events("run.resolve_defaults") == []
