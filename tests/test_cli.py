"""The command line: `multilora <command> --help` shows each option's default once."""

from __future__ import annotations

import re

import pytest

from multilora.cli import main


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return capsys.readouterr().out


def _entries(text: str) -> dict[str, str]:
    """Option -> its help text, from the printed help (an entry starts at a line "  -x ...")."""
    out, current = {}, None
    for line in text.splitlines():
        m = re.match(r"  (-[-\w]+)", line)
        if m:
            current = m.group(1)
            out[current] = line
        elif current is not None and line.startswith("    "):
            out[current] += " " + line.strip()
        else:
            current = None
    return out


@pytest.mark.parametrize("command", ["serve", "serve-ray", "generate"])
def test_help_shows_each_default_once(command, capsys):
    text = _help(command, capsys)
    assert "(default: None)" not in text and "(default: False)" not in text
    entries = _entries(text)
    assert "--max-num-seqs" in entries
    twice = {opt: t for opt, t in entries.items() if t.lower().count("default:") > 1}
    assert not twice
    assert "(default: 64)" in entries["--max-num-seqs"]
