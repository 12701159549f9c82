"""The fault matrix: real node processes, an oracle on every item, the chapter's outcomes.

Every cell runs a consumer node and one or two producer nodes, each in its own process,
on loopback through the impairment proxy (2% loss each way, 1% of datagrams held back so
later ones overtake them, 2 ms of delay): the producers dial the consumer at the proxy,
and the consumer's connection back crosses it too. Every item is ``[stream, seq,
crc32(payload), payload]``; the consumer process checks each as it reads and writes one
record per stream as it ends (tests/procs/oracle_consumer.py), and so does the producer
(tests/procs/oracle_producer.py). Each cell then asserts:

* on every stream that ended normally: no item lost (the consumer took what the producer
  sent), duplicated, reordered, corrupted or misrouted;
* on every stream the fault ends: the chapter's error, within the chapter's bound (the
  watchdog: 3 to 4 heartbeat windows after the last arrival), and a clean prefix;
* streams the fault does not touch complete, and new streams work after it.

Windows are short (0.5 s heartbeat, 2 s QUIC idle timeout, 1 s mux health check) so a
cell takes seconds. The children run on the test's event loop kind (uvloop or asyncio).
docs/reliability.md has the table of what each cell showed.
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tests.procs.oracle import AttachRoundFailed, Cluster, NodeProcess, Record, Settings
from velomux_quic import NodeCredentials

pytestmark = pytest.mark.one_loop  # real processes per cell: uvloop alone by default

SLACK = 1.5
"""Seconds of slack on every detection bound, for a loaded 2-core machine: the processes
of this cell, the proxy and the test share it with the rest of the suite."""

PRODUCER_GONE = {"SenderDropped"}
"""How a consumer's stream ends when its producer died or became unreachable."""

CONSUMER_GONE = {"ChannelClosed", "StreamEndedByConsumer", "TransportClosed", "PeerGone"}
"""How a producer's sender ends when its consumer died (a send, or the cancel it waited on)."""


@pytest.fixture(params=["aioquic", "qh3"])
def engine(request: pytest.FixtureRequest) -> str:
    """Every cell runs on both QUIC engines (qh3's where the extra is installed)."""
    if request.param == "qh3":
        pytest.importorskip("qh3")
    return str(request.param)


@pytest.fixture
async def cluster_factory(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials], engine: str
) -> AsyncIterator[Callable[[Settings], Cluster]]:
    uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    made: list[Cluster] = []

    def make(settings: Settings) -> Cluster:
        settings.uvloop = uvloop
        settings.engine = engine
        cluster = Cluster(tmp_path, make_credentials, settings)
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            await cluster.close()


def assert_delivered(consumer: dict[int, Record], producer: dict[int, Record]) -> None:
    """The oracle for streams that ended normally: all of it, once, in order, intact."""
    for index, seen in consumer.items():
        sent = producer[index]
        assert seen["end"] == "finalized", (index, seen)
        assert sent["outcome"] == "SENT", (index, sent)
        assert seen["items"] == sent["sent"], (index, seen, sent)  # nothing lost or duplicated
        assert_clean(seen)


def assert_clean(seen: Record) -> None:
    """What a stream delivered before it ended is a prefix, in order, of what was sent."""
    assert seen["misrouted"] == seen["corrupt"] == seen["out_of_sequence"] == 0, seen


def detection(records: dict[int, Record], since: float) -> tuple[float, float]:
    """The earliest and latest end, in seconds after ``since``."""
    delays = [record["at"] - since for record in records.values()]
    return min(delays), max(delays)


def report(cell: str, **figures: object) -> None:
    """One line per cell (``pytest -s`` shows it): the figures docs/reliability.md cites."""
    shown = ", ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()
    )
    print(f"\nfault-matrix {cell}: {shown}")


async def consumer_metrics(consumer: NodeProcess) -> dict[str, float]:
    metrics: dict[str, float] = (await consumer.ask({"op": "metrics"}))["metrics"]
    return metrics


@pytest.mark.timeout(90)
async def test_sigkill_of_a_producer_drops_its_streams_within_the_bound_and_no_other(
    cluster_factory: Callable[[Settings], Cluster],
) -> None:
    settings = Settings()
    cluster = cluster_factory(settings)
    consumer = await cluster.start_consumer()
    victim = await cluster.start_producer("victim")
    bystander = await cluster.start_producer("bystander")
    doomed = await cluster.open_streams(consumer, victim, 12, items=None, interval=0.02)
    spared = await cluster.open_streams(consumer, bystander, 12, items=120, interval=0.02)
    killed_at = victim.send_signal(signal.SIGKILL)

    dropped = await consumer.wait_ended(doomed, 4 * settings.heartbeat + SLACK + 10)
    assert {record["end"] for record in dropped.values()} == PRODUCER_GONE, dropped
    for seen in dropped.values():
        assert_clean(seen)
    earliest, latest = detection(dropped, killed_at)
    # The streams sent every 20 ms, so their last arrival is the kill, give or take.
    assert 3 * settings.heartbeat - 0.2 <= earliest, earliest
    assert latest <= 4 * settings.heartbeat + SLACK, latest

    assert_delivered(await consumer.wait_ended(spared, 30), await bystander.wait_ended(spared, 30))
    metrics = await consumer_metrics(consumer)
    assert metrics["velo_streaming_heartbeat_watchdog_firings_total"] == len(doomed)
    report(
        "sigkill-producer",
        streams=len(doomed) + len(spared),
        detect_min=earliest,
        detect_max=latest,
        delivered=sum(r["items"] for r in consumer.records_of(spared)),
    )


CONSUMER_DEATH_BOUND = 2.0 * Settings().idle_timeout + SLACK
"""How soon a producer must learn its consumer died: the QUIC idle timeout (or the mux
health check, whichever comes first), with a second idle timeout of margin for the PTO
backoff and a redial attempt, plus slack."""


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("mux", "idle"),
    [
        pytest.param(True, False, id="mux-sending"),
        pytest.param(True, True, id="mux-idle"),
        pytest.param(False, False, id="per-stream-sending"),
        pytest.param(False, True, id="per-stream-idle"),
    ],
)
async def test_sigkill_of_the_consumer_ends_every_sender_within_the_bound(
    cluster_factory: Callable[[Settings], Cluster], mux: bool, idle: bool
) -> None:
    settings = Settings(mux=mux)
    cluster = cluster_factory(settings)
    consumer = await cluster.start_consumer()
    producer = await cluster.start_producer("producer")
    options = {"idle": True} if idle else {"interval": 0.02}
    streams = await cluster.open_streams(consumer, producer, 16, items=None, **options)
    killed_at = consumer.send_signal(signal.SIGKILL)
    ended = await producer.wait_ended(streams, CONSUMER_DEATH_BOUND + 2)
    outcomes = {record["outcome"] for record in ended.values()}
    assert outcomes <= CONSUMER_GONE, ended
    earliest, latest = detection(ended, killed_at)
    assert latest <= CONSUMER_DEATH_BOUND, latest
    cell = f"sigkill-consumer-{'mux' if mux else 'per-stream'}-{'idle' if idle else 'sending'}"
    metrics = (await producer.ask({"op": "metrics"}))["metrics"]
    counters = {
        name: metrics.get(f"velo_streaming_mux_{name}_total", 0.0)
        for name in ("health_check_failures", "epoch_deaths")
    }
    report(
        cell,
        **counters,
        streams=len(streams),
        detect_min=earliest,
        detect_max=latest,
        outcomes=sorted(outcomes),
    )


async def assert_new_streams_work(
    cluster: Cluster, consumer: NodeProcess, producer: NodeProcess, count: int = 8
) -> int:
    """After the fault: fresh streams between the same nodes deliver all of it, intact."""
    try:
        fresh = await cluster.open_streams(consumer, producer, count, items=30, interval=0.01)
    except AttachRoundFailed as failure:
        assert {r["outcome"] for r in failure.records} == {"AttachRefused"}, failure.records
        raise
    assert_delivered(await consumer.wait_ended(fresh, 30), await producer.wait_ended(fresh, 30))
    return len(fresh)


@pytest.mark.timeout(90)
async def test_sigstop_of_the_consumer_past_the_idle_timeout_then_sigcont(
    cluster_factory: Callable[[Settings], Cluster],
) -> None:
    """The producer learns within its bound; the resumed consumer ends every stream whose
    producer is gone (its watchdog has seen nothing for far more than its windows), with a
    clean prefix; then the same two nodes stream again."""
    settings = Settings()
    cluster = cluster_factory(settings)
    consumer = await cluster.start_consumer()
    producer = await cluster.start_producer("producer")
    streams = await cluster.open_streams(consumer, producer, 16, items=None, interval=0.02)
    stopped_at = consumer.send_signal(signal.SIGSTOP)
    ended = await producer.wait_ended(streams, CONSUMER_DEATH_BOUND + 2)
    assert {record["outcome"] for record in ended.values()} <= CONSUMER_GONE, ended
    _, producer_max = detection(ended, stopped_at)
    assert producer_max <= CONSUMER_DEATH_BOUND, producer_max

    resumed_at = consumer.send_signal(signal.SIGCONT)
    dropped = await consumer.wait_ended(streams, 4 * settings.heartbeat + SLACK + 20)
    assert {record["end"] for record in dropped.values()} <= PRODUCER_GONE, dropped
    for seen in dropped.values():
        assert_clean(seen)
    _, consumer_max = detection(dropped, resumed_at)
    fresh = await assert_new_streams_work(cluster, consumer, producer)
    report(
        "sigstop-consumer",
        streams=len(streams) + fresh,
        producer_detect=producer_max,
        consumer_end_after_resume=consumer_max,
    )
    assert consumer_max <= 4 * settings.heartbeat + SLACK, consumer_max


async def stop_the_producer_past_the_idle_timeout(
    cluster: Cluster, settings: Settings, count: int
) -> tuple[NodeProcess, NodeProcess, dict[str, float]]:
    """SIGSTOP a streaming producer until the consumer dropped its streams and both idle
    timeouts passed, then SIGCONT; check both sides' outcomes, return the nodes and figures."""
    consumer = await cluster.start_consumer()
    producer = await cluster.start_producer("producer")
    streams = await cluster.open_streams(consumer, producer, count, items=None, interval=0.02)
    stopped_at = producer.send_signal(signal.SIGSTOP)
    dropped = await consumer.wait_ended(streams, 4 * settings.heartbeat + SLACK + 10)
    assert {record["end"] for record in dropped.values()} == PRODUCER_GONE, dropped
    for seen in dropped.values():
        assert_clean(seen)
    earliest, latest = detection(dropped, stopped_at)
    assert 3 * settings.heartbeat - 0.2 <= earliest, earliest
    assert latest <= 4 * settings.heartbeat + SLACK, latest
    await fault_lasts(settings.idle_timeout + 0.5)  # past the idle timeout on both sides
    resumed_at = producer.send_signal(signal.SIGCONT)
    ended = await producer.wait_ended(streams, CONSUMER_DEATH_BOUND + 2)
    assert "SENT" not in {record["outcome"] for record in ended.values()}, ended
    _, producer_max = detection(ended, resumed_at)
    assert producer_max <= CONSUMER_DEATH_BOUND, producer_max
    figures = {"detect_min": earliest, "detect_max": latest, "producer_end": producer_max}
    return consumer, producer, figures


@pytest.mark.timeout(90)
async def test_sigstop_of_the_producer_past_the_idle_timeout_then_sigcont(
    cluster_factory: Callable[[Settings], Cluster],
) -> None:
    """The consumer's watchdogs end every stream within 3 to 4 windows of the stop; the
    resumed producer's senders end at once with an error, never SENT: the consumer's
    notices that it dropped them may have died with its connections while the producer
    was stopped, so it answers the records the producer sends on after it resumes."""
    settings = Settings()
    cluster = cluster_factory(settings)
    _, _, figures = await stop_the_producer_past_the_idle_timeout(cluster, settings, 16)
    report("sigstop-producer", streams=16, **figures)


@pytest.mark.timeout(90)
async def test_a_producer_resumed_past_the_idle_timeout_attaches_new_streams_at_once(
    cluster_factory: Callable[[Settings], Cluster],
) -> None:
    settings = Settings()
    cluster = cluster_factory(settings)
    consumer, producer, _ = await stop_the_producer_past_the_idle_timeout(cluster, settings, 4)
    async with asyncio.timeout(CONSUMER_DEATH_BOUND + 5):
        await assert_new_streams_work(cluster, consumer, producer)


async def fault_lasts(seconds: float) -> None:
    """Let a fault (a stopped process, a cut link) last: its duration is what the cell is
    about, a wait for time itself, not for an event another task would set."""
    await asyncio.sleep(seconds)


@pytest.mark.timeout(90)
async def test_a_producer_restarted_with_the_same_identity_streams_again(
    cluster_factory: Callable[[Settings], Cluster],
) -> None:
    """SIGKILL mid-stream, the consumer drops its streams within the bound, and a new
    process with the same certificate (the same InstanceId, a new epoch) opens new streams
    that deliver everything; nothing of the new epoch is taken for the old one."""
    settings = Settings()
    cluster = cluster_factory(settings)
    consumer = await cluster.start_consumer()
    first = await cluster.start_producer("producer")
    streams = await cluster.open_streams(consumer, first, 12, items=None, interval=0.02)
    killed_at = first.send_signal(signal.SIGKILL)
    dropped = await consumer.wait_ended(streams, 4 * settings.heartbeat + SLACK + 10)
    assert {record["end"] for record in dropped.values()} == PRODUCER_GONE, dropped
    _, latest = detection(dropped, killed_at)
    assert latest <= 4 * settings.heartbeat + SLACK, latest

    again = await cluster.start_producer("producer")  # the same credentials directory
    fresh = await assert_new_streams_work(cluster, consumer, again, 12)
    metrics = await consumer_metrics(consumer)
    report(
        "restart-producer",
        streams=len(streams) + fresh,
        detect_max=latest,
        stale_epoch=metrics.get("velo_streaming_mux_ingress_drops_total", 0.0),
    )


@pytest.mark.timeout(90)
async def test_a_consumer_restarted_with_the_same_identity_streams_again(
    cluster_factory: Callable[[Settings], Cluster],
) -> None:
    """SIGKILL of the consumer, its producer's senders end within the bound, and the
    consumer restarted with the same certificate on the same address serves new streams
    from the same producer process, which redials it."""
    settings = Settings()
    cluster = cluster_factory(settings)
    consumer = await cluster.start_consumer()
    producer = await cluster.start_producer("producer")
    streams = await cluster.open_streams(consumer, producer, 12, items=None, interval=0.02)
    killed_at = consumer.send_signal(signal.SIGKILL)
    ended = await producer.wait_ended(streams, CONSUMER_DEATH_BOUND + 2)
    assert {record["outcome"] for record in ended.values()} <= CONSUMER_GONE, ended
    _, latest = detection(ended, killed_at)
    assert latest <= CONSUMER_DEATH_BOUND, latest

    restarted = await cluster.start_consumer()  # the same name, so the same credentials and port
    # Today the first attaches after the restart can be refused, naming the old connection
    # ("unreachable: ... closed: Idle timeout"); an application retries an AttachRefused,
    # and so does this cell, once. The retry must work.
    refused = 0
    try:
        fresh = await assert_new_streams_work(cluster, restarted, producer, 12)
    except AttachRoundFailed as failure:
        refused = failure.refused
        fresh = await assert_new_streams_work(cluster, restarted, producer, 12)
    report(
        "restart-consumer",
        streams=len(streams) + fresh,
        detect_max=latest,
        refused_attaches=refused,
    )


BLACKHOLE = Settings(heartbeat=1.0, idle_timeout=4.0, health_check=2.0)
"""Blackhole cells use 1 s windows: while the link is cut QUIC backs its probe timeout off
(about 30 ms, doubling), so after a 1 s cut the first probe that gets through can come
almost 2 s after the cut. The chapter keeps a stream alive through less than 3 windows of
silence, so with 1 s windows a 1 s cut stays inside the bound, as it should."""


async def cut(cluster: Cluster, seconds: float) -> float:
    """Blackhole the link both ways for ``seconds``; the instant it was cut."""
    assert cluster.proxy is not None
    cluster.proxy.blackhole(True)
    cut_at = time.monotonic()
    try:
        await fault_lasts(seconds)
    finally:
        cluster.proxy.blackhole(False)
    return cut_at


async def traffic_resumed(cluster: Cluster, datagrams: int = 50) -> None:
    """Wait until the proxy forwarded ``datagrams`` more towards the consumer."""
    assert cluster.proxy is not None
    before = cluster.proxy.counters.client_to_server.forwarded
    await cluster.proxy.wait_until(
        lambda counters: counters.client_to_server.forwarded >= before + datagrams, 20
    )


@pytest.mark.timeout(90)
async def test_a_short_blackhole_keeps_every_sending_stream_alive(
    cluster_factory: Callable[[Settings], Cluster],
) -> None:
    settings = Settings(**vars(BLACKHOLE))
    cluster = cluster_factory(settings)
    consumer = await cluster.start_consumer()
    producer = await cluster.start_producer("producer")
    streams = await cluster.open_streams(consumer, producer, 16, items=None, interval=0.02)
    await cut(cluster, 1.0)
    await traffic_resumed(cluster)
    await producer.ask({"op": "finish"}, 60)
    assert_delivered(await consumer.wait_ended(streams, 30), await producer.wait_ended(streams, 5))
    assert cluster.proxy is not None
    blackholed = cluster.proxy.counters.client_to_server.dropped_blackhole
    metrics = await consumer_metrics(consumer)
    assert metrics["velo_streaming_heartbeat_watchdog_firings_total"] == 0
    report(
        "blackhole-short-sending",
        streams=len(streams),
        blackholed=blackholed,
        delivered=sum(r["items"] for r in consumer.records_of(streams)),
    )


@pytest.mark.timeout(90)
async def test_a_short_blackhole_keeps_every_idle_stream_alive(
    cluster_factory: Callable[[Settings], Cluster],
) -> None:
    """A cut of 0.8 windows (the issue's 4 s at 5 s windows, scaled to 0.5 s windows), then
    8 windows of watching the idle streams, which carry nothing but heartbeats."""
    settings = Settings()
    cluster = cluster_factory(settings)
    consumer = await cluster.start_consumer()
    producer = await cluster.start_producer("producer")
    streams = await cluster.open_streams(consumer, producer, 32, items=None, idle=True)
    await cut(cluster, 0.8 * settings.heartbeat)
    await fault_lasts(8 * settings.heartbeat)  # the span in which the race drops them
    dropped = [index for index in streams if index in consumer.records]
    await producer.ask({"op": "finish"}, 60)
    assert dropped == []
    assert_delivered(await consumer.wait_ended(streams, 30), await producer.wait_ended(streams, 5))


@pytest.mark.timeout(90)
async def test_a_blackhole_past_the_bound_ends_every_stream_and_new_streams_work(
    cluster_factory: Callable[[Settings], Cluster],
) -> None:
    """Past 4 windows and the idle timeout: the consumer's watchdogs end every stream
    within 3 to 4 windows of the cut, the producer's senders end with an error (never SENT),
    and once the link is back the same nodes stream again."""
    settings = Settings(**vars(BLACKHOLE))
    cluster = cluster_factory(settings)
    consumer = await cluster.start_consumer()
    producer = await cluster.start_producer("producer")
    streams = await cluster.open_streams(consumer, producer, 16, items=None, interval=0.02)
    cut_at = await cut(cluster, settings.idle_timeout + 1.0)
    dropped = await consumer.wait_ended(streams, 10)
    assert {record["end"] for record in dropped.values()} == PRODUCER_GONE, dropped
    for seen in dropped.values():
        assert_clean(seen)
    earliest, latest = detection(dropped, cut_at)
    assert 3 * settings.heartbeat - 0.2 <= earliest, earliest
    assert latest <= 4 * settings.heartbeat + SLACK, latest
    ended = await producer.wait_ended(streams, 2 * settings.idle_timeout + SLACK)
    assert "SENT" not in {record["outcome"] for record in ended.values()}, ended
    _, producer_latest = detection(ended, cut_at)
    refused = 0
    try:
        fresh = await assert_new_streams_work(cluster, consumer, producer)
    except AttachRoundFailed as failure:
        refused = failure.refused
        fresh = await assert_new_streams_work(cluster, consumer, producer)
    report(
        "blackhole-long",
        streams=len(streams) + fresh,
        detect_min=earliest,
        detect_max=latest,
        producer_end=producer_latest,
        refused_attaches=refused,
        producer_outcomes=sorted({r["outcome"] for r in ended.values()}),
    )


EIGHT_SECOND_CUT = Settings(heartbeat=6.0, idle_timeout=30.0, health_check=2.0)
"""An 8 s cut that every stream must survive: 3 windows of 6 s, a 30 s idle timeout, and
mux health checks every 2 s that wait 14 s for their answer, so a check runs through the
cut and is answered only once the path is back (its PING was lost: qh3's core never
resent it, and the check's failure ended every stream to the peer)."""
EIGHT_SECOND_CUT.health_check_timeout = 14.0


@pytest.mark.timeout(120)
async def test_an_eight_second_blackhole_during_a_health_check_keeps_every_stream(
    cluster_factory: Callable[[Settings], Cluster], engine: str
) -> None:
    settings = Settings(**vars(EIGHT_SECOND_CUT))
    cluster = cluster_factory(settings)
    consumer = await cluster.start_consumer()
    producer = await cluster.start_producer("producer")
    streams = await cluster.open_streams(consumer, producer, 16, items=None, interval=0.02)
    await cut(cluster, 8.0)
    await traffic_resumed(cluster)
    await producer.ask({"op": "finish"}, 60)
    assert_delivered(await consumer.wait_ended(streams, 40), await producer.wait_ended(streams, 5))
    metrics = await consumer_metrics(consumer)
    assert metrics["velo_streaming_heartbeat_watchdog_firings_total"] == 0
    produced = (await producer.ask({"op": "metrics"}))["metrics"]
    failures = produced.get("velo_streaming_mux_health_check_failures_total", 0.0)
    checks = produced.get("velo_streaming_mux_health_checks_total", 0.0)
    assert failures == 0
    report(
        f"blackhole-8s-{engine}",
        streams=len(streams),
        health_checks=checks,
        delivered=sum(r["items"] for r in consumer.records_of(streams)),
    )
