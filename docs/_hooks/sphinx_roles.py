"""MkDocs hook: render the Sphinx roles of the package's docstrings as plain code.

The docstrings are written for ``help()`` and Sphinx (``:meth:`close```,
``:class:`~velomux_quic.errors.VelomuxError```, a paragraph ending in ``::`` before a
code block). mkdocstrings renders them as Markdown, where a role would show as
``:meth:close``; this hook turns each into the code span it names (the last dotted
component under ``~``, as Sphinx does) and the ``::`` into ``:``.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(
    r":(?:py:)?(?:meth|func|class|attr|data|mod|exc|obj|const|type):<code>(~?)([^<]+)</code>"
)
_LITERAL_MARKER = re.compile(r"::</p>")


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"<code>{target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    """Rewrite the roles in every page (only the API pages contain any)."""
    return _LITERAL_MARKER.sub(":</p>", _ROLE.sub(_role, html))
