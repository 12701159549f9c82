"""A consumer node in its own process that reads its anchors and says how each ended.

    python -m tests.procs.reading_consumer --credentials DIR --anchors N [--heartbeat S]

Prints one JSON line (its instance id, address and the anchors' handles), then reads every
anchor concurrently and prints one JSON line per anchor as it ends: its index, the items
read, and how it ended (``finished``, or the error's class name and message). Exits after
the last one, or when its stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from velomux_quic.node import Node
from velomux_quic.programs.runtime import run
from velomux_quic.streaming.anchor import StreamAnchor
from velomux_quic.streaming.config import StreamingConfig


async def read(index: int, anchor: StreamAnchor[Any]) -> None:
    items: list[Any] = []
    outcome, message = "finished", ""
    try:
        async for item in anchor:
            items.append(item)
    except Exception as exc:  # the outcome is what the test checks
        outcome, message = type(exc).__name__, str(exc)
    line = {"index": index, "items": items, "outcome": outcome, "message": message}
    print(json.dumps(line), flush=True)


async def main(args: argparse.Namespace) -> int:
    streaming = StreamingConfig(heartbeat_interval=args.heartbeat)
    async with await Node.start(args.credentials, streaming=streaming) as node:
        anchors = [node.create_anchor() for _ in range(args.anchors)]
        handles = [anchor.handle.to_wire() for anchor in anchors]
        host, port = node.address
        line = {"instance": str(node.instance_id), "host": host, "port": port, "handles": handles}
        print(json.dumps(line), flush=True)
        loop = asyncio.get_running_loop()
        readers = asyncio.gather(*(read(index, anchor) for index, anchor in enumerate(anchors)))
        stdin = loop.run_in_executor(None, sys.stdin.read)  # until stdin closes (or a kill)
        await asyncio.wait([readers, stdin], return_when=asyncio.FIRST_COMPLETED)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--credentials", required=True)
    parser.add_argument("--anchors", type=int, default=1)
    parser.add_argument("--heartbeat", type=float, default=5.0)
    raise SystemExit(run(main(parser.parse_args())))
