"""Every option the foldtrain command accepts: the config keys (``foldtrain config --keys``) and the
flags of every subcommand's argparse parser, collected in this process without running anything."""

from __future__ import annotations

import argparse
import contextlib
import functools


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    out: set[str] = set()
    for action in parser._actions:
        out.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _flags(sub)
    return out


def _parser_of(main, argv: list[str]) -> argparse.ArgumentParser | None:
    """The parser ``main(argv)`` builds: its first parse is stopped before anything else happens."""
    original = argparse.ArgumentParser.parse_known_args

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    argparse.ArgumentParser.parse_known_args = capture
    try:
        with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):
            main(argv)
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original
    return None


@functools.cache
def config_keys() -> frozenset[str]:
    """``section.key`` and top-level keys, as ``foldtrain config --keys`` lists them (without ``--``)."""
    from foldtrain.config import all_keys

    return frozenset(all_keys())


@functools.cache
def parser_flags() -> dict[str, frozenset[str]]:
    """``--flag`` strings per command (``train``, ``plan``, ``bench dp``, ...)."""
    import importlib

    from foldtrain import cli, sim_cli
    from foldtrain.bench import BENCHMARKS

    parsers = {cmd: cli._parser(cmd) for cmd in cli.COMMANDS}
    parsers["plot"] = _parser_of(cli.cmd_plot, [])
    for cmd, main in (
        ("simulate", sim_cli.simulate_main),
        ("plan", sim_cli.plan_main),
        ("calibrate", sim_cli.calibrate_main),
    ):
        parsers[cmd] = _parser_of(main, [])
    for name, module in BENCHMARKS.items():
        parsers[f"bench {name}"] = _parser_of(importlib.import_module(module).main, [])
    missing = [cmd for cmd, p in parsers.items() if p is None]
    assert not missing, f"no argparse parser found for: {missing}"
    return {cmd: frozenset(_flags(p)) for cmd, p in parsers.items()}


def all_flags() -> frozenset[str]:
    return frozenset().union(*parser_flags().values())
