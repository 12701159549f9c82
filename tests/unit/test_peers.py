"""Peer records, the peer registry, and the static and directory discovery backends."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import stat
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from velomux_quic.discovery import (
    PEER_RECORD_MAX_BYTES,
    DirectoryPeers,
    PeerDiscovery,
    PeerRecord,
    StaticPeers,
)
from velomux_quic.errors import PeerRecordError, WorkerIdCollision
from velomux_quic.ids import InstanceId, WorkerId, new_instance_id, worker_id_of
from velomux_quic.messenger.peers import PeerRegistry, sync_registry

LOGGER = "velomux_quic.messenger.peers"
DIRECTORY_LOGGER = "velomux_quic.discovery.directory"

instance_ids = st.uuids().map(InstanceId)
hosts = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=255
) | st.sampled_from(["127.0.0.1", "::1", "fe80::1%eth0", "node-3.cluster.internal"])
records = st.builds(
    PeerRecord,
    instance_id=instance_ids,
    address=st.tuples(hosts, st.integers(1, 65535)),
    name=st.text(),
    lanes=st.integers(1, 16),
    updated_at=st.floats(min_value=0, allow_nan=False, allow_infinity=False)
    | st.integers(0, 2**40),
)


def record(
    instance_id: InstanceId | None = None,
    port: int = 4433,
    *,
    host: str = "127.0.0.1",
    updated_at: float = 1_700_000_000.0,
    **kwargs: Any,
) -> PeerRecord:
    return PeerRecord(
        instance_id or new_instance_id(), (host, port), updated_at=updated_at, **kwargs
    )


def valid_json() -> dict[str, Any]:
    return record(name="n1", lanes=4).to_json()


# -- PeerRecord -------------------------------------------------------------------


@given(records)
def test_record_json_round_trip(rec: PeerRecord) -> None:
    assert PeerRecord.from_json(rec.to_json()) == rec
    # Through JSON text too: what a record file or an etcd value holds.
    assert PeerRecord.from_json(json.loads(json.dumps(rec.to_json()))) == rec


def test_record_json_shape() -> None:
    iid = InstanceId.parse("6f1c1d1e-8a4b-4c7e-9b57-0c2f3a4d5e6f")
    rec = PeerRecord(iid, ("10.0.0.7", 4433), name="gpu-7", lanes=4, updated_at=12.5)
    assert rec.to_json() == {
        "instance_id": "6f1c1d1e-8a4b-4c7e-9b57-0c2f3a4d5e6f",
        "address": {"host": "10.0.0.7", "port": 4433},
        "name": "gpu-7",
        "lanes": 4,
        "updated_at": 12.5,
    }


def test_record_defaults_and_integer_timestamp() -> None:
    obj = valid_json()
    del obj["name"], obj["lanes"]
    obj["updated_at"] = 5
    rec = PeerRecord.from_json(obj)
    assert (rec.name, rec.lanes) == ("", 1)
    assert rec.updated_at == 5.0 and isinstance(rec.updated_at, float)


def test_record_unknown_keys_are_ignored() -> None:
    obj = valid_json()
    expected = PeerRecord.from_json(obj)
    obj["fingerprint"] = "sha256:abcd"
    obj["address"] = {**obj["address"], "transport": "quic-v2"}
    assert PeerRecord.from_json(obj) == expected


def test_record_instance_id_spelling() -> None:
    # Upper case is the same UUID (InstanceId.parse allows it); it reads back canonical.
    iid = new_instance_id()
    rec = PeerRecord.from_json(_with(instance_id=str(iid).upper()))
    assert rec.instance_id == iid
    assert rec.to_json()["instance_id"] == str(iid)


def test_record_refreshed() -> None:
    rec = record(updated_at=1.0)
    assert rec.refreshed(99.0) == PeerRecord(rec.instance_id, rec.address, updated_at=99.0)
    assert rec.refreshed().updated_at > 1.0


def _without(key: str) -> dict[str, Any]:
    obj = valid_json()
    del obj[key]
    return obj


def _with(**changes: Any) -> dict[str, Any]:
    return {**valid_json(), **changes}


def _with_address(**changes: Any) -> dict[str, Any]:
    obj = valid_json()
    obj["address"] = {**obj["address"], **changes}
    return obj


REJECTED: dict[str, object] = {
    "list": [],
    "null": None,
    "string": "peer",
    "no instance_id": _without("instance_id"),
    "no address": _without("address"),
    "no updated_at": _without("updated_at"),
    "instance_id int": _with(instance_id=5),
    "instance_id junk": _with(instance_id="not-a-uuid"),
    "instance_id empty": _with(instance_id=""),
    "instance_id braces": _with(instance_id="{" + str(uuid.uuid4()) + "}"),
    "instance_id urn": _with(instance_id=uuid.uuid4().urn),
    "instance_id hex": _with(instance_id=uuid.uuid4().hex),
    "address list": _with(address=["127.0.0.1", 4433]),
    "address string": _with(address="127.0.0.1:4433"),
    "address no host": _with(address={"port": 4433}),
    "address no port": _with(address={"host": "h"}),
    "host empty": _with_address(host=""),
    "host int": _with_address(host=7),
    "host space": _with_address(host="a b"),
    "host newline": _with_address(host="a\nb"),
    "host non-ascii": _with_address(host="nœud"),
    "host too long": _with_address(host="a" * 256),
    "port 0": _with_address(port=0),
    "port 65536": _with_address(port=65536),
    "port negative": _with_address(port=-1),
    "port string": _with_address(port="4433"),
    "port float": _with_address(port=4433.0),
    "port bool": _with_address(port=True),
    "name int": _with(name=5),
    "name null": _with(name=None),
    "lanes 0": _with(lanes=0),
    "lanes 17": _with(lanes=17),
    "lanes negative": _with(lanes=-1),
    "lanes bool": _with(lanes=True),
    "lanes float": _with(lanes=2.0),
    "lanes string": _with(lanes="2"),
    "updated_at string": _with(updated_at="now"),
    "updated_at null": _with(updated_at=None),
    "updated_at bool": _with(updated_at=True),
    "updated_at negative": _with(updated_at=-1.0),
    "updated_at nan": _with(updated_at=math.nan),
    "updated_at inf": _with(updated_at=math.inf),
}


@pytest.mark.parametrize("obj", REJECTED.values(), ids=REJECTED.keys())
def test_record_rejects_junk(obj: object) -> None:
    with pytest.raises(PeerRecordError):
        PeerRecord.from_json(obj)


def test_record_error_is_a_value_error() -> None:
    assert issubclass(PeerRecordError, ValueError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"instance_id": str(uuid.uuid4())},
        {"address": ["127.0.0.1", 1]},
        {"address": ("127.0.0.1",)},
        {"address": ("127.0.0.1", 0)},
        {"address": ("", 1)},
        {"lanes": 0},
        {"lanes": 17},
        {"name": b"x"},
        {"updated_at": math.nan},
    ],
)
def test_record_constructor_validates(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {
        "instance_id": new_instance_id(),
        "address": ("127.0.0.1", 1),
        "updated_at": 1.0,
    }
    with pytest.raises(PeerRecordError):
        PeerRecord(**{**args, **kwargs})


# -- PeerRegistry -----------------------------------------------------------------


class Changes:
    def __init__(self) -> None:
        self.seen: list[tuple[PeerRecord | None, InstanceId]] = []

    def __call__(self, rec: PeerRecord | None, instance_id: InstanceId) -> None:
        self.seen.append((rec, instance_id))


def test_registry_add_get_iterate() -> None:
    registry = PeerRegistry()
    a, b = record(port=1), record(port=2)
    assert registry.add(a) and registry.add(b)
    assert len(registry) == 2
    assert registry.get(a.instance_id) == a
    assert registry.get(new_instance_id()) is None
    assert a.instance_id in registry and new_instance_id() not in registry
    assert sorted(registry, key=lambda r: r.address) == [a, b]
    assert registry.by_worker(worker_id_of(a.instance_id)) == a.instance_id
    assert registry.by_worker(worker_id_of(b.instance_id)) == b.instance_id
    assert registry.by_worker(WorkerId(0)) is None
    assert len(PeerRegistry([a, b])) == 2


def test_registry_replace_and_remove_notify_listeners() -> None:
    registry = PeerRegistry()
    changes = Changes()
    registry.subscribe(changes)
    first = record(port=1)
    moved = PeerRecord(first.instance_id, ("10.0.0.2", 9), updated_at=2.0)

    registry.add(first)
    assert registry.add(moved)
    assert not registry.add(moved), "an identical record is not a change"
    assert registry.get(first.instance_id) == moved
    assert len(registry) == 1
    assert registry.by_worker(worker_id_of(first.instance_id)) == first.instance_id

    assert registry.remove(first.instance_id) == moved
    assert registry.remove(first.instance_id) is None
    assert len(registry) == 0
    assert registry.by_worker(worker_id_of(first.instance_id)) is None
    assert changes.seen == [
        (first, first.instance_id),
        (moved, first.instance_id),
        (None, first.instance_id),
    ]


def test_registry_unsubscribe_and_listener_sees_new_state() -> None:
    registry = PeerRegistry()
    states: list[PeerRecord | None] = []
    unsubscribe = registry.subscribe(lambda rec, iid: states.append(registry.get(iid)))
    rec = record()
    registry.add(rec)
    unsubscribe()
    unsubscribe()  # idempotent
    registry.remove(rec.instance_id)
    assert states == [rec]


def test_registry_failing_listener_is_logged_and_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = PeerRegistry()
    changes = Changes()

    def broken(rec: PeerRecord | None, iid: InstanceId) -> None:
        raise RuntimeError("listener bug")

    registry.subscribe(broken)
    registry.subscribe(changes)
    rec = record()
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert registry.add(rec)
    assert registry.get(rec.instance_id) == rec
    assert changes.seen == [(rec, rec.instance_id)]
    assert "listener bug" in caplog.text


def test_registry_refuses_a_worker_id_collision() -> None:
    registry = PeerRegistry(worker_id=lambda _: WorkerId(0xABC))
    changes = Changes()
    registry.subscribe(changes)
    holder, intruder = record(port=1), record(port=2)
    registry.add(holder)

    with pytest.raises(WorkerIdCollision) as caught:
        registry.add(intruder)
    message = str(caught.value)
    assert str(holder.instance_id) in message and str(intruder.instance_id) in message
    assert "0000000000000abc" in message
    assert caught.value.holder == holder.instance_id
    assert caught.value.refused == intruder.instance_id
    assert caught.value.worker_id == 0xABC

    # Nothing changed and nobody was told.
    assert list(registry) == [holder]
    assert registry.by_worker(WorkerId(0xABC)) == holder.instance_id
    assert changes.seen == [(holder, holder.instance_id)]

    # The holder may still move; once it leaves, the WorkerId is free again.
    registry.add(PeerRecord(holder.instance_id, ("h", 5), updated_at=3.0))
    registry.remove(holder.instance_id)
    registry.add(intruder)
    assert registry.by_worker(WorkerId(0xABC)) == intruder.instance_id


def test_registry_constructor_refuses_colliding_records() -> None:
    with pytest.raises(WorkerIdCollision):
        PeerRegistry([record(), record()], worker_id=lambda _: WorkerId(1))


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(1, 3)), max_size=60))
def test_registry_invariants_under_random_changes(ops: list[tuple[bool, int, int]]) -> None:
    # Eight identities, WorkerIds folded onto three values so collisions are common.
    ids = [InstanceId(uuid.UUID(int=n + 1)) for n in range(8)]
    fold = {iid: WorkerId(n % 3) for n, iid in enumerate(ids)}
    registry = PeerRegistry(worker_id=fold.__getitem__)
    model: dict[InstanceId, PeerRecord] = {}
    for is_add, which, port in ops:
        iid = ids[which]
        if is_add:
            rec = PeerRecord(iid, ("h", port), updated_at=0.0)
            holder = next((i for i in model if fold[i] == fold[iid] and i != iid), None)
            if holder is None:
                registry.add(rec)
                model[iid] = rec
            else:
                with pytest.raises(WorkerIdCollision):
                    registry.add(rec)
        else:
            assert registry.remove(iid) == model.pop(iid, None)
    assert {r.instance_id: r for r in registry} == model
    for iid in ids:
        expected = iid if iid in model else None
        if expected is not None:
            assert registry.by_worker(fold[iid]) == iid
        elif not any(fold[other] == fold[iid] for other in model):
            assert registry.by_worker(fold[iid]) is None


# -- StaticPeers ------------------------------------------------------------------


async def test_static_peers() -> None:
    a, b, own = record(port=1), record(port=2), record(port=3)
    peers = StaticPeers([a, b])
    assert isinstance(peers, PeerDiscovery)
    assert await peers.lookup(a.instance_id) == a
    assert await peers.lookup(own.instance_id) is None
    await peers.publish(own)
    assert sorted(await peers.snapshot(), key=lambda r: r.address) == [a, b, own]
    await peers.withdraw(own.instance_id)
    await peers.withdraw(own.instance_id)
    assert await peers.lookup(own.instance_id) is None
    await peers.publish(own)
    await peers.close()
    assert sorted(await peers.snapshot(), key=lambda r: r.address) == [a, b]
    with pytest.raises(RuntimeError):
        await peers.publish(own)


def test_static_peers_refuses_a_peer_listed_twice() -> None:
    rec = record()
    with pytest.raises(ValueError, match="twice"):
        StaticPeers([rec, PeerRecord(rec.instance_id, ("other", 1))])


# -- DirectoryPeers ---------------------------------------------------------------


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def test_directory_is_created_with_mode_0755(tmp_path: Path) -> None:
    directory = tmp_path / "run" / "peers"
    peers = DirectoryPeers(directory)
    assert peers.directory == directory
    assert stat.S_IMODE(directory.stat().st_mode) == 0o755 & ~_umask()


def test_directory_rejects_bad_stale_after(tmp_path: Path) -> None:
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            DirectoryPeers(tmp_path, stale_after=bad)


async def test_two_processes_share_a_directory(tmp_path: Path) -> None:
    one, two = DirectoryPeers(tmp_path), DirectoryPeers(tmp_path)
    assert isinstance(one, PeerDiscovery)
    a = record(port=1, name="one", lanes=2)
    b = record(port=2, name="two")

    assert await two.snapshot() == []
    await one.publish(a)
    assert await two.lookup(a.instance_id) == a
    assert await two.snapshot() == [a]

    await two.publish(b)
    expected = sorted([a, b], key=lambda r: r.instance_id)
    assert await one.snapshot() == expected
    assert await two.snapshot() == expected

    path = tmp_path / f"{a.instance_id}.json"
    assert one.path_of(a.instance_id) == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert PeerRecord.from_json(json.loads(path.read_text())) == a

    moved = PeerRecord(a.instance_id, ("10.1.1.1", 7000), updated_at=a.updated_at + 1)
    await one.publish(moved)
    assert await two.lookup(a.instance_id) == moved

    await one.withdraw(a.instance_id)
    await one.withdraw(a.instance_id)  # already gone: no error
    assert not path.exists()
    assert await two.lookup(a.instance_id) is None
    assert await two.snapshot() == [b]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{b.instance_id}.json"]


async def test_close_withdraws_own_records_only(tmp_path: Path) -> None:
    one, two = DirectoryPeers(tmp_path), DirectoryPeers(tmp_path)
    mine, theirs = record(port=1), record(port=2)
    await one.publish(mine)
    await two.publish(theirs)
    await one.close()
    assert await two.snapshot() == [theirs]
    with pytest.raises(RuntimeError):
        await one.publish(mine)


async def test_close_leaves_a_record_another_writer_replaced(tmp_path: Path) -> None:
    old, new = DirectoryPeers(tmp_path), DirectoryPeers(tmp_path)
    first = record(port=1)
    restarted = PeerRecord(first.instance_id, ("127.0.0.1", 2), updated_at=first.updated_at + 5)
    await old.publish(first)
    await new.publish(restarted)
    await old.close()
    assert await new.lookup(first.instance_id) == restarted


async def test_close_removes_its_own_stale_record(tmp_path: Path) -> None:
    peers = DirectoryPeers(tmp_path, stale_after=10.0, clock=lambda: 1_000.0)
    rec = record(updated_at=1.0)
    await peers.publish(rec)
    assert await peers.lookup(rec.instance_id) is None  # stale to readers
    await peers.close()
    assert list(tmp_path.iterdir()) == []


async def test_junk_partial_and_temporary_files_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    peers = DirectoryPeers(tmp_path)
    good = record(port=1)
    await peers.publish(good)
    text = json.dumps(record().to_json())

    partial = new_instance_id()
    (tmp_path / f"{partial}.json").write_text(text[: len(text) // 2])
    not_utf8 = new_instance_id()
    (tmp_path / f"{not_utf8}.json").write_bytes(b'{"instance_id": "\xff"}')
    invalid = new_instance_id()
    (tmp_path / f"{invalid}.json").write_text(json.dumps(_with_address(port=0)))
    empty = new_instance_id()
    (tmp_path / f"{empty}.json").write_bytes(b"")
    nested = new_instance_id()
    (tmp_path / f"{nested}.json").write_text("[" * 30_000 + "]" * 30_000)
    huge = new_instance_id()
    padded = {**record(huge).to_json(), "pad": "x" * PEER_RECORD_MAX_BYTES}
    (tmp_path / f"{huge}.json").write_text(json.dumps(padded))
    # A record filed under another node's name must not answer for that node.
    impostor = new_instance_id()
    (tmp_path / f"{impostor}.json").write_text(json.dumps(record().to_json()))
    a_directory = new_instance_id()
    (tmp_path / f"{a_directory}.json").mkdir()

    # Valid records under names that are not `<canonical uuid>.json`.
    hidden = record()
    (tmp_path / f".{hidden.instance_id}.json.3f2a9c.tmp").write_text(json.dumps(hidden.to_json()))
    (tmp_path / f"{hidden.instance_id}.json.tmp").write_text(json.dumps(hidden.to_json()))
    (tmp_path / f"{str(hidden.instance_id).upper()}.json").write_text(json.dumps(hidden.to_json()))
    (tmp_path / "peer.json").write_text(json.dumps(hidden.to_json()))
    (tmp_path / "README").write_text("not a record")

    with caplog.at_level(logging.DEBUG, logger=DIRECTORY_LOGGER):
        assert await peers.snapshot() == [good]
        for skipped in (partial, not_utf8, invalid, empty, nested, huge, impostor, a_directory):
            assert await peers.lookup(skipped) is None
        assert await peers.lookup(hidden.instance_id) is None
        assert await peers.lookup(new_instance_id()) is None
    assert str(partial) in caplog.text and str(impostor) in caplog.text
    assert all(r.levelno == logging.DEBUG for r in caplog.records)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
async def test_a_fifo_named_like_a_record_does_not_hang_the_scan(tmp_path: Path) -> None:
    peers = DirectoryPeers(tmp_path)
    fifo = new_instance_id()
    os.mkfifo(tmp_path / f"{fifo}.json")
    assert await peers.snapshot() == []
    assert await peers.lookup(fifo) is None


async def test_stale_records_are_skipped(tmp_path: Path) -> None:
    now = [1_000.0]
    reader = DirectoryPeers(tmp_path, stale_after=30.0, clock=lambda: now[0])
    writer = DirectoryPeers(tmp_path)
    fresh = record(port=1, updated_at=990.0)
    edge = record(port=2, updated_at=970.0)  # exactly 30 s old: still fresh
    stale = record(port=3, updated_at=969.5)
    for rec in (fresh, edge, stale):
        await writer.publish(rec)

    assert await reader.snapshot() == sorted([fresh, edge], key=lambda r: r.instance_id)
    assert await reader.lookup(stale.instance_id) is None
    assert await reader.lookup(edge.instance_id) == edge
    # Without stale_after every record is returned; the file was never removed.
    assert len(await writer.snapshot()) == 3

    now[0] = 1_015.0
    assert await reader.snapshot() == [fresh]
    await writer.publish(stale.refreshed(1_014.0))
    assert {r.instance_id for r in await reader.snapshot()} == {
        fresh.instance_id,
        stale.instance_id,
    }


def test_concurrent_publishes_never_leave_a_torn_file(tmp_path: Path) -> None:
    iid = new_instance_id()
    path = DirectoryPeers(tmp_path).path_of(iid)
    asyncio.run(DirectoryPeers(tmp_path).publish(record(iid)))
    writers, rounds = 4, 40
    failures: list[BaseException] = []

    def write(n: int) -> None:
        async def run() -> None:
            peers = DirectoryPeers(tmp_path)
            # Different sizes per writer, so an interleaved write could not look whole.
            for i in range(rounds):
                await peers.publish(record(iid, port=1 + i, name=str(n) * (n * 3000)))

        try:
            asyncio.run(run())
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    for thread in threads:
        thread.start()
    reads = 0
    while any(thread.is_alive() for thread in threads):
        rec = PeerRecord.from_json(json.loads(path.read_bytes()))
        assert rec.instance_id == iid
        assert rec.name == rec.name[:1] * len(rec.name)
        reads += 1
    for thread in threads:
        thread.join()

    assert failures == []
    assert reads > 0
    final = PeerRecord.from_json(json.loads(path.read_bytes()))
    assert final.address[1] == rounds
    # Every temporary file was renamed into place; nothing is left behind.
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


# -- sync_registry --------------------------------------------------------------------


async def test_sync_registry_merges_and_prunes(tmp_path: Path) -> None:
    a, b, c = record(port=1), record(port=2), record(port=3)
    discovery = StaticPeers([a, b])
    registry = PeerRegistry([c])

    report = await sync_registry(registry, discovery)
    assert set(report.added) == {a.instance_id, b.instance_id}
    assert report.updated == report.removed == ()
    assert report.collisions == ()
    assert len(registry) == 3

    report = await sync_registry(registry, discovery)
    assert report.added == report.updated == ()

    moved = PeerRecord(a.instance_id, ("10.0.0.9", 1), updated_at=5.0)
    await discovery.publish(moved)
    report = await sync_registry(registry, discovery, prune=True)
    assert report.updated == (a.instance_id,)
    assert report.removed == (c.instance_id,)
    assert registry.get(a.instance_id) == moved
    assert c.instance_id not in registry


async def test_sync_registry_keeps_collisions_out(caplog: pytest.LogCaptureFixture) -> None:
    holder, intruder, other = record(port=1), record(port=2), record(port=3)
    worker_ids = {
        holder.instance_id: WorkerId(9),
        intruder.instance_id: WorkerId(9),
        other.instance_id: WorkerId(10),
    }
    registry = PeerRegistry([holder], worker_id=worker_ids.__getitem__)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        report = await sync_registry(registry, StaticPeers([intruder, other]))
    assert report.added == (other.instance_id,)
    assert [c.refused for c in report.collisions] == [intruder.instance_id]
    assert registry.by_worker(WorkerId(9)) == holder.instance_id
    assert intruder.instance_id not in registry
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(intruder.instance_id) in warnings[0].getMessage()
    assert str(holder.instance_id) in warnings[0].getMessage()


async def test_sync_registry_from_a_directory(tmp_path: Path) -> None:
    writer = DirectoryPeers(tmp_path)
    a, b = record(port=1), record(port=2)
    await writer.publish(a)
    await writer.publish(b)
    (tmp_path / f"{new_instance_id()}.json").write_text("{")
    registry = PeerRegistry()
    report = await sync_registry(registry, DirectoryPeers(tmp_path))
    assert set(report.added) == {a.instance_id, b.instance_id}
    assert registry.by_worker(worker_id_of(b.instance_id)) == b.instance_id
