"""Attach control messages and the zero-RTT open ticket, in positional MessagePack (sans-IO).

A message is the MessagePack array of its fields in declaration order, the
layout ``rmp_serde`` gives a struct, with the fields and order of the design's
Rust types (``AnchorAttachRequest``, ``AnchorAttachResponse``, the MPSC pair and
``StreamOpenTicket``). Handles are u128s, which MessagePack cannot hold, so a
handle is the map ``{"hi": u64, "lo": u64}`` (see :class:`StreamAnchorHandle`),
the fixmap the Rust ``StreamAnchorHandleWire`` documents; the stream cancel
handle uses the same map. Attach responses are externally tagged enums:
``{"Ok": [fields...]}`` or ``{"Err": [reason]}``.

Each side decodes the other's messages, but the bytes are not always the same
as a Rust peer's. What differs, checked against the Rust sources:

* Trailing defaults. The Rust types leave out only the fields marked
  ``skip_serializing_if`` (an attach request's ``lane_key`` when None, a
  response's or ticket's ``lane`` when 0) and always write the fields that are
  merely ``#[serde(default)]``. This module leaves out *every* trailing field
  that holds its default, so its encoding is shorter where those are at their
  defaults: a per-stream ``Ok`` (``initial_credit`` and ``slot_byte_budget``
  0) is ``[key, heartbeat, session]`` here and ``[key, heartbeat, session, 0,
  0]`` from Rust; a request offering no transport key ends before
  ``supported_transport_keys`` here where Rust writes ``[]``; an ``Ok`` with
  the 5000 ms heartbeat and no session ends after the key. Rust fills the
  missing values with the same defaults, so both read the other.
* Refusal reasons. An ``Err`` here says ``code: words``
  (``anchor_not_found: ...``), and the producer maps the code to its typed
  error; a Rust peer's reasons are free text (``mpsc anchor ... not found``),
  so its refusals arrive as :class:`~velomux_quic.errors.AttachRefused`.
* Handles as maps. This module reads and writes a handle only as the
  ``{"hi", "lo"}`` map, never as the two-element array rmp_serde's compact
  struct form would give the same wire struct.

Positional arrays evolve only at the end, so every message follows one rule:
a new field is appended, has a default that means "the behaviour from before
the field existed", and is left out when it holds that default. Only trailing
fields can be left out (dropping a middle one would shift the rest), so
:meth:`encode` strips defaults from the end and stops at the first field that
must be sent. That keeps a lane-0 response or ticket byte-identical to one
from before lanes. Decoding is the mirror image, and deliberately asymmetric:

* a missing trailing field takes its default: the peer predates it;
* a missing required field is :class:`ControlDecodeError`: the message is
  corrupt, not old (a ticket's first five values are required for this
  reason; defaulting a missing heartbeat would quietly give a short-heartbeat
  anchor's watchdog the wrong window);
* an extra trailing field is :class:`ControlDecodeError`: it carries a meaning
  this version cannot honour. A ticket naming a non-zero lane therefore fails
  on a worker from before lanes, which is why workers upgrade before the nodes
  that mint tickets.

Only the array form is read, not ``rmp_serde``'s alternative map-of-names
struct form: one spelling per message leaves no second parser to get wrong.

Every value is range-checked (u64, u32, and a lane below :data:`MAX_LANES`)
when a message is built, so no message can be encoded that a peer must refuse,
and again when one is decoded. Control messages arrive from peers, so decoding
reports every defect as :class:`ControlDecodeError` and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, NamedTuple, Self, cast

import msgpack  # type: ignore[import-untyped]

from ..errors import ControlDecodeError
from ..ids import StreamAnchorHandle
from ..transport.config import MAX_LANES

__all__ = [
    "ATTACH_HANDLER",
    "CANCEL_HANDLER",
    "DEFAULT_HEARTBEAT_INTERVAL_MS",
    "MAX_LANES",
    "MESSENGER_MUX_KEY",
    "MPSC_ATTACH_HANDLER",
    "PER_STREAM_KEY",
    "STOP_HANDLER",
    "AnchorAttachErr",
    "AnchorAttachOk",
    "AnchorAttachRequest",
    "AnchorAttachResponse",
    "AnchorRef",
    "MpscAnchorAttachErr",
    "MpscAnchorAttachOk",
    "MpscAnchorAttachRequest",
    "MpscAnchorAttachResponse",
    "MpscSenderRef",
    "StreamControl",
    "StreamOpenTicket",
]

MESSENGER_MUX_KEY: Final = "messenger-mux-v2"
"""The transport key of the batched mux; an attach selects it only when both sides name it."""

PER_STREAM_KEY: Final = "quic-stream-v1"
"""The transport key of the one-QUIC-stream-per-stream path, the fallback every node serves."""

ATTACH_HANDLER: Final = "_anchor_attach"
"""The system handler an attach to a single-sender anchor calls (an AnchorAttachRequest)."""

MPSC_ATTACH_HANDLER: Final = "_mpsc_anchor_attach"
"""The system handler an attach to an MPSC anchor calls (an MpscAnchorAttachRequest)."""

CANCEL_HANDLER: Final = "_stream_cancel"
"""The system handler a consumer's node tells a producer's that a stream was cancelled."""

STOP_HANDLER: Final = "_stream_stop"
"""The system handler a consumer's node tells a producer's to stop a stream it gave up."""

DEFAULT_HEARTBEAT_INTERVAL_MS: Final = 5000
"""What an attach response without ``heartbeat_interval_ms`` means: the cadence before the field."""


_U16_MAX: Final = (1 << 16) - 1
_U32_MAX: Final = (1 << 32) - 1
_U64_MAX: Final = (1 << 64) - 1


# -- field codecs ----------------------------------------------------------------
#
# ``check`` validates and normalises a value when a message is built (raising
# ValueError or TypeError); ``to_wire`` and ``from_wire`` convert between that
# value and what MessagePack holds. ``from_wire`` checks only the wire type:
# the range checks run once, in the constructor, for both directions.


def _int(name: str, value: object, maximum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= maximum:
        raise ValueError(f"{name} must be in [0, {maximum}], got {value}")
    return int(value)


def _u64(name: str, value: object) -> int:
    return _int(name, value, _U64_MAX)


def _u32(name: str, value: object) -> int:
    return _int(name, value, _U32_MAX)


def _lane(name: str, value: object) -> int:
    # The wire type is u16; the four-bit lane field is the tighter bound.
    lane = _int(name, value, _U16_MAX)
    if lane >= MAX_LANES:
        raise ValueError(f"{name} must be below {MAX_LANES}, got {lane}")
    return lane


def _opt_u64(name: str, value: object) -> int | None:
    return None if value is None else _u64(name, value)


def _str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} has no UTF-8 form: {exc}") from exc
    return str(value)


def _str_seq(name: str, value: object) -> tuple[str, ...]:
    # A str is itself a Sequence[str]; taking one here would advertise its characters.
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of str, got {type(value).__name__}")
    return tuple(_str(f"{name}[{i}]", key) for i, key in enumerate(value))


def _handle(name: str, value: object) -> StreamAnchorHandle:
    if not isinstance(value, StreamAnchorHandle):
        raise TypeError(f"{name} must be a StreamAnchorHandle, got {type(value).__name__}")
    return value


def _cancel_handle(name: str, value: object) -> tuple[int, int]:
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(f"{name} must be a (hi, lo) tuple, got {value!r}")
    return _u64(f"{name}.hi", value[0]), _u64(f"{name}.lo", value[1])


def _same(value: Any) -> Any:
    return value


def _wire_int(value: object) -> object:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


def _wire_opt_int(value: object) -> object:
    return None if value is None else _wire_int(value)


def _wire_str(value: object) -> object:
    if type(value) is not str:
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _wire_str_list(value: object) -> tuple[object, ...]:
    if type(value) is not list:
        raise TypeError(f"expected an array of strings, got {type(value).__name__}")
    return tuple(_wire_str(key) for key in value)


def _wire_cancel_handle(value: object) -> tuple[int, int]:
    # Same {hi, lo} shape and checks as an anchor handle; only the meaning differs.
    hi, lo = StreamAnchorHandle.from_wire(value).unpack()
    return int(hi), lo


def _cancel_handle_to_wire(value: tuple[int, int]) -> dict[str, int]:
    return {"hi": value[0], "lo": value[1]}


class ControlField(NamedTuple):
    name: str
    check: Callable[[str, object], object]
    to_wire: Callable[[Any], object]
    from_wire: Callable[[object], object]
    required: bool = True
    default: object = None


def _required(name: str, kind: str) -> ControlField:
    check, to_wire, from_wire = _KINDS[kind]
    return ControlField(name, check, to_wire, from_wire)


def _optional(name: str, kind: str, default: object) -> ControlField:
    check, to_wire, from_wire = _KINDS[kind]
    return ControlField(name, check, to_wire, from_wire, required=False, default=default)


_KINDS: Final[
    Mapping[
        str,
        tuple[Callable[[str, object], object], Callable[[Any], object], Callable[[object], object]],
    ]
] = {
    "u64": (_u64, _same, _wire_int),
    "u32": (_u32, _same, _wire_int),
    "lane": (_lane, _same, _wire_int),
    "opt_u64": (_opt_u64, _same, _wire_opt_int),
    "str": (_str, _same, _wire_str),
    "str_list": (_str_seq, list, _wire_str_list),
    "handle": (_handle, StreamAnchorHandle.to_wire, StreamAnchorHandle.from_wire),
    "cancel_handle": (_cancel_handle, _cancel_handle_to_wire, _wire_cancel_handle),
}


def _strict_map(pairs: list[tuple[object, object]]) -> dict[object, object]:
    # A dict keeps the last of two equal keys; a map that names a field twice is malformed.
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("a map names the same key twice")
    return result


def _unpack(data: bytes | memoryview, what: str) -> object:
    try:
        return msgpack.unpackb(data, object_pairs_hook=_strict_map)
    except Exception as exc:
        # msgpack raises a family of types that differs between its C and Python
        # builds; the input is the peer's, so every failure is the peer's defect.
        raise ControlDecodeError(f"{what}: not one MessagePack value ({exc})") from exc


# -- the positional message base ------------------------------------------------------


class ControlMessage:
    """Positional encoding shared by every message; subclasses list ``FIELDS`` in order.

    The schema is public (``FIELDS``: name, checks and default of each position in wire
    order; ``REQUIRED``: how many leading fields a peer must send; ``TAG`` on answers: the
    enum variant's key) so that tests and tools can reason about the wire layout without
    reaching into the codec.
    """

    __slots__ = ()
    FIELDS: ClassVar[tuple[ControlField, ...]] = ()
    REQUIRED: ClassVar[int] = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        required = sum(1 for field in cls.FIELDS if field.required)
        # Only a trailing field can be left out, so nothing required may follow a default.
        if any(field.required for field in cls.FIELDS[required:]):
            raise TypeError(f"{cls.__name__}: a required field follows an optional one")
        cls.REQUIRED = required

    def __post_init__(self) -> None:
        for field in self.FIELDS:
            value = getattr(self, field.name)
            checked = field.check(field.name, value)
            if checked is not value:
                object.__setattr__(self, field.name, checked)
        self._validate()

    def _validate(self) -> None:
        """Rules across fields or beyond a field's type; raises ``ValueError``."""

    def _wire_fields(self) -> list[object]:
        values = [getattr(self, field.name) for field in self.FIELDS]
        count = len(values)
        while count > self.REQUIRED and values[count - 1] == self.FIELDS[count - 1].default:
            count -= 1
        fields = self.FIELDS[:count]
        return [field.to_wire(value) for field, value in zip(fields, values[:count], strict=True)]

    @classmethod
    def _from_fields(cls, fields: object, what: str) -> Self:
        if type(fields) is not list:
            raise ControlDecodeError(f"{what}: not an array of fields but {type(fields).__name__}")
        known = len(cls.FIELDS)
        if len(fields) < cls.REQUIRED:
            missing = cls.FIELDS[len(fields)].name
            raise ControlDecodeError(f"{what}: corrupt, {len(fields)} fields, no {missing!r}")
        if len(fields) > known:
            raise ControlDecodeError(
                f"{what}: {len(fields)} fields, this version knows {known}; "
                "the extra ones come from a newer peer and cannot be ignored"
            )
        kwargs: dict[str, Any] = {}
        try:
            # Shorter is fine (trailing defaults); longer was refused above.
            for field, raw in zip(cls.FIELDS, fields, strict=False):
                kwargs[field.name] = field.from_wire(raw)
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ControlDecodeError(f"{what}: {exc}") from exc

    def encode(self) -> bytes:
        """The MessagePack array of the fields, trailing defaults left out."""
        packed: bytes = msgpack.packb(self._wire_fields())
        return packed

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Self:
        """Read a message; :class:`ControlDecodeError`, and only that, if it is malformed."""
        return cls._from_fields(_unpack(data, cls.__name__), cls.__name__)


class _Response(ControlMessage):
    """One variant of an externally tagged enum: ``{"Ok": [...]}`` or ``{"Err": [...]}``.

    ``Variant.decode`` reads only its own tag (the other one is refused, for a caller that
    can only use one); a family (:class:`_ResponseFamily`) decodes whichever arrived.
    """

    __slots__ = ()
    TAG: ClassVar[str] = ""

    def encode(self) -> bytes:
        packed: bytes = msgpack.packb({self.TAG: self._wire_fields()})
        return packed

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Self:
        tag, fields = _tagged(data, cls.__name__)
        if tag != cls.TAG:
            raise ControlDecodeError(f"{cls.__name__}: expected {cls.TAG}, got {tag}")
        return cls._from_fields(fields, cls.__name__)


def _tagged(data: bytes | memoryview, what: str) -> tuple[str, object]:
    """The (tag, fields) of a one-entry map whose tag is a known variant tag."""
    outer = _unpack(data, what)
    if type(outer) is not dict or len(outer) != 1:
        raise ControlDecodeError(f"{what}: not a one-entry map {{variant: fields}}")
    ((tag, fields),) = outer.items()
    if type(tag) is not str or tag not in _RESPONSE_TAGS:
        raise ControlDecodeError(f"{what}: unknown variant {str(tag)[:64]!r}")
    return tag, fields


_RESPONSE_TAGS: Final = frozenset({"Ok", "Err"})


class _ResponseFamily:
    """The answers to one request: a decoder over its variants, by tag (``_VARIANTS``).

    The refusal (:class:`AnchorAttachErr`) is a variant of both attach families; each Ok
    belongs to one. Membership is the table, not inheritance.
    """

    _VARIANTS: ClassVar[Mapping[str, type[_Response]]] = {}

    @classmethod
    def answers(cls, response: _Response) -> bool:
        """Whether ``response`` is one of this family's variants."""
        return type(response) in cls._VARIANTS.values()

    @classmethod
    def encode_response(cls, response: _Response) -> bytes:
        """``response.encode()``, refusing a variant of the other family (``TypeError``)."""
        if not cls.answers(response):
            raise TypeError(f"{type(response).__name__} is not a {cls.__name__}")
        return response.encode()

    @classmethod
    def err(cls, reason: str) -> bytes:
        """The encoded refusal ``{"Err": [reason]}``, for a handler answering in bytes.

        Characters with no UTF-8 form are replaced: a reason often quotes the
        peer's malformed input, and the refusal must still go out.
        """
        text = reason.encode(errors="replace").decode()
        return cls.encode_response(AnchorAttachErr(text))

    @classmethod
    def _decode_variant(cls, data: bytes | memoryview) -> _Response:
        tag, fields = _tagged(data, cls.__name__)
        variant = cls._VARIANTS[tag]
        return variant._from_fields(fields, variant.__name__)


# -- attach ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _AttachRequest(ControlMessage):
    """The fields an SPSC and an MPSC attach request share."""

    handle: StreamAnchorHandle
    session_id: int
    """Opaque, chosen by the sender; the receiver allocates its own routing session id."""
    stream_cancel_handle: tuple[int, int]
    """(sender WorkerId, sender_stream_id): where the consumer sends ``_stream_cancel``."""
    supported_transport_keys: Sequence[str] = ()
    """Every key the sender can connect on, sorted; empty means a sender from before
    negotiation, which gets the receiver's per-stream default."""
    lane_key: int | None = None
    """Placement hint: streams with one key share a lane. ``None`` lets the receiver choose."""
    replaces_session_id: int = 0
    """The ``session_id`` of this sender's earlier attach to the same anchor that got no
    answer in time (0: none). That attach may still bind late on the receiver; a request
    naming it replaces that bind instead of being refused as ``already_attached``, so a
    timed-out attach can be retried."""

    FIELDS: ClassVar[tuple[ControlField, ...]] = (
        _required("handle", "handle"),
        _required("session_id", "u64"),
        _required("stream_cancel_handle", "cancel_handle"),
        _optional("supported_transport_keys", "str_list", ()),
        _optional("lane_key", "opt_u64", None),
        _optional("replaces_session_id", "u64", 0),
    )


@dataclass(frozen=True, slots=True)
class AnchorAttachRequest(_AttachRequest):
    """``_anchor_attach``: a sender asks to attach to an SPSC anchor and names its transports."""


@dataclass(frozen=True, slots=True)
class MpscAnchorAttachRequest(_AttachRequest):
    """``_mpsc_anchor_attach``: the MPSC form, same fields; the answer adds a sender id."""


@dataclass(frozen=True, slots=True)
class AnchorAttachOk(_Response):
    """The attach succeeded; the sender connects on ``streaming_transport_key``.

    Every field after the key was added later, so each defaults to what a
    receiver that did not send it meant. The two zeros differ:
    ``initial_credit = 0`` means *not offering the mux* (a mux key with zero
    credit is refused by the sender), ``slot_byte_budget = 0`` means *use the
    default budget*.
    """

    streaming_transport_key: str
    heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS
    routing_session_id: int = 0
    initial_credit: int = 0
    slot_byte_budget: int = 0
    lane: int = 0

    TAG: ClassVar[str] = "Ok"
    FIELDS: ClassVar[tuple[ControlField, ...]] = (
        _required("streaming_transport_key", "str"),
        _optional("heartbeat_interval_ms", "u64", DEFAULT_HEARTBEAT_INTERVAL_MS),
        _optional("routing_session_id", "u64", 0),
        _optional("initial_credit", "u32", 0),
        _optional("slot_byte_budget", "u32", 0),
        _optional("lane", "lane", 0),
    )


@dataclass(frozen=True, slots=True)
class MpscAnchorAttachOk(_Response):
    """The MPSC attach succeeded; ``sender_id`` names this sender inside the anchor.

    ``sender_id`` is third on the wire, after the heartbeat: the MPSC answer
    has always carried the key, the heartbeat and the sender id, and the fields
    that came later (session, credit, budget, lane) follow them. A required
    field cannot follow one that may be left out, so here, unlike in
    :class:`AnchorAttachOk`, the heartbeat is required; only the four later
    fields default. This is the layout ``rmp_serde`` peers use.
    """

    streaming_transport_key: str
    heartbeat_interval_ms: int
    sender_id: int
    routing_session_id: int = 0
    initial_credit: int = 0
    slot_byte_budget: int = 0
    lane: int = 0

    TAG: ClassVar[str] = "Ok"
    FIELDS: ClassVar[tuple[ControlField, ...]] = (
        _required("streaming_transport_key", "str"),
        _required("heartbeat_interval_ms", "u64"),
        _required("sender_id", "u64"),
        _optional("routing_session_id", "u64", 0),
        _optional("initial_credit", "u32", 0),
        _optional("slot_byte_budget", "u32", 0),
        _optional("lane", "lane", 0),
    )


@dataclass(frozen=True, slots=True)
class AnchorAttachErr(_Response):
    """The attach was refused; ``reason`` is for the sender's error and its logs.

    One class answers both attach kinds: the refusal is ``{"Err": [reason]}``
    either way, and a caller that attached either kind tests for it with one
    ``isinstance``; each family lists it among its variants. :data:`MpscAnchorAttachErr`
    is the same class.
    """

    reason: str

    TAG: ClassVar[str] = "Err"
    FIELDS: ClassVar[tuple[ControlField, ...]] = (_required("reason", "str"),)


MpscAnchorAttachErr = AnchorAttachErr


class AnchorAttachResponse(_ResponseFamily):
    """The answer to ``_anchor_attach``: :class:`AnchorAttachOk` or :class:`AnchorAttachErr`."""

    _VARIANTS: ClassVar[Mapping[str, type[_Response]]] = {
        "Ok": AnchorAttachOk,
        "Err": AnchorAttachErr,
    }

    @classmethod
    def decode(cls, data: bytes | memoryview) -> AnchorAttachOk | AnchorAttachErr:
        """Whichever answer arrived; :class:`ControlDecodeError`, and only that, otherwise."""
        return cast("AnchorAttachOk | AnchorAttachErr", cls._decode_variant(data))


class MpscAnchorAttachResponse(_ResponseFamily):
    """The answer to ``_mpsc_anchor_attach``: :class:`MpscAnchorAttachOk` or the Err."""

    _VARIANTS: ClassVar[Mapping[str, type[_Response]]] = {
        "Ok": MpscAnchorAttachOk,
        "Err": AnchorAttachErr,
    }

    @classmethod
    def decode(cls, data: bytes | memoryview) -> MpscAnchorAttachOk | AnchorAttachErr:
        """Whichever answer arrived; :class:`ControlDecodeError`, and only that, otherwise."""
        return cast("MpscAnchorAttachOk | AnchorAttachErr", cls._decode_variant(data))


# -- zero-RTT ticket ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamOpenTicket(ControlMessage):
    """What a pre-bound anchor hands the application to carry to the producing worker.

    The six values of an attach answer, for a slot the receiver bound before
    any sender asked, so the worker opens the stream with no ``_anchor_attach``
    round trip. Unlike :class:`AnchorAttachOk`, no peer predates the first five
    values, so a missing one is a corrupt envelope, not an old peer, and is
    refused rather than defaulted. ``initial_credit`` and ``slot_byte_budget``
    carry the resolved window the receiver sized its buffer for, never the
    "no mux" or "use the default" zero. ``lane`` is left out when 0, so a
    lane-0 ticket is the same bytes as a pre-lane one; any other lane adds a
    sixth value, which a pre-lane worker refuses.
    """

    streaming_transport_key: str
    heartbeat_interval_ms: int
    routing_session_id: int
    initial_credit: int
    slot_byte_budget: int
    lane: int = 0

    FIELDS: ClassVar[tuple[ControlField, ...]] = (
        _required("streaming_transport_key", "str"),
        _required("heartbeat_interval_ms", "u64"),
        _required("routing_session_id", "u64"),
        _required("initial_credit", "u32"),
        _required("slot_byte_budget", "u32"),
        _optional("lane", "lane", 0),
    )

    def _validate(self) -> None:
        if self.initial_credit == 0:
            raise ValueError("a ticket's initial_credit is the resolved window, never 0")
        if self.slot_byte_budget == 0:
            raise ValueError("a ticket's slot_byte_budget is the resolved budget, never 0")


# -- anchor and stream operations ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class AnchorRef(ControlMessage):
    """``{handle}``: the body of ``_anchor_detach``, ``_anchor_finalize``, ``_anchor_cancel``
    and ``_mpsc_anchor_cancel``, which need nothing but the anchor."""

    handle: StreamAnchorHandle

    FIELDS: ClassVar[tuple[ControlField, ...]] = (_required("handle", "handle"),)


@dataclass(frozen=True, slots=True)
class MpscSenderRef(ControlMessage):
    """``{handle, sender_id}``: the body of ``_mpsc_anchor_detach``, which detaches one sender."""

    handle: StreamAnchorHandle
    sender_id: int

    FIELDS: ClassVar[tuple[ControlField, ...]] = (
        _required("handle", "handle"),
        _required("sender_id", "u64"),
    )


@dataclass(frozen=True, slots=True)
class StreamControl(ControlMessage):
    """``{sender_stream_id}``: the body of ``_stream_cancel`` and ``_stream_stop``.

    Sent by the consumer to the producer's worker, which finds the sender by
    the low half of the stream cancel handle it received at attach.
    """

    sender_stream_id: int

    FIELDS: ClassVar[tuple[ControlField, ...]] = (_required("sender_stream_id", "u64"),)
