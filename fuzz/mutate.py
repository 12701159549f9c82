"""A small deterministic byte mutator: the default test run's fuzzer and atheris's stand-in.

It mutates the way libFuzzer's default mutators do, minus the coverage feedback: flip a bit,
write an interesting value (0, 0xFF, the edges of u8, u16, u32 and u64, a length that is one
off), insert, erase or duplicate a range, truncate, or splice in part of another corpus
input. Seeded from a :class:`random.Random`, so a given seed always produces the same inputs
and a finding in the default test run reproduces exactly.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Final

__all__ = ["MAX_INPUT", "mutate", "mutations"]

MAX_INPUT: Final = 4096
"""Largest input produced; every format here shows its structure in far fewer bytes."""

_INTERESTING: Final[tuple[bytes, ...]] = (
    b"\x00",
    b"\x01",
    b"\x7f",
    b"\x80",
    b"\xff",
    b"\x00\x00",
    b"\xff\xff",
    b"\x7f\xff",
    b"\x80\x00",
    b"\x00\x00\x00\x00",
    b"\xff\xff\xff\xff",
    b"\x7f\xff\xff\xff",
    b"\x80\x00\x00\x00",
    b"\x00\x00\x00\x01",
    b"\xff" * 8,
    b"\x80" + b"\x00" * 7,
    # MessagePack type bytes that stress a decoder: map32, array32, str32, bin32, ext32, nil.
    b"\xdf",
    b"\xdd",
    b"\xdb",
    b"\xc6",
    b"\xc9",
    b"\xc0",
)


def _pick_range(rng: random.Random, size: int) -> tuple[int, int]:
    start = rng.randrange(size + 1)
    return start, min(size, start + rng.randint(1, 16))


def mutate(data: bytes, rng: random.Random, others: Sequence[bytes] = ()) -> bytes:
    """One to four random edits of ``data`` (``others`` feed the splice edit)."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        if op == 0 and buf:
            pos = rng.randrange(len(buf))
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            value = rng.choice(_INTERESTING)
            pos = rng.randrange(len(buf) + 1)
            buf[pos : pos + len(value)] = value
        elif op == 2:
            pos = rng.randrange(len(buf) + 1)
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and buf:
            start, stop = _pick_range(rng, len(buf))
            del buf[start:stop]
        elif op == 4 and buf:
            start, stop = _pick_range(rng, len(buf))
            pos = rng.randrange(len(buf) + 1)
            buf[pos:pos] = buf[start:stop]
        elif op == 5 and buf:
            del buf[rng.randrange(len(buf)) :]
        elif op == 6 and others:
            other = rng.choice(others)
            start, stop = _pick_range(rng, len(other))
            pos = rng.randrange(len(buf) + 1)
            buf[pos:pos] = other[start:stop]
        elif buf:
            # A small arithmetic nudge to one byte: lengths and counts one off.
            pos = rng.randrange(len(buf))
            buf[pos] = (buf[pos] + rng.choice((-1, 1, 2, -2))) & 0xFF
    return bytes(buf[:MAX_INPUT])


def mutations(seeds: Sequence[bytes], rng: random.Random) -> Iterator[bytes]:
    """Endless mutants: each of a random seed (or, now and then, of random bytes)."""
    while True:
        if not seeds or rng.randrange(16) == 0:
            yield rng.randbytes(rng.randint(0, 64))
        else:
            yield mutate(rng.choice(seeds), rng, seeds)
