"""A QUIC transport in its own process, killed and restarted by the stateless-reset tests.

    python -m tests.procs.resettable --credentials DIR [--port P] [--dial ID HOST PORT]

It prints one JSON line when it is listening (its instance id and address) and, with
``--dial``, one more once its connection to that peer is up. Then it waits until stdin
closes (or the test kills it). Restarted with the same credentials and port it holds no
connection state, as after a crash, and answers the peer's packets with stateless resets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from velomux_quic.ids import InstanceId
from velomux_quic.programs.runtime import run
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport import QuicEndpoint, TransportHandler


class Watcher(TransportHandler):
    """Sets an event when a connection with a peer comes up and when one ends."""

    def __init__(self) -> None:
        self.up = asyncio.Event()
        self.down = asyncio.Event()

    def peer_connected(self, peer: InstanceId, outbound: bool) -> None:
        self.up.set()

    def peer_disconnected(self, peer: InstanceId, outbound: bool) -> None:
        self.down.set()


def say(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def main(args: argparse.Namespace) -> int:
    credentials = NodeCredentials.load(args.credentials)
    async with await QuicEndpoint.start(credentials, port=args.port) as transport:
        say(instance=str(transport.instance_id), address=list(transport.address))
        if args.dial:
            peer = InstanceId.parse(args.dial[0])
            transport.register_peer(peer, (args.dial[1], int(args.dial[2])))
            await transport.connect(peer)
            say(event="connected")
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--credentials", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dial", nargs=3, metavar=("ID", "HOST", "PORT"))
    sys.exit(run(main(parser.parse_args())))
