"""Encode and decode rate of messenger envelopes.

Every frame on a lane is one envelope, so these costs are paid once per mux
batch and once per control message. Four cases:

* MESSAGE, 2 KiB payload, encoded as ``message_prefix(...) + payload`` (how the
  mux sends a batch to ``_stream_batch``);
* REQUEST, precomputed :class:`MessagePrefix` (the unary hot path, no headers);
* REQUEST with a ``_mux_slot`` header through :func:`encode_envelope` (the
  general path, MessagePack on both sides);
* MESSAGE through :func:`encode_envelope`, to show what the prefix saves.

Each case times encoding alone, decoding alone, and a loop that does both;
the best of ``--repeat`` runs is shown.

    python perf/envelope_bench.py
    python perf/envelope_bench.py --ops 200000 --payload 512
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from velomux_quic.messenger.envelope import (
    Kind,
    MessagePrefix,
    decode_envelope,
    encode_envelope,
    message_prefix,
)
from velomux_quic.mux.handlers import MuxSlotRef

DEFAULT_OPS = 500_000
DEFAULT_PAYLOAD = 2048
REQUEST_PAYLOAD = 64


def best_of(repeat: int, run: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def bench(
    name: str,
    ops: int,
    repeat: int,
    encode: Callable[[int], bytes],
) -> None:
    """Time ``encode(i)`` for ``i`` in 1..ops, decoding its output, and both together."""
    sample = encode(1)
    decode_envelope(sample)  # fail early if the case is not a valid envelope
    ids = range(1, ops + 1)
    bodies = [sample] * ops

    def encode_only() -> None:
        for i in ids:
            encode(i)

    def decode_only() -> None:
        decode = decode_envelope
        for body in bodies:
            decode(body)

    def both() -> None:
        decode = decode_envelope
        for i in ids:
            decode(encode(i))

    encode_s = best_of(repeat, encode_only)
    decode_s = best_of(repeat, decode_only)
    both_s = best_of(repeat, both)
    print(
        f"{name:<44} {len(sample):>6} B  "
        f"encode {ops / encode_s:>11,.0f}/s  "
        f"decode {ops / decode_s:>11,.0f}/s  "
        f"encode+decode {ops / both_s:>11,.0f}/s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ops", type=int, default=DEFAULT_OPS, help="envelopes per run")
    parser.add_argument(
        "--payload", type=int, default=DEFAULT_PAYLOAD, help="MESSAGE payload bytes (default 2048)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; best is shown")
    args = parser.parse_args(argv)

    batch = bytes(i % 251 for i in range(args.payload))
    small = bytes(REQUEST_PAYLOAD)
    prefix = message_prefix(Kind.MESSAGE, "_stream_batch")
    request = MessagePrefix(Kind.REQUEST, "_anchor_attach").encode
    headers = {"_mux_slot": MuxSlotRef(7, 513, 42).format()}

    cases: list[tuple[str, Callable[[int], bytes]]] = [
        (f"MESSAGE {args.payload} B, message_prefix", lambda _i: prefix + batch),
        (f"REQUEST {REQUEST_PAYLOAD} B, MessagePrefix", lambda i: request(i, small)),
        (
            f"REQUEST {REQUEST_PAYLOAD} B + _mux_slot, encode_envelope",
            lambda i: encode_envelope(
                Kind.REQUEST,
                handler="_anchor_attach",
                message_id=i,
                headers=headers,
                payload=small,
            ),
        ),
        (
            f"MESSAGE {args.payload} B, encode_envelope",
            lambda _i: encode_envelope(Kind.MESSAGE, handler="_stream_batch", payload=batch),
        ),
    ]
    for name, encode in cases:
        bench(name, args.ops, args.repeat, encode)


if __name__ == "__main__":
    main()
