"""A consumer node in its own process, for fault tests: make anchors, never read them.

    python -m tests.procs.consumer --credentials DIR --anchors N

Prints one JSON line (its instance id, address and the anchors' handles), then waits until
it is killed or its stdin closes, so a test can SIGKILL it while producers hold no credit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from velomux_quic.node import Node
from velomux_quic.programs.runtime import run


async def main(args: argparse.Namespace) -> int:
    async with await Node.start(args.credentials) as node:
        anchors = [node.create_anchor() for _ in range(args.anchors)]
        handles = [anchor.handle.to_wire() for anchor in anchors]
        host, port = node.address
        line = {"instance": str(node.instance_id), "host": host, "port": port, "handles": handles}
        print(json.dumps(line), flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)  # until stdin closes (or a kill)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--credentials", required=True)
    parser.add_argument("--anchors", type=int, default=1)
    raise SystemExit(run(main(parser.parse_args())))
