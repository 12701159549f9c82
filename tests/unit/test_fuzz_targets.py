"""The fuzz targets, run briefly: the seed corpus, then deterministic mutations of it.

``make fuzz`` runs the same targets coverage-guided for minutes each (docs/reliability.md,
"Fuzzing"); here each runs over its corpus and a fixed number of seeded mutants, so a
decoder change that lets an untyped exception escape fails the default suite in seconds,
reproducibly. The findings of the long runs are pinned at the end, each with the input
that found it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from fuzz.corpus import CORPUS_DIR, seeds
from fuzz.mutate import mutations
from fuzz.targets import TARGETS, InvariantBroken, Target, check
from velomux_quic.discovery import DirectoryPeers, PeerRecord
from velomux_quic.errors import PeerRecordError

MUTANTS_PER_TARGET = 20_000
"""Enough to reach every refusal of the small formats, and under 3 s per target on a busy
core (the slowest, the frame decoder with its chunked reference parse, takes about 1.5 s)."""

SEEDS = seeds()


def test_every_target_has_a_corpus_directory_in_the_tree() -> None:
    assert sorted(path.name for path in CORPUS_DIR.iterdir() if path.is_dir()) == sorted(TARGETS)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_corpus_in_the_tree_is_what_the_encoders_make(target: str) -> None:
    # Regenerate with `python -m fuzz.corpus` after changing a wire format.
    on_disk = {path.name: path.read_bytes() for path in (CORPUS_DIR / target).iterdir()}
    assert on_disk == SEEDS[target]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_valid_seeds_decode_and_some_near_valid_ones_do_not(target: str) -> None:
    decoded = {name: check(TARGETS[target], data) for name, data in SEEDS[target].items()}
    assert all(ok for name, ok in decoded.items() if name.startswith("ok-")), decoded
    near = [ok for name, ok in decoded.items() if name.startswith("near-")]
    # A near-valid seed sits next to a refusal (an envelope's payload takes any length, so
    # not every cut or extra byte is one); each target needs some that are refused.
    assert False in near, decoded


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_only_the_typed_refusal_escapes_corpus_and_mutants(target: str) -> None:
    chosen = TARGETS[target]
    corpus = list(SEEDS[target].values())
    rng = random.Random(f"velomux-fuzz-{target}")
    outcomes = {True: 0, False: 0}
    for data in corpus:
        outcomes[check(chosen, data)] += 1
    mutants = mutations(corpus, rng)
    for _ in range(MUTANTS_PER_TARGET):
        data = next(mutants)
        try:
            outcomes[check(chosen, data)] += 1
        except Exception as exc:
            pytest.fail(f"{target}: {type(exc).__name__}: {exc} escaped for input {data!r}")
    # Both sides must be reached, or the mutants are not testing the decoder at all.
    assert outcomes[True] > 0
    assert outcomes[False] > 0


def test_the_oracle_reports_what_is_not_the_typed_refusal() -> None:
    # A finding has to fail loudly: neither a stray exception nor a broken invariant may be
    # taken for a refusal.
    def crashes(data: bytes) -> None:
        raise IndexError("a decoder bug")

    def lies(data: bytes) -> None:
        raise InvariantBroken("a decoder that returns the wrong value")

    refusal = TARGETS["mux_batch"].refusal
    for run, error in ((crashes, IndexError), (lies, InvariantBroken)):
        with pytest.raises(error):
            check(Target("broken", run, refusal, "a broken decoder"), b"")


# -- findings of the long runs, each pinned with the input that found it ----------------------

RECORD = json.loads((CORPUS_DIR / "peer_record" / "ok-record").read_text())


def _record_bytes(**fields: object) -> bytes:
    return json.dumps(RECORD | fields).encode()


def test_a_peer_record_with_an_integer_past_a_float_is_a_record_error() -> None:
    # Found by the peer_record target: JSON integers have any length, and float() of one
    # past 1e308 raised OverflowError out of the record parser (and out of a directory scan).
    data = _record_bytes(updated_at=10**400)
    with pytest.raises(PeerRecordError, match="updated_at"):
        PeerRecord.from_bytes(data)
    assert check(TARGETS["peer_record"], data) is False


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xfe{}",  # not UTF-8
        b'{"instance_id": ',  # a torn write
        b"[" * 100_000 + b"]" * 100_000,  # nesting past the parser's depth
        b"1" * 5000,  # an integer past the digit limit
    ],
    ids=["bad-utf8", "torn", "deep", "long-int"],
)
def test_a_peer_record_that_is_not_json_is_a_record_error(data: bytes) -> None:
    with pytest.raises(PeerRecordError):
        PeerRecord.from_bytes(data)


async def test_a_directory_scan_skips_a_record_with_a_huge_integer(tmp_path: Path) -> None:
    good = PeerRecord.from_json(RECORD)
    peers = DirectoryPeers(tmp_path)
    await peers.publish(good)
    junk = tmp_path / "0b0c2d3e-4b5a-4c6d-8e7f-901a2b3c4d5e.json"
    record = RECORD | {"instance_id": junk.stem, "updated_at": 10**400}
    junk.write_text(json.dumps(record))
    try:
        assert await peers.snapshot() == [good]
    finally:
        await peers.close()
