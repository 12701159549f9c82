"""aioquic and qh3 nodes together, over real UDP with real mutual TLS: every bad certificate
refused in the handshake with each engine on each side, and a mixed pair carrying lanes,
requests, streams with pre-bind tickets, credentials rotation and stateless resets.

Each test names its engines in ``TransportConfig(engine=...)``, so it runs the same under
any ``VELOMUX_QUIC_ENGINE``. Skipped where qh3 is not installed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import ssl
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

pytest.importorskip("qh3")

from aioquic.asyncio.client import connect as aioquic_connect
from aioquic.quic.configuration import QuicConfiguration
from qh3.asyncio.client import connect as qh3_connect
from qh3.quic.configuration import QuicConfiguration as Qh3Configuration

from tests.conftest import NodeFactory, Recorder, StartNode, wait_admitted
from tests.procs.resettable import Watcher
from velomux_quic.errors import ChannelClosed, DialError
from velomux_quic.ids import InstanceId, new_instance_id
from velomux_quic.mux.config import MuxConfig
from velomux_quic.security.alerts import ALPN_PROTOCOL
from velomux_quic.security.certs import (
    CertificateAuthority,
    NodeCredentials,
    issue_node_certificate,
)
from velomux_quic.security.testing import (
    SERVER_ONLY,
    issue_expired,
    issue_with_uris,
    issue_with_usages,
    self_signed_copy,
    with_mismatched_key,
)
from velomux_quic.streaming.control import MESSENGER_MUX_KEY, StreamOpenTicket
from velomux_quic.transport import TransportConfig
from velomux_quic.transport.admission import SendAdmission
from velomux_quic.transport.endpoint import QuicEndpoint

ENGINES = ("aioquic", "qh3")
PAIRS = [(client, server) for client in ENGINES for server in ENGINES]
PAIR_IDS = [f"{client}-dials-{server}" for client, server in PAIRS]
CHECKOUT = Path(__file__).resolve().parents[2]


def engine(name: str, **settings: object) -> TransportConfig:
    return TransportConfig(engine=name, **settings)  # type: ignore[arg-type]


# -- mutual TLS: each engine on each side -----------------------------------------------------

BadCredentials = Callable[
    [CertificateAuthority, CertificateAuthority, NodeCredentials], NodeCredentials
]


def _other_ca(
    ca: CertificateAuthority, other: CertificateAuthority, victim: NodeCredentials
) -> NodeCredentials:
    stranger = issue_node_certificate(other, new_instance_id(), name="stranger")
    return dataclasses.replace(stranger, trust_roots=[other.certificate, ca.certificate])


def _expired(
    ca: CertificateAuthority, other: CertificateAuthority, victim: NodeCredentials
) -> NodeCredentials:
    return issue_expired(ca, new_instance_id(), name="expired")


def _mismatched_key(
    ca: CertificateAuthority, other: CertificateAuthority, victim: NodeCredentials
) -> NodeCredentials:
    return with_mismatched_key(issue_node_certificate(ca, new_instance_id(), name="thief"))


def _self_signed_copy(
    ca: CertificateAuthority, other: CertificateAuthority, victim: NodeCredentials
) -> NodeCredentials:
    return self_signed_copy(victim, mimic_issuer=True)


def _foreign_trust_domain(
    ca: CertificateAuthority, other: CertificateAuthority, victim: NodeCredentials
) -> NodeCredentials:
    """Our CA's signature, but the identity of another cluster's trust domain."""
    return issue_with_uris(ca, [f"spiffe://elsewhere/instance/{new_instance_id()}"], name="x")


def _server_only(
    ca: CertificateAuthority, other: CertificateAuthority, victim: NodeCredentials
) -> NodeCredentials:
    return issue_with_usages(ca, new_instance_id(), name="x", extended_key_usages=SERVER_ONLY)


BAD_CLIENTS = [
    (_other_ca, "untrusted_chain"),
    (_expired, "expired"),
    (_mismatched_key, "bad_signature"),
    (_self_signed_copy, "untrusted_chain"),
    (_foreign_trust_domain, "bad_identity"),
    (_server_only, "bad_key_usage"),
]
BAD_IDS = [
    "other_ca",
    "expired",
    "key_does_not_match",
    "self_signed_copy",
    "foreign_trust_domain",
    "server_only_usage",
]


@pytest.mark.parametrize(("client_engine", "server_engine"), PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize(("make_bad", "reason"), BAD_CLIENTS, ids=BAD_IDS)
async def test_a_bad_client_certificate_is_refused_in_the_handshake(
    start_node: NodeFactory,
    ca: CertificateAuthority,
    other_ca: CertificateAuthority,
    make_credentials: Callable[..., NodeCredentials],
    client_engine: str,
    server_engine: str,
    make_bad: BadCredentials,
    reason: str,
) -> None:
    b, b_seen = await start_node("b", config=engine(server_engine))
    bad, _ = await start_node(
        "bad",
        credentials=make_bad(ca, other_ca, make_credentials("a")),
        config=engine(client_engine),
    )
    bad.register_peer(b.instance_id, b.address)
    outcome = bad.send(b.instance_id, 0, b"must never arrive")
    with pytest.raises(DialError) as refused:
        await asyncio.wait_for(bad.connect(b.instance_id), 10)
    assert refused.value.reason == f"refused_by_peer:{reason}"
    assert b.stats.peer_refusals[reason] == 1
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(outcome, 10)  # type: ignore[arg-type]
    assert b_seen.count() == 0 and b_seen.connected == []
    good, _ = await start_node("good", config=engine(client_engine))
    good.register_peer(b.instance_id, b.address)
    await wait_admitted([good.send(b.instance_id, 0, b"good")])
    await b_seen.wait_until(lambda: b_seen.frames.get((good.instance_id, 0)) == [b"good"])


@pytest.mark.parametrize(("client_engine", "server_engine"), PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("kind", ["wrong_identity", "impostor", "key_does_not_match"])
async def test_the_dialer_refuses_a_bad_server_in_the_handshake(
    start_node: NodeFactory,
    make_credentials: Callable[..., NodeCredentials],
    client_engine: str,
    server_engine: str,
    kind: str,
) -> None:
    real_b = make_credentials("b")
    served = {
        "wrong_identity": make_credentials("someone"),
        "impostor": self_signed_copy(real_b),
        "key_does_not_match": with_mismatched_key(real_b),
    }[kind]
    server, server_seen = await start_node(
        "server", credentials=served, config=engine(server_engine)
    )
    a, _ = await start_node("a", config=engine(client_engine))
    a.register_peer(real_b.instance_id, server.address)
    with pytest.raises(DialError) as refused:
        await asyncio.wait_for(a.connect(real_b.instance_id), 10)
    expected = {
        "wrong_identity": "identity_mismatch",
        "impostor": "untrusted_chain",
        "key_does_not_match": "bad_signature",
    }[kind]
    assert refused.value.reason == expected
    assert a.stats.peer_refusals[expected] == 1
    assert server_seen.count() == 0 and server_seen.connected == []


@pytest.mark.parametrize("server_engine", ENGINES)
@pytest.mark.parametrize("client_library", ["aioquic", "qh3"])
async def test_a_client_with_no_certificate_is_refused(
    start_node: NodeFactory, server_engine: str, client_library: str
) -> None:
    """A plain QUIC client of either library, presenting no certificate at all."""
    b, b_seen = await start_node("b", config=engine(server_engine))
    host, port = b.address
    with pytest.raises(ConnectionError):
        if client_library == "aioquic":
            configuration = QuicConfiguration(
                is_client=True, alpn_protocols=[ALPN_PROTOCOL], verify_mode=ssl.CERT_NONE
            )
            async with aioquic_connect(host, port, configuration=configuration) as client:
                _, writer = await client.create_stream(is_unidirectional=True)
                writer.write(b"\x00\x00\x00\x05hello")
                await asyncio.wait_for(client.wait_closed(), 10)
        else:
            qh3_configuration = Qh3Configuration(
                is_client=True, alpn_protocols=[ALPN_PROTOCOL], verify_mode=ssl.CERT_NONE
            )
            async with qh3_connect(host, port, configuration=qh3_configuration) as qh3_client:
                _, qh3_writer = await qh3_client.create_stream(is_unidirectional=True)
                qh3_writer.write(b"\x00\x00\x00\x05hello")
                await asyncio.wait_for(qh3_client.wait_closed(), 10)
        raise ConnectionError("closed by the server")
    await b_seen.wait_until(lambda: b.stats.peer_refusals["no_certificate"] == 1)
    assert b_seen.count() == 0 and b_seen.connected == []


# -- a mixed pair at work -------------------------------------------------------------------


@pytest.mark.parametrize(("client_engine", "server_engine"), PAIRS, ids=PAIR_IDS)
async def test_lanes_and_requests_cross_engines_both_ways(
    start_node: NodeFactory,
    make_credentials: Callable[..., NodeCredentials],
    client_engine: str,
    server_engine: str,
) -> None:
    from velomux_quic.transport import TransportHandler

    class Server(Recorder, TransportHandler):
        async def serve_request(self, peer: InstanceId, request: bytes) -> bytes:
            return request[::-1] * 50_000 if request == b"big!" else request[::-1]

    b, b_seen = await start_node("b", config=engine(server_engine, lanes=4))
    a_seen = Server()
    a = await QuicEndpoint.start(
        make_credentials("a"), config=engine(client_engine, lanes=4), handler=a_seen
    )
    try:
        a.register_peer(b.instance_id, b.address)
        frames = {lane: [f"{lane}:{i}".encode() * 40 for i in range(300)] for lane in range(4)}
        await wait_admitted(
            [a.send(b.instance_id, lane, f) for lane in frames for f in frames[lane]]
        )
        for lane, sent in frames.items():
            await b_seen.wait_until(
                lambda lane=lane, sent=sent: b_seen.frames[(a.instance_id, lane)] == sent
            )  # type: ignore[misc]
        assert await b.request(a.instance_id, b"abc", max_response=10, timeout=5) == b"cba"
        big = await b.request(a.instance_id, b"big!", max_response=1 << 20, timeout=10)
        assert len(big) == 200_000
        # and back: b dials a (the engines swap roles on that connection)
        b.register_peer(a.instance_id, a.address)
        await wait_admitted([b.send(a.instance_id, 1, b"back")])
        await a_seen.wait_until(lambda: a_seen.frames[(b.instance_id, 1)] == [b"back"])
        assert b.engine.name == server_engine and a.engine.name == client_engine
        snapshot = a.snapshot()
        assert snapshot.engine is not None and snapshot.engine.name == client_engine
        outbound = a.snapshot().to(b.instance_id)
        assert outbound is not None and outbound.peer_certificate_serial is not None
    finally:
        await a.close()


@pytest.mark.parametrize(("client_engine", "server_engine"), PAIRS, ids=PAIR_IDS)
async def test_streams_open_with_tickets_across_engines(
    start_nodes: StartNode, client_engine: str, server_engine: str
) -> None:
    b = await start_nodes("b", transport=engine(server_engine), mux=MuxConfig())
    a = await start_nodes("a", transport=engine(client_engine), mux=MuxConfig())
    a.add_peer(b.instance_id, b.address)

    async def one(index: int) -> list[object]:
        anchor = b.create_anchor()
        ticket = StreamOpenTicket.decode(b.prebind_anchor(anchor.handle).encode())
        sender = await a.open_anchor_stream(anchor.handle, ticket)
        assert sender.negotiated_transport() == MESSENGER_MUX_KEY
        for item in range(20):
            await sender.send([index, item])
        sender.finalize()
        return [item async for item in anchor]

    async with asyncio.timeout(30):
        results = await asyncio.gather(*(one(i) for i in range(50)))
    assert results == [[[i, item] for item in range(20)] for i in range(50)]


@pytest.mark.parametrize(("client_engine", "server_engine"), PAIRS, ids=PAIR_IDS)
async def test_rotated_credentials_are_presented_to_a_peer_of_the_other_engine(
    start_node: NodeFactory,
    ca: CertificateAuthority,
    make_credentials: Callable[..., NodeCredentials],
    client_engine: str,
    server_engine: str,
) -> None:
    b_credentials = make_credentials("b")
    b, b_seen = await start_node("b", credentials=b_credentials, config=engine(server_engine))
    a, _ = await start_node("a", config=engine(client_engine))
    a.register_peer(b.instance_id, b.address)
    await wait_admitted([a.send(b.instance_id, 0, b"before")])
    first = a.snapshot().to(b.instance_id)
    assert first is not None
    renewed = issue_node_certificate(ca, b_credentials.instance_id, name="b")
    summary = b.reload_credentials(renewed)
    a.disconnect(b.instance_id)
    await wait_admitted([a.send(b.instance_id, 0, b"after")])
    await b_seen.wait_until(lambda: b_seen.frames[(a.instance_id, 0)][-1:] == [b"after"])
    live = [c for c in a.snapshot().connections if c.outbound and c.state == "established"]
    assert [c.peer_certificate_serial for c in live] == [summary.serial]
    assert summary.serial != first.peer_certificate_serial


# -- stateless resets between engines -------------------------------------------------------


class _Peer:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def line(self) -> dict[str, object]:
        assert self.process.stdout is not None
        raw = await asyncio.wait_for(self.process.stdout.readline(), 20)
        return json.loads(raw)  # type: ignore[no-any-return]


@asynccontextmanager
async def _peer_process(credentials: Path, peer_engine: str, *options: str) -> AsyncIterator[_Peer]:
    import os

    environment = {**os.environ, "VELOMUX_QUIC_ENGINE": peer_engine}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.procs.resettable", "--credentials", str(credentials),
        *options, cwd=CHECKOUT, env=environment,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        yield _Peer(process)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


@pytest.mark.timeout(60)
@pytest.mark.one_loop
@pytest.mark.parametrize(("ours", "theirs"), PAIRS, ids=[f"{a}-resets-by-{b}" for a, b in PAIRS])
async def test_a_restarted_peer_of_either_engine_resets_the_connection_at_once(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials], ours: str, theirs: str
) -> None:
    """This node dialed a peer that was killed and restarted without its state: the
    peer's reset, with the token derived for its first connection ID, ends the connection
    at once (both engines derive that one)."""
    peer_dir = make_credentials("restarted").save(tmp_path / "restarted")
    watcher = Watcher()
    config = engine(ours, idle_timeout=60.0, keep_alive_interval=0.2)
    async with await QuicEndpoint.start(
        make_credentials("survivor"), config=config, handler=watcher
    ) as survivor:
        host, _ = survivor.address
        async with _peer_process(peer_dir, theirs) as first:
            ready = await first.line()
            peer = InstanceId.parse(str(ready["instance"]))
            peer_port = int(ready["address"][1])  # type: ignore[index]
            survivor.register_peer(peer, (host, peer_port))
            await survivor.connect(peer)
            await watcher.up.wait()
            first.process.kill()
            await first.process.wait()
        async with _peer_process(peer_dir, theirs, "--port", str(peer_port)) as restarted:
            await restarted.line()
            async with asyncio.timeout(20):  # the idle timeout is 60 s away
                await watcher.down.wait()
        assert survivor.stats.stateless_resets_received == 1


# -- receive-side backpressure where the engine holds per connection -------------------------


@pytest.mark.parametrize("client_engine", ENGINES)
async def test_a_paused_lane_on_qh3_holds_its_writer_within_a_bound_then_releases_it(
    start_node: NodeFactory, client_engine: str
) -> None:
    """qh3 grants credit as stream events are taken, so a paused lane holds its writer by
    holding the connection (EngineFeatures.receive_backpressure "connection"): the writer's
    sends go pending after at most the lane window plus one stream window plus its send
    buffer plus one received burst (the core hands a GRO buffer's stream data over as one
    piece, taken whole before the hold), and stay pending; resuming delivers everything,
    in order."""
    window = 64 * 1024
    config = {"lanes": 2, "lane_window": window, "stream_window": window, "send_buffer": window}
    b, b_seen = await start_node("b", config=engine("qh3", **config))
    a, _ = await start_node("a", config=engine(client_engine, **config))
    assert b.engine.receive_backpressure == "connection"
    a.register_peer(b.instance_id, b.address)
    await a.connect(b.instance_id)
    b.pause_reading(a.instance_id, 1)

    frame = bytes(1024)
    admitted = 0
    held: SendAdmission | None = None
    for _ in range(10_000):  # bounded: the bound below is a few hundred frames
        outcome = a.send(b.instance_id, 1, frame)
        if isinstance(outcome, SendAdmission):
            try:  # idle otherwise: a wait this long that admits nothing is the hold
                await asyncio.wait_for(asyncio.shield(outcome), 2.0)
            except TimeoutError:
                held = outcome
                break
        admitted += 1
    assert held is not None, "the paused lane never held its writer"
    burst = 64 * 1024  # a GRO buffer's datagrams at most
    bound = (window + window + window + 64 * 1024 + burst) // len(frame) + 2
    assert admitted <= bound, (admitted, bound)

    b.resume_reading(a.instance_id, 1)
    await asyncio.wait_for(asyncio.shield(held), 20)
    await b_seen.wait_until(lambda: len(b_seen.frames[(a.instance_id, 1)]) == admitted + 1)
