"""Per-record cost of the ``StreamFrame`` codec on a token-sized item.

Times the calls every streamed token goes through: :func:`encode_item` on the
producer, :func:`is_terminal_sentinel` in egress and :func:`decode_frame` on
the consumer, plus what they are measured against (``msgpack.packb`` per item,
the batch encoder, the sentinel and heartbeat paths). Each figure is the best
of ``--repeat`` runs over ``--records`` calls, loop overhead included.

    python perf/stream_frames_bench.py                    # 48-byte token frame
    python perf/stream_frames_bench.py --item small       # {"token": 123, "text": "hello"}
    python perf/stream_frames_bench.py --records 1000000 --repeat 3
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import msgpack

from velomux_quic.streaming.frames import (
    DROPPED,
    HEARTBEAT,
    ITEM_PREFIX,
    decode_frame,
    encode_item,
    encode_items,
    encode_transport_error,
    is_heartbeat,
    is_terminal_sentinel,
)

ITEMS: dict[str, object] = {
    # A frame of 48 bytes: a token id, its text, a log-probability and a sequence id.
    "token48": {"id": 123, "token": 12345, "text": "hello", "logprob": -0.25},
    # A frame of 25 bytes.
    "small": {"token": 123, "text": "hello"},
}
BATCH = 64


def best_of(repeat: int, run: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def report(name: str, calls: int, seconds: float) -> None:
    print(f"{name:<44} {seconds / calls * 1e9:8.1f} ns/call  {calls / seconds:14,.0f} calls/s")


def per_call(name: str, func: Callable[[Any], object], arg: object, n: int, r: int) -> None:
    def run() -> None:
        f = func
        a = arg
        for _ in range(n):
            f(a)

    report(name, n, best_of(r, run))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--item", choices=sorted(ITEMS), default="token48")
    parser.add_argument("--records", type=int, default=200_000, help="calls per timed run")
    parser.add_argument("--repeat", type=int, default=9, help="timed runs; the best is shown")
    args = parser.parse_args(argv)
    n, r = args.records, args.repeat

    item = ITEMS[args.item]
    frame = encode_item(item)
    if frame != ITEM_PREFIX + msgpack.packb(item):
        raise SystemExit("encode_item disagrees with msgpack.packb")
    print(f"item {item!r}: {len(frame)}-byte frame, {n:,} calls per run, best of {r}")

    packb = msgpack.packb
    per_call("encode_item", encode_item, item, n, r)
    per_call(
        "ITEM_PREFIX + msgpack.packb(item) (reference)",
        lambda value: ITEM_PREFIX + packb(value),
        item,
        n,
        r,
    )

    batch = [item] * BATCH
    batches = max(1, n // BATCH)

    def run_batched() -> None:
        for _ in range(batches):
            encode_items(batch)

    def run_unbatched() -> None:
        for _ in range(batches):
            [encode_item(value) for value in batch]

    count = batches * BATCH
    report(f"encode_items, batches of {BATCH} (per item)", count, best_of(r, run_batched))
    report(f"[encode_item(x) ...] of {BATCH} (per item)", count, best_of(r, run_unbatched))

    per_call("decode_frame(bytes)", decode_frame, frame, n, r)
    per_call("decode_frame(memoryview)", decode_frame, memoryview(frame), n, r)
    per_call("decode_frame(Heartbeat)", decode_frame, HEARTBEAT, n, r)

    per_call("is_terminal_sentinel(Item)", is_terminal_sentinel, frame, n, r)
    per_call("is_terminal_sentinel(memoryview Item)", is_terminal_sentinel, memoryview(frame), n, r)
    per_call("is_terminal_sentinel(Heartbeat)", is_terminal_sentinel, HEARTBEAT, n, r)
    per_call("is_terminal_sentinel(Dropped)", is_terminal_sentinel, DROPPED, n, r)
    transport_error = encode_transport_error("peer lost")
    per_call("is_terminal_sentinel(TransportError)", is_terminal_sentinel, transport_error, n, r)
    per_call("is_heartbeat(Item)", is_heartbeat, frame, n, r)


if __name__ == "__main__":
    main()
