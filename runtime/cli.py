"""The ``ringfence`` command: ``launch``, ``serve``, ``router``, ``replay``, ``bench NAME``
and ``clean``.

``launch`` and ``clean`` are the runtime's own; every other command lives with the actors
it runs, listed in their command table, which the runtime finds by import path
(:mod:`ringfence.runtime.commands`) and whose modules it imports only when chosen.

Every text argparse prints is plain words (no markup from the docstrings):
``tests/runtime/test_cli_help.py`` walks every command's ``--help``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, cast

import orjson

from ringfence.runtime.commands import CommandTable, command_table
from ringfence.runtime.extras import missing_line
from ringfence.runtime.imports import import_target
from ringfence.shm import names

if TYPE_CHECKING:
    from ringfence.runtime.config import RunConfig

MANIFEST = "names.json"
STOP_CODES = frozenset({128 + signal.SIGINT, 128 + signal.SIGTERM})  # a stop by a signal
REQUEST_ERRORS = 1  # launch's exit status when a request of its workload ended in error

DESCRIPTION = (
    "ringfence: a KV-cache runtime for LLM serving, built as actors that talk through "
    "shared-memory rings. Start with 'ringfence launch --workload synthetic:chat --set "
    "model.preset=small': it runs a long multi-round chat on a small built-in model and "
    "prints what the cache did."
)
LAUNCH_DESCRIPTION = (
    "Start a run: create its shared-memory names, spawn the actors (engine, worker, "
    "transfer lanes) and watch them. With --workload the engine runs those requests to the "
    "end, writes outputs.jsonl and summary.json into the run dir and prints a summary "
    "table, and under it each kind of error with its count and the setting to change; "
    "without it the instance serves clients until Ctrl-C. Exit status: 0 when the run ended "
    "normally, 2 for a bad config or command line, 1 when an actor failed or a request of "
    "the workload ended in error."
)


class _Command(Protocol):
    """A command module: its arguments, and what it runs (``ringfence bench NAME``,
    ``serve``, ``router``, ``replay``). ``DESCRIPTION``, if it has one, is its help text."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...
    def main(self, args: argparse.Namespace) -> int: ...


def _command_module(path: str) -> _Command:
    return cast(_Command, importlib.import_module(path))


class _LazyCommands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subcommands whose arguments are added only when one is chosen.

    ``ringfence --help`` and ``ringfence clean`` then import no command module (the
    benchmarks, the HTTP server, the router, replay), and a command that needs an optional
    extra fails alone, naming it, instead of every command failing to build its parser.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fill: dict[str, Callable[[argparse.ArgumentParser], None]] = {}

    def add_command(
        self, name: str, fill: Callable[[argparse.ArgumentParser], None], *, help: str
    ) -> argparse.ArgumentParser:
        """A subcommand ``name`` listed with ``help``; ``fill(parser)`` adds its arguments
        (and its description) when it is chosen, or at once by :meth:`fill`."""
        parser: argparse.ArgumentParser = self.add_parser(
            name, help=help, description=f"{help[0].upper()}{help[1:]}."
        )
        self._fill[name] = fill
        return parser

    def fill(self, name: str) -> argparse.ArgumentParser:
        """The parser of ``name`` with its arguments added (once)."""
        parser: argparse.ArgumentParser = self.choices[name]
        fill = self._fill.pop(name, None)
        if fill is not None:
            try:
                fill(parser)
            except ModuleNotFoundError as e:  # a command module that needs an extra
                line = missing_line(e)
                if line is None:
                    raise
                parser.exit(2, f"{parser.prog}: {line}\n")
        return parser

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if values and values[0] in self.choices:
            self.fill(values[0])
        super().__call__(parser, namespace, values, option_string)


def _module_fill(path: str) -> Callable[[argparse.ArgumentParser], None]:
    """Fill a subcommand from the module at ``path``: its arguments and its DESCRIPTION."""

    def fill(parser: argparse.ArgumentParser) -> None:
        module = _command_module(path)
        parser.description = getattr(module, "DESCRIPTION", parser.description)
        module.add_arguments(parser)

    return fill


def _bench_fill(path: str) -> Callable[[argparse.ArgumentParser], None]:
    def fill(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--json", type=Path, metavar="FILE", help="also write the figures as JSON"
        )
        _command_module(path).add_arguments(parser)

    return fill


def _subcommands(parser: argparse.ArgumentParser, dest: str, metavar: str) -> _LazyCommands:
    parser.register("action", "lazy_parsers", _LazyCommands)
    return cast(
        _LazyCommands,
        parser.add_subparsers(dest=dest, required=True, metavar=metavar, action="lazy_parsers"),
    )


def fill_all(parser: argparse.ArgumentParser) -> None:
    """Add every subcommand's arguments below ``parser`` now (what ``--help`` of each would
    show), as the tests that walk every command need."""
    for action in parser._actions:
        if isinstance(action, _LazyCommands):
            for name in list(action.choices):
                fill_all(action.fill(name))


def build_parser() -> argparse.ArgumentParser:
    """The ``ringfence`` parser. It imports no command module: each command's arguments are
    added when that command is chosen (:class:`_LazyCommands`); the commands that live
    with the actors come from their table (:func:`command_table`)."""
    table = command_table()
    parser = argparse.ArgumentParser(prog="ringfence", description=DESCRIPTION)
    sub = _subcommands(parser, "command", "COMMAND")

    text = "run a benchmark against its baselines, side by side"
    bench = sub.add_parser("bench", help=text, description=f"{text.capitalize()}.")
    benches = _subcommands(bench, "bench", "NAME")
    for name, command in table.benchmarks.items():
        benches.add_command(name, _bench_fill(command.module), help=command.help)

    text = "start a run: create its names, spawn and watch actors"
    launch = sub.add_command("launch", _launch_arguments, help=text)
    launch.description = LAUNCH_DESCRIPTION
    for name, command in table.commands.items():
        chosen = sub.add_command(name, _module_fill(command.module), help=command.help)
        chosen.description = command.description or chosen.description
    text = "remove the shared-memory names of dead runs"
    clean = sub.add_command("clean", _clean_arguments, help=text)
    clean.description = (
        "Remove the shared-memory names a run left behind (a live run only with --force)."
    )
    return parser


def _launch_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser)
    parser.add_argument(
        "--workload",
        metavar="FILE.jsonl|synthetic:NAME",
        help="run these requests to completion, print a summary and exit (sets engine.workload;"
        " synthetic: chat, multiturn, unique, pressure, interleaved); without it the instance"
        " serves clients",
    )


def _clean_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("run", nargs="?", help="a run dir (its names manifest) or a run id")
    target.add_argument("--all", action="store_true", help="every run whose creator is dead")
    parser.add_argument("--force", action="store_true", help="also remove names of live runs")


def run_id_of(target: str) -> str:
    """The run id named by a run dir (its manifest, else its folder name) or given directly."""
    path = Path(target)
    if path.is_dir():
        manifest = path / MANIFEST
        if manifest.is_file():
            try:
                return names.check_run_id(str(orjson.loads(manifest.read_bytes())["run_id"]))
            except (orjson.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{manifest}: not a ringfence names manifest ({e})") from e
        return names.check_run_id(path.name)
    return names.check_run_id(target)


def _clean(args: argparse.Namespace) -> int:
    if args.all:
        report = names.clean_all(force=args.force)
        for name in report.removed:
            print(f"removed {name}")
        for run_id in report.live_runs:
            print(f"kept run {run_id}: its creator is alive (--force removes it)")
        print(f"{len(report.removed)} names removed")
        return 0
    run_id = run_id_of(args.run)
    if not args.force and names.run_is_live(run_id):
        print(
            f"run {run_id} is live; not cleaning it (--force to remove its names anyway)",
            file=sys.stderr,
        )
        return 1
    removed = names.clean_run(run_id)
    for name in removed:
        print(f"removed {name}")
    print(f"{len(removed)} names removed")
    return 0


def _debug_settings() -> list[str]:
    """The run's settings that exist to measure or debug (``config_tables.DEBUG``)."""
    from ringfence.runtime.config import schema
    from ringfence.runtime.config_tables import debug_settings

    return debug_settings(schema())


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--set`` and ``--run-dir``: what every command that starts a run takes."""
    parser.add_argument("--config", type=Path, metavar="FILE", help="a TOML config file")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="override one config key, e.g. runtime.log_level=trace (repeatable). To measure "
        f"or debug only, never for a production run: {', '.join(_debug_settings())}",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        metavar="DIR",
        help="the run dir (default: runtime.run_dir/<run id>)",
    )


def supervise(
    command: str,
    config: RunConfig,
    run_dir: Path | None,
    *,
    signal_is_success: bool = False,
    after: Callable[[Path], int] | None = None,
) -> int:
    """Run a supervisor on ``config`` to its end, telling the terminal as ``ringfence
    COMMAND``: the run's dir, what ended it (an actor's failure on stderr), its exit status.

    ``after(run_dir)`` prints what the run left (launch: its summary) and returns the exit
    status that calls for (launch: 1 when a request ended in error), which a run that ended
    normally takes. With ``signal_is_success`` a stop by SIGINT/SIGTERM exits 0 rather than
    128 + the signal.
    """
    from ringfence.runtime.secrets import export_secrets
    from ringfence.runtime.supervisor import Supervisor

    # A secret (an API key) reaches the actors by environment, never through the run dir.
    config = export_secrets(config)
    # The topology's preflight (a checkpoint the Worker could not load, a workload the
    # engine could not read) runs here, before a run exists: its error is the command's.
    supervisor = Supervisor(config, run_dir)
    print(f"ringfence {command}: run {supervisor.run_id} in {supervisor.run_dir}", flush=True)
    for note in supervisor.notes:  # the settings the machine chose (on a GPU: the pool)
        print(f"ringfence {command}: {note}", flush=True)
    code = supervisor.run()
    if signal_is_success and code in STOP_CODES and not supervisor.failure:
        code = 0
    if after is not None:
        verdict = after(supervisor.run_dir)  # printed however the run ended
        code = code or verdict
    if supervisor.failure:  # what ended the run: the actor, its error, where it was raised
        sys.stdout.flush()  # the run's own lines first, on a terminal that shows both
        head, *rest = supervisor.failure
        print("\n".join([f"ringfence {command}: {head}", *rest]), file=sys.stderr, flush=True)
    print(
        f"ringfence {command}: run {supervisor.run_id} ended ({supervisor.stop_reason}), "
        f"exit status {code}",
        flush=True,
    )
    return code


def _launch(args: argparse.Namespace) -> int:
    from ringfence.runtime.config import load_config

    overrides = list(args.overrides)
    if args.workload:
        overrides.append(f"engine.workload={args.workload}")
    return supervise("launch", load_config(args.config, overrides), args.run_dir, after=_summary)


def _summary(run_dir: Path) -> int:
    """Print the summary table of a workload run (--workload or engine.workload), the
    errors under it; 1 when a request ended in error (:data:`REQUEST_ERRORS`), else 0."""
    path = run_dir / "summary.json"
    if not path.exists():
        return 0
    summary = orjson.loads(path.read_bytes())
    # The table lives with the actors; the runtime imports it only by name.
    table = import_target(command_table().launch_summary)
    print(table(summary))  # type: ignore[operator]
    errors = summary.get("requests", {}).get("errors") if isinstance(summary, dict) else None
    return REQUEST_ERRORS if errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(command_table(), args)
    except ValueError as e:
        print(f"ringfence {args.command}: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        line = missing_line(e)
        if line is None:
            raise
        print(f"ringfence {args.command}: {line}", file=sys.stderr)
        return 2


def _run(table: CommandTable, args: argparse.Namespace) -> int:
    """Run the command ``args`` chose: the runtime's own, or one of ``table``'s."""
    if args.command == "bench":
        return _command_module(table.benchmarks[args.bench].module).main(args)
    if args.command == "launch":
        return _launch(args)
    if args.command in table.commands:
        return _command_module(table.commands[args.command].module).main(args)
    return _clean(args)


def console_main() -> NoReturn:
    """The ``ringfence`` command: :func:`main` on the command line. A ``launch`` then leaves
    by ``os._exit`` once its output is flushed: the run ended and closed everything it
    opened (its children reaped, its names unlinked, the fork server stopped), and the
    interpreter's teardown of torch and the model's modules, which the launch imported to
    check the topology, takes about a second more (as each child leaves, ``child.py``)."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] == ["launch"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
