"""Error handling: every misuse gets a typed error from one tree, with what to do next.

Every exception the library raises on purpose derives from ``VelomuxError``. A program
catches a *branch*, the thing it does differently, not a module's private class::

    ConfigurationError  fix the settings or files and restart
    TransportError      the network: retry, or fix the peer's address
    CallError           an active message got no answer: retry, or give up on the request
    AttachError         an attach or a ticket produced no sender: give up on that stream
    StreamError         the consumer's stream ended abnormally
    SendError           the producer's send failed: the stream is over, or it had no room
    UsageError          an object used in a way it does not allow (a bug in the caller)

It provokes one error of each kind on two real nodes, catches it by its branch, and prints
the branch, the class and the message. The cases:

- a bad configuration (``TransportConfig(lanes=17)``) and a missing certificate directory;
- a bad attach: a handle no anchor has, an MPSC handle given to ``attach_anchor``;
- a reused zero-RTT ticket;
- a call to a handler the peer does not have, and one whose handler raised;
- a send after ``finalize``;
- the consumer side: a read that times out, and an anchor read twice.

Run it with ``python examples/error_handling.py [CERT_DIR]``. Only root imports.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from velomux_quic import (
    AnchorNotFound,
    AttachError,
    CallError,
    ChannelClosed,
    ConfigurationError,
    Context,
    CredentialsError,
    HandlerFailed,
    Node,
    ReadTimeout,
    SendError,
    StreamAnchorHandle,
    StreamError,
    TicketError,
    TransportConfig,
    TransportError,
    UnknownHandler,
    UsageError,
    VelomuxError,
    WrongHandleKind,
    ensure_dev_cluster,
    open_node,
)

BRANCHES: tuple[type[VelomuxError], ...] = (
    ConfigurationError,
    TransportError,
    CallError,
    AttachError,
    StreamError,
    SendError,
    UsageError,
)


def what_to_do(error: VelomuxError) -> str:
    """What a program does about ``error``: one ``except`` per branch, most specific first.

    ``ChannelClosed`` is both a ``SendError`` and a ``TransportError`` (the channel the send
    went to closed), so the producer's branch comes before the network's.
    """
    try:
        raise error
    except ConfigurationError:
        return "fix the settings or files, then restart"
    except SendError:
        return "stop producing into this stream (or retry the item later, for SendTimeout)"
    except TransportError:
        return "retry, or fix the peer's address"
    except CallError:
        return "retry the call elsewhere, or fail the request"
    except AttachError:
        return "give up on this stream: ask the consumer for a new handle or ticket"
    except StreamError:
        return "end this request (after a ReadTimeout it may read again); other streams go on"
    except UsageError:
        return "a bug in the caller: the message says which rule it broke"
    except VelomuxError:
        return "log it"


Case = Callable[[], Awaitable[object]]


def branches_of(error: VelomuxError) -> str:
    """The branches of the tree ``error`` belongs to (one, except for ChannelClosed)."""
    names = [branch.__name__ for branch in BRANCHES if isinstance(error, branch)]
    return " & ".join(names) or VelomuxError.__name__


async def provoke(title: str, case: Case, expected: type[VelomuxError]) -> bool:
    """Run one case; print how it failed. True when it raised ``expected``."""
    try:
        await case()
    except VelomuxError as error:  # the one root every deliberate error shares
        print(f"{title}\n  {branches_of(error)} > {type(error).__name__}: {error}")
        print(f"  -> {what_to_do(error)}")
        return isinstance(error, expected)
    print(f"{title}\n  no error: the example is wrong")
    return False


async def main(certs: Path) -> int:
    dirs = ensure_dev_cluster(certs, ("engine", "frontend"))
    async with (
        open_node(dirs["engine"]) as engine,
        open_node(dirs["frontend"], peers=[engine.record]) as frontend,
    ):
        engine.add_peer(frontend.instance_id, frontend.address)

        def overloaded(ctx: Context) -> bytes:
            raise RuntimeError("the model is not loaded yet; retry in a minute")

        engine.register_handler("generate", overloaded)
        results = [await provoke(*case) for case in cases(engine, frontend, certs)]

        # Catching by branch: one except clause per thing the program does differently.
        try:
            await frontend.attach_anchor(StreamAnchorHandle.pack(engine.worker_id, 12345))
        except AttachError as error:  # AnchorNotFound, AlreadyAttached, TicketError, ...
            print(f"caught by its branch: except AttachError -> {type(error).__name__}")
            results.append(isinstance(error, AnchorNotFound))

        print(f"{sum(results)} of {len(results)} misuses raised the expected error")
        ok = all(results)
        print("error handling OK" if ok else "error handling FAILED")
        return 0 if ok else 1


def cases(engine: Node, frontend: Node, certs: Path) -> list[tuple[str, Case, type[VelomuxError]]]:
    """Each misuse: a title, the coroutine that commits it, and the error it must raise."""

    async def bad_lanes() -> object:
        return TransportConfig(lanes=17)

    async def missing_credentials() -> object:
        async with open_node(certs / "no-such-node") as node:
            return node

    async def unknown_anchor() -> object:
        # The engine's worker id with an anchor number it never minted.
        return await frontend.attach_anchor(StreamAnchorHandle.pack(engine.worker_id, 999))

    async def mpsc_handle_to_attach_anchor() -> object:
        anchor = engine.create_mpsc_anchor()
        try:
            return await frontend.attach_anchor(anchor.handle)
        finally:
            anchor.cancel()

    async def reused_ticket() -> object:
        anchor = frontend.create_anchor()
        ticket = frontend.prebind_anchor(anchor.handle)
        sender = await engine.open_anchor_stream(anchor.handle, ticket)
        await sender.send("first")
        sender.finalize()
        assert [item async for item in anchor] == ["first"]
        return await engine.open_anchor_stream(anchor.handle, ticket)  # the same ticket again

    async def unknown_handler() -> object:
        return await frontend.call(engine.instance_id, "genrate", b"{}", timeout=10.0)

    async def handler_raised() -> object:
        return await frontend.call(engine.instance_id, "generate", b"{}", timeout=10.0)

    async def send_after_finalize() -> object:
        anchor = frontend.create_anchor()
        sender = await engine.attach_anchor(anchor.handle)
        await sender.send("last")
        sender.finalize()
        await sender.send("one too many")
        return sender

    async def read_timeout() -> object:
        anchor = frontend.create_anchor()
        sender = await engine.attach_anchor(anchor.handle)
        try:
            return await anchor.next(timeout=0.2)  # nothing was sent
        finally:
            sender.finalize()

    async def anchor_read_twice() -> object:
        anchor = frontend.create_anchor()
        sender = await engine.attach_anchor(anchor.handle)
        sender.finalize()
        assert [item async for item in anchor] == []
        return [item async for item in anchor]  # it ended: there is nothing to read again

    return [
        ("a lane count above 16", bad_lanes, ConfigurationError),
        ("a node directory with no certificate", missing_credentials, CredentialsError),
        ("attach to a handle no anchor has", unknown_anchor, AnchorNotFound),
        ("an MPSC handle given to attach_anchor", mpsc_handle_to_attach_anchor, WrongHandleKind),
        ("a zero-RTT ticket used twice", reused_ticket, TicketError),
        ("a call to a handler the engine lacks", unknown_handler, UnknownHandler),
        ("a call whose handler raised", handler_raised, HandlerFailed),
        ("a send after finalize", send_after_finalize, ChannelClosed),
        ("a read with nothing to read", read_timeout, ReadTimeout),
        ("reading an ended anchor again", anchor_read_twice, UsageError),
    ]


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(asyncio.run(main(Path(sys.argv[1]))))
    with tempfile.TemporaryDirectory() as scratch:
        sys.exit(asyncio.run(main(Path(scratch))))
