"""Decode throughput of the lane-stream frame codec.

Builds a stream of identical frames, cuts it into fixed-size chunks as QUIC
stream data events would deliver it, and times ``FrameDecoder.feed`` over all
chunks. Only decoding is timed; building and cutting the stream is not.

    python perf/framing_bench.py                   # 48-byte and 16 KiB frames
    python perf/framing_bench.py --size 200 --frames 500000
"""

from __future__ import annotations

import argparse
import time

from velomux_quic.transport.framing import FRAME_HEADER_SIZE, FrameDecoder, encode_frames

DEFAULT_SIZES = (48, 16 << 10)
DEFAULT_FRAMES = 1_000_000
# Without --frames, large frames are capped so the stream stays near this size.
DEFAULT_STREAM_BYTES = 256 << 20


def make_chunks(frames: int, size: int, chunk: int) -> list[bytes]:
    body = bytes(i % 251 for i in range(size))
    stream = encode_frames([body] * frames)
    return [stream[i : i + chunk] for i in range(0, len(stream), chunk)]


def decode_all(chunks: list[bytes], max_message_size: int) -> int:
    decoder = FrameDecoder(max_message_size)
    feed = decoder.feed
    count = 0
    for chunk in chunks:
        count += len(feed(chunk))
    return count


def bench(frames: int, size: int, chunk: int, repeat: int) -> None:
    chunks = make_chunks(frames, size, chunk)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        count = decode_all(chunks, size)
        best = min(best, time.perf_counter() - start)
        if count != frames:
            raise SystemExit(f"decoded {count} frames, expected {frames}")
    wire_mb = frames * (size + FRAME_HEADER_SIZE) / 1e6
    print(
        f"{frames:>9} frames of {size:>6} B in {chunk:,} B chunks: "
        f"{best * 1e3:8.1f} ms  {frames / best:12,.0f} frames/s  "
        f"{frames * size / 1e6 / best:9,.1f} MB/s body  {wire_mb / best:9,.1f} MB/s wire"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--frames",
        type=int,
        default=None,
        help=f"frames per run (default {DEFAULT_FRAMES:,}, fewer for large frames)",
    )
    parser.add_argument(
        "--size",
        type=int,
        action="append",
        default=None,
        help="body size in bytes; repeat for several (default 48 and 16384)",
    )
    parser.add_argument(
        "--chunk", type=int, default=64 << 10, help="bytes per feed() call (default 65536)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; best is shown")
    args = parser.parse_args(argv)
    for size in args.size or DEFAULT_SIZES:
        frames = args.frames
        if frames is None:
            frames = min(DEFAULT_FRAMES, DEFAULT_STREAM_BYTES // (size + FRAME_HEADER_SIZE))
        bench(frames, size, args.chunk, args.repeat)


if __name__ == "__main__":
    main()
