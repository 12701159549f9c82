"""A member that floods a victim with requests, in its own process, for fairness tests.

    python -m tests.procs.flooder --credentials DIR --victim INSTANCE --host H --port P

Sends ``echo`` requests of 1 KB on lane 0 as fast as the victim admits them (it reads the
replies, like an honest but greedy peer), prints one line once the first thousand are
admitted, and exits when stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from velomux_quic.ids import InstanceId
from velomux_quic.messenger.envelope import Kind, encode_envelope
from velomux_quic.programs.runtime import run
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport.admission import SendAdmission
from velomux_quic.transport.endpoint import QuicEndpoint

_PAYLOAD = bytes(1000)


async def flood(transport: QuicEndpoint, victim: InstanceId) -> None:
    sent = 0
    announced = False
    while True:
        outcomes = [
            transport.send(
                victim,
                0,
                encode_envelope(
                    Kind.REQUEST, handler="echo", message_id=sent + i, payload=_PAYLOAD
                ),
            )
            for i in range(1, 201)
        ]
        sent += len(outcomes)
        for outcome in outcomes:
            if isinstance(outcome, SendAdmission):
                await outcome
        await asyncio.sleep(0)  # let replies in between bursts
        if not announced and sent >= 1000:
            announced = True
            print("flooding", flush=True)


async def main(args: argparse.Namespace) -> int:
    credentials = NodeCredentials.load(args.credentials)
    transport = await QuicEndpoint.start(credentials)
    try:
        victim = InstanceId.parse(args.victim)
        transport.register_peer(victim, (args.host, args.port))
        task = asyncio.ensure_future(flood(transport, victim))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)  # until stdin closes
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await transport.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--credentials", required=True)
    parser.add_argument("--victim", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    raise SystemExit(run(main(parser.parse_args())))
