"""The mux's names on the messenger: its batch handlers and its ``_mux_slot`` header.

The messenger carries the mux's batches as active messages and knows nothing of them: the
mux registers one inline handler per lane under the reserved names here
(:data:`BATCH_HANDLER_NAMES`, see :meth:`~velomux_quic.messenger.Messenger.register_system`)
and the one envelope header it reads, ``_mux_slot``, as a
:class:`~velomux_quic.messenger.HeaderCodec` (:data:`MUX_SLOT`, see
:meth:`~velomux_quic.messenger.Messenger.register_header`). The wire bytes are the ones the
messenger used when it defined these names itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ..errors import MalformedEnvelope
from ..messenger.headers import HeaderCodec
from .protocol import MAX_LANES, batch_handler

__all__ = ["BATCH_HANDLER_NAMES", "BATCH_LANES", "MUX_SLOT", "MUX_SLOT_HEADER", "MuxSlotRef"]

BATCH_HANDLER_NAMES: Final[tuple[str, ...]] = tuple(
    batch_handler(lane) for lane in range(MAX_LANES)
)
"""The handler of each lane's batches: ``_stream_batch`` for lane 0, ``_stream_batch.k`` after."""

BATCH_LANES: Final[dict[str, int]] = {name: lane for lane, name in enumerate(BATCH_HANDLER_NAMES)}
"""Which lane a batch handler name carries (the inverse of :data:`BATCH_HANDLER_NAMES`)."""

MUX_SLOT_HEADER: Final = "_mux_slot"
"""Header naming the stream of a staged mux singleton; its value is a :class:`MuxSlotRef`.

A receiver that refuses a staged batch (it states more bytes than
``staged_payload_max``) never reads the batch, so this header is how it learns
which stream to end.
"""

_U32_MAX: Final = (1 << 32) - 1
_U64_MAX: Final = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class MuxSlotRef:
    """The value of the ``_mux_slot`` header: ``<epoch>:<slot>:<session>``.

    ``epoch`` (u64) is the sender's peer epoch, ``slot`` (u32) the full slot id,
    ``session`` (u64) the routing session the receiver allocated when the slot
    was bound. Together they name one stream lifetime; a slot id alone does not,
    because a replaced batcher reuses ids and a reused slot's eight-bit
    generation wraps. The session, the receiver's own never-reused u64, is what
    lets a late refusal find nothing rather than end a later stream.
    """

    epoch: int
    slot: int
    session: int

    def __post_init__(self) -> None:
        for name, value, limit in (
            ("epoch", self.epoch, _U64_MAX),
            ("slot", self.slot, _U32_MAX),
            ("session", self.session, _U64_MAX),
        ):
            if not isinstance(value, int) or not 0 <= value <= limit:
                raise ValueError(f"{name} must be in 0..{limit}, got {value!r}")

    def format(self) -> str:
        """The header value, in canonical form."""
        return f"{self.epoch}:{self.slot}:{self.session}"

    @classmethod
    def parse(cls, value: str) -> MuxSlotRef:
        """Read a header value; :class:`MalformedEnvelope` on anything but the canonical form.

        Only ASCII digits without sign, spaces, underscores or leading zeros are
        accepted (``int()`` takes all of those), so every reference has exactly
        one spelling and one that would not round-trip through :meth:`format` is
        refused rather than guessed at.
        """
        parts = value.split(":") if isinstance(value, str) else []
        if len(parts) != 3:
            raise _bad_slot_ref(value, "expected <epoch>:<slot>:<session>")
        numbers: list[int] = []
        for name, text, limit in zip(
            ("epoch", "slot", "session"), parts, (_U64_MAX, _U32_MAX, _U64_MAX), strict=True
        ):
            # A u64 has at most 20 digits: the length test keeps int() off long input.
            if (
                not text
                or len(text) > 20
                or not (text.isascii() and text.isdigit())
                or (text[0] == "0" and len(text) > 1)
            ):
                raise _bad_slot_ref(value, f"{name} is not a canonical decimal")
            number = int(text)
            if number > limit:
                raise _bad_slot_ref(value, f"{name} exceeds {limit}")
            numbers.append(number)
        return cls(numbers[0], numbers[1], numbers[2])


def _bad_slot_ref(value: object, what: str) -> MalformedEnvelope:
    shown = value[:64] if isinstance(value, str) else value
    return MalformedEnvelope(f"{MUX_SLOT_HEADER} header {shown!r}: {what}", MUX_SLOT_HEADER)


MUX_SLOT: Final[HeaderCodec[MuxSlotRef]] = HeaderCodec(
    MUX_SLOT_HEADER, MuxSlotRef.format, MuxSlotRef.parse
)
"""The ``_mux_slot`` header as the mux registers it with the messenger."""
