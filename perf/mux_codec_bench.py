"""Encode and decode rates of the messenger mux batch codec.

Times three things on batches of data records (1,000 records of 48-byte bodies
by default, about the shape of a full 60 KiB batch of small tokens):

* ``BatchBuilder``: add every record, finish, reset (the egress hot path);
* ``encode_batch``: the one-call reference encoder, for comparison;
* ``decode_batch``: parse the batch into zero-copy records (the ingress path).

Only the codec is timed; building the inputs is not. Each run covers
``--batches`` batches; the three take turns for ``--repeat`` rounds and the best
of each is shown, so a burst of other load does not favour one of them.

    python perf/mux_codec_bench.py
    python perf/mux_codec_bench.py --records 100 --size 200 --batches 5000
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from velomux_quic.mux.protocol import (
    BATCH_HEADER_SIZE,
    RECORD_HEADER_SIZE,
    BatchBuilder,
    BatchHeader,
    RecordType,
    decode_batch,
    encode_batch,
    slot_id,
)


def best_of(repeat: int, runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Best time of each run, taking turns so a burst of load hits all of them alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def report(name: str, batches: int, records: int, seconds: float) -> None:
    total = batches * records
    print(
        f"{name:<22} {seconds / batches * 1e6:9.1f} us/batch  "
        f"{total / seconds:14,.0f} records/s  {batches / seconds:10,.0f} batches/s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--records", type=int, default=1000, help="records per batch")
    parser.add_argument("--size", type=int, default=48, help="body bytes per record")
    parser.add_argument("--batches", type=int, default=500, help="batches per run")
    parser.add_argument("--repeat", type=int, default=7, help="rounds; the best is shown")
    args = parser.parse_args(argv)

    body = bytes(i % 251 for i in range(args.size))
    records = [
        (int(RecordType.DATA), slot_id(i % 64, 1), i // 64 + 1, body) for i in range(args.records)
    ]
    batch_bytes = BATCH_HEADER_SIZE + args.records * (RECORD_HEADER_SIZE + args.size)
    header = BatchHeader(lane=0, record_count=args.records, peer_epoch=1, batch_seq=0)
    builder = BatchBuilder(batch_bytes)
    batches = args.batches

    def run_builder() -> None:
        add = builder.add
        finish = builder.finish
        reset = builder.reset
        for seq in range(batches):
            for record_type, slot, frame_seq, payload in records:
                add(record_type, slot, frame_seq, payload)
            finish(0, 1, seq)
            reset()

    def run_encode() -> None:
        for _ in range(batches):
            encode_batch(header, records)

    wire = encode_batch(header, records)

    def run_decode() -> None:
        for _ in range(batches):
            decode_batch(wire)

    # Check before timing: both encoders agree and decoding inverts them.
    for record in records:
        builder.add(*record)
    built = builder.finish(0, 1, 0)
    builder.reset()
    if built != wire or len(decode_batch(built)[1]) != args.records:
        raise SystemExit("BatchBuilder and encode_batch disagree")

    print(
        f"{args.records} records of {args.size} B per batch ({batch_bytes:,} B), "
        f"{batches:,} batches per run, best of {args.repeat}"
    )
    runs: dict[str, Callable[[], object]] = {
        "encode (BatchBuilder)": run_builder,
        "encode (encode_batch)": run_encode,
        "decode (decode_batch)": run_decode,
    }
    for name, seconds in best_of(args.repeat, runs).items():
        report(name, batches, args.records, seconds)


if __name__ == "__main__":
    main()
