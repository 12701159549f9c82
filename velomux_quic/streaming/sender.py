"""The producer's end of a stream: StreamSender.

``await send(item)`` stages a record, waiting only while the stream's channel is full (that
wait is the backpressure; ``timeout=`` bounds it). ``finalize()`` and ``detach()`` hand the
terminal over without blocking and both return the future of the stream's retirement
(:class:`Retired`); dropping a sender without a terminal still ends the stream: the
consumer sees ``SenderDropped``.

The consumer's cancel and graceful stop reach the producer as two read-only conditions:
``is_cancelled`` / ``await wait_cancelled()`` and ``is_stop_requested`` /
``await wait_stop_requested()``. Only the library sets them.

:func:`send_pass` hands a whole forward pass over in one call: one record to each of many
streams, under the rules ``send()`` follows, reporting per pair what it could not take.

``send()`` and the pass loop run once per token, so this module is one of the record path's
compiled modules (velomux_quic.recordpath): where built, this same file is compiled, with
the C declarations of ``sender.pxd`` (the fields every record's send reads, kept in C);
otherwise it runs as it is.
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import weakref
from collections.abc import Callable, Coroutine, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal, NoReturn, Protocol, cast

try:
    import cython  # type: ignore[import-not-found, unused-ignore]
except ModuleNotFoundError:  # run as source, where Cython (needed only to build) is absent
    from ..recordpath import shadow as cython  # type: ignore[no-redef, unused-ignore]

from ..errors import ChannelClosed, SendTimeout, SerializationError, UsageError
from ..ids import InstanceId, StreamAnchorHandle
from ..recordpath import companion
from .channels import ProducerChannel, StagingChannel
from .frames import (
    DETACHED,
    DROPPED,
    FINALIZED,
    ITEM_PREFIX,
    PACKER_BUFFER,
    SHUTDOWN,
    ItemPacker,
    encode_item,
    encode_sender_error,
    item_frame,
)
from .metrics import StreamingMetrics
from .reader import thrown_exception

__all__ = [
    "PassOutcome",
    "Retired",
    "SenderOwner",
    "SenderState",
    "SenderStateName",
    "StreamSender",
    "send_pass",
]

logger = logging.getLogger(__name__)

SenderStateName = Literal["open", "finished", "detached", "dropped", "cancelled"]
"""Where a sender is in its life: sending (``open``) or how its stream ended here."""

_TERMINAL_STATES: dict[bytes, SenderStateName] = {
    FINALIZED: "finished",
    DETACHED: "detached",
    DROPPED: "dropped",
}


class Retired(enum.Enum):
    """How a stream's output ended on the producer's node (first outcome wins).

    What ``SENT`` promises depends on the path. On the mux (the default between two
    nodes that both have it): the peer's QUIC stack acknowledged the batch that carried
    the terminal, and every staged record of the stream was pulled by the peer. The
    consumer's node therefore holds the whole stream, in order; its reader gets to the
    end unless the stream had already ended there (the consumer cancelled it, or its
    watchdog fired first) or that node fails before the reader takes it. No message of
    the consumer confirms it (the Batched streaming chapter rejected that round trip per stream).
    On the per-stream path: the terminal was admitted to the stream's QUIC send buffer.
    To a same-node anchor: it is in the anchor's channel."""

    SENT = "sent"
    """The terminal reached the consumer's node (see the class docstring for each path)."""
    DISCARDED = "discarded"
    """The terminal did not reach the consumer's node, as far as this node knows: it never
    left (channel closed, consumer cancelled, teardown), it left and its connection ended
    before the peer acknowledged it, or a staged record of the stream was never pulled
    (the consumer's node refused it as over its ``staged_payload_max``, or nobody pulled
    it in time)."""


# Read per stream end: an enum member read off its class runs the enum type's attribute
# hook each time, a module global does not.
_SENT: Final = Retired.SENT
_DISCARDED: Final = Retired.DISCARDED


class SenderOwner(Protocol):
    """What a sender's state tells the node's producer side (the only call back up)."""

    def sender_finished(self, state: SenderState) -> None:
        """The sender handed over its terminal or was cancelled: forget it, no heartbeats."""

    def sender_retired(self, state: SenderState) -> None:
        """The sender's retirement future resolved (its terminal's fate is known)."""


class SenderState:
    """Everything a sender's lifetime needs, apart from the sender object itself, so that
    ``weakref.finalize`` can end a dropped sender's stream without keeping it alive.

    Every record's send reads ``terminal_sent`` (the stream took its terminal) and
    ``channel`` (where the record goes); compiled, all the fields are C fields."""

    __slots__ = (
        "__weakref__",
        "cancelled",
        "channel",
        "handle",
        "heartbeat_interval",
        "loop",
        "metrics",
        "next_heartbeat",
        "owner",
        "retired",
        "sender_id",
        "sender_stream_id",
        "staging",
        "state",
        "stop_requested",
        "target",
        "terminal_body",
        "terminal_sent",
        "transport_key",
    )

    channel: ProducerChannel
    terminal_sent: bool
    terminal_body: bytes

    def __init__(
        self,
        owner: SenderOwner,
        metrics: StreamingMetrics,
        handle: StreamAnchorHandle,
        channel: ProducerChannel,
        *,
        sender_stream_id: int,
        transport_key: str | None,
        target: InstanceId | None,
        heartbeat_interval: float | None,
        sender_id: int = 0,
    ) -> None:
        self.owner = owner
        self.metrics = metrics
        self.handle = handle
        self.channel = channel
        self.staging = channel if isinstance(channel, StagingChannel) else None
        """The channel again where it is a :class:`StagingChannel`, which the per-record
        sends call as one (compiled, a C call); None for any other channel."""
        self.sender_stream_id = sender_stream_id
        self.transport_key = transport_key
        self.target = target
        self.sender_id = sender_id
        self.heartbeat_interval = heartbeat_interval
        self.loop = asyncio.get_running_loop()
        self.next_heartbeat = self.loop.time() + (heartbeat_interval or 0.0)
        self.retired: asyncio.Future[Retired] = self.loop.create_future()
        self.cancelled = asyncio.Event()
        self.stop_requested = asyncio.Event()
        self.terminal_sent = False
        self.terminal_body = b""
        self.state: SenderStateName = "open"

    def terminal(self, body: bytes) -> asyncio.Future[Retired]:
        """Hand over the stream's last record once; later calls return the same future.

        The stream takes no record after this call, but an ending terminal is staged only
        once the channel has handed on the records it took in this loop turn
        (``after_records``): a producer that ends many streams right after their last
        records (a decode loop's last pass) would otherwise hold those records back by
        every end's bookkeeping, on this node and, in the same batch, on the consumer's.
        A Detached is staged at once: the consumer takes the next sender's attach, from
        whichever node, only once it arrived, so it must not wait for anything."""
        if self.terminal_sent:
            return self.retired
        self.terminal_sent = True
        self.state = _TERMINAL_STATES.get(body, "dropped")
        self.owner.sender_finished(self)
        self.terminal_body = body
        if body == DETACHED:
            self._stage_terminal()
        else:
            self.channel.after_records(self._stage_terminal)
        return self.retired

    def _stage_terminal(self) -> None:
        """The second half of :meth:`terminal`: the channel's records are handed on."""
        if self.retired.done():  # abandoned meanwhile: the node closed
            return
        channel = self.channel
        if self.cancelled.is_set() or channel.closed:
            if not channel.closed:  # cancelled meanwhile, and its cancel left the channel
                channel.abort()
            self._retire(_DISCARDED)
            return
        body = self.terminal_body
        done: asyncio.Future[bool] = self.loop.create_future()
        done.add_done_callback(lambda f: self._retire(_SENT if f.result() else _DISCARDED))
        channel.send_terminal(body, done)

    def shut_down(self) -> asyncio.Future[Retired]:
        """This node is closing: end the stream on the wire now with the shutdown terminal
        (records not written yet are discarded where the channel can, on the mux), so the
        consumer learns at once instead of by its watchdog. A sender that already handed
        over its terminal keeps it; its retirement future is returned either way."""
        if self.terminal_sent:
            return self.retired
        self.terminal_sent = True
        self.state = "dropped"
        self.owner.sender_finished(self)
        if self.cancelled.is_set() or self.channel.closed:
            self.cancelled.set()
            self.stop_requested.set()
            self._retire(_DISCARDED)
            return self.retired
        done: asyncio.Future[bool] = self.loop.create_future()
        # Retired by the terminal's fate, but never SENT: the stream did not finish.
        done.add_done_callback(lambda _: self._retire(_DISCARDED))
        end_now = getattr(self.channel, "end_now", None)
        (end_now or self.channel.send_terminal)(SHUTDOWN, done)
        # A producer awaiting wait_cancelled() learns that its stream is over.
        self.cancelled.set()
        self.stop_requested.set()
        return self.retired

    def cancel(self) -> None:
        """The consumer cancelled: fire both conditions, stop writing."""
        self.cancelled.set()
        self.stop_requested.set()
        if not self.terminal_sent:
            self.terminal_sent = True
            self.state = "cancelled"
            self.channel.abort()
            self.owner.sender_finished(self)
            self._retire(_DISCARDED)

    def abandon(self) -> None:
        """The node closes and this stream's terminal has not left: drop it, retire
        DISCARDED (what an application awaiting ``retired()`` learns)."""
        self.cancelled.set()
        self.stop_requested.set()
        self.terminal_sent = True
        self.channel.abort()
        self._retire(_DISCARDED)

    def request_stop(self) -> None:
        """The consumer asked for a graceful stop (``_stream_stop`` or a local anchor's)."""
        self.stop_requested.set()

    # The mux's slot owner: what the consumer or the peer's health did to this stream.
    def slot_stopped(self) -> None:
        """The consumer asked for a graceful stop (LifecycleSlot stop)."""
        self.stop_requested.set()

    def slot_closed(self, reason: object) -> None:
        """The slot closed under the sender (consumer cancel, peer gone, protocol error):
        both conditions fire and later sends fail, as a ``_stream_cancel`` would do."""
        self.cancel()

    def _retire(self, outcome: Retired) -> None:
        if not self.retired.done():
            self.retired.set_result(outcome)
            self.owner.sender_retired(self)

    def dropped(self) -> None:
        """The sender object was garbage-collected: end its stream with Dropped."""
        if self.terminal_sent or self.loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self.loop.call_soon_threadsafe(self.terminal, DROPPED)


class StreamSender:
    """A producer attached to one anchor. Create with ``AnchorManager.attach_anchor``
    (or ``attach_mpsc_anchor``, or ``open_anchor_stream`` with a ticket)."""

    __slots__ = ("__weakref__", "_state")

    def __init__(self, state: SenderState) -> None:
        self._state = state
        # Never detached: once a terminal was handed over, ``dropped`` returns at once,
        # and a detach in every end would cost the turn in which many streams end.
        weakref.finalize(self, SenderState.dropped, state)

    @property
    def handle(self) -> StreamAnchorHandle:
        """The handle of the anchor this sender writes to."""
        return self._state.handle

    @property
    def sender_id(self) -> int:
        """This producer's id inside an MPSC anchor (0 for a single-sender anchor)."""
        return self._state.sender_id

    def negotiated_transport(self) -> str | None:
        """The transport key the attach settled on; None for a same-worker attach."""
        return self._state.transport_key

    @property
    def state(self) -> SenderStateName:
        """``open`` while it may send; else how it ended (finished, detached, dropped,
        cancelled)."""
        return self._state.state

    # -- the consumer's cancel and stop, read-only ---------------------------------------

    @property
    def is_cancelled(self) -> bool:
        """True once the consumer cancelled or dropped the stream; later sends fail."""
        return self._state.cancelled.is_set()

    async def wait_cancelled(self) -> None:
        """Return once the consumer cancelled or dropped the stream (at once if it has)."""
        await self._state.cancelled.wait()

    @property
    def is_stop_requested(self) -> bool:
        """True once the consumer asked for a graceful stop (or cancelled): send what
        remains, then finalize."""
        return self._state.stop_requested.is_set()

    async def wait_stop_requested(self) -> None:
        """Return once the consumer asked for a graceful stop or cancelled."""
        await self._state.stop_requested.wait()

    # -- flow ----------------------------------------------------------------------------

    @property
    def credit(self) -> int | None:
        """Records this sender may send now without waiting, as its channel knows it: the
        mux slot's credit window, a local anchor's free room; None on the per-stream
        path, whose QUIC window is in bytes. A snapshot: it changes as records move."""
        return self._state.channel.credit

    @property
    def lane(self) -> int | None:
        """The lane (0-15) the consumer placed this stream on under the mux (see
        ``key=`` on attach); None for a same-node anchor or the per-stream path."""
        return self._state.channel.lane

    @property
    def queued_bytes(self) -> int:
        """Bytes sent into the channel that are not on the wire yet (staged in the mux
        slot, or written to the QUIC stream and not transmitted)."""
        return self._state.channel.queued_bytes

    def send(self, item: Any, *, timeout: float | None = None) -> Coroutine[Any, Any, None]:
        """Send one item, waiting while the stream has no room (the backpressure):
        ``await sender.send(item)``.

        ``timeout`` bounds that wait: :class:`SendTimeout` when no room opened in time;
        the item was not taken and the stream goes on. Raises :class:`ChannelClosed` once
        the stream ended or the consumer cancelled it, and :class:`SerializationError`
        (nothing sent) for an item MessagePack cannot encode. A send that has to wait is
        counted in ``velo_streaming_producer_send_backpressure_total``.

        The call itself takes the item when the stream has room and returns
        :data:`SENT`, an awaitable already done; otherwise it returns the wait for room, a
        coroutine that takes the item once room opens. Await what it returns either way
        (``asyncio.create_task`` takes either). A producer that keeps up never waits, and
        this way its send makes no coroutine per item; the errors above are raised by the
        call, before anything is awaited.
        """
        state = self._state
        if state.terminal_sent:  # a cancel sets it too, so one flag guards the hot path
            raise _closed_error(state)
        body = encode_item(item)  # SerializationError for what MessagePack cannot hold
        staging = state.staging
        if staging.try_send(body) if staging is not None else state.channel.try_send(body):
            return SENT
        return _send_when_room(state, body, timeout)

    def try_send(self, item: Any) -> bool:
        """Send one item only if the stream has room now; never waits.

        True: taken, exactly as a ``send()`` that returned. False: not taken (the stream's
        credit window or byte budget, or on the mux the peer lane's queue bound
        ``peer_queue_bytes``, is full); the stream goes on, so retry later or shed the
        item. Counted in ``velo_streaming_producer_send_backpressure_total`` like a
        ``send()`` that waits. Raises :class:`ChannelClosed` once the stream ended or the
        consumer cancelled it, and :class:`SerializationError` for an item MessagePack
        cannot encode.
        """
        state = self._state
        if state.terminal_sent:
            raise _closed_error(state)
        body = encode_item(item)
        channel = state.channel
        if channel.try_send(body):
            return True
        if channel.closed:
            raise ChannelClosed("the stream's channel is closed")
        state.metrics.producer_send_backpressure += 1
        return False

    async def send_err(self, message: str) -> None:
        """A soft error: the consumer's iteration raises SenderError, the stream goes on."""
        state = self._state
        if state.terminal_sent or state.cancelled.is_set():
            raise ChannelClosed("the stream has ended")
        await state.channel.send(encode_sender_error(message))

    # -- the end -------------------------------------------------------------------------

    def finalize(self) -> asyncio.Future[Retired]:
        """End the stream normally (the consumer's iteration ends). Never blocks; the
        returned future resolves with the stream's :class:`Retired` outcome."""
        return self._state.terminal(FINALIZED)

    def detach(self) -> asyncio.Future[Retired]:
        """Leave without finishing: another sender may attach to :attr:`handle` and
        continue the stream. Never blocks; the returned future resolves with this
        sender's :class:`Retired` outcome (its Detached handed on, or discarded)."""
        return self._state.terminal(DETACHED)

    async def aclose(self) -> None:
        """End the stream as dropped if it was not finalized or detached."""
        self._state.terminal(DROPPED)

    async def __aenter__(self) -> StreamSender:
        """``async with sender:`` finalizes on leaving (see :meth:`__aexit__`)."""
        return self

    async def __aexit__(self, exc_type: object, *_: object) -> None:
        """Leaving the block finalizes the stream, or drops it if the block raised."""
        self._state.terminal(DROPPED if exc_type is not None else FINALIZED)

    def on_retired(self, callback: Callable[[Retired], None]) -> None:
        """Call ``callback(outcome)`` once the stream retires (at once if it has): what
        :meth:`retired` returns, without a task waiting for it per stream."""
        self._state.retired.add_done_callback(
            lambda done: None if done.cancelled() else callback(done.result())
        )

    async def retired(self) -> Retired:
        """Resolves once the consumer's node holds all of the stream's output
        (:attr:`Retired.SENT`), or once it is known that it never will (see
        :class:`Retired` for what each path promises)."""
        return await asyncio.shield(self._state.retired)


class SendDone:
    """What :meth:`StreamSender.send` returns when it took the item at once: an awaitable
    already done, which a task also runs as a coroutine (``send``, ``throw``, ``close``),
    so ``asyncio.create_task`` takes it. It holds nothing: one object, :data:`SENT`,
    serves every send.

    Compiled, ending an await through ``__next__`` costs a StopIteration for every item;
    ``_sender_send.pyx`` gives the type an ``am_send`` slot that ends it with a value (see
    :class:`~.reader.AnchorRead`).
    """

    __slots__ = ()

    __name__ = "StreamSender.send"
    """What asyncio calls it, as it would name the coroutine (a task's repr)."""

    def __await__(self) -> Generator[Any, None, None]:
        return self  # its own iterator, with send, throw and close

    def __iter__(self) -> SendDone:
        return self

    def __next__(self) -> NoReturn:
        raise StopIteration

    def send(self, value: object) -> NoReturn:
        raise StopIteration

    def throw(self, typ: Any, value: Any = None, traceback: Any = None) -> NoReturn:
        raise thrown_exception(typ, value, traceback)

    def close(self) -> None:
        pass


SENT: Final = cast("Coroutine[Any, Any, None]", SendDone())
"""The awaitable of every send that took its item at once (a coroutine to the type
checker, as it is to ``asyncio.iscoroutine``, through the ``Coroutine`` ABC's methods)."""


async def _send_when_room(state: SenderState, body: bytes, timeout: float | None) -> None:
    """The rest of a ``send()`` whose record found no room: fail if the channel closed,
    else count the backpressure and wait for room (at most ``timeout``). Apart from
    ``send()`` so that the common send stays short."""
    channel = state.channel
    if channel.closed:
        raise ChannelClosed("the stream's channel is closed")
    state.metrics.producer_send_backpressure += 1
    if timeout is None:
        await channel.send(body)
        return
    try:
        async with asyncio.timeout(timeout):
            await channel.send(body)
    except TimeoutError:
        raise SendTimeout(
            f"no room on the stream to {state.handle} within {timeout} s; the item "
            "was not sent: retry, shed it, or raise the consumer's read rate"
        ) from None


# -- a forward pass in one call ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PassOutcome:
    """What :func:`send_pass` (``Node.send_pass``) did with each pair it was given.

    Pairs are named by their position in the pass (0-based). A pair is in exactly one of
    three places: taken (sent, like a ``send()`` that returned), ``left`` (not taken:
    its stream had no room; hand it over again, in this order, once it has), or
    ``failed`` (not taken, never will be as it is: :class:`ChannelClosed` for an ended or
    cancelled stream, :class:`SerializationError` for an item MessagePack cannot hold).
    """

    taken: int
    """How many pairs were sent."""
    left: tuple[int, ...] = ()
    """Positions of the pairs left over for lack of room, in pass order."""
    failed: Mapping[int, ChannelClosed | SerializationError] = field(
        default_factory=lambda: MappingProxyType({})
    )
    """Position -> the error that pair would have raised from ``send()``."""

    @property
    def complete(self) -> bool:
        """Every pair was taken: nothing left over, nothing failed."""
        return not self.left and not self.failed


_PassEntry = tuple[int, SenderState, bytes]
"""A pair left over: its position, its sender's state and its encoded record."""


def _closed_error(state: SenderState) -> ChannelClosed:
    return ChannelClosed(
        "the stream was cancelled" if state.cancelled.is_set() else "the stream has ended"
    )


def _restage(
    entries: Iterable[tuple[int, SenderState, bytes]],
    failed: dict[int, ChannelClosed | SerializationError],
) -> tuple[int, list[_PassEntry]]:
    """Offer left-over records again without waiting; (taken, still left over). A stream
    that refuses a record takes none of its later ones in this round, so its order holds.
    Not counted as backpressure again: each left-over pair was counted once already."""
    taken = 0
    left: list[_PassEntry] = []
    blocked: set[int] = set()
    for entry in entries:
        index, state, body = entry
        if state.terminal_sent:
            failed[index] = _closed_error(state)
            continue
        if blocked and id(state) in blocked:
            left.append(entry)
            continue
        channel = state.channel
        if channel.try_send(body):
            taken += 1
            continue
        if channel.closed:
            failed[index] = ChannelClosed("the stream's channel is closed")
            continue
        blocked.add(id(state))
        left.append(entry)
    return taken, left


def _stage_pass(
    pairs: Iterable[tuple[StreamSender, Any]],
    failed: dict[int, ChannelClosed | SerializationError],
    left: list[_PassEntry],
) -> int:
    """The pass without waiting: each pair's record encoded and staged as ``send()`` would,
    what failed into ``failed``, what found no room (and every later pair of its stream)
    into ``left``, each of those counted once as backpressure. Returns how many were taken.
    The loop runs once per token: compiled, its counters and the sender's state are C
    variables (``sender.pxd``)."""
    blocked: set[int] = set()
    taken = 0
    packer = ItemPacker()  # encode_item inline: one packer for the pass
    pack = packer.pack
    # Read once a pass: interpreted, ``cython.compiled`` is a lookup on a module.
    compiled = cython.compiled
    prefix = ITEM_PREFIX
    packer_buffer = PACKER_BUFFER
    grew = False
    try:
        for index, (sender, item) in enumerate(pairs):
            state = sender._state
            if state.terminal_sent:  # ended or cancelled: what send() raises, for this pair
                failed[index] = _closed_error(state)
                continue
            try:
                packed = pack(item)
            except (TypeError, ValueError, OverflowError) as exc:
                failed[index] = packer.failed(item, exc)
                pack = packer.pack  # a fresh packer: a failed one is not used again
                continue
            if len(packed) > packer_buffer:
                grew = True
            body = item_frame(packed) if compiled else prefix + packed
            if blocked and id(state) in blocked:
                left.append((index, state, body))  # behind its stream's refused record
                state.metrics.producer_send_backpressure += 1
                continue
            channel = state.channel
            staging = state.staging
            if staging.try_send(body) if staging is not None else channel.try_send(body):
                taken += 1
                continue
            if channel.closed:
                failed[index] = ChannelClosed("the stream's channel is closed")
                continue
            blocked.add(id(state))
            left.append((index, state, body))
            state.metrics.producer_send_backpressure += 1
    finally:
        packer.release(grew)
    return taken


async def send_pass(
    pairs: Iterable[tuple[StreamSender, Any]],
    *,
    wait: bool = False,
    timeout: float | None = None,
) -> PassOutcome:
    """Send one item to each of many streams in one call: a decode engine's forward pass.

    ``pairs`` is ``(sender, item)`` in the order the items are to go; a sender may appear
    more than once (its items keep their order). Each item is taken exactly as
    ``sender.send(item)`` would take it: on the mux its record is staged into the slot of
    its stream under the same credit, byte budget and fence rules, and written under the
    node's flush policy (``AutoFlush``: the pass goes out at the end of the event-loop
    wake, in as few batches per peer and lane as the clamps allow, one flush each;
    ``Manual``: the caller still calls ``flush_batch()``). Senders on the per-stream path
    or to a same-node anchor take their records as their ``send()`` does.

    Errors are reported per pair, never raised for one pair, so one cancelled request
    does not fail the pass, and an item already taken is never lost or sent twice: the
    returned :class:`PassOutcome` names every pair that was not taken, with the
    :class:`ChannelClosed` or :class:`SerializationError` ``send()`` would have raised.
    A pair whose stream has no room (its byte budget is full) is left over, and so is
    every later pair of that stream in the call; each is counted once in
    ``velo_streaming_producer_send_backpressure_total``, as a ``send()`` that waits.

    ``wait=False`` (the default) never suspends: the left-overs are returned at once.
    ``wait=True`` waits for room for them in pass order, taking the others as room
    opens; ``timeout`` (seconds, with ``wait=True``) bounds the whole wait, after which
    what is still waiting is returned as left over (not raised: the outcome says which
    pairs were taken). Under ``Manual`` a wait for room needs the flushes that make it,
    exactly as a waiting ``send()`` does.

    Why a function over pairs and not a pass writer: an engine already holds its pass as
    (request, token) pairs, so one call with no object to keep or close is the least to
    get wrong, and the outcome is a value the engine can act on (retry ``left``, retire
    ``failed``) without callbacks.
    """
    if timeout is not None and not wait:
        raise UsageError("send_pass(timeout=...) bounds a wait: pass wait=True with it")
    failed: dict[int, ChannelClosed | SerializationError] = {}
    left: list[_PassEntry] = []
    taken = _stage_pass(pairs, failed, left)
    if left and wait:
        try:
            async with asyncio.timeout(timeout):
                while left:
                    index, state, body = left[0]
                    if state.terminal_sent:
                        failed[index] = _closed_error(state)
                    else:
                        try:
                            await state.channel.send(body)
                        except ChannelClosed as exc:
                            failed[index] = exc
                        else:
                            taken += 1
                    more, left = _restage(left[1:], failed)
                    taken += more
        except TimeoutError:
            pass
    return PassOutcome(
        taken,
        tuple(entry[0] for entry in left),
        MappingProxyType(dict(sorted(failed.items()))),
    )


companion("velomux_quic.streaming._sender_send")
