"""What the documentation says, checked against running nodes.

The getting-started example runs as a user runs it (a separate process, from a directory
outside the source tree) and prints what the page says it prints; and the operations page
lists every series two real nodes export after streaming, so a new metric cannot ship
undocumented.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import StartNode
from velomux_quic import Node

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def getting_started_example() -> str:
    text = (DOCS / "getting-started.md").read_text()
    blocks: list[str] = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    return next(block for block in blocks if "asyncio.run(" in block)


@pytest.mark.timeout(90)
def test_the_getting_started_example_prints_what_the_page_says(tmp_path: Path) -> None:
    script = tmp_path / "stream.py"
    script.write_text(getting_started_example())
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,  # its certs/dev/ is made here, not in the source tree
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["Hello, world!"], result.stdout + result.stderr
    assert (tmp_path / "certs" / "dev" / "engine" / "node.pem").is_file()


def exported_series(node: Node) -> set[str]:
    """The series a scrape of ``node`` reads, by the names its ``# TYPE`` lines give."""
    names = set()
    for line in node.metrics_text().splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            if not name.endswith("_created"):  # prometheus_client's creation timestamps
                names.add(name)
    return names


@pytest.mark.timeout(60)
async def test_the_operations_page_lists_every_series_a_node_exports(
    start_nodes: StartNode,
) -> None:
    consumer = await start_nodes("consumer")
    producer = await start_nodes("producer", peers=[consumer.record])
    anchor = consumer.create_anchor()
    sender = await producer.attach_anchor(anchor.handle)
    for token in range(8):
        await sender.send(token)
    await sender.finalize()
    assert [token async for token in anchor] == list(range(8))

    series = exported_series(consumer) | exported_series(producer)
    assert len(series) > 50, sorted(series)  # every layer registered its collectors
    page = (DOCS / "operations.md").read_text()
    undocumented = sorted(
        name for name in series if not re.search(rf"`{re.escape(name)}[`{{]", page)
    )
    assert not undocumented, (
        f"series a node exports that docs/operations.md does not list: {undocumented}"
    )
