"""Discovery on a real etcd: nodes find each other, leave at once or when their lease
lapses, survive an etcd restart, ignore hostile records, speak TLS to etcd, and close in
bounded time.

Every test starts its own etcd (tests/etcd_server.py) on free loopback ports, and real
nodes over real QUIC; leases are 2 or 3 seconds so a lapse costs little. Waits are
bounded loops on a condition the node reports (its snapshot, its metrics), never sleeps.
Every thread a test starts, gRPC's poller above all, is gone when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import etcd_server as etcd_fixtures
from tests.conftest import StartNode
from tests.etcd_server import EtcdServer, EtcdTls, require_etcd
from tests.polling import poll_until
from velomux_quic import (
    ConfigurationError,
    Context,
    DiscoveryConfig,
    EtcdPeers,
    InstanceId,
    Node,
    NodeConfig,
    NodeCredentials,
    PeerRecord,
    VelomuxError,
)
from velomux_quic.ids import new_instance_id

aetcd = pytest.importorskip("aetcd", reason="the etcd extra: pip install 'velomux-quic[etcd]'")

etcd_server = etcd_fixtures.etcd_server  # the fixture: a running etcd for each test

ROOT = Path(__file__).resolve().parents[2]
VELOMUX = [sys.executable, "-m", "velomux_quic.programs.cli"]
TTL = 2
WAIT = 20.0


@pytest.fixture
def prefix() -> str:
    return f"/velomux-test/{new_instance_id()}"


@pytest.fixture(autouse=True)
def threads_end_with_the_test() -> Iterator[None]:
    """Every thread started during the test has ended once it is over (its loop closed).

    gRPC's asyncio machinery runs a poller thread while any of its channel objects lives,
    bound to every loop it served. Left to the next test, it serves a closed loop, and a
    later test's uvloop subprocess forks with gRPC's threads running, which crashes a
    child now and then (docs/operations.md). The collector runs while it waits: a reference
    cycle in a client library may hold a channel that is closed but not yet freed.
    """
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 10.0
    while (started := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        gc.collect()  # again each time: a channel's last holder may be freed meanwhile
        for thread in started:
            thread.join(timeout=0.5)
    left = [thread.name for thread in set(threading.enumerate()) - before]
    assert left == [], f"threads the test started outlived it: {left}"


def peers_of(node: Node) -> dict[InstanceId, PeerRecord]:
    return {record.instance_id: record for record in node.snapshot().peers}


def metric(node: Node, name: str, **labels: str) -> float:
    """The value of one sample of ``node``'s metrics (0 when absent)."""
    total = 0.0
    for family in text_string_to_metric_families(node.metrics_text()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def etcd_peers(etcd_server: EtcdServer, prefix: str, **options: Any) -> EtcdPeers:
    options.setdefault("lease_ttl", TTL)
    options.setdefault("connect_timeout", 10.0)
    return EtcdPeers([etcd_server.endpoint], prefix=prefix, **options)


async def raw_client(etcd_server: EtcdServer) -> Any:
    host, port = etcd_server.endpoint.split(":")
    client = aetcd.Client(host=host, port=int(port), timeout=5)
    await client.connect()
    return client


async def test_nodes_discover_each_other_call_and_stream(
    etcd_server: EtcdServer, prefix: str, start_nodes: StartNode
) -> None:
    a = await start_nodes("node-a", discovery=etcd_peers(etcd_server, prefix))
    b = await start_nodes("node-b", discovery=etcd_peers(etcd_server, prefix))
    c = await start_nodes("node-c", discovery=etcd_peers(etcd_server, prefix))
    # Nobody was told about anybody: the watch brings every node to the others.
    for node in (a, b, c):
        others = {n.instance_id for n in (a, b, c)} - {node.instance_id}
        await poll_until(
            lambda node=node, others=others: others <= set(peers_of(node)), "joins", timeout=WAIT
        )
        assert node.instance_id not in peers_of(node), "a node does not list itself"
    assert peers_of(a)[b.instance_id].address == b.address

    b.register_handler("echo", lambda ctx: b"echo:" + bytes(ctx.payload))
    assert await a.call(b.instance_id, "echo", b"hi", timeout=10) == b"echo:hi"

    anchor = c.create_anchor()  # the consumer on c, the producer on a: a knows c from etcd
    sender = await a.attach_anchor(anchor.handle)
    for token in range(20):
        await sender.send(token)
    await sender.finalize()
    assert [item async for item in anchor] == list(range(20))
    assert metric(a, "velo_discovery_connected", backend="etcd") == 1
    assert metric(a, "velo_discovery_peer_events_total", backend="etcd", event="join") >= 2
    # Every discovery series the node exports has its row in the operations page.
    page = (ROOT / "docs" / "operations.md").read_text()
    exported = {
        line.split()[2]
        for line in a.metrics_text().splitlines()
        if line.startswith("# TYPE velo_discovery_")
    }
    assert len(exported) == 6, exported
    assert [name for name in sorted(exported) if f"`{name}{{" not in page] == []


async def test_a_closed_node_leaves_the_others_at_once(
    etcd_server: EtcdServer, prefix: str, start_nodes: StartNode
) -> None:
    # A 30 s lease: the leave seen within the wait below came from the revoke and the
    # watch, not from the lease running out.
    a = await start_nodes("node-a", discovery=etcd_peers(etcd_server, prefix, lease_ttl=30))
    b = await start_nodes("node-b", discovery=etcd_peers(etcd_server, prefix, lease_ttl=30))
    await poll_until(lambda: b.instance_id in peers_of(a), "b joins a", timeout=WAIT)
    await b.close()
    await poll_until(lambda: b.instance_id not in peers_of(a), "b leaves a", timeout=10)
    client = await raw_client(etcd_server)
    try:
        assert await client.get(f"{prefix}/{b.instance_id}".encode()) is None
    finally:
        await client.close()


async def test_a_node_back_at_a_new_address_is_dialed_there(
    etcd_server: EtcdServer,
    prefix: str,
    start_nodes: StartNode,
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    a = await start_nodes("node-a", discovery=etcd_peers(etcd_server, prefix))
    credentials = make_credentials("node-b")
    async with contextlib.AsyncExitStack() as stack:
        first = await Node.start(credentials, discovery=etcd_peers(etcd_server, prefix))
        stack.push_async_callback(first.close)
        first.register_handler("who", lambda ctx: b"first")
        await poll_until(lambda: first.instance_id in peers_of(a), "b joins", timeout=WAIT)
        assert await a.call(first.instance_id, "who", b"", timeout=10) == b"first"
        # The same identity comes up elsewhere (a restart on a new port) and re-registers
        # over the record of the old process, which is still alive but forgotten.
        second = await Node.start(credentials, discovery=etcd_peers(etcd_server, prefix))
        stack.push_async_callback(second.close)
        second.register_handler("who", lambda ctx: b"second")
        assert second.instance_id == first.instance_id and second.address != first.address
        await poll_until(
            lambda: peers_of(a)[first.instance_id].address == second.address,
            "a hears the move",
            timeout=WAIT,
        )
        assert await a.call(first.instance_id, "who", b"", timeout=10) == b"second"
        assert metric(a, "velo_discovery_peer_events_total", backend="etcd", event="change") >= 1
        await first.close()
        # The old process's close revoked its own lease only: the new record stays.
        assert await a.call(second.instance_id, "who", b"", timeout=10) == b"second"
        assert peers_of(a)[second.instance_id].address == second.address


async def test_a_killed_process_lapses_from_the_registry_within_its_ttl(
    etcd_server: EtcdServer, prefix: str, start_nodes: StartNode
) -> None:
    a = await start_nodes("node-a", discovery=etcd_peers(etcd_server, prefix))
    # subprocess.Popen, not the loop's subprocess support: uvloop forks and runs Python
    # in the child before exec, which is unsafe while gRPC's threads run (docs/operations.md).
    child = await asyncio.to_thread(
        subprocess.Popen,
        [
            sys.executable,
            "-m",
            "tests.procs.etcd_registrant",
            "--endpoint",
            etcd_server.endpoint,
            "--prefix",
            prefix,
            "--ttl",
            str(TTL),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), WAIT)
        report = json.loads(line)
        assert report["connected"] is True
        ghost = InstanceId.parse(report["instance_id"])
        await poll_until(lambda: ghost in peers_of(a), "the child's record reaches a", timeout=WAIT)
        child.send_signal(signal.SIGKILL)  # no close, no revoke: only the lease can end it
        await asyncio.to_thread(child.wait, 10)
        await poll_until(
            lambda: ghost not in peers_of(a), "the lapsed lease removes it", timeout=TTL + 8
        )
        assert metric(a, "velo_discovery_peer_events_total", backend="etcd", event="leave") >= 1
    finally:
        if child.poll() is None:
            child.kill()
        await asyncio.to_thread(child.wait, 10)
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()


async def test_etcd_restarted_mid_run_the_nodes_re_register_and_go_on(
    etcd_server: EtcdServer, prefix: str, start_nodes: StartNode
) -> None:
    a = await start_nodes("node-a", discovery=etcd_peers(etcd_server, prefix, max_backoff=0.5))
    b = await start_nodes("node-b", discovery=etcd_peers(etcd_server, prefix, max_backoff=0.5))
    await poll_until(lambda: b.instance_id in peers_of(a), "b joins a", timeout=WAIT)
    b.register_handler("echo", lambda ctx: bytes(ctx.payload))
    host, port = await a.serve_ops("127.0.0.1", 0)

    def ready() -> int:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/readyz", timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as error:
            return int(error.code)

    assert await asyncio.to_thread(ready) == 200
    await asyncio.to_thread(etcd_server.stop)
    discovery = a.messenger.discovery
    assert isinstance(discovery, EtcdPeers)
    await poll_until(lambda: not discovery.connected, "a sees etcd gone", timeout=WAIT)
    assert await asyncio.to_thread(ready) == 503, "readiness reports discovery down"
    # The node still works from its last view while etcd is away.
    assert await a.call(b.instance_id, "echo", b"during", timeout=10) == b"during"
    await asyncio.to_thread(etcd_server.start)
    await poll_until(lambda: discovery.connected, "a reconnects", timeout=WAIT)
    await poll_until(
        lambda: metric(a, "velo_discovery_reconnects_total", backend="etcd") >= 1,
        "counted",
        timeout=WAIT,
    )
    # Both re-registered: a node that joins now sees both, and both see it.
    c = await start_nodes("node-c", discovery=etcd_peers(etcd_server, prefix))
    await poll_until(
        lambda: {a.instance_id, b.instance_id} <= set(peers_of(c)), "c sees a, b", timeout=WAIT
    )
    await poll_until(
        lambda: c.instance_id in peers_of(a) and c.instance_id in peers_of(b), "", timeout=WAIT
    )
    assert await a.call(b.instance_id, "echo", b"after", timeout=10) == b"after"
    assert await asyncio.to_thread(ready) == 200


async def test_etcd_losing_its_data_the_nodes_re_put_and_departed_peers_go(
    etcd_server: EtcdServer, prefix: str, start_nodes: StartNode
) -> None:
    a = await start_nodes("node-a", discovery=etcd_peers(etcd_server, prefix, max_backoff=0.5))
    b = await start_nodes("node-b", discovery=etcd_peers(etcd_server, prefix, max_backoff=0.5))
    ghost = etcd_peers(etcd_server, prefix)
    ghost_record = PeerRecord(new_instance_id(), ("127.0.0.1", 9), name="ghost")
    await ghost.publish(ghost_record)
    await poll_until(
        lambda: {b.instance_id, ghost_record.instance_id} <= set(peers_of(a)), "joins", timeout=WAIT
    )
    await asyncio.to_thread(etcd_server.kill)
    await ghost.close()  # its revoke cannot reach etcd: the ghost just goes away
    await asyncio.to_thread(etcd_server.wipe)
    await asyncio.to_thread(etcd_server.start)  # an empty etcd at the same endpoint
    # a's resync finds no ghost (removed) and b's record again (b re-put it).
    await poll_until(
        lambda: ghost_record.instance_id not in peers_of(a), "the ghost goes", timeout=WAIT
    )
    await poll_until(lambda: b.instance_id in peers_of(a), "b is listed again", timeout=WAIT)
    client = await raw_client(etcd_server)
    try:
        listing = await client.get_prefix(f"{prefix}/".encode())
        keys = {kv.key.decode() for kv in listing}
    finally:
        await client.close()
    assert keys == {f"{prefix}/{a.instance_id}", f"{prefix}/{b.instance_id}"}


async def test_malformed_records_are_ignored_and_counted(
    etcd_server: EtcdServer, prefix: str, start_nodes: StartNode
) -> None:
    a = await start_nodes("node-a", discovery=etcd_peers(etcd_server, prefix))
    valid = PeerRecord(new_instance_id(), ("127.0.0.1", 9), name="valid")
    mismatched = PeerRecord(new_instance_id(), ("127.0.0.1", 9))
    victim_key, large_key, junk_key = new_instance_id(), new_instance_id(), new_instance_id()
    client = await raw_client(etcd_server)
    try:

        async def put(key: str, value: bytes) -> None:
            await client.put(f"{prefix}/{key}".encode(), value)

        await put(
            str(victim_key), json.dumps(PeerRecord(victim_key, ("127.0.0.1", 9)).to_json()).encode()
        )
        await poll_until(lambda: victim_key in peers_of(a), "a first, valid record", timeout=WAIT)
        await put(str(junk_key), b"\xff\xfe not json")
        await put(str(victim_key), b"{}")  # a known key overwritten with junk: it leaves
        await put(str(new_instance_id()), json.dumps(mismatched.to_json()).encode())
        await put(str(large_key), b" " * (64 * 1024 + 1) + b"{}")
        await put("not-a-uuid", json.dumps(valid.to_json()).encode())
        await put(str(valid.instance_id), json.dumps(valid.to_json()).encode())  # a barrier
        await poll_until(
            lambda: valid.instance_id in peers_of(a), "the valid record arrives", timeout=WAIT
        )
        # Another spelling of a listed node's UUID is not its key: putting it is refused,
        # and deleting it does not remove the node.
        upper = str(valid.instance_id).upper()
        await put(upper, json.dumps(valid.to_json()).encode())
        await client.delete(f"{prefix}/{upper}".encode())
        barrier = new_instance_id()
        await put(
            str(barrier), json.dumps(PeerRecord(barrier, ("127.0.0.1", 9)).to_json()).encode()
        )
        await poll_until(lambda: barrier in peers_of(a), "the second barrier arrives", timeout=WAIT)
    finally:
        await client.close()
    known = set(peers_of(a))
    assert victim_key not in known
    assert junk_key not in known and large_key not in known
    assert mismatched.instance_id not in known
    counts = {
        reason: metric(a, "velo_discovery_records_rejected_total", backend="etcd", reason=reason)
        for reason in ("malformed", "instance_mismatch", "too_large", "bad_key")
    }
    assert counts == {"malformed": 2, "instance_mismatch": 1, "too_large": 1, "bad_key": 2}
    assert valid.instance_id in known


async def test_a_forged_address_for_a_node_is_never_dialed_as_that_node(
    etcd_server: EtcdServer, prefix: str, start_nodes: StartNode
) -> None:
    caller = await start_nodes("caller", discovery=etcd_peers(etcd_server, prefix))
    victim = await start_nodes("victim", discovery=etcd_peers(etcd_server, prefix))
    # The attacker holds a valid certificate of the same cluster, for its own identity.
    attacker = await start_nodes("attacker")
    reached: list[bytes] = []

    def steal(ctx: Context) -> bytes:
        reached.append(bytes(ctx.payload))
        return b"stolen"

    attacker.register_handler("secret", steal)
    victim.register_handler("secret", lambda ctx: b"victim")
    await poll_until(
        lambda: victim.instance_id in peers_of(caller), "the victim joins", timeout=WAIT
    )
    assert await caller.call(victim.instance_id, "secret", b"one", timeout=10) == b"victim"

    forged = PeerRecord(victim.instance_id, attacker.address, name="victim")
    client = await raw_client(etcd_server)
    try:
        await client.put(
            f"{prefix}/{victim.instance_id}".encode(), json.dumps(forged.to_json()).encode()
        )
    finally:
        await client.close()
    # The registry says where: it now points at the attacker ...
    await poll_until(
        lambda: peers_of(caller)[victim.instance_id].address == attacker.address,
        "moved",
        timeout=WAIT,
    )
    refusals_before = metric(
        caller, "velo_transport_peer_refusals_total", reason="identity_mismatch"
    )
    # ... and the certificate says who: no call to the victim reaches the attacker.
    for attempt in range(3):
        with pytest.raises(VelomuxError):
            await caller.call(victim.instance_id, "secret", b"secret %d" % attempt, timeout=5)
    assert reached == []
    assert (
        metric(caller, "velo_transport_peer_refusals_total", reason="identity_mismatch")
        > refusals_before
    )
    assert not any(
        c.peer == victim.instance_id and c.state == "established" and c.outbound
        for c in caller.snapshot().transport.connections
    )


async def test_tls_to_etcd_with_client_certificates(
    tmp_path: Path, prefix: str, start_nodes: StartNode
) -> None:
    require_etcd()
    tls = EtcdTls.create(tmp_path / "etcd-tls")
    with EtcdServer(tls=tls) as etcd_server:

        def secured(**options: Any) -> EtcdPeers:
            return etcd_peers(
                etcd_server,
                prefix,
                ca_file=tls.ca,
                cert_file=tls.client_cert,
                key_file=tls.client_key,
                **options,
            )

        a = await start_nodes("node-a", discovery=secured())
        b = await start_nodes("node-b", discovery=secured())
        await poll_until(lambda: b.instance_id in peers_of(a), "discovered over TLS", timeout=WAIT)
        b.register_handler("echo", lambda ctx: bytes(ctx.payload))
        assert await a.call(b.instance_id, "echo", b"tls", timeout=10) == b"tls"

        # A client whose certificate etcd does not trust never gets a session.
        intruder = etcd_peers(
            etcd_server,
            prefix,
            ca_file=tls.ca,
            cert_file=tls.untrusted_cert,
            key_file=tls.untrusted_key,
            connect_timeout=2.0,
        )
        try:
            await intruder.publish(PeerRecord(new_instance_id(), ("127.0.0.1", 9)))
            assert not intruder.connected
        finally:
            await intruder.close()
        # Nor one without TLS at all.
        plain = etcd_peers(etcd_server, prefix, connect_timeout=2.0)
        try:
            assert await plain.snapshot() == []
            assert not plain.connected
        finally:
            await plain.close()
        await a.close()
        await b.close()


async def test_a_close_that_cannot_wait_for_its_session_returns_and_says_so(
    etcd_server: EtcdServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A bound too short for any session to stop in: close() returns without it, counts it,
    # logs where it waits, and the session still stops on its own afterwards.
    peers = etcd_peers(etcd_server, prefix, close_timeout=1e-6)
    await peers.publish(PeerRecord(new_instance_id(), ("127.0.0.1", 9)))
    assert peers.connected
    [session] = [t for t in asyncio.all_tasks() if t.get_name() == "velomux-etcd-discovery"]
    with caplog.at_level(logging.WARNING, logger="velomux_quic.discovery.etcd"):
        await peers.close()
    assert not session.done(), "close() waited for the session after all"
    assert not peers.connected
    assert peers.stuck_tasks == 1
    [warning] = [r.getMessage() for r in caplog.records if "did not stop" in r.getMessage()]
    assert "within 0.0 s of close()" in warning and "leaving it behind" in warning
    assert "waiting in " in warning and "an unknown place" not in warning
    async with asyncio.timeout(WAIT):
        await asyncio.wait({session})
    assert session.cancelled()
    client = await raw_client(etcd_server)
    try:  # the lease was revoked before the wait: the record is gone all the same
        assert list(await client.get_prefix(f"{prefix}/".encode())) == []
    finally:
        await client.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_closes_that_race_lease_renewals_all_return(
    etcd_server: EtcdServer, prefix: str
) -> None:
    # Ten backends renew in step, and all close at a random point of the renewal period,
    # cycle after cycle: a close landing in the turn a renewal's reply arrives used to
    # lose its cancel (Python 3.11's asyncio.wait_for) and wait for ever on a session
    # that went on renewing. Every close returns, and no session is left behind.
    rng = random.Random()
    for _ in range(200):
        batch = [etcd_peers(etcd_server, prefix) for _ in range(10)]
        await asyncio.gather(
            *(peers.publish(PeerRecord(new_instance_id(), ("127.0.0.1", 9))) for peers in batch)
        )
        assert all(peers.connected for peers in batch)
        await asyncio.sleep(rng.uniform(0, TTL / 3))  # a random phase of the renewals
        async with asyncio.timeout(WAIT):
            await asyncio.gather(*(peers.close() for peers in batch))
        assert [peers.stuck_tasks for peers in batch] == [0] * 10


async def test_node_config_selects_etcd_and_names_bad_keys(
    etcd_server: EtcdServer,
    prefix: str,
    tmp_path: Path,
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    credentials = make_credentials("configured")
    directory = tmp_path / "creds"
    credentials.save(directory)
    path = tmp_path / "node.toml"
    path.write_text(
        f"""
[node]
credentials = "{directory}"

[discovery]
backend = "etcd"
etcd_endpoints = ["{etcd_server.endpoint}"]
etcd_prefix = "{prefix}"
lease_ttl = 3
"""
    )
    config = NodeConfig.from_toml(path, environ={})
    assert config.discovery == DiscoveryConfig(
        backend="etcd", etcd_endpoints=(etcd_server.endpoint,), etcd_prefix=prefix, lease_ttl=3
    )
    async with Node.open(config) as node:
        assert isinstance(node.messenger.discovery, EtcdPeers)
        client = await raw_client(etcd_server)
        try:
            stored = await client.get(f"{prefix}/{node.instance_id}".encode())
        finally:
            await client.close()
        assert stored is not None
        assert PeerRecord.from_bytes(stored.value).address == node.address
    with pytest.raises(
        ConfigurationError, match=r"VELOMUX_DISCOVERY_LEASE_TTL: lease_ttl .*whole number"
    ):
        NodeConfig.from_toml(path, environ={"VELOMUX_DISCOVERY_LEASE_TTL": "0"})
    with pytest.raises(ConfigurationError, match=r"ENDPOINTS: etcd_endpoints: 'nowhere' is not"):
        NodeConfig.from_toml(path, environ={"VELOMUX_DISCOVERY_ETCD_ENDPOINTS": "a:1,nowhere"})
    bad = tmp_path / "bad.toml"
    bad.write_text('[discovery]\nbackend = "consul"\n')
    with pytest.raises(ConfigurationError, match=r"bad.toml: discovery\.backend: .*'etcd'"):
        NodeConfig.from_toml(bad, environ={})
    bad.write_text('[node]\npeer_directory = "x"\n[discovery]\nbackend = "etcd"\n')
    with pytest.raises(ConfigurationError, match=r"node\.peer_directory.*keep one"):
        NodeConfig.from_toml(bad, environ={})
    with pytest.raises(ConfigurationError, match=r"CA file .* cannot read it"):
        DiscoveryConfig(backend="etcd", etcd_ca=str(tmp_path / "missing.pem")).backend_for()


async def test_the_view_is_bounded_however_many_records_the_store_holds(
    etcd_server: EtcdServer, prefix: str
) -> None:
    observer = etcd_peers(etcd_server, prefix, max_records=2)
    seen: list[InstanceId] = []
    unsubscribe = observer.watch(lambda record, instance_id: seen.append(instance_id))
    assert await observer.snapshot() == []  # live: the puts below arrive by the watch, in order
    client = await raw_client(etcd_server)
    try:
        records = [PeerRecord(new_instance_id(), ("127.0.0.1", 9)) for _ in range(4)]
        for record in records:
            key = f"{prefix}/{record.instance_id}".encode()
            await client.put(key, json.dumps(record.to_json()).encode())
        await poll_until(
            lambda: observer.rejected["too_many"] == 2, "the flood is refused", timeout=WAIT
        )
        assert observer.view_size == 2
        assert seen == [records[0].instance_id, records[1].instance_id]
        # A place frees up when a listed record leaves.
        await client.delete(f"{prefix}/{records[0].instance_id}".encode())
        await poll_until(lambda: observer.view_size == 1, "the leave", timeout=WAIT)
    finally:
        unsubscribe()
        await client.close()
        await observer.close()


@pytest.mark.one_loop
async def test_a_velomux_node_service_joins_by_config_and_lapses_when_killed(
    etcd_server: EtcdServer,
    prefix: str,
    tmp_path: Path,
    start_nodes: StartNode,
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    a = await start_nodes("node-a", discovery=etcd_peers(etcd_server, prefix))
    credentials = make_credentials("sink").save(tmp_path / "sink")
    config = tmp_path / "node.toml"
    config.write_text(
        f'[node]\ncredentials = "{credentials}"\nname = "sink-0"\n\n'
        f'[discovery]\nbackend = "etcd"\netcd_endpoints = ["{etcd_server.endpoint}"]\n'
        f'etcd_prefix = "{prefix}"\nlease_ttl = {TTL}\n'
    )
    service = await asyncio.to_thread(
        subprocess.Popen,
        [*VELOMUX, "node", "--config", str(config), "--ops", "off"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert service.stdout is not None

        def listening() -> str:
            assert service.stdout is not None
            for line in service.stdout:
                if "event=listening" in line:
                    return line
            raise AssertionError("the service exited before it listened")

        line = await asyncio.wait_for(asyncio.to_thread(listening), WAIT)
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        sink = InstanceId.parse(fields["instance"])
        # Nobody told a where the service is: its record in etcd did.
        await poll_until(
            lambda: sink in peers_of(a), "the service joins by its config", timeout=WAIT
        )
        reply = json.loads(await a.call(sink, "velomux.sink", b"", timeout=10))
        assert isinstance(reply["handle"], int)
        service.send_signal(signal.SIGKILL)
        await asyncio.to_thread(service.wait, 10)
        await poll_until(lambda: sink not in peers_of(a), "its lease lapses", timeout=TTL + 8)
    finally:
        if service.poll() is None:
            service.kill()
        await asyncio.to_thread(service.wait, 10)
        if service.stdout is not None:
            service.stdout.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_calls_go_on_through_repeated_etcd_restarts_and_node_churn(
    etcd_server: EtcdServer, prefix: str, start_nodes: StartNode
) -> None:
    a = await start_nodes("node-a", discovery=etcd_peers(etcd_server, prefix, max_backoff=1.0))
    b = await start_nodes("node-b", discovery=etcd_peers(etcd_server, prefix, max_backoff=1.0))
    b.register_handler("echo", lambda ctx: bytes(ctx.payload))
    await poll_until(lambda: b.instance_id in peers_of(a), "b joins", timeout=WAIT)
    discovery = a.messenger.discovery
    assert isinstance(discovery, EtcdPeers)
    calls = 0
    for cycle in range(5):
        await asyncio.to_thread(etcd_server.kill if cycle % 2 else etcd_server.stop)
        await poll_until(lambda: not discovery.connected, "a sees etcd gone", timeout=WAIT)
        for _ in range(20):  # the last view still routes
            assert await a.call(b.instance_id, "echo", b"%d" % calls, timeout=10) == b"%d" % calls
            calls += 1
        await asyncio.to_thread(etcd_server.start)
        await poll_until(lambda: discovery.connected, "a reconnects", timeout=30)
        # A node joining and one leaving between restarts reach a's registry.
        churn = await start_nodes(f"churn-{cycle}", discovery=etcd_peers(etcd_server, prefix))
        await poll_until(
            lambda churn=churn: churn.instance_id in peers_of(a), "churn joins", timeout=WAIT
        )
        await churn.close()
        await poll_until(
            lambda churn=churn: churn.instance_id not in peers_of(a), "churn leaves", timeout=WAIT
        )
    assert metric(a, "velo_discovery_reconnects_total", backend="etcd") >= 5
    assert set(peers_of(a)) == {b.instance_id}
