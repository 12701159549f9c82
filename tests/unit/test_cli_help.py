"""``velomux --help`` and every subcommand's help, as a person reads them.

Each parser's help is formatted as the terminal shows it: no suppressed entry, no reST
markup from a docstring, every option with a help line, and every option that has a
default says what it is.
"""

from __future__ import annotations

import argparse
import re

import pytest

from velomux_quic.programs.cli import build_parser, parsers

ALL = list(parsers(build_parser()))
MARKUP = re.compile(r"``|:(?:class|func|meth|mod|attr|data|exc):|==SUPPRESS==|SUPPRESS")


def option_blocks(text: str) -> dict[str, str]:
    """Each option's lines in a formatted help, by its first option string."""
    blocks: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        found = re.match(r"^  (-{1,2}[\w-]+)", line)
        if found:
            current = found.group(1)
            blocks[current] = line
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = ""
    return blocks


def test_every_command_and_subcommand_is_covered() -> None:
    names = {parser.prog for parser in ALL}
    for command in ("velomux", "velomux demo", "velomux node", "velomux probe"):
        assert command in names
    for command in ("init-ca", "issue", "renew", "trust", "dev"):
        assert f"velomux certs {command}" in names
    assert not any("demo-frontend" in name for name in names)


@pytest.mark.parametrize("parser", ALL, ids=[parser.prog for parser in ALL])
def test_help_has_no_suppressed_entry_and_no_markup(parser: argparse.ArgumentParser) -> None:
    found = MARKUP.search(parser.format_help())
    assert found is None, found


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's own arguments (argparse keeps them in a private list), without
    ``--help`` and the subcommand choosers."""
    return [
        action
        for action in parser._actions  # noqa: SLF001 (argparse's, not the library's)
        if action.dest != "help" and not isinstance(action, argparse._SubParsersAction)  # noqa: SLF001
    ]


@pytest.mark.parametrize("parser", ALL, ids=[parser.prog for parser in ALL])
def test_every_option_has_a_help_line_and_its_default(parser: argparse.ArgumentParser) -> None:
    blocks = option_blocks(parser.format_help())
    for action in arguments(parser):
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help, f"{parser.prog} {name} has no help line"
        if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS):
            assert "default" in blocks[name], f"{name} does not say its default: {blocks[name]}"
