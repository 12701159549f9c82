"""The ``velomux`` command. Each command group adds itself; this module only dispatches.

Every leaf parser sets ``handler`` (``Callable[[argparse.Namespace], int]``), so adding a
group is one ``add_*_commands(subparsers)`` call here.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence

from velomux_quic import runtime_info
from velomux_quic.node import warn_unknown_variables
from velomux_quic.programs.certs import add_certs_commands
from velomux_quic.programs.demo import add_demo_commands
from velomux_quic.programs.probe import add_probe_commands
from velomux_quic.programs.service import add_node_commands

__all__ = ["HelpFormatter", "build_parser", "main", "parsers", "version_text"]


class HelpFormatter(argparse.HelpFormatter):
    """Every command's help: a description's paragraphs keep the line breaks they were
    written with (a list, say) unless a line is too long for the terminal, and an
    option's help ends with its default unless it has none (None, a flag's False, an
    empty list) or says it in its own words."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.strip("\n").split("\n\n"):
            if max(map(len, paragraph.splitlines()), default=0) <= width:
                paragraphs.append(textwrap.indent(paragraph, indent))
            else:
                paragraphs.append(super()._fill_text(paragraph, width, indent))
        return "\n\n".join(paragraphs)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if not text or text is argparse.SUPPRESS or not action.option_strings:
            return text
        default = action.default
        if default in (None, False, [], argparse.SUPPRESS) or "default" in text:
            return text
        if text.endswith(")"):  # "(1 to 1024)" reads "(1 to 1024; default: 4)"
            return f"{text[:-1]}; default: %(default)s)"
        return f"{text} (default: %(default)s)"


def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser under it, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from parsers(child)


def version_text() -> str:
    """What ``velomux --version`` prints: the package version, the record path this process
    runs and the QUIC engine a node started here gets, so a bug report says which
    implementation produced it."""
    return runtime_info().describe()


class _Version(argparse.Action):
    """``--version``, computed when asked (it imports the default engine), then exit."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="velomux",
        description="Stream records between cluster nodes over mutually authenticated QUIC.",
    )
    parser.add_argument(
        "--version",
        action=_Version,
        help="print the version, the record path (compiled or pure-python) and the QUIC "
        "engine, and exit",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_certs_commands(commands)
    add_demo_commands(commands)
    add_node_commands(commands)
    add_probe_commands(commands)
    for each in parsers(parser):
        each.formatter_class = HelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (argparse exits 2 on a usage error)."""
    args = build_parser().parse_args(argv)
    if args.command != "node":  # velomux node warns once its log format is set up
        warn_unknown_variables()
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
