"""The seed corpus: small valid and near-valid inputs for every target, made by the encoders.

``python -m fuzz.corpus`` rewrites ``fuzz/corpus/<target>/`` from :func:`seeds`, so the
corpus follows the wire format when it changes; ``tests/unit/test_fuzz_targets.py`` fails
while the files in the tree differ from what this module makes. A file named ``ok-*`` is
valid (its target must decode it); ``near-*`` is one edit away from valid (truncated, a
length one off, an unknown enum value) and shows the fuzzer where the refusals are.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final

import msgpack  # type: ignore[import-untyped]

from velomux_quic.discovery import PeerRecord
from velomux_quic.ids import InstanceId, StreamAnchorHandle
from velomux_quic.messenger.envelope import (
    ErrorCode,
    Kind,
    StagedDescriptor,
    encode_envelope,
    encode_error,
)
from velomux_quic.mux.protocol import (
    BatchHeader,
    CloseReason,
    LifecycleAction,
    RecordType,
    close_slot_body,
    credit_body,
    encode_batch,
    lifecycle_body,
    open_slot_body,
    slot_id,
)
from velomux_quic.streaming.control import (
    MESSENGER_MUX_KEY,
    PER_STREAM_KEY,
    AnchorAttachErr,
    AnchorAttachOk,
    AnchorAttachRequest,
    AnchorRef,
    MpscAnchorAttachOk,
    MpscAnchorAttachRequest,
    MpscSenderRef,
    StreamControl,
    StreamOpenTicket,
)
from velomux_quic.streaming.frames import (
    DETACHED,
    DROPPED,
    FINALIZED,
    HEARTBEAT,
    encode_item,
    encode_sender_error,
    encode_transport_error,
)
from velomux_quic.transport.framing import encode_frames

from .targets import CONTROL_MESSAGES, TARGETS

__all__ = ["CORPUS_DIR", "seeds", "write"]

CORPUS_DIR: Final = Path(__file__).parent / "corpus"

Seeds = dict[str, bytes]

_HANDLE: Final = StreamAnchorHandle.pack(0x1234_5678_9ABC_DEF0, 42)
_INSTANCE: Final = InstanceId.parse("6f1c2d3e-4b5a-4c6d-8e7f-901a2b3c4d5e")


def _near(valid: Seeds) -> Seeds:
    """Near-valid variants of each valid seed: the last byte cut, one byte added."""
    out: Seeds = {}
    for name, data in valid.items():
        stem = name.removeprefix("ok-")
        if data:
            out[f"near-{stem}-cut"] = data[:-1]
        out[f"near-{stem}-extra"] = data + b"\x00"
    return out


def _mux_batch() -> Seeds:
    data = (RecordType.DATA, slot_id(1, 0), 0, encode_item("token"))
    control = [
        (RecordType.OPEN_SLOT, slot_id(2, 1), 0, open_slot_body(7, 9)),
        (RecordType.CREDIT_UPDATE, slot_id(2, 1), 0, credit_body(64)),
        (RecordType.SLOT_HEARTBEAT, slot_id(2, 1), 0, b""),
        (RecordType.LIFECYCLE_SLOT, slot_id(2, 1), 0, lifecycle_body(9, LifecycleAction.STOP)),
        (RecordType.CLOSE_SLOT, slot_id(2, 1), 1, close_slot_body(CloseReason.TERMINAL_SENT)),
    ]
    valid = {
        "ok-empty": encode_batch(BatchHeader(0, 0, 1, 0), []),
        "ok-data": encode_batch(BatchHeader(0, 1, 1, 1), [data]),
        "ok-lane7-data3": encode_batch(BatchHeader(7, 3, 2, 0xFFFF_FFFF), [data] * 3),
        "ok-control": encode_batch(BatchHeader(3, 5, 5, 17), control),
        "ok-mixed": encode_batch(BatchHeader(15, 6, 9, 4), [data, *control]),
    }
    near = _near(valid)
    bad_close = bytearray(encode_batch(BatchHeader(0, 1, 1, 1), [control[-1]]))
    bad_close[-1] = len(CloseReason)
    near["near-close-reason"] = bytes(bad_close)
    overrun = bytearray(valid["ok-data"])
    overrun[16 + 9 : 16 + 13] = (0xFFFF_FFFF).to_bytes(4, "big")
    near["near-len-4gib"] = bytes(overrun)
    return valid | near


def _mux_record() -> Seeds:
    # The first byte picks the decoder (modulo 4): open, close, credit, lifecycle.
    valid = {
        "ok-open": b"\x00" + open_slot_body(0xDEAD_BEEF, 1),
        "ok-close": b"\x01" + close_slot_body(CloseReason.PROTOCOL_ERROR),
        "ok-credit": b"\x02" + credit_body(0xFFFF_FFFF),
        "ok-lifecycle": b"\x03" + lifecycle_body(5, LifecycleAction.CANCEL),
    }
    return valid | _near(valid) | {"near-lifecycle-action": b"\x03" + bytes(8) + b"\x02"}


def _lane_frames() -> Seeds:
    # Byte 0: the size limit / 4; byte 1: how the stream is cut into chunks.
    bodies = [b"", b"a", b"x" * 40, bytes(range(200))]
    stream = encode_frames(bodies)
    valid = {
        "ok-frames-1byte-chunks": b"\x40\x00" + stream,
        "ok-frames-mixed-chunks": b"\x40\xf3" + stream,
        "ok-one-frame": b"\xff\x10" + encode_frames([b"hello"]),
    }
    return valid | {
        "near-over-limit": b"\x01\x05" + stream,
        "near-4gib-header": b"\xff\x00" + b"\xff\xff\xff\xff" + b"x" * 8,
        "near-cut-body": b"\x40\x02" + stream[:-3],
    }


def _envelope() -> Seeds:
    descriptor = StagedDescriptor(99, 1 << 20).encode()
    valid = {
        "ok-message": encode_envelope(Kind.MESSAGE, handler="_stream_batch", payload=b"batch"),
        "ok-request-headers": encode_envelope(
            Kind.REQUEST, handler="echo", message_id=7, headers={"trace": "abc"}, payload=b"x"
        ),
        "ok-sync-staged": encode_envelope(
            Kind.SYNC, handler="load", message_id=3, payload=descriptor, staged=True
        ),
        "ok-response": encode_envelope(Kind.RESPONSE, message_id=7, payload=b"reply"),
        "ok-error": encode_envelope(
            Kind.ERROR, message_id=7, payload=encode_error(ErrorCode.REFUSED, "too big")
        ),
        "ok-ack": encode_envelope(Kind.ACK, message_id=3),
    }
    # The encoder refuses a header value over 1024 bytes, so this one is packed by hand.
    headers = msgpack.packb({"trace": "v" * 1025})
    long_value = (
        bytes((1, Kind.REQUEST, 1, 4))
        + (7).to_bytes(8, "big")
        + b"echo"
        + len(headers).to_bytes(2, "big")
        + headers
    )
    return valid | _near(valid) | {"near-header-value-1025": long_value}


def _envelope_contents() -> Seeds:
    # The first byte picks the decoder: odd an ERROR payload, even a STAGED descriptor.
    valid = {
        "ok-error": b"\x01" + encode_error(ErrorCode.HANDLER_FAILED, "boom"),
        "ok-error-extra-field": b"\x01" + msgpack.packb(["refused", "later", 1]),
        "ok-error-unknown-code": b"\x01" + msgpack.packb(["from_the_future", "x"]),
        "ok-descriptor": b"\x00" + StagedDescriptor(1, 2).encode(),
    }
    return valid | _near(valid)


def _control_messages() -> list[object]:
    return [
        AnchorAttachRequest(_HANDLE, 5, (1, 2), (MESSENGER_MUX_KEY, PER_STREAM_KEY), 3),
        MpscAnchorAttachRequest(_HANDLE, 6, (1, 3)),
        AnchorAttachOk(MESSENGER_MUX_KEY, 500, 11, 64, 1 << 20, 2),
        MpscAnchorAttachOk(PER_STREAM_KEY, 5000, 4),
        AnchorAttachOk(MESSENGER_MUX_KEY, 500, 11, 64, 1 << 20, 2),
        MpscAnchorAttachOk(PER_STREAM_KEY, 5000, 4, 8, 16, 32, 1),
        AnchorAttachErr("anchor_not_found: no such anchor"),
        AnchorRef(_HANDLE),
        MpscSenderRef(_HANDLE, 3),
        StreamControl(77),
    ]


def _control() -> Seeds:
    # The first byte picks the class, in CONTROL_MESSAGES order.
    valid: Seeds = {}
    for index, message in enumerate(_control_messages()):
        cls = CONTROL_MESSAGES[index]
        encoded: bytes = message.encode()  # type: ignore[attr-defined]
        valid[f"ok-{index:02d}-{cls.__name__}"] = bytes((index,)) + encoded
    return valid | _near(valid)


def _ticket() -> Seeds:
    valid = {
        "ok-lane0": StreamOpenTicket(MESSENGER_MUX_KEY, 500, 9, 64, 1 << 16).encode(),
        "ok-lane5": StreamOpenTicket(MESSENGER_MUX_KEY, 500, 9, 64, 1 << 16, 5).encode(),
    }
    return valid | _near(valid) | {"near-five-fields-zero-credit": msgpack.packb(["k", 1, 2, 0, 1])}


def _stream_frame() -> Seeds:
    valid = {
        "ok-item-str": encode_item("hello"),
        "ok-item-map": encode_item({"tokens": [1, 2, 3], "done": False, 7: b"\x00"}),
        "ok-heartbeat": HEARTBEAT,
        "ok-finalized": FINALIZED,
        "ok-detached": DETACHED,
        "ok-dropped": DROPPED,
        "ok-sender-error": encode_sender_error("soft"),
        "ok-transport-error": encode_transport_error("hard"),
        "ok-str8-dropped": b"\xd9\x07Dropped",
        "ok-map16-error": b"\xde\x00\x01" + msgpack.packb("SenderError") + msgpack.packb("x"),
    }
    return valid | _near(valid) | {"near-empty": b"", "near-map32-two": b"\xdf\x00\x00\x00\x02"}


def _peer_record() -> Seeds:
    record = PeerRecord(_INSTANCE, ("10.0.0.7", 4433), name="worker-a", lanes=4, updated_at=1.5)
    text = json.dumps(record.to_json())
    valid = {
        "ok-record": text.encode(),
        "ok-ipv6-extra-key": json.dumps(
            PeerRecord(_INSTANCE, ("fe80::1%eth0", 1), updated_at=0).to_json() | {"new": [1]}
        ).encode(),
    }
    fields = record.to_json()
    return (
        valid
        | _near(valid)
        | {
            "near-lanes-17": text.replace('"lanes": 4', '"lanes": 17').encode(),
            "near-name-not-str": json.dumps(fields | {"name": 5}).encode(),
            # The first finding: an integer past a float's range raised OverflowError.
            "near-updated-at-past-float": json.dumps(fields | {"updated_at": 10**400}).encode(),
        }
    )


_MAKERS: Final[dict[str, Callable[[], Seeds]]] = {
    "mux_batch": _mux_batch,
    "mux_record": _mux_record,
    "lane_frames": _lane_frames,
    "envelope": _envelope,
    "envelope_contents": _envelope_contents,
    "control": _control,
    "ticket": _ticket,
    "stream_frame": _stream_frame,
    "peer_record": _peer_record,
}


def seeds() -> dict[str, Seeds]:
    """Every target's seed inputs, by target name and then file name."""
    if set(_MAKERS) != set(TARGETS):
        raise RuntimeError(f"seeds for {sorted(_MAKERS)}, targets {sorted(TARGETS)}")
    return {name: make() for name, make in _MAKERS.items()}


def write(root: Path = CORPUS_DIR) -> int:
    """Rewrite ``root/<target>/`` from :func:`seeds` (stale files removed); returns the count."""
    count = 0
    for target, files in seeds().items():
        directory = root / target
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.iterdir():
            if stale.name not in files:
                stale.unlink()
        for name, data in files.items():
            (directory / name).write_bytes(data)
            count += 1
    return count


if __name__ == "__main__":
    written = write(Path(sys.argv[1]) if len(sys.argv) > 1 else CORPUS_DIR)
    print(f"wrote {written} seed inputs under {CORPUS_DIR}")
