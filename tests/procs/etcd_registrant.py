"""A process that registers one peer record in etcd and then only keeps its lease alive.

    python -m tests.procs.etcd_registrant --endpoint 127.0.0.1:2379 --prefix /p --ttl 2

Prints one JSON line, ``{"instance_id": ..., "connected": ...}``, once its record is in
etcd, then runs until it is killed or its stdin closes. The tests SIGKILL it to show
that a node that dies without closing leaves the others' registries when its lease lapses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from velomux_quic.discovery import EtcdPeers, PeerRecord
from velomux_quic.ids import new_instance_id


async def main(endpoint: str, prefix: str, ttl: int) -> None:
    peers = EtcdPeers([endpoint], prefix=prefix, lease_ttl=ttl)
    record = PeerRecord(new_instance_id(), ("127.0.0.1", 9), name="registrant")
    await peers.publish(record)
    print(json.dumps({"instance_id": str(record.instance_id), "connected": peers.connected}))
    sys.stdout.flush()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until stdin closes
    await peers.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--ttl", type=int, default=2)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.endpoint, arguments.prefix, arguments.ttl))
