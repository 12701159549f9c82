"""A three-node cluster as an operator runs one: TOML files, a real etcd, probes, HTTP.

Three ``velomux node`` processes, each from its own TOML file and its own certificate (one
cluster CA), find each other through a real etcd (tests/etcd_server.py); ``velomux probe``
runs between the nodes, from probe credentials of its own on each node's host; each
node's ``/metrics`` and ``/readyz`` are scraped over HTTP; then the failure cases: hostile
records in etcd, etcd restarted under the nodes, a node stopped with SIGTERM (gone from the
others at once, long before its lease could lapse) and a node SIGKILLed (gone when its
lease lapses).

It runs twice: on loopback, and on three "hosts" in network namespaces on a bridge, with
etcd on a fourth (skipped with the reason where ``ip netns`` is unavailable). Everything a
node reports is read from its event lines (``peer_joined``, ``peer_left``...), its HTTP
endpoints or the probe's JSON; a wait with no event to wait on is a bounded poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import etcd_server as etcd_fixtures
from tests.etcd_server import EtcdServer, require_etcd
from tests.integration.test_node_command import parse_event
from velomux_quic import ensure_dev_cluster
from velomux_quic.ids import new_instance_id

pytest.importorskip("aetcd", reason="the etcd extra: pip install 'velomux-quic[etcd]'")

ROOT = Path(__file__).resolve().parents[2]
NODES = ("a", "b", "c")
LONG_TTL = 30
"""Lease of the nodes that are stopped cleanly or not at all: a leave seen sooner than this
is the node withdrawing its record, not its lease lapsing."""
SHORT_TTL = 3
"""Lease of the node that is SIGKILLed: it leaves when this lapses."""
WAIT = 30.0


@dataclass(frozen=True)
class Host:
    """Where a process runs: this host's loopback, or a namespace on the test bridge."""

    name: str
    address: str
    namespace: str | None = None

    def command(self, *argv: str) -> list[str]:
        prefix = [] if self.namespace is None else ["ip", "netns", "exec", self.namespace]
        return [*prefix, *argv]


@dataclass
class Service:
    """A running ``velomux node`` and the events it printed so far."""

    host: Host
    process: asyncio.subprocess.Process
    events: list[dict[str, str]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    reader: asyncio.Task[None] | None = None

    async def read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            self.events.append(parse_event(line.decode()))
            self.changed.set()
        self.changed.set()

    async def until(
        self, what: str, found: Callable[[list[dict[str, str]]], bool], timeout: float = WAIT
    ) -> None:
        """Wait for the event lines to satisfy ``found`` (each new line wakes the check)."""
        async with asyncio.timeout(timeout):
            while not found(self.events):
                if self.process.returncode is not None and self.reader and self.reader.done():
                    raise AssertionError(f"{self.host.name} exited before {what}: {self.events}")
                self.changed.clear()
                await self.changed.wait()

    def first(self, name: str) -> dict[str, str]:
        return next(event for event in self.events if event.get("event") == name)

    def peers(self) -> set[str]:
        """The peers it knows now, by its own peer_joined / peer_left lines."""
        known: set[str] = set()
        for event in self.events:
            if event.get("event") == "peer_joined":
                known.add(event["instance"])
            elif event.get("event") == "peer_left":
                known.discard(event["instance"])
        return known


async def run(host: Host, *argv: str, timeout: float = 60.0) -> tuple[int, str, str]:
    """One short command on ``host``; its exit status, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        *host.command(*argv), cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(timeout):
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


HTTP_GET = (
    "import sys, urllib.request, urllib.error\n"
    "try:\n"
    "    r = urllib.request.urlopen(sys.argv[1], timeout=10)\n"
    "except urllib.error.HTTPError as e:\n"
    "    r = e\n"
    "print(r.status if hasattr(r, 'status') else r.code)\n"
    "sys.stdout.write(r.read().decode())\n"
)


async def http_get(host: Host, address: str, path: str) -> tuple[int, str]:
    """GET over HTTP from inside ``host`` (the endpoints listen on its address only)."""
    status, out, err = await run(host, sys.executable, "-c", HTTP_GET, f"http://{address}{path}")
    assert status == 0, err
    code, _, body = out.partition("\n")
    return int(code), body


PUT_RECORDS = (
    "import asyncio, json, sys, aetcd\n"
    "async def main():\n"
    "    host, port = sys.argv[1].rsplit(':', 1)\n"
    "    client = aetcd.Client(host=host, port=int(port), timeout=5)\n"
    "    await client.connect()\n"
    "    for key, value in json.loads(sys.argv[2]).items():\n"
    "        await client.put(key.encode(), value.encode())\n"
    "    await client.close()\n"
    "asyncio.run(main())\n"
)


def metric_total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


class Cluster:
    """etcd, three node services and the files they start from."""

    def __init__(self, directory: Path, etcd: EtcdServer, hosts: dict[str, Host]) -> None:
        self.directory = directory
        self.etcd = etcd
        self.hosts = hosts
        self.prefix = f"/velomux-cluster/{new_instance_id()}"
        names = [f"node-{n}" for n in NODES] + [f"probe-{n}" for n in NODES]
        self.credentials = ensure_dev_cluster(directory / "certs", names)
        self.services: dict[str, Service] = {}

    def config(self, kind: str, name: str, ttl: int) -> Path:
        host = self.hosts[name]
        path = self.directory / f"{kind}-{name}.toml"
        path.write_text(
            f'[node]\ncredentials = "{self.credentials[f"{kind}-{name}"]}"\n'
            f'name = "{kind}-{name}"\nhost = "{host.address}"\nport = 0\n\n'
            f'[discovery]\nbackend = "etcd"\netcd_endpoints = ["{self.etcd.endpoint}"]\n'
            f'etcd_prefix = "{self.prefix}"\nlease_ttl = {ttl}\n'
        )
        return path

    async def start(self, name: str, ttl: int) -> Service:
        host = self.hosts[name]
        config = self.config("node", name, ttl)
        process = await asyncio.create_subprocess_exec(
            *host.command(
                sys.executable, "-m", "velomux_quic.programs.cli", "node", "--config", str(config),
                "--ops", f"{host.address}:0", "--drain-timeout", "2",
            ),
            cwd=ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        service = Service(host, process)
        service.reader = asyncio.create_task(service.read())
        self.services[name] = service
        await service.until("listening", lambda events: any(
            e.get("event") == "listening" for e in events
        ))  # fmt: skip
        assert service.first("listening")["address"].startswith(f"{host.address}:")
        return service

    def instance(self, name: str) -> str:
        return self.services[name].first("listening")["instance"]

    def ops(self, name: str) -> str:
        return self.services[name].first("listening")["ops"]

    async def probe(self, source: str, target: str, *options: str) -> dict[str, Any]:
        """``velomux probe node-<target>`` from ``source``'s host, as its own probe node."""
        config = self.config("probe", source, LONG_TTL)
        status, out, err = await run(
            self.hosts[source], sys.executable, "-m", "velomux_quic.programs.cli", "probe",
            f"node-{target}", "--config", str(config), "--json", *options,
        )  # fmt: skip
        assert status == 0, f"probe {source} -> {target} exited {status}:\n{out}\n{err}"
        report: dict[str, Any] = json.loads(out)
        return report

    async def put_records(self, records: dict[str, str]) -> None:
        """Write raw values into etcd, from the etcd host (as anyone with access could)."""
        status, _, err = await run(
            self.hosts["etcd"], sys.executable, "-c", PUT_RECORDS, self.etcd.endpoint,
            json.dumps(records),
        )  # fmt: skip
        assert status == 0, err

    async def close(self) -> None:
        for service in self.services.values():
            if service.process.returncode is None:
                service.process.kill()
            await service.process.wait()
            if service.reader is not None:
                await service.reader


async def check_cluster(cluster: Cluster, *, every_pair: bool) -> None:
    """The whole story: join, probe, scrape, hostile records, etcd restart, SIGTERM, SIGKILL."""
    for name, ttl in (("a", LONG_TTL), ("b", SHORT_TTL), ("c", LONG_TTL)):
        await cluster.start(name, ttl)
    ids = {name: cluster.instance(name) for name in NODES}
    for name, service in cluster.services.items():
        others = {ids[other] for other in NODES if other != name}
        await service.until(f"{name} learns the others", lambda _e, s=service, o=others: (
            o <= s.peers()
        ))  # fmt: skip

    # A probe between the nodes: identity proven, every record there and back.
    pairs = [(s, t) for s in NODES for t in NODES if s != t] if every_pair else [
        ("a", "b"), ("b", "c"), ("c", "a"),
    ]  # fmt: skip
    records = "400" if every_pair else "100"
    for source, target in pairs:
        report = await cluster.probe(source, target, "--streams", "4", "--records", records)
        assert report["ok"] is True, report
        assert report["identity"]["verified"] is True
        assert report["identity"]["instance_id"] == ids[target]
        delivery = report["delivery"]
        assert delivery["records_sent"] == 4 * int(records)
        assert delivery["records_lost"] == 0 and delivery["checksum_mismatches"] == 0

    # The probes looked their peers up in etcd but were never listed there.
    for service in cluster.services.values():
        names = {e.get("name", "") for e in service.events if e.get("event") == "peer_joined"}
        assert not any(name.startswith("probe-") for name in names), names
    # A probe with a running node's credentials would pass for that node: refused.
    status, out, err = await run(
        cluster.hosts["a"], sys.executable, "-m", "velomux_quic.programs.cli", "probe", "node-b",
        "--config", str(cluster.directory / "node-a.toml"), "--json",
    )  # fmt: skip
    assert status == 2 and "running node" in err, (status, out, err)

    # The endpoints: the mux series in /metrics, each node ready with discovery connected.
    for name in NODES:
        code, text = await http_get(cluster.hosts[name], cluster.ops(name), "/metrics")
        assert code == 200
        assert metric_total(text, "velo_streaming_mux_batches_total") > 0
        assert metric_total(text, "velomux_sink_echoed_records_total") > 0
        assert metric_total(text, "velo_discovery_connected", backend="etcd") == 1
        code, body = await http_get(cluster.hosts[name], cluster.ops(name), "/readyz")
        assert code == 200, body
        assert json.loads(body)["checks"]["discovery"] == "ok"

    # Hostile records: junk, and one claiming node a's InstanceId under another key with an
    # attacker's address. Both are ignored and counted; nobody is told a moved.
    forged = {"instance_id": ids["a"], "address": ["203.0.113.7", 4433], "name": "node-a"}
    junk_key, forged_key = new_instance_id(), new_instance_id()
    await cluster.put_records({
        f"{cluster.prefix}/{junk_key}": "not a record",
        f"{cluster.prefix}/{forged_key}": json.dumps(forged),
    })  # fmt: skip
    for name in ("b", "c"):
        host, address = cluster.hosts[name], cluster.ops(name)

        async def rejected(host: Host = host, address: str = address) -> float:
            _, text = await http_get(host, address, "/metrics")
            return metric_total(text, "velo_discovery_records_rejected_total", backend="etcd")

        async with asyncio.timeout(WAIT):  # no event for a dropped record: a bounded poll
            while await rejected() < 2:
                await asyncio.sleep(0.1)
        moved = [e for e in cluster.services[name].events if e.get("event") == "peer_moved"]
        assert moved == [], moved
    report = await cluster.probe("b", "a", "--streams", "2", "--records", "50")
    assert report["ok"] is True and report["identity"]["instance_id"] == ids["a"]

    # etcd restarted under the nodes: they reconnect, re-register, and the cluster works.
    await asyncio.to_thread(cluster.etcd.restart)
    for name in NODES:
        async with asyncio.timeout(WAIT):  # readiness has no event: a bounded poll
            while (await http_get(cluster.hosts[name], cluster.ops(name), "/readyz"))[0] != 200:
                await asyncio.sleep(0.2)
    report = await cluster.probe("a", "c", "--streams", "2", "--records", "50")
    assert report["ok"] is True

    # SIGTERM: c withdraws its record on the way out; the others hear it at once, long
    # before its 30 s lease could lapse.
    stopped_at = time.monotonic()
    cluster.services["c"].process.send_signal(signal.SIGTERM)
    for name in ("a", "b"):
        service = cluster.services[name]
        await service.until("c leaves", lambda _e, s=service: ids["c"] not in s.peers(), 10.0)
    assert time.monotonic() - stopped_at < LONG_TTL / 2
    assert await cluster.services["c"].process.wait() == 0

    # SIGKILL: b cannot withdraw; it leaves a's registry when its 3 s lease lapses.
    killed_at = time.monotonic()
    cluster.services["b"].process.send_signal(signal.SIGKILL)
    service = cluster.services["a"]
    await service.until("b lapses", lambda _e: ids["b"] not in service.peers(), SHORT_TTL + 15)
    # Not withdrawn (that is heard within milliseconds, as c's was) but lapsed: b renewed its
    # lease every SHORT_TTL / 3 s, so at the kill at least SHORT_TTL - SHORT_TTL / 3 s were
    # left, less however late a renewal of a process starved of CPU ran; SHORT_TTL / 3 keeps
    # a second of that lateness (a bound of SHORT_TTL - 1 s failed on a loaded machine).
    assert time.monotonic() - killed_at >= SHORT_TTL / 3


etcd_server = etcd_fixtures.etcd_server


@pytest.mark.timeout(240)
@pytest.mark.one_loop
@pytest.mark.parametrize("every_pair", [pytest.param(False, id="short"), pytest.param(
    True, id="every-pair", marks=pytest.mark.slow
)])  # fmt: skip
async def test_three_nodes_on_loopback_discover_probe_and_leave(
    tmp_path: Path, etcd_server: EtcdServer, every_pair: bool
) -> None:
    hosts = {name: Host(name, "127.0.0.1") for name in (*NODES, "etcd")}
    cluster = Cluster(tmp_path, etcd_server, hosts)
    try:
        await check_cluster(cluster, every_pair=every_pair)
    finally:
        await cluster.close()


# -- three hosts in network namespaces ----------------------------------------------------


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


@contextlib.contextmanager
def bridged_hosts(names: tuple[str, ...]) -> Iterator[dict[str, Host]]:
    """One namespace per host, each with a veth into a switch namespace's bridge
    (10.232.0.0/24); nothing appears on this machine's own interfaces. Deleted at the end,
    with anything still running in them."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need Linux, root and the `ip` command (iproute2)")
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    switch = f"vmx-{tag}-sw"
    hosts = {
        name: Host(name, f"10.232.0.{index + 1}", f"vmx-{tag}-{name}")
        for index, name in enumerate(names)
    }
    created: list[str] = []
    try:
        for namespace in (switch, *(h.namespace for h in hosts.values())):
            assert namespace is not None
            result = ip("netns", "add", namespace, check=False)
            if result.returncode != 0:
                if not created:
                    pytest.skip(f"`ip netns add` failed: {result.stderr.strip()}")
                raise RuntimeError(result.stderr.strip())
            created.append(namespace)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for index, host in enumerate(hosts.values()):
            assert host.namespace is not None
            port = f"port{index}"
            ip("-n", host.namespace, "link", "add", "eth0", "type", "veth", "peer", "name",
               port, "netns", switch)  # fmt: skip
            ip("-n", switch, "link", "set", port, "master", "br0", "up")
            ip("-n", host.namespace, "link", "set", "lo", "up")
            ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            ip("-n", host.namespace, "link", "set", "eth0", "up")
        deadline = time.monotonic() + 10
        for host in hosts.values():  # the links come up a moment later: a bounded poll
            assert host.namespace is not None
            while True:
                info = json.loads(ip("-n", host.namespace, "-j", "link", "show", "eth0").stdout)
                if info[0].get("operstate") == "UP":
                    break
                assert time.monotonic() < deadline, f"{host.name}: eth0 not up"
                time.sleep(0.02)
        yield hosts
    finally:
        leftovers: dict[str, list[str]] = {}
        for namespace in created:
            pids = ip("netns", "pids", namespace, check=False).stdout.split()
            if pids:
                leftovers[namespace] = pids
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            ip("netns", "del", namespace, check=False)
        remaining = set(created) & set(ip("netns", "list", check=False).stdout.split())
        assert not remaining, f"namespaces not deleted: {remaining}"
        assert not leftovers, f"processes left in the test namespaces: {leftovers}"


@contextlib.asynccontextmanager
async def netns_cluster(directory: Path) -> AsyncIterator[Cluster]:
    require_etcd()
    with bridged_hosts((*NODES, "etcd")) as hosts:
        etcd = EtcdServer(host=hosts["etcd"].address, namespace=hosts["etcd"].namespace)
        try:
            await asyncio.to_thread(etcd.start)
            cluster = Cluster(directory, etcd, hosts)
            try:
                yield cluster
            finally:
                await cluster.close()
        finally:
            await asyncio.to_thread(etcd.close)


@pytest.mark.netns
@pytest.mark.timeout(300)
@pytest.mark.one_loop
@pytest.mark.parametrize("every_pair", [pytest.param(False, id="short"), pytest.param(
    True, id="every-pair", marks=pytest.mark.slow
)])  # fmt: skip
async def test_three_hosts_in_namespaces_discover_probe_and_leave(
    tmp_path: Path, every_pair: bool
) -> None:
    async with netns_cluster(tmp_path) as cluster:
        await check_cluster(cluster, every_pair=every_pair)
