"""Shared fixtures: a cluster CA, node credentials, and a recording transport handler."""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

from velomux_quic.errors import TransportError
from velomux_quic.ids import InstanceId, new_instance_id
from velomux_quic.security.certs import (
    CertificateAuthority,
    NodeCredentials,
    issue_node_certificate,
)
from velomux_quic.transport.config import TransportConfig
from velomux_quic.transport.endpoint import QuicEndpoint, TransportHandler
from velomux_quic.transport.engine_choice import engine_features, resolve_engine

if TYPE_CHECKING:
    from velomux_quic.node import Node

# hang_backstop ends a run stuck in a test pytest-timeout cannot end; run_alone keeps the
# tests marked `alone` (wall-clock ratios) from running beside others under pytest-xdist.
pytest_plugins = ["tests.hang_backstop", "tests.run_alone"]

uvloop: ModuleType | None
try:
    import uvloop
except ImportError:  # pragma: no cover - non-Linux
    uvloop = None


def pytest_configure(config: pytest.Config) -> None:
    """``VELOMUX_TEST_INSTALLED=1`` (``make test-pythons``, ``make dist-check``): the
    session tests an installed package, so one imported from this checkout is an error."""
    if os.environ.get("VELOMUX_TEST_INSTALLED") == "1":
        import velomux_quic

        package = Path(velomux_quic.__file__).resolve()
        if package.is_relative_to(Path(__file__).resolve().parent.parent):
            raise pytest.UsageError(
                f"VELOMUX_TEST_INSTALLED=1, but velomux_quic comes from the checkout "
                f"({package}): run the environment's pytest with --import-mode=append"
            )


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run every async test on uvloop (what our entry points use) and on plain asyncio.

    ``VELOMUX_TEST_LOOPS=uvloop`` (or ``asyncio``) narrows it to one loop. Tests marked
    ``one_loop`` (multi-process fault cells, whose cost is the processes' own) run on uvloop
    alone unless ``VELOMUX_TEST_LOOPS`` names the loops to use.
    """
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    wanted = os.environ.get("VELOMUX_TEST_LOOPS")
    if wanted:
        factories = {k: v for k, v in factories.items() if k in wanted.split(",")} or factories
    elif item.get_closest_marker("one_loop") is not None and "uvloop" in factories:
        factories = {"uvloop": factories["uvloop"]}
    return factories


ENGINE = engine_features(resolve_engine(TransportConfig()))
"""The QUIC engine this run's nodes use (VELOMUX_QUIC_ENGINE, else aioquic), and what it does."""

needs_stream_backpressure = pytest.mark.skipif(
    ENGINE.receive_backpressure != "stream",
    reason=f"{ENGINE.name} cannot hold one stream back alone (receive_backpressure "
    f"{ENGINE.receive_backpressure!r}): a slow lane holds its connection, a per-stream "
    "reader too far behind has its stream cut",
)
needs_mtu_probes = pytest.mark.skipif(
    not ENGINE.mtu_probes, reason=f"{ENGINE.name} cannot probe a path for a larger datagram"
)
needs_derived_reset_tokens = pytest.mark.skipif(
    ENGINE.derived_reset_tokens != "all",
    reason=f"{ENGINE.name} derives the reset token of a server's first connection ID only",
)


@pytest.fixture(scope="session")
def ca() -> CertificateAuthority:
    return CertificateAuthority.create("test cluster CA")


@pytest.fixture(scope="session")
def other_ca() -> CertificateAuthority:
    return CertificateAuthority.create("a foreign CA")


@pytest.fixture
def make_credentials(ca: CertificateAuthority) -> Callable[..., NodeCredentials]:
    def make(name: str = "node", instance: InstanceId | None = None) -> NodeCredentials:
        return issue_node_certificate(ca, instance or new_instance_id(), name=name)

    return make


class Recorder(TransportHandler):
    """Records every frame per (peer, lane); tests wait on it with an event, never a sleep."""

    def __init__(self) -> None:
        self.frames: dict[tuple[InstanceId, int], list[bytes]] = defaultdict(list)
        self.resets: list[tuple[InstanceId, int]] = []
        self.failures: list[tuple[InstanceId, int, TransportError]] = []
        self.connected: list[tuple[InstanceId, bool]] = []
        self.disconnected: list[tuple[InstanceId, bool]] = []
        self._changed = asyncio.Event()

    def frame_received(self, peer: InstanceId, lane: int, body: bytes) -> None:
        self.frames[(peer, lane)].append(body)
        self._changed.set()

    def lane_reset(self, peer: InstanceId, lane: int) -> None:
        self.resets.append((peer, lane))
        self._changed.set()

    def send_failed(self, peer: InstanceId, lane: int, error: TransportError) -> None:
        self.failures.append((peer, lane, error))
        self._changed.set()

    def peer_connected(self, peer: InstanceId, outbound: bool) -> None:
        self.connected.append((peer, outbound))
        self._changed.set()

    def peer_disconnected(self, peer: InstanceId, outbound: bool) -> None:
        self.disconnected.append((peer, outbound))
        self._changed.set()

    def changed(self) -> None:
        """Wake :meth:`wait_until`: a subclass that records more calls this after each."""
        self._changed.set()

    def count(self, peer: InstanceId | None = None) -> int:
        return sum(len(v) for (p, _), v in self.frames.items() if peer is None or p == peer)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()


NodeFactory = Callable[..., Awaitable[tuple[QuicEndpoint, Recorder]]]


@pytest.fixture
async def start_node(
    make_credentials: Callable[..., NodeCredentials],
) -> AsyncIterator[NodeFactory]:
    """Start transports that are closed (and asserted closed) when the test ends."""
    async with AsyncExitStack() as stack:

        async def start(
            name: str = "node",
            *,
            credentials: NodeCredentials | None = None,
            config: TransportConfig | None = None,
        ) -> tuple[QuicEndpoint, Recorder]:
            recorder = Recorder()
            transport = await QuicEndpoint.start(
                credentials or make_credentials(name), config=config, handler=recorder
            )
            stack.push_async_callback(transport.close)
            return transport, recorder

        yield start


async def wait_admitted(outcomes: list[object], timeout: float = 20.0) -> None:
    """Await every pending admission among ``outcomes``."""
    from velomux_quic.transport.admission import SendAdmission

    async with asyncio.timeout(timeout):
        for outcome in outcomes:
            if isinstance(outcome, SendAdmission):
                await outcome


StartNode = Callable[..., Awaitable["Node"]]


@pytest.fixture
async def start_nodes(
    make_credentials: Callable[..., NodeCredentials],
) -> AsyncIterator[StartNode]:
    """Start Nodes (transport + messenger + streaming + mux) closed when the test ends."""
    from velomux_quic.node import Node

    async with AsyncExitStack() as stack:

        async def start(name: str = "node", **options: object) -> Node:
            node = await Node.start(make_credentials(name), **options)  # type: ignore[arg-type]
            stack.push_async_callback(node.close)
            return node

        yield start
