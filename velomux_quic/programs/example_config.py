"""The commented sample configuration ``velomux node --example-config`` prints.

Every key the node's loader reads, set to its default, with a comment saying what it
does. It is a file of the package (``programs/node.toml``), not of the checkout, so an
installed wheel prints it; ``examples/node.toml`` in the sources is a link to it, so the
sample is written once (a test checks that it loads and names every field).
"""

from __future__ import annotations

from importlib.resources import files

__all__ = ["EXAMPLE_CONFIG"]

EXAMPLE_CONFIG = files(__package__).joinpath("node.toml").read_text(encoding="utf-8")
"""The sample's text, read once when the ``node`` command is set up."""
