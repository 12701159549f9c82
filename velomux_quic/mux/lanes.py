"""Lane placement: which of a peer's mux lanes a stream rides.

The receiver picks a stream's lane once, when it binds the slot. With a key it
hashes the key, so one key lands on one lane index in every build and on every
receiver with the same lane count; that is why the hash is a fixed function
(SplitMix64) and not Python's ``hash``, which is salted per process for
strings and not specified across versions. Without a key it picks the lane
with the least load, ties going to the lowest lane so a default one-lane
deployment behaves as before lanes existed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from .protocol import MAX_LANES

__all__ = ["lane_for_key", "least_loaded", "splitmix64"]

_MASK64: Final = 0xFFFF_FFFF_FFFF_FFFF
_GOLDEN_GAMMA: Final = 0x9E37_79B9_7F4A_7C15


def splitmix64(x: int) -> int:
    """One SplitMix64 step on state ``x``: add the golden-ratio gamma, then mix.

    All arithmetic is modulo ``2**64`` (a key outside ``0..2**64-1`` is reduced
    first), so the result matches the u64 implementation bit for bit:
    ``splitmix64(0) == 0xE220A8397B1DCDAF``, the first output of a SplitMix64
    generator seeded with 0. The increment matters: without it, key 0 would
    hash to 0 and small keys would cluster in the finalizer's weak corner.
    """
    z = (x + _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return z ^ (z >> 31)


def lane_for_key(key: int, lanes: int) -> int:
    """The lane of a keyed stream: ``splitmix64(key) % lanes``.

    Streams with one key to one receiver share a lane; this is a placement
    hint, not an ordering guarantee between those streams.
    """
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"lanes must be in 1..{MAX_LANES}, got {lanes}")
    return splitmix64(key) % lanes


def least_loaded(loads: Sequence[int]) -> int:
    """The index of the smallest load, the lowest index on a tie.

    ``loads[k]`` is lane k's live slots plus its answered, unclaimed binds;
    counting the unclaimed binds keeps simultaneous attaches from all picking
    lane 0 before any of their OpenSlots arrive.
    """
    if not loads:
        raise ValueError("least_loaded needs at least one lane")
    return min(range(len(loads)), key=loads.__getitem__)
