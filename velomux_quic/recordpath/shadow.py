"""What ``import cython`` gives a compiled module's source where Cython is not installed.

Cython is a build requirement, not a dependency: an installation runs the pure-Python
record path without it. A compiled module that branches on ``cython.compiled`` imports
this instead when ``cython`` cannot be imported; where the module is compiled, Cython
decides that branch when it builds the extension and nothing is imported."""

from __future__ import annotations

__all__ = ["compiled"]

compiled: bool = False
"""This module's importer runs as plain Python."""
