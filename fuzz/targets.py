"""The fuzz targets: one per decoder that reads bytes a peer chose, and the oracle they share.

Each target takes one input (``bytes``) and runs a decoder on it. The oracle is the decoder's
own documented contract: for any input, the decoder either returns, or raises its one typed
refusal (the :class:`~velomux_quic.errors.ProtocolError` subclass its docstring names, "and
nothing else"). Anything else escaping (IndexError, struct.error, KeyError, OverflowError,
RecursionError, MemoryError, UnicodeDecodeError, a bare ValueError...) is a finding: the
caller that catches the typed refusal to drop and count a peer's bad bytes would crash on it
instead.

Where the decoder's output can be checked, a target also checks it and raises
:class:`InvariantBroken` when it is wrong: a record the batch decoder accepted must decode
with its body decoder, a decoded value re-encodes to the same bytes (or, where the wire
allows several spellings, to a value that decodes the same), the frame decoder agrees with
a one-shot reference parse however the stream is cut into chunks, and the quick sentinel
tests agree with the full decode.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from velomux_quic.discovery import PeerRecord
from velomux_quic.errors import (
    ControlDecodeError,
    FrameDecodeError,
    FrameTooLarge,
    FramingError,
    MalformedBatch,
    MalformedEnvelope,
    PeerRecordError,
    SerializationError,
)
from velomux_quic.messenger.envelope import (
    NAME_CACHE_MAX,
    Kind,
    StagedDescriptor,
    decode_envelope,
    decode_error,
    encode_envelope,
    handler_name_cache_size,
)
from velomux_quic.mux.protocol import (
    RecordType,
    close_slot_body,
    credit_body,
    decode_batch,
    decode_close_slot,
    decode_credit,
    decode_header,
    decode_lifecycle,
    decode_open_slot,
    encode_batch,
    lifecycle_body,
    open_slot_body,
)
from velomux_quic.streaming.control import (
    AnchorAttachErr,
    AnchorAttachOk,
    AnchorAttachRequest,
    AnchorAttachResponse,
    AnchorRef,
    ControlMessage,
    MpscAnchorAttachOk,
    MpscAnchorAttachRequest,
    MpscAnchorAttachResponse,
    MpscSenderRef,
    StreamControl,
    StreamOpenTicket,
)
from velomux_quic.streaming.frames import (
    TERMINAL_KINDS,
    FrameKind,
    decode_frame,
    encode_item,
    is_heartbeat,
    is_terminal_sentinel,
)
from velomux_quic.transport.framing import FRAME_HEADER_SIZE, FrameDecoder

__all__ = [
    "CONTROL_MESSAGES",
    "TARGETS",
    "InvariantBroken",
    "Target",
    "check",
]


class InvariantBroken(AssertionError):
    """A decoder returned, but what it returned is wrong (a finding, like a stray exception)."""


def _require(condition: bool, what: str) -> None:
    # Not ``assert``: the oracle must hold under ``python -O`` too.
    if not condition:
        raise InvariantBroken(what)


@dataclass(frozen=True, slots=True)
class Target:
    """A fuzz target: ``run`` feeds one input to a decoder; ``refusal`` is what it may raise."""

    name: str
    run: Callable[[bytes], None]
    refusal: type[Exception]
    """The decoder's typed refusal; any other exception out of ``run`` is a finding."""
    doc: str


def check(target: Target, data: bytes) -> bool:
    """Run ``target`` on ``data``: True if the input decoded, False if it was refused.

    Any exception other than the target's typed refusal propagates: that is a finding.
    """
    try:
        target.run(data)
    except target.refusal:
        return False
    return True


# -- mux batches and records --------------------------------------------------------------

_LANE_BITS: Final = 0x0F

_BODY_DECODERS: Final[Mapping[int, Callable[[Any], object]]] = {
    int(RecordType.OPEN_SLOT): decode_open_slot,
    int(RecordType.CLOSE_SLOT): decode_close_slot,
    int(RecordType.CREDIT_UPDATE): decode_credit,
    int(RecordType.LIFECYCLE_SLOT): decode_lifecycle,
}


def _mux_batch(data: bytes) -> None:
    header, records = decode_batch(data)
    _require(decode_header(data) == header, "decode_header disagrees with decode_batch")
    for record_type, _slot, _seq, body in records:
        decoder = _BODY_DECODERS.get(record_type)
        if decoder is None:
            continue
        try:
            decoder(body)
        except MalformedBatch as exc:
            raise InvariantBroken(
                f"decode_batch accepted a body its decoder refuses: {exc}"
            ) from exc
    # The reserved high bits of flags are ignored on receipt and written as zero.
    canonical = data[:1] + bytes((data[1] & _LANE_BITS,)) + data[2:]
    _require(encode_batch(header, records) == canonical, "re-encoded batch differs")
    _require(decode_batch(memoryview(data))[1] == records, "a memoryview decodes differently")


def _mux_record(data: bytes) -> None:
    if not data:
        return
    choice, body = data[0] % 4, data[1:]
    if choice == 0:
        anchor, session = decode_open_slot(body)
        _require(open_slot_body(anchor, session) == body, "OpenSlot body does not round-trip")
    elif choice == 1:
        reason = decode_close_slot(memoryview(body))
        _require(close_slot_body(reason) == body, "CloseSlot body does not round-trip")
    elif choice == 2:
        _require(credit_body(decode_credit(body)) == body, "CreditUpdate does not round-trip")
    else:
        session, action = decode_lifecycle(body)
        _require(lifecycle_body(session, action) == body, "LifecycleSlot does not round-trip")


# -- lane frames -----------------------------------------------------------------------------


def _reference_frames(stream: bytes, limit: int) -> tuple[list[bytes], bool]:
    """The frames of ``stream`` parsed in one pass, and whether a header over ``limit`` ends it."""
    frames: list[bytes] = []
    pos = 0
    while pos + FRAME_HEADER_SIZE <= len(stream):
        length = int.from_bytes(stream[pos : pos + FRAME_HEADER_SIZE], "big")
        if length > limit:
            return frames, True
        start = pos + FRAME_HEADER_SIZE
        if start + length > len(stream):
            break
        frames.append(stream[start : start + length])
        pos = start + length
    return frames, False


def _lane_frames(data: bytes) -> None:
    """The first byte sets the size limit, the second how the rest is cut into chunks."""
    if len(data) < 2:
        return
    limit = data[0] * 4
    # Every other chunk may be empty (short == 0): QUIC can deliver an empty STREAM frame.
    short, long = data[1] % 7, 1 + data[1] // 7 % 37
    stream = data[2:]
    expected, too_large = _reference_frames(stream, limit)
    decoder = FrameDecoder(limit)
    frames: list[bytes] = []
    pos = turn = 0
    try:
        while pos < len(stream):
            size = short if turn % 2 == 0 else long
            chunk = stream[pos : pos + size]
            frames += decoder.feed(chunk if turn % 3 else memoryview(chunk))
            pos += size
            turn += 1
            consumed = min(pos, len(stream))
            held = sum(FRAME_HEADER_SIZE + len(frame) for frame in frames)
            _require(
                consumed == held + decoder.buffered_bytes, "buffered_bytes loses count of bytes"
            )
    except FrameTooLarge as exc:
        frames += exc.frames
        _require(too_large, f"refused a header within the limit: {exc}")
        _require(frames == expected, "frames before the refused header differ")
        try:
            decoder.feed(b"\x00")
        except FrameTooLarge:
            raise InvariantBroken("a failed decoder re-parsed a header") from None
        except FramingError:
            raise exc from None
        raise InvariantBroken("a failed decoder accepted more bytes") from None
    _require(not too_large, "missed a header over the limit")
    _require(frames == expected, "incremental frames differ from the one-shot parse")
    _require(all(len(frame) <= limit for frame in frames), "a frame over the limit")


# -- messenger envelopes and their contents ---------------------------------------------------


def _envelope(data: bytes) -> None:
    envelope = decode_envelope(data)
    _require(handler_name_cache_size() <= NAME_CACHE_MAX, "the handler name cache grew")
    payload = bytes(envelope.payload)
    descriptor = envelope.descriptor
    if descriptor is not None:
        _require(descriptor.encode() == payload, "the STAGED descriptor does not round-trip")
    if envelope.kind is Kind.ERROR:
        decode_error(envelope.payload)
    if envelope.headers is None:
        again = encode_envelope(
            envelope.kind,
            handler=envelope.handler,
            message_id=envelope.message_id,
            payload=payload,
            staged=envelope.staged,
        )
        _require(again == data, "a header-less envelope does not re-encode to its bytes")
    else:
        again = encode_envelope(
            envelope.kind,
            handler=envelope.handler,
            message_id=envelope.message_id,
            headers=envelope.headers,
            payload=payload,
            staged=envelope.staged,
        )
        # An empty map re-encodes as no headers at all (the encoder's documented choice).
        decoded = decode_envelope(again)
        _require((decoded.headers or {}) == envelope.headers, "headers do not survive a re-encode")


def _envelope_contents(data: bytes) -> None:
    if not data:
        return
    body = data[1:]
    if data[0] % 2:
        code, message = decode_error(body)
        _require(isinstance(message, str) and code.value != "", "decode_error gave no code")
    else:
        descriptor = StagedDescriptor.decode(body)
        _require(descriptor.encode() == body, "a descriptor does not round-trip")


# -- streaming control messages and tickets ---------------------------------------------------

ControlDecoder = type[ControlMessage] | type[AnchorAttachResponse] | type[MpscAnchorAttachResponse]
"""A message class, or a response family that decodes whichever of its variants arrived."""

CONTROL_MESSAGES: Final[tuple[ControlDecoder, ...]] = (
    AnchorAttachRequest,
    MpscAnchorAttachRequest,
    AnchorAttachResponse,
    MpscAnchorAttachResponse,
    AnchorAttachOk,
    MpscAnchorAttachOk,
    AnchorAttachErr,
    AnchorRef,
    MpscSenderRef,
    StreamControl,
)
"""Every control message class a peer's bytes are decoded as (the ticket has its own target)."""


def _round_trips(cls: ControlDecoder, message: ControlMessage) -> None:
    again = cls.decode(message.encode())
    _require(again == message, f"{cls.__name__} does not survive a re-encode")


def _control(data: bytes) -> None:
    if not data:
        return
    cls = CONTROL_MESSAGES[data[0] % len(CONTROL_MESSAGES)]
    _round_trips(cls, cls.decode(data[1:]))


def _ticket(data: bytes) -> None:
    _round_trips(StreamOpenTicket, StreamOpenTicket.decode(data))


# -- stream frames -------------------------------------------------------------------------------


def _stream_frame(data: bytes) -> None:
    terminal = is_terminal_sentinel(data)
    heartbeat = is_heartbeat(data)
    for other in (bytearray(data), memoryview(data)):
        _require(is_terminal_sentinel(other) == terminal, "a buffer is a terminal differently")
        _require(is_heartbeat(other) == heartbeat, "a buffer is a heartbeat differently")
    try:
        kind, value = decode_frame(data)
    except FrameDecodeError:
        _require(not terminal and not heartbeat, "a quick test accepted a malformed frame")
        for other in (bytearray(data), memoryview(data)):
            try:
                decode_frame(other)
            except FrameDecodeError:
                continue
            raise InvariantBroken("bytes refused as bytes decode as a buffer") from None
        raise
    _require(terminal == (kind in TERMINAL_KINDS), "is_terminal_sentinel disagrees with decode")
    _require(heartbeat == (kind is FrameKind.HEARTBEAT), "is_heartbeat disagrees with decode")
    for other in (bytearray(data), memoryview(data)):
        other_kind, other_value = decode_frame(other)
        _require(
            other_kind is kind and repr(other_value) == repr(value), "a buffer decodes differently"
        )
    if kind is FrameKind.ITEM:
        try:
            encoded = encode_item(value)
        except SerializationError:
            # Deeper than the packer nests: decodable, not re-sendable; not a decoder defect.
            return
        again_kind, again = decode_frame(encoded)
        _require(again_kind is kind and repr(again) == repr(value), "an item does not round-trip")


# -- discovery peer records ----------------------------------------------------------------------


def _peer_record(data: bytes) -> None:
    record = PeerRecord.from_bytes(data)
    again = PeerRecord.from_bytes(json.dumps(record.to_json()).encode())
    _require(again == record, "a peer record does not survive a re-encode")


# -- the registry ----------------------------------------------------------------------------------

TARGETS: Final[Mapping[str, Target]] = {
    target.name: target
    for target in (
        Target("mux_batch", _mux_batch, MalformedBatch, "decode_batch and decode_header"),
        Target("mux_record", _mux_record, MalformedBatch, "the four control body decoders"),
        Target("lane_frames", _lane_frames, FramingError, "FrameDecoder.feed over chunks"),
        Target("envelope", _envelope, MalformedEnvelope, "decode_envelope"),
        Target(
            "envelope_contents",
            _envelope_contents,
            MalformedEnvelope,
            "decode_error and StagedDescriptor.decode",
        ),
        Target("control", _control, ControlDecodeError, "every control message's decode"),
        Target("ticket", _ticket, ControlDecodeError, "StreamOpenTicket.decode"),
        Target("stream_frame", _stream_frame, FrameDecodeError, "decode_frame and quick tests"),
        Target("peer_record", _peer_record, PeerRecordError, "PeerRecord.from_bytes"),
    )
}
"""Every target by name; the name is also its corpus directory under ``fuzz/corpus/``."""
