"""One node of a two-node streaming exchange, run in its own process (and network namespace).

    python -m tests.procs.netns_node consumer --credentials DIR --host IP --streams N
    python -m tests.procs.netns_node producer --credentials DIR --host IP \\
        --peer UUID@HOST:PORT --handles FILE --tokens N

``--transport quic-stream-v1`` starts the node with the mux disabled, so that its attaches
negotiate the per-stream path; the default leaves the mux on (``messenger-mux-v2``).

Each role prints one JSON object per line, with an ``event`` key, and nothing else on stdout:

consumer
    ``ready``: its instance id, the address it listens on, and one ``[hi, lo]`` handle per
    stream. ``flowing`` (only with ``--flowing K``): every stream has delivered at least K
    items. ``report``: per stream the items received, whether they arrived in order, how
    the stream ended (``finalized``, the name of the StreamError raised, or ``timeout``)
    and when (``time.monotonic()``, the same clock as the test's on Linux), plus the
    node's ``velo_streaming_*`` samples.
producer
    ``attached``: every stream has a sender, with the transports negotiated. ``done``: every
    stream was sent ``--tokens`` items (``[stream index, n]``), one per stream per pass,
    and finalized, with how each retired, plus the node's ``velo_streaming_*`` samples.

Both reports also carry ``datagrams``: per connection its direction, datagram size and
how that was chosen (``TransportSnapshot``), and ``transport_metrics``, the node's path
MTU samples; the producer's are taken after its last pass, before it finalizes. With
``--settle`` it first waits there (at most 20 s) until no connection is still searching
for its path's datagram size.

Both exit 0 once they reported; a stream that failed is in the report, not the exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from velomux_quic.errors import StreamError
from velomux_quic.ids import InstanceId, StreamAnchorHandle
from velomux_quic.mux.config import MuxConfig
from velomux_quic.node import Node
from velomux_quic.programs.runtime import run
from velomux_quic.streaming.anchor import StreamAnchor
from velomux_quic.streaming.control import MESSENGER_MUX_KEY, PER_STREAM_KEY
from velomux_quic.streaming.manager import StreamingConfig


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def streaming_metrics(node: Node) -> dict[str, float]:
    """The node's ``velo_streaming_*`` samples but histogram buckets, by name and labels
    as exported (``velo_streaming_mux_records_total{direction="received"}``)."""
    metrics: dict[str, float] = {}
    for line in node.metrics_text().splitlines():
        if line.startswith("velo_streaming_") and "_bucket{" not in line:
            sample, _, value = line.rpartition(" ")
            metrics[sample] = float(value)
    return metrics


def datagram_report(node: Node) -> list[dict[str, Any]]:
    """Each connection's datagram size and how it was chosen, from the node's snapshot."""
    return [
        {"outbound": c.outbound, "size": c.datagram_size, "mode": c.datagram_mode}
        for c in node.snapshot().transport.connections
    ]


def transport_metrics(node: Node) -> dict[str, float]:
    """The node's path MTU samples (probes, black holes, sends too big for the device)."""
    metrics: dict[str, float] = {}
    for line in node.metrics_text().splitlines():
        if line.startswith(("velo_transport_pmtu_", "velo_transport_datagrams_too_big")):
            sample, _, value = line.rpartition(" ")
            metrics[sample] = float(value)
    return metrics


async def settle(node: Node, timeout: float = 20.0) -> None:
    """Until no connection searches for its datagram size. The search reports to no event
    a test process could await, so this is a bounded poll of the snapshot."""
    async with asyncio.timeout(timeout):
        while any(c["mode"] == "searching" for c in datagram_report(node)):
            await asyncio.sleep(0.05)


def mux_config(args: argparse.Namespace) -> MuxConfig | None:
    return MuxConfig(enabled=False) if args.transport == PER_STREAM_KEY else None


async def consume(args: argparse.Namespace) -> int:
    streaming = StreamingConfig(heartbeat_interval=args.heartbeat) if args.heartbeat else None
    async with await Node.start(
        args.credentials, host=args.host, port=0, streaming=streaming, mux=mux_config(args)
    ) as node:
        anchors = [node.create_anchor() for _ in range(args.streams)]
        emit(
            "ready",
            instance=str(node.instance_id),
            address=list(node.address),
            handles=[[a.handle.to_wire()["hi"], a.handle.to_wire()["lo"]] for a in anchors],
        )
        results: list[dict[str, Any]] = [{} for _ in anchors]
        flowing = 0

        async def read(index: int, anchor: StreamAnchor[Any]) -> None:
            nonlocal flowing
            count, in_order, outcome = 0, True, "timeout"
            try:
                while True:
                    for item in await anchor.take_ready():
                        in_order &= item == [index, count]
                        count += 1
                        if count == args.flowing:
                            flowing += 1
                            if flowing == args.streams:
                                emit("flowing")
            except StopAsyncIteration:
                outcome = "finalized"
            except StreamError as exc:
                outcome = type(exc).__name__
            finally:  # also when cancelled at the deadline: "timeout"
                results[index] = {
                    "count": count,
                    "in_order": in_order,
                    "outcome": outcome,
                    "ended_at": time.monotonic(),
                }

        readers = [asyncio.create_task(read(i, a)) for i, a in enumerate(anchors)]
        started = time.monotonic()
        _, pending = await asyncio.wait(readers, timeout=args.timeout)
        for reader in pending:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        emit(
            "report",
            streams=results,
            elapsed=time.monotonic() - started,
            metrics=streaming_metrics(node),
            datagrams=datagram_report(node),
            transport_metrics=transport_metrics(node),
        )
    return 0


async def produce(args: argparse.Namespace) -> int:
    identity, _, address = args.peer.partition("@")
    host, _, port = address.rpartition(":")
    handles = [StreamAnchorHandle.pack(hi, lo) for hi, lo in json.loads(args.handles.read_text())]
    async with await Node.start(
        args.credentials, host=args.host, port=0, mux=mux_config(args)
    ) as node:
        node.add_peer(InstanceId.parse(identity), (host, int(port)))
        senders = await asyncio.gather(*(node.attach_anchor(h) for h in handles))
        emit("attached", transports=sorted({str(s.negotiated_transport()) for s in senders}))
        started = time.monotonic()
        for step in range(args.tokens):
            for index, sender in enumerate(senders):
                await sender.send([index, step])
            # A pass is an engine's forward pass, which awaits; this loop must too. send()
            # returns without suspending while the stream's window has room, so a loop of
            # sends alone never lets the event loop write its frames or heartbeats.
            await asyncio.sleep(args.interval)  # also paces a fake producer: not synchronisation
        if args.settle:  # before finalizing: the consumer closes once its streams ended
            await settle(node)
        datagrams, path_metrics = datagram_report(node), transport_metrics(node)
        retired = await asyncio.wait_for(
            asyncio.gather(*(s.finalize() for s in senders)), args.timeout
        )
        emit(
            "done",
            retired=dict(Counter(r.value for r in retired)),
            elapsed=time.monotonic() - started,
            metrics=streaming_metrics(node),
            datagrams=datagrams,
            transport_metrics=path_metrics,
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    roles = parser.add_subparsers(dest="role", required=True)
    consumer = roles.add_parser("consumer")
    consumer.add_argument("--credentials", type=Path, required=True)
    consumer.add_argument("--host", required=True)
    consumer.add_argument("--streams", type=int, required=True)
    consumer.add_argument("--timeout", type=float, default=60.0, help="for every stream to end")
    consumer.add_argument("--heartbeat", type=float, default=0.0, help="heartbeat window (s)")
    consumer.add_argument("--flowing", type=int, default=0, help="say so after K items each")
    consumer.set_defaults(handler=consume)
    producer = roles.add_parser("producer")
    producer.add_argument("--credentials", type=Path, required=True)
    producer.add_argument("--host", required=True)
    producer.add_argument("--peer", required=True, help="UUID@HOST:PORT of the consumer")
    producer.add_argument("--handles", type=Path, required=True, help="JSON [[hi, lo], ...]")
    producer.add_argument("--tokens", type=int, required=True)
    producer.add_argument("--interval", type=float, default=0.0, help="pause between passes")
    producer.add_argument("--timeout", type=float, default=60.0, help="for the retirements")
    producer.add_argument(
        "--settle", action="store_true", help="report once no datagram size search runs"
    )
    producer.set_defaults(handler=produce)
    for role in (consumer, producer):
        role.add_argument(
            "--transport", choices=[MESSENGER_MUX_KEY, PER_STREAM_KEY], default=MESSENGER_MUX_KEY
        )
    args = parser.parse_args()
    code: int = run(args.handler(args))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
