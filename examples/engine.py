"""A token-streaming engine: one process that answers ``generate`` requests with streams.

Run it first, then the frontend it prints the command line for::

    python examples/engine.py --certs /tmp/velomux-certs
    # engine ready: python examples/frontend.py --certs /tmp/velomux-certs \
    #     --engine <instance id> --address 127.0.0.1:<port>

What it shows:

- **the request carries the stream.** A frontend's ``generate`` request holds the
  anchor's handle and a zero-RTT ticket (``Node.prebind_anchor`` on the frontend). The
  handler opens the stream with ``open_anchor_stream``: no attach round trip, the first
  batch claims the slot the frontend bound. It runs with ``dispatch="spawn"`` because it
  awaits; under the default ``"ordered"`` one frontend's requests would wait for each
  other.
- **forward passes, like a decode engine.** The handler only admits the request into
  the running batch and answers at once. One loop then does a pass every ``--pass-ms``
  (10 ms by default): one token to every active stream, then ``flush_batch()``, so the
  mux writes every token of the pass to one frontend in one batch (the engine runs
  ``MuxConfig(flush_policy=Manual())``, the policy a pass-structured producer wants).
- **finding each other.** The engine prints its InstanceId and address; the frontend
  takes them on its command line. The engine needs no address for the frontend: the
  streams go back over the connection the frontend opened to send its requests (the
  handle names the frontend's node, and the engine knows that node from the connection,
  as its certificate proved it; that is also ``ctx.sender``).

Both processes need certificates from one cluster CA: both are made on demand under
``--certs`` (the engine's ``engine`` and the frontend's ``frontend`` directory).
SIGINT or SIGTERM stop the engine cleanly; ``--exit-after N`` stops it after it
finished N streams (what the test uses). Only root imports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from velomux_quic import (
    Context,
    Manual,
    MuxConfig,
    Node,
    SendError,
    StreamAnchorHandle,
    StreamOpenTicket,
    StreamSender,
    VelomuxError,
    ensure_dev_cluster,
    open_node,
)

NODE_NAMES = ("engine", "frontend")


@dataclass
class ActiveRequest:
    """One request in the running batch: its stream and how many tokens remain."""

    request_id: str
    sender: StreamSender
    remaining: int
    produced: int = 0


class Engine:
    """The admitted requests and the forward-pass loop that feeds them."""

    def __init__(self, node: Node, pass_seconds: float, exit_after: int | None) -> None:
        self.node = node
        self.pass_seconds = pass_seconds
        self.exit_after = exit_after
        self.active: list[ActiveRequest] = []
        self.finished_streams = 0
        self.tokens_sent = 0
        self.passes = 0
        self.work = asyncio.Event()
        self.done = asyncio.Event()

    async def generate(self, ctx: Context) -> bytes:
        """Admit one request: open its stream from the ticket it carries and answer."""
        request = json.loads(bytes(ctx.payload))
        handle = StreamAnchorHandle(int(request["handle"]))
        ticket = StreamOpenTicket.decode(bytes.fromhex(request["ticket"]))
        sender = await self.node.open_anchor_stream(handle, ticket)  # no attach round trip
        self.active.append(ActiveRequest(str(request["id"]), sender, int(request["tokens"])))
        self.work.set()
        return json.dumps({"accepted": request["id"], "batch": len(self.active)}).encode()

    async def run_passes(self) -> None:
        """Forward passes: one token per active request, then one flush for all of them."""
        next_pass = time.monotonic()
        while True:
            if not self.active:
                self.work.clear()
                await self.work.wait()
                next_pass = time.monotonic()
            next_pass += self.pass_seconds
            await asyncio.sleep(max(0.0, next_pass - time.monotonic()))  # the model's compute
            self.passes += 1
            still_running: list[ActiveRequest] = []
            for request in self.active:
                text = f"tok{request.produced}"
                try:
                    # 32 records of credit per stream: a frontend that reads never waits here.
                    await request.sender.send({"i": request.produced, "text": text})
                except SendError as error:  # the frontend cancelled it or went away
                    print(f"request {request.request_id} ended early: {error}", flush=True)
                    continue
                request.produced += 1
                request.remaining -= 1
                self.tokens_sent += 1
                if request.remaining > 0:
                    still_running.append(request)
                else:
                    request.sender.finalize()
                    self.finished_streams += 1
            self.active = still_running
            self.node.flush_batch()  # Manual policy: this pass's tokens go out now
            if self.exit_after is not None and self.finished_streams >= self.exit_after:
                self.done.set()


async def serve(certs: Path, pass_ms: float, exit_after: int | None, port: int) -> int:
    dirs = ensure_dev_cluster(certs, NODE_NAMES)
    async with open_node(
        dirs["engine"], port=port, mux=MuxConfig(flush_policy=Manual()), name="engine"
    ) as node:
        engine = Engine(node, pass_ms / 1000.0, exit_after)
        node.register_handler("generate", engine.generate, dispatch="spawn")
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, engine.done.set)
        host, bound_port = node.address
        print(
            "engine ready: python examples/frontend.py "
            f"--certs {certs} --engine {node.instance_id} --address {host}:{bound_port}",
            flush=True,
        )
        passes = asyncio.create_task(engine.run_passes())
        try:
            await engine.done.wait()
        finally:
            passes.cancel()
            await asyncio.gather(passes, return_exceptions=True)
        live = node.snapshot().mux
        print(
            f"engine done: {engine.finished_streams} streams, {engine.tokens_sent} tokens "
            f"in {engine.passes} passes; live egress slots "
            f"{sum(lane.live_slots for lane in live.egress.values()) if live else 0}",
            flush=True,
        )
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--certs", type=Path, default=Path("certs/examples"))
    parser.add_argument("--port", type=int, default=0, help="UDP port (0: any free one)")
    parser.add_argument("--pass-ms", type=float, default=10.0, help="forward-pass period")
    parser.add_argument("--exit-after", type=int, default=None, help="stop after N streams")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(serve(args.certs, args.pass_ms, args.exit_after, args.port))
    except VelomuxError as error:  # a bad certificate directory, say: the message says what to do
        print(f"engine failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
