"""A producer node in its own process, for fault tests: attach, stream until killed.

    python -m tests.procs.producer --credentials DIR --peer UUID@HOST:PORT --handle HI:LO

Prints one line ``attached`` once the first item was sent, then sends an item every
``--interval`` seconds (a bounded count), so a test can SIGKILL it mid-stream.
"""

from __future__ import annotations

import argparse
import asyncio

from velomux_quic.ids import InstanceId, StreamAnchorHandle
from velomux_quic.node import Node
from velomux_quic.runtime import run


async def main(args: argparse.Namespace) -> int:
    identity, _, address = args.peer.partition("@")
    host, _, port = address.rpartition(":")
    hi, _, lo = args.handle.partition(":")
    async with await Node.start(args.credentials) as node:
        node.add_peer(InstanceId.parse(identity), (host, int(port)))
        sender = await node.attach_anchor(StreamAnchorHandle.pack(int(hi), int(lo)))
        for number in range(args.count):
            await sender.send({"n": number})
            if number == 0:
                print("attached", flush=True)
            await asyncio.sleep(args.interval)  # pacing of the fake producer, not synchronisation
        sender.finalize()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--credentials", required=True)
    parser.add_argument("--peer", required=True)
    parser.add_argument("--handle", required=True)
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--interval", type=float, default=0.01)
    raise SystemExit(run(main(parser.parse_args())))
