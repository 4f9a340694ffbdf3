"""The command line: `multilora <command> --help` shows each option's default once."""

from __future__ import annotations

import argparse

import pytest

from multilora.cli import DefaultsOnceFormatter, build_parser


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", ["serve", "serve-ray", "generate"])
def test_help_shows_each_default_once(command, capsys):
    parser = _commands()[command]
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "(default: None)" not in text and "(default: False)" not in text
    formatter = DefaultsOnceFormatter(prog=command)
    for action in parser._actions:
        shown = (formatter._get_help_string(action) or "").replace("%(default)s", "X")
        assert shown.lower().count("default:") <= 1, (action.option_strings, shown)
