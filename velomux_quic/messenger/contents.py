"""What envelopes carry that the envelope codec does not read: typed payloads.

An envelope (:mod:`.envelope`) says what a frame is for and where its parts start and end.
Two of those parts have formats of their own, defined here:

* the payload of an ERROR envelope, MessagePack ``[code, message]``
  (:class:`ErrorCode`, :func:`encode_error`, :func:`decode_error`);
* the payload of a STAGED envelope, one fixed-size :class:`StagedDescriptor`.

They are kept apart from the envelope because other code reads them, at another time.
:func:`~.envelope.decode_envelope` runs on every frame and parses the framing only (of a
STAGED payload it checks the length, nothing more), while each format here is read by
the one consumer that needs it, after dispatch: the caller an ERROR reply is for, the
rendezvous that pulls a staged payload. They are built and read once per failed call or
staged transfer, never for an ordinary inline message. (Header values belong to the layer
that registers them: see :mod:`.headers`.)

:class:`MalformedEnvelope` is defined here too, because the envelope decoder and the
decoders here all raise it, and this is the module that depends on no other part of the
package. :mod:`.envelope` re-exports every public name of this one, so the whole wire
format is imported from one place.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

import msgpack  # type: ignore[import-untyped]

from ..errors import ConfigurationError, MalformedEnvelope

__all__ = [
    "DESCRIPTOR_SIZE",
    "BytesLike",
    "ErrorCode",
    "MalformedEnvelope",
    "StagedDescriptor",
    "decode_error",
    "encode_error",
]

BytesLike = bytes | bytearray | memoryview
"""What the encoders accept as a payload, and the decoders here as input."""

DESCRIPTOR_SIZE: Final = 16
"""Bytes in an encoded :class:`StagedDescriptor`: ``[u64 staged_id][u64 size]``."""

_U64_MAX: Final = (1 << 64) - 1

_DESCRIPTOR: Final = struct.Struct(">QQ")

_unpackb: Final = msgpack.unpackb
_packb: Final = msgpack.packb


# -- error payloads ---------------------------------------------------------------


class ErrorCode(StrEnum):
    """Why a REQUEST or SYNC failed, as carried in an ERROR payload."""

    UNKNOWN_HANDLER = "unknown_handler"
    """No handler of that name is registered on the receiver."""
    HANDLER_FAILED = "handler_failed"
    """The handler raised; the message says how."""
    MALFORMED = "malformed"
    """The receiver could not read the request (bad headers, payload or descriptor)."""
    REFUSED = "refused"
    """The receiver declined the request (a limit, an admission rule, a staged size cap)."""
    SHUTTING_DOWN = "shutting_down"
    """The receiver is draining and takes no new requests; try another node."""


_ERROR_CODES: Final[dict[str, ErrorCode]] = {code.value: code for code in ErrorCode}


def encode_error(code: ErrorCode, message: str) -> bytes:
    """The payload of an ERROR envelope: MessagePack ``[code, message]``.

    Characters that UTF-8 cannot carry (lone surrogates, which ``str()`` of an
    exception about a file name can hold) are replaced rather than refused: this
    runs on a failure path, and raising here would lose the error reply and
    leave the caller waiting for a timeout instead.
    """
    code = ErrorCode(code)  # ValueError for a string that is not a code
    if not isinstance(message, str):
        raise ConfigurationError(f"message must be a str, got {type(message).__name__}")
    try:
        packed: bytes = _packb([code.value, message])
    except UnicodeEncodeError:
        message = message.encode("utf-8", "replace").decode()
        packed = _packb([code.value, message])
    return packed


def decode_error(payload: BytesLike) -> tuple[ErrorCode, str]:
    """Read an ERROR payload; :class:`MalformedEnvelope` if it is not ``[str, str, ...]``.

    Elements after the second are ignored: control bodies add fields at the
    end, and an older receiver must still read the code and message. A code
    this version does not know becomes ``HANDLER_FAILED`` with the code kept in
    the message: a newer peer may define codes, and its caller must still see
    the request fail (rather than the reply dropped as malformed), with enough
    text for an operator to tell what happened.
    """
    try:
        error = _unpackb(payload)
    except Exception as exc:
        # See .envelope._decode_headers: any failure to parse peer input is the peer's defect.
        raise MalformedEnvelope(f"error payload: not MessagePack ({exc})", "error") from exc
    if type(error) is not list or len(error) < 2:
        raise MalformedEnvelope("error payload: not an array [code, message]", "error")
    code, message = error[0], error[1]
    if type(code) is not str or type(message) is not str:
        raise MalformedEnvelope("error payload: code and message must be str", "error")
    known = _ERROR_CODES.get(code)
    if known is None:
        return ErrorCode.HANDLER_FAILED, f"{message} (unknown error code {code[:64]!r})"
    return known, message


# -- staged payloads --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StagedDescriptor:
    """What travels on the lane in place of a staged payload: its id and its size.

    ``staged_id`` names the staged bytes on the sending node, which serves them
    to the receiver's pull; ``size`` is their length, stated up front so the
    receiver can refuse a transfer bigger than its ``staged_payload_max`` before
    allocating anything. Both are u64. The encoding is fixed-size binary rather
    than a string header so that decoding it cannot fail in any way other than a
    wrong length.
    """

    staged_id: int
    size: int

    def __post_init__(self) -> None:
        for name, value in (("staged_id", self.staged_id), ("size", self.size)):
            if not isinstance(value, int) or not 0 <= value <= _U64_MAX:
                raise ConfigurationError(f"{name} must be a u64, got {value!r}")

    def encode(self) -> bytes:
        """The 16-byte payload of a STAGED envelope."""
        return _DESCRIPTOR.pack(self.staged_id, self.size)

    @classmethod
    def decode(cls, payload: BytesLike) -> StagedDescriptor:
        """Read a descriptor; :class:`MalformedEnvelope` unless exactly 16 bytes."""
        size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        if size != DESCRIPTOR_SIZE:
            raise MalformedEnvelope(_descriptor_size_problem(size), "descriptor")
        staged_id, staged_size = _DESCRIPTOR.unpack_from(payload)
        return cls(staged_id, staged_size)


def _descriptor_size_problem(size: int) -> str:
    if size < DESCRIPTOR_SIZE:
        return f"truncated descriptor: {size} bytes, a descriptor is {DESCRIPTOR_SIZE}"
    return f"descriptor followed by {size - DESCRIPTOR_SIZE} trailing bytes"
