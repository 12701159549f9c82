"""A frontend asks an engine for tokens, and the engine streams them back.

Two nodes in one process, each with its own certificate (made on demand under the
directory given as the first argument, a temporary one by default):

1. the engine registers a ``generate`` handler, run with ``dispatch="spawn"`` because
   it awaits (it opens a stream and sends tokens into it);
2. the frontend creates an anchor for the request, pre-binds it for a zero-RTT
   ticket, and calls ``generate`` with the handle and the ticket;
3. the handler opens the stream with the ticket (no attach round trip), streams the
   tokens and finalizes; the frontend reads them as they come;
4. two deliberate mistakes show the typed errors: a second pre-bind of one anchor
   (``TicketError``) and a call to a handler the engine does not have
   (``UnknownHandler``), both caught as their ``VelomuxError`` branches.

Run it with ``python examples/quickstart.py``. It imports nothing but the package root.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

from velomux_quic import (
    AttachError,
    CallError,
    Context,
    Node,
    StreamAnchorHandle,
    StreamOpenTicket,
    TicketError,
    UnknownHandler,
    VelomuxError,
    ensure_dev_cluster,
    open_node,
)

TOKENS = 12


def serve_generate(engine: Node) -> None:
    """Register the engine's request handler: open the request's stream and fill it."""

    async def generate(ctx: Context) -> bytes:
        request = json.loads(bytes(ctx.payload))
        handle = StreamAnchorHandle(int(request["handle"]))
        ticket = StreamOpenTicket.decode(bytes.fromhex(request["ticket"]))
        sender = await engine.open_anchor_stream(handle, ticket)
        for index in range(int(request["tokens"])):
            await sender.send({"index": index, "text": f"token-{index}"})
        await sender.finalize()
        return json.dumps({"sent": int(request["tokens"])}).encode()

    engine.register_handler("generate", generate, dispatch="spawn")


async def main(certs: Path) -> int:
    dirs = ensure_dev_cluster(certs, ("engine", "frontend"))
    async with (
        open_node(dirs["engine"]) as engine,
        open_node(dirs["frontend"], peers=[engine.record]) as frontend,
    ):
        engine.add_peer(frontend.instance_id, frontend.address)  # where the stream goes
        serve_generate(engine)

        anchor = frontend.create_anchor()
        ticket = frontend.prebind_anchor(anchor.handle)
        try:
            frontend.prebind_anchor(anchor.handle)
        except TicketError as error:  # an AttachError: this anchor already has its ticket
            assert isinstance(error, AttachError)
            print(f"second prebind refused: {type(error).__name__}")

        request = {"handle": str(anchor.handle.value), "ticket": ticket.encode().hex()}

        async def read_tokens() -> list[object]:
            return [item async for item in anchor]

        reply, tokens = await asyncio.gather(
            frontend.call(
                engine.instance_id,
                "generate",
                json.dumps({**request, "tokens": TOKENS}).encode(),
                timeout=30.0,
            ),
            read_tokens(),
        )
        print(f"engine replied {json.loads(reply)}; frontend read {len(tokens)} tokens")
        print(f"first {tokens[0]}, last {tokens[-1]}")

        try:
            await frontend.call(engine.instance_id, "no-such-handler", timeout=30.0)
        except UnknownHandler as error:  # a CallError, like every failed call
            assert isinstance(error, CallError) and isinstance(error, VelomuxError)
            print(f"unknown handler refused: {type(error).__name__}")

        ok = len(tokens) == TOKENS and json.loads(reply) == {"sent": TOKENS}
        print("quickstart OK" if ok else "quickstart FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(asyncio.run(main(Path(sys.argv[1]))))
    with tempfile.TemporaryDirectory() as scratch:
        sys.exit(asyncio.run(main(Path(scratch))))
