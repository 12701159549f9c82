"""A producer node in its own process, for fault tests: attach, stream until killed.

    python -m tests.procs.producer --credentials DIR --peer UUID@HOST:PORT --handle HI:LO \
        [--handle HI:LO ...] [--lanes N]

Attaches one sender per ``--handle``, prints one line ``attached`` once every stream sent
its first item, then sends an item to every stream each ``--interval`` seconds (a bounded
count), so a test can SIGKILL it mid-stream.
"""

from __future__ import annotations

import argparse
import asyncio

from velomux_quic.ids import InstanceId, StreamAnchorHandle
from velomux_quic.node import Node
from velomux_quic.programs.runtime import run
from velomux_quic.transport import TransportConfig


async def main(args: argparse.Namespace) -> int:
    identity, _, address = args.peer.partition("@")
    host, _, port = address.rpartition(":")
    handles = []
    for text in args.handle:
        hi, _, lo = text.partition(":")
        handles.append(StreamAnchorHandle.pack(int(hi), int(lo)))
    transport = TransportConfig(lanes=args.lanes)
    async with await Node.start(args.credentials, transport=transport) as node:
        node.add_peer(InstanceId.parse(identity), (host, int(port)))
        senders = [await node.attach_anchor(handle) for handle in handles]
        for number in range(args.count):
            for sender in senders:
                await sender.send({"n": number})
            if number == 0:
                print("attached", flush=True)
            await asyncio.sleep(args.interval)  # pacing of the fake producer, not synchronisation
        for sender in senders:
            sender.finalize()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--credentials", required=True)
    parser.add_argument("--peer", required=True)
    parser.add_argument("--handle", required=True, action="append")
    parser.add_argument("--lanes", type=int, default=1)
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--interval", type=float, default=0.01)
    raise SystemExit(run(main(parser.parse_args())))
