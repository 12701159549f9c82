"""A victim node in its own process, for hostile-peer tests: it reports what it holds.

    python -m tests.procs.victim --credentials DIR

Prints one JSON line (its instance id and address), then answers one command per line on
stdin, each with one JSON line on stdout:

* ``report``: its resident memory (VmRSS of /proc/self/status, in KiB, after a garbage
  collection), every sample of the ``velo_transport_rejections_total`` and
  ``velo_streaming_mux_*`` series and of the messenger's pull refusals, and what its
  snapshot says it holds (connections, unfinished openings and frames, pulls, mux slots);
* ``anchor``: makes an anchor, starts reading it, and prints its handle;
* ``dial INSTANCE HOST PORT``: adds that peer and dials it (a hostile server's requests
  then reach this node on the connection it dialed);
* ``result``: waits for the anchor's stream to end and prints what it read.

It exits when stdin closes. Its memory is its own: the attackers run in the test process.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
from typing import Any

from velomux_quic.ids import InstanceId
from velomux_quic.node import Node
from velomux_quic.programs.runtime import run

_REPORTED = (
    "velo_transport_rejections_total",
    "velo_streaming_mux_",
    "velo_messenger_staged_pulls_refused_total",
    "velo_rendezvous_pulls_outstanding",
    "velo_rendezvous_refusals_total",
    "velo_messenger_staged_releases_skipped_total",
    "velo_messenger_replies_dropped_total",
    "velo_messenger_pending_reply_bytes",
    "velo_messenger_handler_requests_total",
    "velo_transport_unacked_cap_reached_total",
    "velo_transport_peer_turns_waited_total",
)


def resident_kib() -> int:
    """This process's resident set size, from the kernel's own account of it."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def report(node: Node) -> dict[str, Any]:
    gc.collect()
    samples: dict[str, float] = {}
    for family in node.registry.collect():
        for sample in family.samples:
            if sample.name.startswith(_REPORTED) and not sample.name.endswith("_created"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    snapshot = node.snapshot()
    connections = snapshot.transport.connections
    mux = snapshot.mux
    return {
        "rss_kib": resident_kib(),
        "metrics": samples,
        "connections": len(connections),
        "stream_openings": sum(c.stream_openings for c in connections),
        "partial_frame_bytes": sum(c.partial_frame_bytes for c in connections),
        "unacked_bytes": sum(c.unacked_bytes for c in connections),
        "pulls_outstanding": snapshot.messenger.pulls_outstanding,
        "releases_outstanding": snapshot.messenger.releases_outstanding,
        "pending_reply_bytes": snapshot.messenger.pending_reply_bytes,
        "partial_requests": sum(c.partial_requests for c in connections),
        "mux_live_ingress_slots": (
            sum(lane.live_slots for lane in mux.ingress.values()) if mux is not None else 0
        ),
    }


async def main(args: argparse.Namespace) -> int:
    async with await Node.start(args.credentials) as node:
        node.register_handler("sink", lambda ctx: None)
        node.register_handler("echo", lambda ctx: bytes(ctx.payload))
        host, port = node.address
        print(json.dumps({"instance": str(node.instance_id), "host": host, "port": port}))
        sys.stdout.flush()
        loop = asyncio.get_running_loop()
        reading: asyncio.Task[list[object]] | None = None
        while True:
            command = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if not command:  # stdin closed
                break
            if command == "report":
                answer: dict[str, Any] = report(node)
            elif command == "anchor":
                anchor = node.create_anchor()

                async def read_all(source: Any = anchor) -> list[object]:
                    return [item async for item in source]

                reading = asyncio.ensure_future(read_all())
                answer = {"handle": anchor.handle.to_wire()}
            elif command.startswith("dial "):
                _, instance, host, port = command.split()
                peer = InstanceId.parse(instance)
                node.add_peer(peer, (host, int(port)))
                await node.messenger.transport.connect(peer)
                answer = {"dialed": instance}
            elif command == "result" and reading is not None:
                items = await asyncio.wait_for(reading, 30)
                answer = {"items": items}
            else:
                answer = {"error": f"unknown command {command!r}"}
            print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--credentials", required=True)
    raise SystemExit(run(main(parser.parse_args())))
