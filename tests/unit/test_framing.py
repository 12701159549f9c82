"""The lane-stream frame codec: encoding, incremental decoding, and its limits."""

from __future__ import annotations

import pickle
import random
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velomux_quic.transport.framing import (
    FRAME_HEADER_SIZE,
    MAX_FRAME_LENGTH,
    FrameDecoder,
    FrameTooLarge,
    FramingError,
    encode_frame,
    encode_frames,
    frame_header,
)

LIMIT = 1 << 20

# A fixed stream with an empty frame, a header that straddles most cut points,
# and bodies short and long enough that every cut lands in each kind of spot.
FIXED_BODIES = [b"hello", b"", b"x" * 37, bytes(range(19)), b"\x00\x00\x00\x01"]
FIXED_STREAM = encode_frames(FIXED_BODIES)


def decode_pieces(pieces: list[bytes], limit: int = LIMIT) -> tuple[list[bytes], FrameDecoder]:
    """Feed pieces in order, checking buffered_bytes after each; return all bodies."""
    decoder = FrameDecoder(limit)
    bodies: list[bytes] = []
    fed = consumed = 0
    for piece in pieces:
        got = decoder.feed(piece)
        for body in got:
            assert type(body) is bytes
        bodies.extend(got)
        fed += len(piece)
        consumed += sum(FRAME_HEADER_SIZE + len(body) for body in got)
        assert decoder.buffered_bytes == fed - consumed
    return bodies, decoder


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in pairwise(bounds)]


# -- encoding -----------------------------------------------------------------


def test_encode_frame_wire_form() -> None:
    assert encode_frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert encode_frame(b"") == b"\x00\x00\x00\x00"
    assert encode_frame(b"\xff" * 258) == b"\x00\x00\x01\x02" + b"\xff" * 258
    assert FRAME_HEADER_SIZE == 4


def test_encode_accepts_bytes_like_bodies() -> None:
    assert encode_frame(bytearray(b"ab")) == b"\x00\x00\x00\x02ab"
    assert encode_frame(memoryview(b"xabcx")[1:4]) == b"\x00\x00\x00\x03abc"
    # A cast memoryview has fewer items than bytes; the header states bytes.
    wide = memoryview(b"abcdefgh").cast("I")
    assert len(wide) == 2
    assert encode_frame(wide) == b"\x00\x00\x00\x08abcdefgh"
    assert encode_frames([wide, bytearray(b"z")]) == b"\x00\x00\x00\x08abcdefgh\x00\x00\x00\x01z"


@given(st.lists(st.binary(max_size=300), max_size=20))
def test_encode_frames_is_concatenated_encode_frame(bodies: list[bytes]) -> None:
    assert encode_frames(bodies) == b"".join(encode_frame(b) for b in bodies)
    assert encode_frames(iter(bodies)) == encode_frames(bodies)


def test_frame_header() -> None:
    assert frame_header(0) == b"\x00\x00\x00\x00"
    assert frame_header(0x01020304) == b"\x01\x02\x03\x04"
    assert frame_header(MAX_FRAME_LENGTH) == b"\xff\xff\xff\xff"
    with pytest.raises(FrameTooLarge) as info:
        frame_header(MAX_FRAME_LENGTH + 1)
    assert (info.value.length, info.value.limit) == (MAX_FRAME_LENGTH + 1, MAX_FRAME_LENGTH)
    with pytest.raises(ValueError):
        frame_header(-1)


# -- decoding: arbitrary splits -------------------------------------------------


@given(
    bodies=st.lists(st.binary(max_size=5000), max_size=12),
    data=st.data(),
)
def test_any_split_decodes_to_the_same_bodies(bodies: list[bytes], data: st.DataObject) -> None:
    stream = encode_frames(bodies)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=30), label="cuts")
    got, decoder = decode_pieces(split_at(stream, cuts))
    assert got == bodies
    assert decoder.buffered_bytes == 0


@given(st.lists(st.sampled_from([0, 1, 3, 4, 5, 48]), max_size=200), st.integers(1, 64))
def test_many_small_frames_in_fixed_chunks(sizes: list[int], chunk: int) -> None:
    bodies = [bytes([i % 256]) * size for i, size in enumerate(sizes)]
    stream = encode_frames(bodies)
    pieces = [stream[i : i + chunk] for i in range(0, len(stream), chunk)]
    assert decode_pieces(pieces)[0] == bodies


@given(st.lists(st.binary(max_size=100), max_size=8), st.data())
def test_mutable_input_is_copied(bodies: list[bytes], data: st.DataObject) -> None:
    stream = encode_frames(bodies)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=6), label="cuts")
    decoder = FrameDecoder(LIMIT)
    got: list[bytes] = []
    for piece in split_at(stream, cuts):
        buf = bytearray(piece)
        got.extend(decoder.feed(buf if len(got) % 2 else memoryview(buf)))
        buf[:] = b"\xee" * len(buf)  # the caller reuses its buffer
    assert got == bodies
    assert all(type(body) is bytes for body in got)


def test_every_single_cut_of_a_fixed_stream() -> None:
    for i in range(len(FIXED_STREAM) + 1):
        got, decoder = decode_pieces([FIXED_STREAM[:i], FIXED_STREAM[i:]])
        assert got == FIXED_BODIES, i
        assert decoder.buffered_bytes == 0


def test_every_pair_of_cuts_of_a_fixed_stream() -> None:
    n = len(FIXED_STREAM)
    for i in range(n + 1):
        for j in range(i, n + 1):
            pieces = [FIXED_STREAM[:i], FIXED_STREAM[i:j], FIXED_STREAM[j:]]
            assert decode_pieces(pieces)[0] == FIXED_BODIES, (i, j)


def test_one_byte_at_a_time() -> None:
    pieces = [FIXED_STREAM[i : i + 1] for i in range(len(FIXED_STREAM))]
    got, decoder = decode_pieces(pieces)
    assert got == FIXED_BODIES
    assert decoder.buffered_bytes == 0


def test_bodies_are_returned_as_soon_as_complete() -> None:
    decoder = FrameDecoder(LIMIT)
    assert decoder.feed(b"") == []
    assert decoder.feed(b"\x00\x00") == []
    assert decoder.buffered_bytes == 2
    assert decoder.feed(b"\x00\x03ab") == []
    assert decoder.buffered_bytes == 6
    assert decoder.feed(b"") == []
    assert decoder.feed(b"c\x00\x00\x00\x00\x00") == [b"abc", b""]
    assert decoder.buffered_bytes == 1


def test_zero_length_frames_only() -> None:
    stream = encode_frames([b""] * 1000)
    got, _ = decode_pieces([stream[:1999], stream[1999:]], limit=0)
    assert got == [b""] * 1000


# -- decoding: the size limit ---------------------------------------------------


def test_oversized_header_is_refused_before_its_body() -> None:
    decoder = FrameDecoder(1024)
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(frame_header(1025))
    assert info.value.length == 1025
    assert info.value.limit == 1024
    assert str(info.value) == "frame of 1025 bytes exceeds max_message_size 1024"
    assert decoder.buffered_bytes == 0


def test_oversized_header_split_across_chunks() -> None:
    decoder = FrameDecoder(1024)
    assert decoder.feed(b"\xff") == []
    assert decoder.feed(b"\xff\xff") == []
    assert decoder.buffered_bytes == 3
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(b"\xff" + b"\x00" * 100)
    assert info.value.length == MAX_FRAME_LENGTH
    assert decoder.buffered_bytes == 0


def test_oversized_header_after_valid_frames_in_one_chunk() -> None:
    decoder = FrameDecoder(16)
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(encode_frames([b"a", b"b" * 16]) + frame_header(17) + b"z" * 17)
    assert info.value.frames == [b"a", b"b" * 16]  # accepted frames are not lost


def test_oversized_header_after_a_body_completes() -> None:
    decoder = FrameDecoder(16)
    assert decoder.feed(encode_frame(b"a" * 16)[:10]) == []
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(b"a" * 10 + frame_header(1 << 31))
    assert info.value.frames == [b"a" * 16]


def test_frame_exactly_at_the_limit_is_accepted() -> None:
    body = bytes(range(256)) * 4
    stream = encode_frames([body, b"", body])
    assert decode_pieces([stream], limit=len(body))[0] == [body, b"", body]
    assert decode_pieces([stream[:3], stream[3:700], stream[700:]], limit=len(body))[0] == [
        body,
        b"",
        body,
    ]


def test_limit_zero_refuses_any_non_empty_frame() -> None:
    decoder = FrameDecoder(0)
    assert decoder.feed(encode_frame(b"")) == [b""]
    with pytest.raises(FrameTooLarge):
        decoder.feed(frame_header(1))


def test_decoder_is_poisoned_after_an_error() -> None:
    decoder = FrameDecoder(8)
    with pytest.raises(FrameTooLarge) as first:
        decoder.feed(frame_header(9))
    for data in (b"", encode_frame(b"ok"), frame_header(9)):
        with pytest.raises(FramingError) as again:
            decoder.feed(data)
        assert not isinstance(again.value, FrameTooLarge)
        assert again.value.__cause__ is first.value


def test_negative_limit_rejected() -> None:
    with pytest.raises(ValueError):
        FrameDecoder(-1)
    assert FrameDecoder(7).max_message_size == 7


def test_frame_too_large_pickles() -> None:
    error = pickle.loads(pickle.dumps(FrameTooLarge(10, 5)))
    assert isinstance(error, FrameTooLarge)
    assert isinstance(error, FramingError)
    assert (error.length, error.limit, str(error)) == (10, 5, str(FrameTooLarge(10, 5)))


# -- decoding: large bodies -----------------------------------------------------


def test_sixteen_mib_body_in_64_kib_pieces() -> None:
    size = 16 << 20
    body = bytes(range(256)) * (size // 256)
    stream = encode_frames([b"before", body, b"after"])
    chunk = 64 << 10
    decoder = FrameDecoder(size)
    got: list[bytes] = []
    fed = 0
    for i in range(0, len(stream), chunk):
        piece = stream[i : i + chunk]
        out = decoder.feed(piece)
        fed += len(piece)
        if fed < 10 + 4 + size:
            # Only the first frame can be complete until the body's last byte.
            assert out == ([b"before"] if i == 0 else [])
        got.extend(out)
    assert got == [b"before", body, b"after"]
    assert decoder.buffered_bytes == 0


@settings(max_examples=25)
@given(st.integers(1, 4096), st.integers(50_000, 60_000), st.integers(0, 2**32))
def test_large_body_in_random_pieces(piece_size: int, size: int, seed: int) -> None:
    body = random.Random(seed).randbytes(size)
    stream = encode_frame(body) + encode_frame(b"tail")
    pieces = [stream[i : i + piece_size] for i in range(0, len(stream), piece_size)]
    assert decode_pieces(pieces, limit=len(body))[0] == [body, b"tail"]
