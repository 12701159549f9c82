"""The ``velomux`` command. Each command group adds itself; this module only dispatches.

Every leaf parser sets ``handler`` (``Callable[[argparse.Namespace], int]``), so adding a
group is one ``add_*_commands(subparsers)`` call here.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable, Sequence

from velomux_quic.demo import add_demo_commands
from velomux_quic.probe import add_probe_commands
from velomux_quic.security.cli import add_certs_commands
from velomux_quic.service import add_node_commands

__all__ = ["build_parser", "main", "version_text"]


def _installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_text() -> str:
    """``velomux --version``: this package, and the QUIC engine a node started here runs
    (its ``[transport] engine`` may still name another one)."""
    from velomux_quic.errors import ConfigurationError
    from velomux_quic.transport.config import TransportConfig
    from velomux_quic.transport.engine_choice import engine_features, resolve_engine

    lines = [f"velomux_quic {_installed('velomux_quic') or 'unknown'}"]
    try:
        features = engine_features(resolve_engine(TransportConfig()))
        lines.append(f"QUIC engine: {features.name} {features.version} (default here)")
    except ConfigurationError as exc:
        lines.append(f"QUIC engine: unusable ({exc})")
    installed = {name: _installed(name) for name in ("aioquic", "qh3")}
    lines.append(
        "engines installed: "
        + ", ".join(f"{name} {version}" for name, version in installed.items() if version)
    )
    return "\n".join(lines)


class _Version(argparse.Action):
    """``--version``: computed when asked (it imports the engines), then exit."""

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
        "--version", action=_Version, help="show the versions and the QUIC engine, and exit"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_certs_commands(commands)
    add_demo_commands(commands)
    add_node_commands(commands)
    add_probe_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (argparse exits 2 on a usage error)."""
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
