"""Two nodes on two "hosts": network namespaces joined by a veth pair.

The consumer node runs in one namespace and the producer in the other, each a child
process (``tests.procs.netns_node``) listening on its own veth address, with a
certificate issued for that address; the test process only relays the anchor handles
and reads the reports. Every test runs on both transports: the messenger mux
(``messenger-mux-v2``, the default) and the per-stream QUIC path (``quic-stream-v1``,
what nodes with the mux disabled negotiate).

The addresses (10.231.0.1 and .2/24) exist only on the two veth ends, inside the two
namespaces, so the host's interfaces, routes and addresses are never involved, and
parallel runs, each in namespaces of their own, cannot see one another.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from tests.conftest import needs_mtu_probes
from velomux_quic.ids import new_instance_id
from velomux_quic.mux.config import DISABLE_ENVS
from velomux_quic.security.certs import CertificateAuthority, issue_node_certificate
from velomux_quic.streaming.control import MESSENGER_MUX_KEY, PER_STREAM_KEY

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[2]
NODE = [sys.executable, "-m", "tests.procs.netns_node"]
CHILD_ENV = {
    **{k: v for k, v in os.environ.items() if k not in DISABLE_ENVS},
    "PYTHONUNBUFFERED": "1",
}
"""The children's environment: the transport is chosen by their ``--transport`` alone."""


@pytest.fixture(params=[MESSENGER_MUX_KEY, PER_STREAM_KEY])
def transport(request: pytest.FixtureRequest) -> str:
    """The transport both nodes of the test negotiate."""
    return str(request.param)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


@dataclass(frozen=True)
class Host:
    """One end of the pair: a namespace, its veth end and that end's address."""

    namespace: str
    device: str
    address: str

    def command(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]

    def link(self, state: str) -> None:
        ip("-n", self.namespace, "link", "set", self.device, state)

    def mtu(self, mtu: int) -> None:
        ip("-n", self.namespace, "link", "set", self.device, "mtu", str(mtu))

    def link_info(self) -> dict[str, Any]:
        info: list[dict[str, Any]] = json.loads(
            ip("-n", self.namespace, "-j", "-s", "link", "show", "dev", self.device).stdout
        )
        return info[0]


@dataclass(frozen=True)
class HostPair:
    consumer: Host
    producer: Host


def _wait_operational(hosts: tuple[Host, ...], timeout: float = 10.0) -> None:
    """Wait until both veth ends report operstate UP (the kernel may activate a device's
    queueing a moment after its carrier comes on, and drops what is sent before that).

    There is no event to wait on for this OS fact: a bounded poll.
    """
    deadline = time.monotonic() + timeout
    while True:
        states = {h.device: h.link_info().get("operstate") for h in hosts}
        if all(state == "UP" for state in states.values()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"veth ends not up after {timeout} s: {states}")
        time.sleep(0.02)


@pytest.fixture
def hosts() -> Iterator[HostPair]:
    """Two fresh namespaces joined by a veth pair; deleted, with their veth, at the end."""
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces are Linux only")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    pair = HostPair(
        consumer=Host(f"velomux-{tag}-c", "vmx-c", "10.231.0.1"),
        producer=Host(f"velomux-{tag}-p", "vmx-p", "10.231.0.2"),
    )
    created: list[str] = []
    try:
        for host in (pair.consumer, pair.producer):
            result = ip("netns", "add", host.namespace, check=False)
            if result.returncode != 0:
                if not created:
                    pytest.skip(f"`ip netns add` failed: {result.stderr.strip()}")
                raise RuntimeError(f"`ip netns add` failed: {result.stderr.strip()}")
            created.append(host.namespace)
        # Both ends are created inside the namespaces: nothing appears on the host.
        veth = ip("-n", pair.consumer.namespace, "link", "add", pair.consumer.device,
                  "type", "veth", "peer", "name", pair.producer.device,
                  "netns", pair.producer.namespace, check=False)  # fmt: skip
        if veth.returncode != 0:
            pytest.skip(f"cannot create a veth pair: {veth.stderr.strip()}")
        for host in (pair.consumer, pair.producer):
            ip("-n", host.namespace, "link", "set", "lo", "up")
            ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device)
            host.link("up")
        _wait_operational((pair.consumer, pair.producer))
        yield pair
    finally:
        leftovers: dict[str, list[str]] = {}
        for namespace in created:
            pids = ip("netns", "pids", namespace, check=False).stdout.split()
            if pids:  # a test left a child behind: end it, and fail below
                leftovers[namespace] = pids
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            ip("netns", "del", namespace, check=False)
        remaining = set(created) & set(ip("netns", "list", check=False).stdout.split())
        assert not leftovers, f"processes left in the test namespaces: {leftovers}"
        assert not remaining, f"namespaces not deleted: {remaining}"


class Child:
    """A child process whose stdout is JSON lines, read by a thread into a queue."""

    def __init__(self, name: str, argv: list[str], logs: Path) -> None:
        self.name = name
        self.stderr_path = logs / f"{name}.stderr"
        self._stderr: IO[bytes] = self.stderr_path.open("wb")
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=ROOT,
            env=CHILD_ENV,
        )
        self._lines: queue.Queue[bytes | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"{name} stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr_tail(self, limit: int = 4000) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")[-limit:]

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        """The next line, which must be the JSON object of ``event``."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"{self.name}: no {event!r} within {timeout} s; stderr:\n{self.stderr_tail()}"
            ) from None
        if line is None:
            raise AssertionError(
                f"{self.name} exited ({self.process.wait()}) before {event!r}; "
                f"stderr:\n{self.stderr_tail()}"
            )
        message: dict[str, Any] = json.loads(line)
        assert message.get("event") == event, (message, self.stderr_tail())
        return message

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} did not exit within {timeout} s; stderr:\n{self.stderr_tail()}"
            ) from None

    def stop(self) -> None:
        """Kill the process if it still runs, and always reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(10)
        assert self.process.stdout is not None
        self.process.stdout.close()
        self._stderr.close()


@contextlib.contextmanager
def children() -> Iterator[list[Child]]:
    """Every Child appended to the yielded list is stopped and reaped on the way out."""
    started: list[Child] = []
    try:
        yield started
    finally:
        for child in started:
            child.stop()


def credentials(ca: CertificateAuthority, host: Host, name: str, directory: Path) -> Path:
    issued = issue_node_certificate(ca, new_instance_id(), name=name, ip_addresses=[host.address])
    return issued.save(directory / name)


def start_consumer(
    running: list[Child],
    pair: HostPair,
    ca: CertificateAuthority,
    tmp_path: Path,
    transport: str,
    *options: str,
) -> tuple[Child, dict[str, Any]]:
    host = pair.consumer
    directory = credentials(ca, host, "consumer", tmp_path)
    consumer = Child(
        "consumer",
        host.command(*NODE, "consumer", "--credentials", str(directory), "--host", host.address,
                     "--transport", transport, *options),
        tmp_path,
    )  # fmt: skip
    running.append(consumer)
    ready = consumer.expect("ready", 30)
    assert ready["address"][0] == host.address
    return consumer, ready


def start_producer(
    running: list[Child],
    pair: HostPair,
    ca: CertificateAuthority,
    tmp_path: Path,
    transport: str,
    ready: dict[str, Any],
    *options: str,
) -> Child:
    host = pair.producer
    directory = credentials(ca, host, "producer", tmp_path)
    handles = tmp_path / "handles.json"
    handles.write_text(json.dumps(ready["handles"]))
    consumer_host, consumer_port = ready["address"]
    producer = Child(
        "producer",
        host.command(*NODE, "producer", "--credentials", str(directory), "--host", host.address,
                     "--peer", f"{ready['instance']}@{consumer_host}:{consumer_port}",
                     "--handles", str(handles), "--transport", transport, *options),
        tmp_path,
    )  # fmt: skip
    running.append(producer)
    attached = producer.expect("attached", 60)
    assert attached["transports"] == [transport]
    return producer


def exchange(
    pair: HostPair, ca: CertificateAuthority, tmp_path: Path, transport: str, *, streams: int,
    tokens: int, deadline: float, producer_options: tuple[str, ...] = (),
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """Stream ``tokens`` items on each of ``streams`` streams across the veth; both reports."""
    with children() as running:
        consumer, ready = start_consumer(
            running, pair, ca, tmp_path, transport,
            "--streams", str(streams), "--timeout", str(deadline),
        )  # fmt: skip
        producer = start_producer(
            running, pair, ca, tmp_path, transport, ready,
            "--tokens", str(tokens), "--timeout", str(deadline), *producer_options,
        )  # fmt: skip
        done = producer.expect("done", deadline)
        report = consumer.expect("report", deadline)
        assert producer.wait(30) == 0, producer.stderr_tail()
        assert consumer.wait(30) == 0, consumer.stderr_tail()
    return report, done


def total(metrics: dict[str, float], name: str) -> float:
    """The sum of a metric's samples over all its label values."""
    return sum(v for sample, v in metrics.items() if sample.partition("{")[0] == name)


def assert_complete(
    report: dict[str, Any], done: dict[str, Any], transport: str, streams: int, tokens: int
) -> None:
    results = report["streams"]
    assert len(results) == streams
    broken = {
        index: result
        for index, result in enumerate(results)
        if (result["count"], result["in_order"], result["outcome"]) != (tokens, True, "finalized")
    }
    assert not broken, (
        f"{len(broken)} of {streams} streams incomplete, e.g. {list(broken.items())[:3]}"
    )
    assert done["retired"] == {"sent": streams}
    consumer, producer = report["metrics"], done["metrics"]
    assert consumer["velo_streaming_active_anchors"] == 0
    assert consumer["velo_streaming_heartbeat_watchdog_firings_total"] == 0
    # Every item and each stream's terminal arrived as a record of the transport.
    if transport == PER_STREAM_KEY:
        assert consumer["velo_streaming_frames_received_total"] >= streams * (tokens + 1)
        assert consumer["velo_streaming_refused_streams_total"] == 0
    else:
        received = 'velo_streaming_mux_records_total{direction="received"}'
        assert consumer[received] >= streams * (tokens + 1)
        for metrics in (consumer, producer):
            assert metrics["velo_streaming_mux_live_slots"] == 0
            assert metrics["velo_streaming_mux_reader_stall_total"] == 0
            assert metrics["velo_streaming_mux_credit_lost_total"] == 0
            assert total(metrics, "velo_streaming_mux_records_dropped_total") == 0


def received_bytes(host: Host) -> int:
    return int(host.link_info()["stats64"]["rx"]["bytes"])


@pytest.mark.timeout(120)
def test_streams_cross_the_veth_link_complete_and_in_order(
    hosts: HostPair, ca: CertificateAuthority, tmp_path: Path, transport: str
) -> None:
    streams, tokens = 64, 50
    before = received_bytes(hosts.consumer)
    report, done = exchange(
        hosts, ca, tmp_path, transport, streams=streams, tokens=tokens, deadline=60
    )
    assert_complete(report, done, transport, streams, tokens)
    # The items crossed the veth: on either transport an item takes at least 13 bytes
    # (a 4-byte length, the 6-byte Item tag, the item).
    assert received_bytes(hosts.consumer) - before >= 13 * streams * tokens


@pytest.mark.timeout(90)
@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_cutting_the_link_ends_every_stream_with_sender_dropped_within_the_watchdog_bound(
    hosts: HostPair, ca: CertificateAuthority, tmp_path: Path, transport: str, side: str
) -> None:
    window, streams, first = 0.5, 16, 20
    with children() as running:
        consumer, ready = start_consumer(
            running, hosts, ca, tmp_path, transport, "--streams", str(streams),
            "--heartbeat", str(window), "--flowing", str(first), "--timeout", "30",
        )  # fmt: skip
        producer = start_producer(
            running, hosts, ca, tmp_path, transport, ready,
            "--tokens", "100000", "--interval", "0.01",
        )  # fmt: skip
        consumer.expect("flowing", 30)  # every stream delivered `first` items: mid-stream
        host = hosts.producer if side == "producer" else hosts.consumer
        cut_started = time.monotonic()
        host.link("down")
        cut = time.monotonic()
        report = consumer.expect("report", 30)
        assert producer.process.poll() is None, producer.stderr_tail()  # unreachable, not dead
        producer.stop()
        assert consumer.wait(30) == 0, consumer.stderr_tail()
    outcomes = {result["outcome"] for result in report["streams"]}
    assert outcomes == {"SenderDropped"}, report["streams"]
    assert all(r["in_order"] and r["count"] >= first for r in report["streams"])
    # The last arrival was at most a window (a heartbeat; items were more frequent) before
    # the cut, and detection lands 3 to 4 windows after the last arrival.
    elapsed = [(r["ended_at"] - cut, r["ended_at"] - cut_started) for r in report["streams"]]
    assert all(2 * window <= after and since <= 4 * window + 1.0 for after, since in elapsed), (
        elapsed
    )
    metrics = report["metrics"]
    assert metrics["velo_streaming_heartbeat_watchdog_firings_total"] == streams
    assert metrics["velo_streaming_active_anchors"] == 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_many_streams_across_the_veth_link(
    hosts: HostPair, ca: CertificateAuthority, tmp_path: Path, transport: str
) -> None:
    streams, tokens = 1024, 2000
    report, done = exchange(
        hosts, ca, tmp_path, transport, streams=streams, tokens=tokens, deadline=1200
    )
    assert_complete(report, done, transport, streams, tokens)


@pytest.mark.timeout(120)
@needs_mtu_probes
@pytest.mark.parametrize(
    ("producer_mtu", "consumer_mtu", "settled", "refused_here"),
    [
        (1500, 1500, 1452, True),  # Ethernet: the kernel refuses the 4096 probes (EMSGSIZE)
        (9000, 9000, 8972, False),  # jumbo frames under IPv4: 9000 - 20 - 8
        (9000, 1500, 1452, False),  # sent, then dropped by the far end: probes lost on the way
    ],
)
def test_the_datagram_size_settles_at_what_the_veth_path_carries(
    hosts: HostPair,
    ca: CertificateAuthority,
    tmp_path: Path,
    producer_mtu: int,
    consumer_mtu: int,
    settled: int,
    refused_here: bool,
) -> None:
    hosts.producer.mtu(producer_mtu)
    hosts.consumer.mtu(consumer_mtu)
    streams, tokens = 16, 200
    report, done = exchange(
        hosts, ca, tmp_path, MESSENGER_MUX_KEY, streams=streams, tokens=tokens, deadline=60,
        producer_options=("--settle",),
    )  # fmt: skip
    assert_complete(report, done, MESSENGER_MUX_KEY, streams, tokens)
    dialed = [c for c in done["datagrams"] if c["outbound"]]
    assert dialed and all((c["size"], c["mode"]) == (settled, "complete") for c in dialed), dialed
    metrics = done["transport_metrics"]
    acked = metrics['velo_transport_pmtu_probes_total{outcome="acked",transport="quic"}']
    lost = metrics['velo_transport_pmtu_probes_total{outcome="lost",transport="quic"}']
    assert acked >= (3 if settled > 1452 else 0)  # 4096, 8952, 8972
    assert lost >= (0 if settled > 1452 else 3)  # 4096, three times
    assert metrics['velo_transport_pmtu_black_holes_total{transport="quic"}'] == 0
    too_big = metrics['velo_transport_datagrams_too_big_total{transport="quic"}']
    assert (too_big >= 3) if refused_here else (too_big == 0), too_big
