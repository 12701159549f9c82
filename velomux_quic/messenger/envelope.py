"""The messenger's wire envelope: the body of one transport frame (sans-IO).

Every active message, reply and acknowledgement is one frame on a lane, and the
frame body is an envelope. All integers are big-endian::

    [u8 version = 1][u8 kind][u8 flags][u8 name_len][u64 message_id]   12 bytes
    [name: name_len bytes, UTF-8]
    [u16 headers_len][headers: MessagePack map str -> str]   only if flags & HAS_HEADERS
    [payload: the rest of the body]

The payload has no length of its own: the transport already delimits the frame,
so a second length would only be one more thing to check and to get wrong.

``kind`` says what the envelope is for and therefore which fields it must have.
The requests (MESSAGE, SYNC, REQUEST) name a handler; the replies (RESPONSE,
ERROR, ACK) name none, because they go to whoever is waiting for
``message_id``, which the requester chose. MESSAGE is fire-and-forget, nothing
waits for it, so its ``message_id`` is 0 and every other kind's is non-zero:
that makes "expects a reply" readable from the id alone and keeps 0 free as "no
id". Which node sent an envelope is not in it: the transport knows the peer
from the verified client certificate of the connection the frame arrived on.

Unknown flag bits are refused, not ignored, because a flag may change the
meaning of what follows it: :data:`HAS_HEADERS` puts a header block between
the name and the payload, :data:`STAGED` makes the payload a descriptor of
data held elsewhere. A receiver that skipped a flag it did not know would read
the rest of the body with the wrong layout and hand its handler bytes that
mean something else. A new flag therefore needs a new version.

The decoder is on the hot path: every frame on every lane goes through
:func:`decode_envelope`. It reads the fixed header with one ``unpack_from``,
maps handler names through a small cache so a known name costs a dict lookup
instead of a UTF-8 decode, calls MessagePack only when headers are present,
and returns the payload as a ``memoryview`` slice of the frame, never a copy.
The encoders' hot paths (:func:`message_prefix`, :class:`MessagePrefix`)
precompute everything but the message id, so sending costs one ``struct``
pack and one concatenation.

Everything peer-supplied is validated, and :func:`decode_envelope` reports any
defect as :class:`MalformedEnvelope` only, so a receiver can handle a bad frame
from a peer with one ``except`` without hiding its own bugs.

This module owns the framing: the fixed header, the kinds and flags, the handler
name and the header map, with the per-message decoder and encoders. The formats of
what some envelopes carry (the ERROR payload, the STAGED descriptor) live in
:mod:`.contents`, with :class:`MalformedEnvelope`:
their consumers read them after dispatch; the per-frame decoder does not. This
module re-exports all of them, so callers import the whole wire format from here.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

import msgpack  # type: ignore[import-untyped]

from ..errors import ConfigurationError
from .contents import (
    DESCRIPTOR_SIZE,
    BytesLike,
    ErrorCode,
    MalformedEnvelope,
    StagedDescriptor,
    _descriptor_size_problem,  # the decoder words a bad STAGED payload the same way
    decode_error,
    encode_error,
)

__all__ = [
    "DESCRIPTOR_SIZE",
    "FIXED_HEADER_SIZE",
    "HAS_HEADERS",
    "KNOWN_FLAGS",
    "MAX_HANDLER_NAME_SIZE",
    "MAX_HEADERS_SIZE",
    "MAX_HEADER_VALUE_SIZE",
    "NAME_CACHE_MAX",
    "STAGED",
    "VERSION",
    "BytesLike",
    "Envelope",
    "ErrorCode",
    "Kind",
    "MalformedEnvelope",
    "MessagePrefix",
    "StagedDescriptor",
    "decode_envelope",
    "decode_error",
    "encode_envelope",
    "encode_error",
    "handler_name_cache_size",
    "message_prefix",
]

VERSION: Final = 1
"""The envelope version this module reads and writes; any other is refused."""

HAS_HEADERS: Final = 0x01
"""Flag bit 0: a ``u16`` length and a MessagePack header map follow the name."""

STAGED: Final = 0x02
"""Flag bit 1: the payload is a 16-byte :class:`StagedDescriptor`, not the data.

The data itself is pulled from the sender over a stream of its own, so a large
transfer never blocks the lane the descriptor arrived on. This is a flag and
not a header because it changes what the payload *is*: a receiver that missed
it would hand the descriptor's 16 bytes to a handler as if they were the data.
"""

KNOWN_FLAGS: Final = HAS_HEADERS | STAGED
"""Every flag bit this version defines; any other set bit is refused."""
_UNKNOWN_FLAGS: Final = 0xFF & ~KNOWN_FLAGS

MAX_HANDLER_NAME_SIZE: Final = 255
"""Largest handler name, in UTF-8 bytes (``name_len`` is a u8)."""

MAX_HEADERS_SIZE: Final = 16 * 1024
"""Largest encoded header map, in bytes.

Headers are small routing metadata, decoded before any handler runs. The cap
bounds what a peer can make the decoder parse per frame, well below what the
``u16`` length could state.
"""

MAX_HEADER_VALUE_SIZE: Final = 1024
"""Largest header value, in UTF-8 bytes. Anything bigger belongs in the payload."""

_U64_MAX: Final = (1 << 64) - 1

_FIXED: Final = struct.Struct(">BBBBQ")
_unpack_fixed_from: Final = _FIXED.unpack_from
_pack_fixed: Final = _FIXED.pack
_HEADERS_LEN: Final = struct.Struct(">H")

FIXED_HEADER_SIZE: Final = _FIXED.size
"""Bytes before the handler name: version, kind, flags, name_len, message_id."""

_unpackb: Final = msgpack.unpackb
_packb: Final = msgpack.packb


class Kind(IntEnum):
    """What an envelope is for; fixes whether it names a handler and carries an id."""

    MESSAGE = 0
    """Fire-and-forget: the sender learns nothing about delivery. Id 0."""
    SYNC = 1
    """A message whose sender waits for the handler to finish (ACK or ERROR)."""
    REQUEST = 2
    """A unary request; answered by RESPONSE or ERROR with the same id."""
    RESPONSE = 3
    """The result of a REQUEST."""
    ERROR = 4
    """A REQUEST or SYNC failed; the payload is :func:`encode_error` output."""
    ACK = 5
    """A SYNC message's handler finished."""


_KINDS: Final[tuple[Kind, ...]] = tuple(Kind)
_MESSAGE: Final = 0  # Kind.MESSAGE as a plain int: the decoder compares raw bytes
# Indexed by the kind byte: which kinds name a handler, and which may be staged.
_NAMED: Final = tuple(k in (Kind.MESSAGE, Kind.SYNC, Kind.REQUEST) for k in _KINDS)
# ERROR and ACK are short control replies: staging them would make the failure
# or the acknowledgement depend on a second transfer, which may itself fail.
_STAGEABLE: Final = tuple(k not in (Kind.ERROR, Kind.ACK) for k in _KINDS)


def _malformed(field: str, offset: int, what: str) -> MalformedEnvelope:
    return MalformedEnvelope(f"{field} at offset {offset}: {what}", field, offset)


@dataclass(slots=True)
class Envelope:
    """One decoded frame body.

    ``payload`` is a read-only ``memoryview`` into the frame's ``bytes``, not a
    copy. It stays valid as long as it is referenced, because the view itself
    keeps the frame alive and ``bytes`` cannot change: a handler may keep it,
    or ``bytes(payload)`` it, as it likes. For a STAGED envelope the payload is
    the descriptor; read it through :attr:`descriptor`.
    """

    kind: Kind
    flags: int
    message_id: int
    handler: str
    """The handler name for MESSAGE, SYNC and REQUEST; ``""`` for replies."""
    headers: dict[str, str] | None
    """``None`` when the envelope carries no headers."""
    payload: memoryview

    @property
    def staged(self) -> bool:
        """The payload is a descriptor and the data must be pulled."""
        return bool(self.flags & STAGED)

    @property
    def descriptor(self) -> StagedDescriptor | None:
        """The staged payload's descriptor, or ``None`` if the envelope is not staged."""
        if not self.flags & STAGED:
            return None
        return StagedDescriptor.decode(self.payload)


# -- decoding -------------------------------------------------------------------

NAME_CACHE_MAX: Final = 1024
"""Most handler names the decoder keeps decoded (see :func:`handler_name_cache_size`)."""

_name_cache: dict[bytes, str] = {}
"""Handler names already decoded, keyed by their UTF-8 bytes.

A node sees a handful of handler names, so the cache turns a UTF-8 decode per
frame into a lookup and hands every envelope the same ``str``. Names come from
peers, so the cache is bounded: when full it is emptied, not frozen, so the
names in actual use come straight back, and a peer sending endless distinct
names costs decodes, never memory.
"""


def handler_name_cache_size() -> int:
    """How many decoded handler names the decoder holds now: never more than
    :data:`NAME_CACHE_MAX`, whatever names peers send (for tests and operators)."""
    return len(_name_cache)


def decode_envelope(body: bytes) -> Envelope:
    """Decode one frame body.

    Raises :class:`MalformedEnvelope`, and nothing else, for any body that is
    not a valid envelope of this version: too short for its fixed header or
    its name, another version, an unknown kind, an unknown flag, a handler name
    missing where the kind needs one or present where it must not be, a name
    that is not UTF-8, a message id where none belongs or missing where one
    must be, headers that run past the end, are too large or are not a
    str-to-str map, a STAGED flag on ERROR or ACK, and a STAGED payload that is
    not exactly one descriptor.

    ``body`` should be ``bytes``: the payload is a view into it, and only an
    immutable buffer makes that view safe to keep.
    """
    size = len(body)
    if size < FIXED_HEADER_SIZE:
        raise _malformed("header", 0, f"{size} bytes, the fixed header needs {FIXED_HEADER_SIZE}")
    version, kind, flags, name_len, message_id = _unpack_fixed_from(body)
    if version != VERSION:
        raise _malformed("version", 0, f"version {version} is not supported (expected {VERSION})")
    if kind >= len(_KINDS):
        raise _malformed("kind", 1, f"unknown kind {kind}")
    if flags & _UNKNOWN_FLAGS:
        raise _malformed(
            "flags",
            2,
            f"unknown flag bits 0x{flags & _UNKNOWN_FLAGS:02x} in 0x{flags:02x}"
            " (an unknown flag may change the meaning of what follows)",
        )
    pos = FIXED_HEADER_SIZE + name_len
    if _NAMED[kind]:
        if not name_len:
            raise _malformed("name_len", 3, f"{_KINDS[kind].name} needs a handler name")
        if pos > size:
            raise _malformed(
                "handler",
                FIXED_HEADER_SIZE,
                f"{name_len} bytes stated, {size - FIXED_HEADER_SIZE} present",
            )
        key = body[FIXED_HEADER_SIZE:pos]
        handler = _name_cache.get(key)
        if handler is None:
            handler = _decode_name(key)
    elif name_len:
        raise _malformed(
            "name_len", 3, f"{_KINDS[kind].name} must not name a handler (name_len {name_len})"
        )
    else:
        handler = ""
    if (message_id == 0) != (kind == _MESSAGE):
        raise _malformed(
            "message_id",
            4,
            f"must be 0 for MESSAGE, got {message_id}"
            if kind == _MESSAGE
            else f"must be non-zero for {_KINDS[kind].name}",
        )
    headers = None
    if flags & HAS_HEADERS:
        headers, pos = _decode_headers(body, pos, size)
    if flags & STAGED:
        if not _STAGEABLE[kind]:
            raise _malformed("flags", 2, f"{_KINDS[kind].name} cannot be STAGED")
        if size - pos != DESCRIPTOR_SIZE:
            raise _malformed("payload", pos, _descriptor_size_problem(size - pos))
    return Envelope(_KINDS[kind], flags, message_id, handler, headers, memoryview(body)[pos:])


def _decode_name(key: bytes) -> str:
    try:
        handler = key.decode()
    except UnicodeDecodeError as exc:
        raise _malformed("handler", FIXED_HEADER_SIZE, f"not valid UTF-8 ({exc.reason})") from None
    if len(_name_cache) >= NAME_CACHE_MAX:
        _name_cache.clear()
    _name_cache[key] = handler
    return handler


def _decode_headers(body: bytes, pos: int, size: int) -> tuple[dict[str, str], int]:
    if pos + _HEADERS_LEN.size > size:
        raise _malformed("headers_len", pos, f"runs past the end of the {size}-byte body")
    (length,) = _HEADERS_LEN.unpack_from(body, pos)
    start = pos + _HEADERS_LEN.size
    if length > MAX_HEADERS_SIZE:
        raise _malformed("headers_len", pos, f"{length} bytes, over the {MAX_HEADERS_SIZE} limit")
    end = start + length
    if end > size:
        raise _malformed("headers_len", pos, f"{length} bytes stated, {size - start} present")
    try:
        headers = _unpackb(memoryview(body)[start:end])
    except Exception as exc:
        # msgpack documents a family of exceptions ("other exceptions can be raised
        # during unpacking") that differs between its C and Python builds; the
        # input is the peer's, so every failure to parse it is the peer's defect.
        raise _malformed("headers", start, f"not MessagePack ({exc})") from exc
    if type(headers) is not dict:
        raise _malformed("headers", start, f"not a map but {type(headers).__name__}")
    for name, value in headers.items():
        if type(name) is not str or type(value) is not str:
            raise _malformed("headers", start, f"entry {name!r} is not str -> str")
        # A str of n characters is at most 4n UTF-8 bytes, so short values skip the encode.
        if len(value) > MAX_HEADER_VALUE_SIZE // 4 and len(value.encode()) > MAX_HEADER_VALUE_SIZE:
            raise _malformed(
                "headers", start, f"value of {name!r} is over {MAX_HEADER_VALUE_SIZE} bytes"
            )
    return headers, end


# -- encoding -------------------------------------------------------------------


def _check_kind(kind: Kind | int) -> Kind:
    if isinstance(kind, Kind):
        return kind
    if isinstance(kind, int) and not isinstance(kind, bool) and 0 <= kind < len(_KINDS):
        return _KINDS[kind]
    raise ConfigurationError(f"unknown envelope kind {kind!r}")


def _check_handler(kind: Kind, handler: str) -> bytes:
    if not isinstance(handler, str):
        raise ConfigurationError(f"handler must be a str, got {type(handler).__name__}")
    if not _NAMED[kind]:
        if handler:
            raise ConfigurationError(f"{kind.name} must not name a handler, got {handler!r}")
        return b""
    try:
        name = handler.encode()
    except UnicodeEncodeError as exc:
        raise ConfigurationError(
            f"handler {handler!r} cannot be encoded as UTF-8: {exc.reason}"
        ) from None
    if not 0 < len(name) <= MAX_HANDLER_NAME_SIZE:
        raise ConfigurationError(
            f"{kind.name} needs a handler name of 1 to {MAX_HANDLER_NAME_SIZE} UTF-8 bytes,"
            f" got {len(name)}"
        )
    return name


def _id_bounds(kind: Kind) -> tuple[int, int]:
    return (0, 0) if kind is Kind.MESSAGE else (1, _U64_MAX)


def _check_message_id(kind: Kind, message_id: int) -> None:
    low, high = _id_bounds(kind)
    if isinstance(message_id, bool) or not isinstance(message_id, int):
        raise ConfigurationError(f"message_id must be an int, got {type(message_id).__name__}")
    if not low <= message_id <= high:
        raise ConfigurationError(_id_problem(kind, message_id))


def _id_problem(kind: Kind, message_id: int) -> str:
    if kind is Kind.MESSAGE:
        return f"message_id must be 0 for MESSAGE, got {message_id}"
    return f"message_id for {kind.name} must be in 1..{_U64_MAX}, got {message_id}"


def _encode_headers(headers: Mapping[str, str]) -> bytes:
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ConfigurationError(f"header {name!r}: names and values must be str")
        try:
            value_size = len(value.encode())
            name.encode()
        except UnicodeEncodeError as exc:
            raise ConfigurationError(
                f"header {name!r} cannot be encoded as UTF-8: {exc.reason}"
            ) from None
        if value_size > MAX_HEADER_VALUE_SIZE:
            raise ConfigurationError(
                f"header {name!r}: value of {value_size} bytes, over {MAX_HEADER_VALUE_SIZE}"
            )
    packed: bytes = _packb(headers if type(headers) is dict else dict(headers))
    if len(packed) > MAX_HEADERS_SIZE:
        raise ConfigurationError(f"headers encode to {len(packed)} bytes, over {MAX_HEADERS_SIZE}")
    return packed


def encode_envelope(
    kind: Kind,
    *,
    handler: str = "",
    message_id: int = 0,
    headers: Mapping[str, str] | None = None,
    payload: BytesLike = b"",
    staged: bool = False,
) -> bytes:
    """Encode any envelope; ConfigurationError (a ValueError) if the arguments do not make one.

    An empty ``headers`` map is the same as ``None``: the HAS_HEADERS flag is
    left clear, so the receiver skips MessagePack entirely. With ``staged``,
    ``payload`` must be a :meth:`StagedDescriptor.encode` result, and the kind
    may not be ERROR or ACK.

    This is the general path. Header-less envelopes sent often are cheaper
    through :func:`message_prefix` or :class:`MessagePrefix`.
    """
    kind = _check_kind(kind)
    name = _check_handler(kind, handler)
    _check_message_id(kind, message_id)
    flags = 0
    parts: list[BytesLike] = [b"", name]
    if headers:
        packed = _encode_headers(headers)
        parts += (_HEADERS_LEN.pack(len(packed)), packed)
        flags |= HAS_HEADERS
    if staged:
        if not _STAGEABLE[kind]:
            raise ConfigurationError(f"{kind.name} cannot be STAGED")
        size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        if size != DESCRIPTOR_SIZE:
            raise ConfigurationError(
                f"a STAGED payload is one {DESCRIPTOR_SIZE}-byte descriptor, got {size} bytes"
            )
        flags |= STAGED
    parts[0] = _pack_fixed(VERSION, kind, flags, len(name), message_id)
    parts.append(payload)
    return b"".join(parts)


class MessagePrefix:
    """A precomputed encoder for header-less envelopes of one kind and handler.

    Everything before the payload is fixed except the message id, so encoding
    is one ``struct`` pack (header and name together) plus one concatenation
    with the payload. That was measured faster than packing into a preallocated
    ``bytearray``, because the transport takes ``bytes`` and the ``bytearray``
    would have to be copied once more. :meth:`pack_into` is there for callers
    who build a larger buffer anyway.

    Build one per (kind, handler) and keep it: construction validates and
    compiles the format, the per-message methods only check the id.
    """

    __slots__ = ("_high", "_kind", "_low", "_name", "_pack", "_pack_into", "_struct", "handler")

    handler: str
    """The handler name, ``""`` for a reply kind."""

    def __init__(self, kind: Kind, handler: str = "") -> None:
        self._kind = _check_kind(kind)
        self._name = _check_handler(self._kind, handler)
        self.handler = handler
        self._low, self._high = _id_bounds(self._kind)
        self._struct = struct.Struct(f">BBBBQ{len(self._name)}s")
        self._pack = self._struct.pack
        self._pack_into = self._struct.pack_into

    @property
    def kind(self) -> Kind:
        """The kind of every envelope this encodes."""
        return self._kind

    @property
    def size(self) -> int:
        """Bytes before the payload: the fixed header and the handler name."""
        return self._struct.size

    def header(self, message_id: int) -> bytes:
        """Everything before the payload, for ``message_id``."""
        if not self._low <= message_id <= self._high:
            raise ConfigurationError(_id_problem(self._kind, message_id))
        return self._pack(VERSION, self._kind, 0, len(self._name), message_id, self._name)

    def encode(self, message_id: int, payload: BytesLike = b"") -> bytes:
        """One whole envelope."""
        if not self._low <= message_id <= self._high:
            raise ConfigurationError(_id_problem(self._kind, message_id))
        return self._pack(VERSION, self._kind, 0, len(self._name), message_id, self._name) + payload

    def pack_into(self, buffer: bytearray | memoryview, offset: int, message_id: int) -> int:
        """Write the prefix into ``buffer`` at ``offset``; return where the payload starts."""
        if not self._low <= message_id <= self._high:
            raise ConfigurationError(_id_problem(self._kind, message_id))
        self._pack_into(
            buffer, offset, VERSION, self._kind, 0, len(self._name), message_id, self._name
        )
        return offset + self._struct.size

    def __repr__(self) -> str:
        return f"MessagePrefix({self._kind.name}, {self.handler!r})"


def message_prefix(kind: Kind, handler: str) -> bytes:
    """The bytes before the payload of every header-less MESSAGE to ``handler``.

    A MESSAGE's id is always 0, so its prefix is a constant and sending is
    ``prefix + payload``: one concatenation, nothing packed per message. The
    mux sends one such MESSAGE per batch to ``_stream_batch``. Other kinds carry
    a per-message id; use :class:`MessagePrefix` for them.
    """
    kind = _check_kind(kind)
    if kind is not Kind.MESSAGE:
        raise ConfigurationError(
            f"only MESSAGE has a constant prefix; use MessagePrefix for {kind.name}"
        )
    return MessagePrefix(kind, handler).header(0)
