"""The attach request's ``replaces_session_id`` (a retry of a timed-out attach): a trailing
field, left out at 0, so a first attempt is byte-identical to a request from before it."""

from __future__ import annotations

import msgpack  # type: ignore[import-untyped]
import pytest

from velomux_quic.errors import ControlDecodeError
from velomux_quic.ids import StreamAnchorHandle
from velomux_quic.streaming.control import (
    PER_STREAM_KEY,
    AnchorAttachRequest,
    MpscAnchorAttachRequest,
)

HANDLE = StreamAnchorHandle((7 << 64) | 9)
WIRE = {"hi": 7, "lo": 9}


@pytest.mark.parametrize("kind", [AnchorAttachRequest, MpscAnchorAttachRequest])
def test_a_first_attempt_leaves_the_field_out(
    kind: type[AnchorAttachRequest] | type[MpscAnchorAttachRequest],
) -> None:
    request = kind(HANDLE, 42, (5, 6), [PER_STREAM_KEY])
    assert request.encode() == msgpack.packb([WIRE, 42, {"hi": 5, "lo": 6}, [PER_STREAM_KEY]])
    assert kind.decode(request.encode()).replaces_session_id == 0


@pytest.mark.parametrize("kind", [AnchorAttachRequest, MpscAnchorAttachRequest])
def test_a_retry_names_the_attempt_it_replaces_after_the_lane_key(
    kind: type[AnchorAttachRequest] | type[MpscAnchorAttachRequest],
) -> None:
    request = kind(HANDLE, 43, (5, 6), [PER_STREAM_KEY], replaces_session_id=42)
    raw = request.encode()
    # lane_key is None but must be written (as nil) to keep the positions.
    assert raw == msgpack.packb([WIRE, 43, {"hi": 5, "lo": 6}, [PER_STREAM_KEY], None, 42])
    assert kind.decode(raw) == request


def test_a_replaced_session_id_outside_u64_is_refused() -> None:
    raw = msgpack.packb([WIRE, 43, {"hi": 5, "lo": 6}, [PER_STREAM_KEY], None, -1])
    with pytest.raises(ControlDecodeError):
        AnchorAttachRequest.decode(raw)
