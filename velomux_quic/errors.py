"""Every exception velomux_quic raises, in one tree rooted at :class:`VelomuxError`.

A caller catches a branch, not a module's private class: the branches are the few things
a program does differently (fix its configuration, retry on another connection, give up on
one attach, end one request, or blame the peer)::

    VelomuxError
    ├── ConfigurationError (ValueError)    bad settings, files or arguments: fix and restart
    │   ├── CredentialsError               a certificate, key or CA file missing or unusable
    │   ├── LaneError                      a lane outside 0 .. 15
    │   ├── HandlerExists                  a handler name already taken (or reserved)
    │   └── WorkerIdCollision              two InstanceIds with one WorkerId
    ├── TransportError                     the network: connections, dials, admission
    │   ├── DialError                      no connection could be made (``reason`` says why)
    │   ├── PeerNotRegistered              no address known: add_peer() or discovery
    │   ├── PeerVerificationError          the peer's certificate was refused (``reason``)
    │   ├── TransportClosed                this node's transport is closed
    │   ├── MessageTooLarge (ValueError)   a frame above max_message_size
    │   ├── RequestRefused                 the peer refused a request stream
    │   ├── ResponseTooLarge               a response above the size the requester allowed
    │   └── AdmissionError                 a frame that never reached the wire
    │       ├── ChannelClosed              the connection or stream closed (also a SendError)
    │       ├── ConnectionReplaced         a newer connection to the peer replaced it
    │       └── AdmissionCancelled         the sender withdrew it
    ├── CapacityError                      a local bound is reached: wait or shed load
    │   ├── StagingFull                    staged bytes at max_staged_bytes
    │   └── SlotsExhausted                 every slot of a (peer, lane) table is live
    ├── CallError                          an active message got no answer (``peer``, ``handler``)
    │   ├── MessengerClosed, UnknownHandler, HandlerFailed, RemoteRefused, PeerGone
    │   └── UnaryTimeout (TimeoutError)
    ├── AttachError                        an attach or a ticket that produced no sender
    │   ├── AnchorNotFound, AlreadyAttached, MaxSendersReached, WrongHandleKind
    │   ├── AttachRefused                  no common transport, unreachable node, ...
    │   └── TicketError                    a pre-bind that cannot be made, or a ticket reused
    ├── StreamError                        the consumer's stream ended abnormally
    │   ├── SenderError                    a soft error from the producer; the stream goes on
    │   ├── SenderDropped                  the producer vanished (crash, watchdog, network)
    │   ├── StreamTransportError           delivery failed or the peer broke the protocol
    │   ├── DeserializationError           a record that does not decode
    │   ├── StreamCancelled                this consumer cancelled the anchor
    │   └── ReadTimeout (TimeoutError)     no item within a read's ``timeout=``
    ├── SendError                          the producer's send failed
    │   ├── ChannelClosed                  (the same class as above)
    │   ├── SerializationError (ValueError) an item MessagePack cannot encode
    │   └── SendTimeout (TimeoutError)     no room within a send's ``timeout=``
    ├── UsageError (RuntimeError)          an object used in a way it does not allow
    └── ProtocolError                      a peer sent bytes that break the wire format
        ├── FramingError, FrameTooLarge    the lane's length-prefixed framing
        ├── MalformedEnvelope              a messenger envelope or header
        ├── MalformedBatch                 a mux batch (and its six kinds)
        ├── FrameDecodeError               a StreamFrame body
        ├── ControlDecodeError             an attach message or ticket
        └── PeerRecordError                a discovery record

Every :class:`ProtocolError` carries a stable ``code`` (a :class:`ProtocolErrorCode`) for
metric labels and logs, the way aioquic's and h2's errors do. Each class also stays
importable from the module that raises it, where it used to live.
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal, get_args

__all__ = [
    "AdmissionCancelled",
    "AdmissionError",
    "AlreadyAttached",
    "AnchorNotFound",
    "AttachError",
    "AttachRefused",
    "CallError",
    "CallPeerNotRegistered",
    "CapacityError",
    "ChannelClosed",
    "ConfigurationError",
    "ConnectionReplaced",
    "ControlDecodeError",
    "CredentialsError",
    "DeserializationError",
    "DialError",
    "FrameDecodeError",
    "FrameTooLarge",
    "FramingError",
    "HandlerExists",
    "HandlerFailed",
    "LaneError",
    "MalformedBatch",
    "MalformedEnvelope",
    "MaxSendersReached",
    "MessageTooLarge",
    "MessengerClosed",
    "PeerGone",
    "PeerNotRegistered",
    "PeerRecordError",
    "PeerVerificationError",
    "ProtocolError",
    "ProtocolErrorCode",
    "ReadTimeout",
    "RefusalReason",
    "RemoteRefused",
    "RequestRefused",
    "ResponseTooLarge",
    "SendError",
    "SendTimeout",
    "SenderDropped",
    "SenderError",
    "SerializationError",
    "SlotsExhausted",
    "StagingFull",
    "StreamCancelled",
    "StreamError",
    "StreamTransportError",
    "TicketError",
    "TransportClosed",
    "TransportError",
    "UnaryTimeout",
    "UnknownHandler",
    "UsageError",
    "VelomuxError",
    "WorkerIdCollision",
    "WrongHandleKind",
]


class VelomuxError(Exception):
    """The root: every exception this library raises on purpose derives from it."""


# -- configuration and credentials ---------------------------------------------------


class ConfigurationError(VelomuxError, ValueError):
    """A setting, file or argument the library cannot use; fix it and try again."""


class CredentialsError(ConfigurationError):
    """Credential files that are missing, malformed or inconsistent with each other."""


class LaneError(ConfigurationError):
    """A lane index outside ``0 .. 15``, the most lanes any node has. A lane at or above
    the node's own lane count is no error: it folds onto ``lane % lanes``, so nodes with
    different counts still talk."""


class HandlerExists(ConfigurationError):
    """A handler of that name is already registered (or the name is reserved)."""


class WorkerIdCollision(ConfigurationError):
    """Two InstanceIds with the same WorkerId; the second one is refused.

    Stream handles name their destination by WorkerId alone, so a registry holding both
    could deliver one node's streams to the other. Refusing loudly is the only safe
    answer; at 64 bits it takes billions of nodes before this is likely to happen.
    """

    def __init__(self, worker_id: int, holder: object, refused: object) -> None:
        super().__init__(
            f"WorkerId {worker_id:016x} of {refused} is already held by {holder}; "
            f"refusing {refused} so no stream is routed to the wrong node"
        )
        self.worker_id = worker_id
        self.holder = holder
        self.refused = refused

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.worker_id, self.holder, self.refused)


# -- transport: connections and admission --------------------------------------------


class TransportError(VelomuxError):
    """The network between two nodes: a connection, a dial or an admission failed."""


class DialError(TransportError):
    """A connection to a peer could not be established (handshake refused, timeout, ...).

    ``reason`` is a short machine-readable code (for example ``identity_mismatch``,
    ``handshake_timeout``, ``refused``); the message says it in words.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_with_reason, (type(self), str(self), self.reason)


class PeerNotRegistered(TransportError):
    """No address is known for that peer: call ``add_peer`` or configure discovery.

    A call (``Node.call``) to such a peer raises :class:`CallPeerNotRegistered` instead,
    a :class:`PeerGone` like every call that cannot reach its peer, with this as its cause.
    """


RefusalReason = Literal[
    "no_certificate",
    "untrusted_chain",
    "expired",
    "not_yet_valid",
    "bad_key_usage",
    "bad_identity",
    "identity_mismatch",
    "bad_signature",
]
"""Why a peer certificate was refused (the values of :attr:`PeerVerificationError.reason`)."""


class PeerVerificationError(TransportError):
    """A peer's certificate was refused; ``reason`` is stable, the message is for people.

    ``reason`` is one of :data:`RefusalReason` and is meant for metrics labels and for
    tests; the message names the certificate and says what to fix.
    """

    def __init__(self, reason: RefusalReason, message: str) -> None:
        if reason not in _REFUSAL_REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        super().__init__(message)
        self.reason: RefusalReason = reason

    def __reduce__(self) -> tuple[type[PeerVerificationError], tuple[str, str]]:
        return type(self), (self.reason, str(self))


class TransportClosed(TransportError):
    """This node's transport was closed; it cannot send or dial any more."""


class MessageTooLarge(TransportError, ValueError):
    """A frame larger than ``max_message_size``; refused before anything was queued."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds max_message_size {limit}")
        self.length = length
        self.limit = limit

    def __reduce__(self) -> tuple[type[MessageTooLarge], tuple[int, int]]:
        return type(self), (self.length, self.limit)


class RequestRefused(TransportError):
    """The peer refused (reset) a request stream, or has nothing to serve it."""


class ResponseTooLarge(TransportError):
    """A request stream's response grew past the size the requester allowed."""


class AdmissionError(TransportError):
    """A send that was not admitted and never will be; the frame never reached the wire."""


class SendError(VelomuxError):
    """What a producer's ``send`` raises: the item was not taken."""


class ChannelClosed(AdmissionError, SendError):
    """The connection, the stream or the whole node closed before the data was taken.

    One class for both layers: the transport refuses a frame with it, and a sender's
    ``send`` raises it when the consumer is gone, cancelled the stream or its channel
    closed. Catch it as a :class:`TransportError` or as a :class:`SendError`.
    """


class ConnectionReplaced(AdmissionError):
    """The connection the frame waited on was replaced by a newer one to the same peer."""


class AdmissionCancelled(AdmissionError):
    """The sender cancelled the admission explicitly."""


# -- local capacity ----------------------------------------------------------------------


class CapacityError(VelomuxError):
    """A bound of this node is reached; wait for room or shed load."""


class StagingFull(CapacityError):
    """Staging the payload would exceed the node's ``max_staged_bytes``."""


class SlotsExhausted(CapacityError, RuntimeError):
    """Every slot index of this (peer, lane) table is live."""


# -- active messages -----------------------------------------------------------------


class CallError(VelomuxError):
    """A call (``am_sync`` or ``unary``) did not produce an answer."""

    def __init__(self, message: str, *, peer: object = None, handler: str = "") -> None:
        super().__init__(message)
        self.peer = peer
        self.handler = handler


class MessengerClosed(CallError):
    """The messenger was closed; it neither sends nor waits for answers any more."""


class UnknownHandler(CallError):
    """The peer has no handler of that name."""


class HandlerFailed(CallError):
    """The peer's handler raised; ``remote_message`` is what it said."""

    def __init__(
        self, message: str, *, remote_message: str, peer: object = None, handler: str = ""
    ) -> None:
        super().__init__(message, peer=peer, handler=handler)
        self.remote_message = remote_message


class RemoteRefused(CallError):
    """The peer refused the message (malformed, too large to stage, shutting down)."""


class UnaryTimeout(CallError, TimeoutError):
    """No answer within the call's timeout."""


class PeerGone(CallError):
    """The peer could not be reached, or its connection died while we waited."""


class CallPeerNotRegistered(PeerGone):
    """A call to a peer whose address nobody knows: a :class:`PeerGone`, the call branch's
    class for a peer it cannot reach, whose message says what to fix (``add_peer`` or
    discovery). It is a call's failure, so it is in the call branch alone; the transport's
    :class:`PeerNotRegistered` that caused it is its ``__cause__``."""


# -- attach ----------------------------------------------------------------------------


class AttachError(VelomuxError):
    """An attach (or a ticket's open) that did not produce a sender."""

    def __init__(self, message: str, handle: Any = None) -> None:
        super().__init__(message)
        # Typed Any, not StreamAnchorHandle: ids raises this module's errors (a str passed
        # as an InstanceId), so this module must not import ids, not even for a type.
        self.handle: Any = handle
        """The :class:`~velomux_quic.StreamAnchorHandle` the attach was for, if known."""


class AnchorNotFound(AttachError):
    """No such anchor on the consumer's node (never created, finished or cancelled)."""


class AlreadyAttached(AttachError):
    """The single-sender anchor already has a live sender."""


class MaxSendersReached(AttachError):
    """The MPSC anchor's ``max_senders`` cap is reached."""


class WrongHandleKind(AttachError):
    """An SPSC handle given to an MPSC call or the reverse (detected locally)."""


class AttachRefused(AttachError):
    """The attach failed for another reason: no common transport, unreachable node, ..."""


class TicketError(AttachError):
    """A pre-bind that cannot be made (no mux, an MPSC or attached anchor, another
    node's handle), or a ticket that was already used to open a stream."""


# -- streams: the consumer's side ----------------------------------------------------------


class StreamError(VelomuxError):
    """What a consumer's anchor raises instead of yielding an item."""


class SenderError(StreamError):
    """The producer reported a soft error (``send_err``); the stream goes on."""


class SenderDropped(StreamError):
    """The producer vanished without finishing (dropped, watchdog, connection loss)."""


class StreamTransportError(StreamError):
    """Unrecoverable delivery failure or protocol violation; the stream is over."""


class DeserializationError(StreamError):
    """A frame could not be decoded; the stream is over."""


class StreamCancelled(StreamError):
    """The consumer cancelled the anchor (or it was removed); no more items will come."""


class ReadTimeout(StreamError, TimeoutError):
    """No item arrived within the read's ``timeout=``; the stream goes on."""


# -- streams: the producer's side -----------------------------------------------------------


class SerializationError(SendError, ValueError):
    """An item MessagePack cannot encode; nothing was sent and the stream goes on."""


class SendTimeout(SendError, TimeoutError):
    """The stream had no room within the send's ``timeout=``; the item was not taken."""


# -- misuse --------------------------------------------------------------------------------


class UsageError(VelomuxError, RuntimeError):
    """An object used in a way it does not allow (two readers of one anchor, ...).

    The message says what to do instead.
    """


# -- protocol violations by a peer -------------------------------------------------------


class ProtocolErrorCode(StrEnum):
    """What part of the wire format a peer broke; stable, for metric labels and logs."""

    FRAMING = "framing"
    """The lane's ``[u32 length][body]`` framing (a length above the limit, say)."""
    MALFORMED_ENVELOPE = "malformed_envelope"
    """A messenger envelope, header value or ERROR payload."""
    MALFORMED_BATCH = "malformed_batch"
    """A ``_stream_batch`` payload or one of its records."""
    MALFORMED_FRAME = "malformed_frame"
    """A ``StreamFrame`` body (an item, heartbeat or sentinel)."""
    MALFORMED_CONTROL = "malformed_control"
    """An attach request or answer, a stream control message or a ticket."""
    MALFORMED_PEER_RECORD = "malformed_peer_record"
    """A discovery record."""


class ProtocolError(VelomuxError, ValueError):
    """Bytes from a peer that break the wire format; ``code`` names the part.

    The library drops exactly what the Batched streaming chapter says (one batch, one slot, one
    connection) and counts it; the error reaches a caller only where a request of its
    own was answered with such bytes.
    """

    code: ProtocolErrorCode = ProtocolErrorCode.FRAMING


class FramingError(ProtocolError):
    """The byte stream is not a valid sequence of frames; close the connection."""

    code = ProtocolErrorCode.FRAMING


class FrameTooLarge(FramingError):
    """A frame header states a body longer than the permitted limit.

    ``length`` is the stated body length and ``limit`` the largest accepted.
    ``frames`` holds the whole frames the same feed completed before the bad header:
    they were valid, so the caller delivers them before closing the connection.
    """

    length: int
    limit: int
    frames: list[bytes]

    def __init__(self, length: int, limit: int, frames: list[bytes] | None = None) -> None:
        super().__init__(f"frame of {length} bytes exceeds max_message_size {limit}")
        self.length = length
        self.limit = limit
        self.frames = frames if frames is not None else []

    def __reduce__(self) -> tuple[type[FrameTooLarge], tuple[int, int]]:
        # The default reduction would call __init__ with the message alone.
        return type(self), (self.length, self.limit)


class MalformedEnvelope(ProtocolError):
    """A frame body, header value or error payload from a peer is not valid.

    The message names the field and, inside an envelope, its byte offset.
    ``field`` and ``offset`` carry the same for code (a metric label, a log
    field); ``offset`` is ``None`` where the value is not read from a position
    in an envelope (a header value, an error payload).
    """

    code = ProtocolErrorCode.MALFORMED_ENVELOPE
    field: str
    offset: int | None

    def __init__(self, message: str, field: str = "", offset: int | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.offset = offset

    def __reduce__(self) -> tuple[type[MalformedEnvelope], tuple[str, str, int | None]]:
        # The default reduction would call __init__ with the message alone.
        return type(self), (str(self), self.field, self.offset)


class MalformedBatch(ProtocolError):
    """A mux batch is malformed; drop it whole and count it.

    Every refusal of the mux's batch decoder and its record body decoders is a subclass
    (``velomux_quic.mux.records`` and ``.protocol`` name the kinds), and nothing else
    escapes them for any input bytes. ``header`` is the batch header when it parsed
    before the fault was found (None otherwise), so the caller can count the dropped
    records against the right lane and peer epoch.
    """

    code = ProtocolErrorCode.MALFORMED_BATCH
    header: Any = None


class FrameDecodeError(ProtocolError):
    """A frame body that is not a well-formed ``StreamFrame``; the consumer ends the anchor."""

    code = ProtocolErrorCode.MALFORMED_FRAME


class ControlDecodeError(ProtocolError):
    """A control message or ticket that is not well-formed; the handler refuses it."""

    code = ProtocolErrorCode.MALFORMED_CONTROL


class PeerRecordError(ProtocolError):
    """A peer record that is not well formed: wrong type, bad UUID, port or lane count."""

    code = ProtocolErrorCode.MALFORMED_PEER_RECORD


# -- helpers -------------------------------------------------------------------------------

_REFUSAL_REASONS: frozenset[str] = frozenset(get_args(RefusalReason))


def _rebuild_with_reason(cls: type[DialError], message: str, reason: str) -> DialError:
    return cls(message, reason=reason)
