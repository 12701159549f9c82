"""Every metric the Grafana dashboard (docs/grafana/velomux.json) queries is one a node exports.

Two real nodes stream a little over the mux and answer a call through an ordered handler (so
the ordered-lane histogram has samples); then both nodes' Prometheus text, as a scrape reads
it, must name every metric of every panel expression. A renamed series fails here instead of
leaving an operator with an empty panel.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import StartNode
from tests.unit.test_dashboard import dashboard_expressions, histogram_family, metric_names
from velomux_quic import Context


def exported_names(text: str) -> set[str]:
    """Sample names and family names (``# TYPE`` lines) of one Prometheus text exposition."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names


@pytest.mark.timeout(60)
async def test_every_dashboard_expression_names_a_metric_both_nodes_export(
    start_nodes: StartNode,
) -> None:
    consumer = await start_nodes("consumer")
    producer = await start_nodes("producer", peers=[consumer.record])

    async def echo(ctx: Context) -> bytes:  # a coroutine handler: ordered dispatch
        return bytes(ctx.payload)

    consumer.register_handler("echo", echo)
    assert await producer.call(consumer.instance_id, "echo", b"ping", timeout=10.0) == b"ping"

    anchors = [consumer.create_anchor() for _ in range(4)]
    senders = [await producer.attach_anchor(anchor.handle) for anchor in anchors]
    for index in range(16):
        for sender in senders:
            await sender.send({"token": index})
    for sender in senders:
        sender.finalize()
    async with asyncio.timeout(20):
        received = [[item async for item in anchor] for anchor in anchors]
    assert all(len(items) == 16 for items in received)

    texts = {
        "consumer": consumer.metrics_text(),
        "producer": producer.metrics_text(),
    }
    wanted = {
        (title, name) for title, expr in dashboard_expressions() for name in metric_names(expr)
    }
    assert len(wanted) >= 20
    for node, text in texts.items():
        exported = exported_names(text)
        missing = sorted(
            f"{title}: {name}"
            for title, name in wanted
            if name not in exported and histogram_family(name) not in exported
        )
        assert not missing, f"{node} does not export {missing}"
    # The histograms the dashboard reads have samples, not just a declaration.
    producer_samples = exported_names(
        "\n".join(line for line in texts["producer"].splitlines() if not line.startswith("#"))
    )
    consumer_samples = exported_names(
        "\n".join(line for line in texts["consumer"].splitlines() if not line.startswith("#"))
    )
    assert "velo_streaming_mux_records_per_batch_bucket" in producer_samples
    assert "velo_messenger_ordered_lane_wait_seconds_bucket" in consumer_samples
