"""Node: the one object an application holds (the Batched streaming chapter's ``Velo``).

A node is one process's endpoint in the cluster: one UDP port, one certificate, and the
layers built on them (the QUIC transport, the messenger, the anchor manager and, unless
it is disabled, the messenger mux), with one Prometheus registry for all of their
metrics. Open it for the length of a block with :func:`open_node`, the way aioquic's
``connect()`` is used (docs/getting-started.md has a whole first program);
``await Node.start(...)`` returns a running node for code that manages its lifetime
itself; it must then call :meth:`Node.close`.
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypedDict, Unpack

from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from .config import NodeConfig, warn_deprecated_variable
from .discovery import PeerDiscovery, PeerRecord
from .errors import ConfigurationError, UsageError
from .eventlog import log_event
from .ids import InstanceId, StreamAnchorHandle, WorkerId
from .messenger import Messenger, MessengerConfig, PeerRegistry
from .messenger.registry import Dispatch, Handler
from .mux.config import DISABLE_ENV, MuxConfig, switch_is_on
from .mux.transport import MuxTransport
from .ops import OpsConfig, OpsServer, PeerReadiness
from .ops.environment import warn_unknown_variables
from .ops.node_info import NodeInfoCollector
from .recordpath import IMPLEMENTATION as RECORD_PATH
from .recordpath import RecordPath
from .security.certs import NodeCredentials
from .security.rotation import CertificateSummary
from .security.startup import check_own_credentials, expiring_certificates, utc_text
from .streaming.anchor import MpscAnchor, StreamAnchor
from .streaming.control import StreamOpenTicket
from .streaming.manager import AnchorManager, StreamingConfig
from .streaming.sender import PassOutcome, StreamSender, send_pass
from .tracing import node_tracing
from .transport import TransportConfig
from .transport.batched_udp import batching_available, gso_wanted
from .transport.engine_choice import engine_features, resolve_engine
from .transport.liveness import StaticPeerLiveness

if TYPE_CHECKING:
    # The layers' snapshot types. Each layer defines its own next to its state.
    from .messenger import MessengerSnapshot
    from .mux import MuxSnapshot
    from .streaming.snapshot import StreamingSnapshot
    from .transport import TransportSnapshot

__all__ = [
    "Node",
    "NodeSnapshot",
    "RuntimeInfo",
    "open_node",
    "runtime_info",
    "warn_unknown_variables",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """What a node started in this process would run, so that a bug report, a log line or
    ``velomux --version`` can say which implementation produced it: the record path
    (compiled, or run as plain Python under ``VELOMUX_PURE_PYTHON=1``) and the QUIC engine
    that a configuration naming none gets (``VELOMUX_QUIC_ENGINE``, else aioquic).

    A node's own ``[transport] engine`` may name another engine; its snapshot
    (``node.snapshot().transport.engine``) says what that node runs."""

    version: str
    """This package's version, or ``unknown`` when it is not installed as a distribution."""
    record_path: RecordPath
    """``compiled`` or ``pure-python``: chosen once, at import."""
    quic_engine: str | None
    """The default engine here (``aioquic`` or ``qh3``), or None when it cannot be used."""
    quic_engine_version: str | None
    quic_engine_problem: str | None
    """Why the default engine cannot be used (an unknown name, qh3 not installed)."""
    engines_installed: tuple[tuple[str, str], ...]
    """Each QUIC engine package installed, with its version."""
    udp_gso: bool = False
    """The kernel here sends a train of datagrams in one call (UDP GSO), and it is not
    turned off (``VELOMUX_UDP_GSO=0``); a node's own ``[transport] gso`` may differ."""
    udp_gro: bool = False
    """The kernel here coalesces received datagrams (UDP GRO), and it is not turned off."""
    udp_batching_off: bool = False
    """``VELOMUX_UDP_GSO=0`` turns both off for nodes whose configuration leaves ``gso``
    unset (then neither is probed)."""

    def describe(self) -> str:
        """A few lines for a person: what ``velomux --version`` prints."""
        if self.quic_engine is None:
            engine = f"unusable ({self.quic_engine_problem})"
        else:
            engine = f"{self.quic_engine} {self.quic_engine_version} (default here)"
        installed = ", ".join(f"{name} {version}" for name, version in self.engines_installed)
        return "\n".join(
            (
                f"velomux_quic {self.version}",
                f"record path: {self.record_path}",
                f"QUIC engine: {engine}",
                f"engines installed: {installed or 'none'}",
                "UDP GSO/GRO: off (VELOMUX_UDP_GSO=0)"
                if self.udp_batching_off
                else f"UDP GSO: {'yes' if self.udp_gso else 'no'}, "
                f"GRO: {'yes' if self.udp_gro else 'no'}",
            )
        )


def _distribution_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def runtime_info() -> RuntimeInfo:
    """What a node started here would run (see :class:`RuntimeInfo`); it imports the
    default engine to learn its version, so call it when asked, not on a hot path."""
    engine: str | None = None
    engine_version: str | None = None
    problem: str | None = None
    try:
        features = engine_features(resolve_engine(TransportConfig()))
        engine, engine_version = features.name, features.version
    except ConfigurationError as exc:
        problem = str(exc)
    installed = tuple(
        (name, version)
        for name in ("aioquic", "qh3")
        if (version := _distribution_version(name)) is not None
    )
    batching_off = not gso_wanted(None)
    gso, gro = (False, False) if batching_off else batching_available()
    return RuntimeInfo(
        version=_distribution_version("velomux_quic") or "unknown",
        record_path=RECORD_PATH,
        quic_engine=engine,
        quic_engine_version=engine_version,
        quic_engine_problem=problem,
        engines_installed=installed,
        udp_gso=gso,
        udp_gro=gro,
        udp_batching_off=batching_off,
    )


class _NodeKeywords(TypedDict, total=False):
    """The keywords of :meth:`Node.start`, :meth:`Node.open` and :func:`open_node`, typed
    once for the three; every one is optional.

    ``host``, ``port``, ``name``, ``transport``, ``messenger``, ``streaming`` and ``mux``
    are settings: :class:`~velomux_quic.NodeConfig`'s fields by the same names, which say
    what each means. Given (not None, and ``name`` not ""), one replaces the value of the
    config the call is given, or the default: keywords come first in the rule of
    :mod:`velomux_quic.config`. The others are objects of this process, not settings.
    Type checkers read them as those calls' keywords, so a misspelt or mistyped one fails a
    checked program; at run time a keyword that is none of these raises
    :class:`~velomux_quic.errors.ConfigurationError` naming it.
    """

    host: str | None
    port: int | None
    transport: TransportConfig | None
    messenger: MessengerConfig | None
    streaming: StreamingConfig | None
    mux: MuxConfig | None
    name: str
    registry: CollectorRegistry | None
    """The Prometheus registry the node's metrics go to (a new one when absent)."""
    peers: PeerRegistry | Iterable[PeerRecord] | None
    """The nodes it knows from the start, joining the config's ``peers``: PeerRecords
    (another node's :attr:`Node.record`) or an existing :class:`~velomux_quic.PeerRegistry`
    to share."""
    discovery: PeerDiscovery | None
    """A discovery backend (a ``DirectoryPeers``, an ``EtcdPeers``), in place of the one the
    config's ``[discovery]`` would make: it publishes this node's record and finds the
    peers it is asked to reach; one that watches (``EtcdPeers``) also adds and removes
    peers as they join and leave."""
    publish: bool
    """False: use ``discovery`` to find peers without listing this node there, for a
    short-lived client such as ``velomux probe``, which others must not dial or route to
    (True when absent)."""


_OPTIONS = _NodeKeywords.__optional_keys__
_SETTINGS = ("host", "port", "name", "transport", "messenger", "streaming", "mux")
"""The keywords that are NodeConfig fields (a unit test keeps them so)."""

if TYPE_CHECKING:
    NodeOptions = _NodeKeywords
    """Deprecated: the keywords' type, when they were a second declaration of the settings."""
else:

    def __getattr__(name: str) -> object:
        # Hidden from type checkers: a module __getattr__ would make every misspelt name of
        # this module an Any to them.
        if name == "NodeOptions":
            return _deprecated_node_options(stacklevel=3)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _deprecated_node_options(stacklevel: int) -> type[_NodeKeywords]:
    """The keywords' type under its old name, warning at the line that named it."""
    warnings.warn(
        "NodeOptions is deprecated and goes in the next release: a node's settings are "
        "declared once, by NodeConfig (the keywords of open_node are its fields); build a "
        "NodeConfig, or pass the keywords directly",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return _NodeKeywords


def _check_options(call: str, options: Mapping[str, object]) -> None:
    """Refuse a keyword that is no option at the call, not when the node starts."""
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise ConfigurationError(
            f"{call}() got {', '.join(map(repr, unknown))}, which is no option; the options "
            f"are {', '.join(sorted(_OPTIONS))} (the settings among them are NodeConfig's "
            "fields)"
        )


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """What one node holds at one moment, for operators and tests (see :meth:`Node.snapshot`).

    Each layer reports its own state in its own frozen snapshot; this one adds who the
    node is and whom it knows. Taking a snapshot costs a walk over the node's live
    state: call it when you look, not per record.
    """

    instance_id: InstanceId
    worker_id: WorkerId
    address: tuple[str, int]
    peers: tuple[PeerRecord, ...]
    """Every peer the node knows an address for (added, configured or discovered)."""
    transport: TransportSnapshot
    """Connections, lanes, send backlogs and request streams."""
    messenger: MessengerSnapshot
    """Registered handlers, pending calls, staged payloads and pulls."""
    streaming: StreamingSnapshot
    """Anchors, senders and their states, pending attaches."""
    mux: MuxSnapshot | None
    """Slots per (peer, lane), binds, byte budgets; None when the node runs without a mux."""
    record_path: RecordPath
    """Which implementation of the per-record loops this process runs: ``compiled`` (the
    Cython extensions) or ``pure-python`` (the same sources run as Python, chosen with
    VELOMUX_PURE_PYTHON=1)."""


class Node:
    """A running node: streams, requests and metrics between cluster nodes.

    Open one with :func:`open_node` (``async with``) or :meth:`Node.open`, or with
    ``await Node.start(...)`` and a later :meth:`close`.

    Streams: the consumer creates an anchor (:meth:`create_anchor`,
    :meth:`create_mpsc_anchor`) and hands its ``handle`` to a producer on any node,
    which attaches a sender (:meth:`attach_anchor`, :meth:`attach_mpsc_anchor`), or opens
    the stream with no round trip from a ticket (:meth:`prebind_anchor`,
    :meth:`open_anchor_stream`).

    Requests: :meth:`register_handler` names a function peers may call;
    :meth:`send_message` (fire-and-forget) and :meth:`call` (request and answer) reach
    a peer's. This is how a frontend hands a request's handle or ticket to an engine.

    Every exception it raises on purpose derives from
    :class:`~velomux_quic.errors.VelomuxError`.

    A node is not thread-safe: use it on the thread (and event loop) it was started on;
    a method called from another raises :class:`~velomux_quic.errors.UsageError`. Other
    threads hand work over with ``asyncio.run_coroutine_threadsafe(coro, node.loop)``.

    ``messenger``, ``anchors`` and ``mux`` are the layers the node is built from, for
    advanced use (their own configuration, hooks and metrics); an application needs
    none of them.
    """

    messenger: Messenger
    """The active-message layer (handlers, calls, the peer registry)."""
    anchors: AnchorManager
    """The streaming layer (anchors, senders, attach, the per-stream QUIC path)."""
    mux: MuxTransport | None
    """The messenger mux that batches streams to a peer; None when it is disabled."""

    def __init__(
        self,
        messenger: Messenger,
        anchors: AnchorManager,
        mux: MuxTransport | None,
        *,
        name: str = "",
        credentials_dir: Path | None = None,
    ) -> None:
        """Assemble a node from running layers; applications use :meth:`start` instead.

        ``credentials_dir`` is the directory the credentials came from, which
        :meth:`reload_credentials` reads again when given no other source.
        """
        self.messenger = messenger
        self.anchors = anchors
        self.mux = mux
        self._name = name
        self._closed = False
        self._ops: OpsServer | None = None
        self._readiness: PeerReadiness | None = None
        self._configured_peers = tuple(record.instance_id for record in messenger.peers)
        self._credentials_dir = credentials_dir
        self._loop = messenger.transport.loop
        self._liveness = StaticPeerLiveness(
            messenger.transport, self._configured_peers, lost=self._static_peer_lost
        )
        self._thread = threading.get_ident()
        """The thread whose event loop runs the node: the only one that may use it."""

        # OpenTelemetry spans when the otel extra is installed; None (nothing imported,
        # no hook anywhere) otherwise.
        self._tracing = node_tracing(messenger, anchors, str(messenger.instance_id))

    # -- threads -------------------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the node runs on. A node is not thread-safe: another thread hands
        work to it with ``asyncio.run_coroutine_threadsafe(coro, node.loop)`` or
        ``node.loop.call_soon_threadsafe(...)``."""
        return self._loop

    def _static_peer_lost(self, peer: InstanceId) -> None:
        """A configured peer stopped answering: readiness must not trust its last answer."""
        if self._readiness is not None:
            self._readiness.forget(peer)

    def _on_own_thread(self) -> None:
        if threading.get_ident() != self._thread:
            raise UsageError(
                f"this node runs on its event loop's thread, and was used from thread "
                f"{threading.current_thread().name!r}: a node is not thread-safe; from another "
                "thread use asyncio.run_coroutine_threadsafe(coro, node.loop) or "
                "node.loop.call_soon_threadsafe(callback)"
            )

    def _on_own_loop(self) -> None:
        # A thread runs one loop at a time: on the node's thread with the node's loop
        # running, that loop is the one awaiting. This is checked first because
        # asyncio.get_running_loop() makes a getpid() system call (CPython 3.11), once per
        # call of the node's API.
        if threading.get_ident() == self._thread and self._loop.is_running():
            return
        self._on_own_thread()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise UsageError(
                "this node runs on another event loop than the one awaiting it: use a node "
                "on the loop it was started on (asyncio.run_coroutine_threadsafe(coro, "
                "node.loop) from elsewhere)"
            )

    @classmethod
    async def start(
        cls,
        credentials: NodeConfig | NodeCredentials | str | Path,
        **options: Unpack[_NodeKeywords],
    ) -> Node:
        """Start a node and return it running; the caller must :meth:`close` it.

        ``credentials`` is a :class:`~velomux_quic.NodeConfig` (built in code, or
        ``NodeConfig.load(path)``), which supplies the credentials, address, name, peers,
        discovery (its ``[discovery]`` section, or ``peer_directory``) and every layer's
        config. Or it is a :class:`NodeCredentials` or the directory holding ``node.pem``,
        ``node.key``, ``ca.pem`` and ``node.json`` (``velomux certs dev`` or
        :func:`~velomux_quic.ensure_dev_cluster` make one), the other settings at their
        defaults.

        ``options``: the settings among them (``host``, ``port``, ``name`` and each layer's
        config) are NodeConfig's fields and replace the config's values, as keywords do in
        :meth:`NodeConfig.load <velomux_quic.NodeConfig.load>`: keywords > environment >
        file > defaults. ``registry``, ``peers`` (joining the configured ones),
        ``discovery`` (replacing the configured one) and ``publish`` are objects of this
        process. Every one is optional.

        The environment is read where the config was loaded, not here, except the design
        chapter's rollback variable, ``VELO_MESSENGER_MUX_DISABLE=1``, which runs any
        node without the mux.

        Raises :class:`~velomux_quic.errors.CredentialsError` for missing or unusable
        credential files and :class:`~velomux_quic.errors.ConfigurationError` for a
        setting it cannot use (a mux-only node with the mux disabled, say, or a keyword
        that is not an option); nothing is left running when it raises.
        """
        _check_options("Node.start", options)
        warn_unknown_variables()  # once per process: a misspelt VELOMUX_ variable
        registry, peers = options.get("registry"), options.get("peers")
        discovery = options.get("discovery")
        publish = options.get("publish", True)
        given = {key: options.get(key) for key in _SETTINGS}
        settings = {key: value for key, value in given.items() if value not in (None, "")}
        if isinstance(credentials, NodeConfig):
            config = credentials.override(**settings)
            credentials = config.credentials
            peers = _with_configured_peers(peers, config.peer_records())
            if discovery is None:
                # [discovery] (none, directory, etcd), or the older [node] peer_directory.
                discovery = config.discovery.backend_for(config.peer_directory)
        else:
            config = NodeConfig().override(**settings)
        host, port, name = config.host, config.port, config.name
        transport, messenger = config.transport, config.messenger
        streaming, mux = config.streaming, config.mux
        credentials_dir = None
        if not isinstance(credentials, NodeCredentials):
            credentials_dir = Path(credentials)
            credentials = NodeCredentials.load(credentials_dir)
        # Refused here, as a reload refuses them, not by every peer after the node runs.
        check_own_credentials(credentials, credentials_dir)
        if peers is not None and not isinstance(peers, PeerRegistry):
            peers = PeerRegistry(peers)
        name = name or credentials.name
        node_messenger = await Messenger.start(
            credentials,
            host=host,
            port=port,
            config=messenger,
            transport_config=transport,
            registry=registry,
            peers=peers,
            discovery=discovery,
            name=name,
            publish=publish,
        )
        if mux.enabled and switch_is_on(DISABLE_ENV):
            warn_deprecated_variable(DISABLE_ENV)
        try:
            enabled = mux.effective_enabled()  # a disabled mux-only node fails here
            anchors = AnchorManager(node_messenger, streaming, per_stream=not mux.mux_only)
            mux_transport = MuxTransport(node_messenger, mux) if enabled else None
            if mux_transport is not None:
                anchors.install_transport(mux_transport)
        except BaseException:
            await node_messenger.close()
            raise
        node = cls(
            node_messenger, anchors, mux_transport, name=name, credentials_dir=credentials_dir
        )
        node._liveness.start()
        build = node.build_info
        node.registry.register(
            NodeInfoCollector(
                version=build["version"],
                engine=build["engine"],
                record_path=build["record_path"],
                credentials=lambda: node_messenger.transport.credentials,
            )
        )
        log_event(
            logger,
            logging.INFO,
            "node_start",
            instance=node.instance_id,
            name=name,
            mux=mux_transport is not None,
            peers=len(node._configured_peers),
            **build,
        )
        node._warn_expiring()
        host, port = node.address
        log_event(
            logger,
            logging.INFO,
            "node_listening",
            instance=node.instance_id,
            address=f"{host}:{port}",
            lanes=node_messenger.transport.config.lanes,
        )
        return node

    @classmethod
    def open(
        cls,
        credentials: NodeConfig | NodeCredentials | str | Path,
        **options: Unpack[_NodeKeywords],
    ) -> contextlib.AbstractAsyncContextManager[Node]:
        """``async with Node.open(...) as node:``, the same as :func:`open_node`.

        The node starts on entry (the arguments are :meth:`start`'s) and closes when
        the block ends, however it ends.
        """
        _check_options("Node.open", options)
        return _opened(lambda: cls.start(credentials, **options))

    async def __aenter__(self) -> Node:
        """``async with node:`` for a node already started: it closes when the block ends."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close the node (see :meth:`close`), whether or not the block raised."""
        await self.close()

    # -- identity and peers --------------------------------------------------------------

    @property
    def instance_id(self) -> InstanceId:
        """This node's identity, proven to peers by its certificate."""
        return self.messenger.instance_id

    @property
    def worker_id(self) -> WorkerId:
        """The 64-bit name of this node inside stream handles (a hash of its InstanceId)."""
        return self.anchors.worker_id

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) this node listens on."""
        return self.messenger.address

    @property
    def record(self) -> PeerRecord:
        """This node's :class:`PeerRecord`: give it to another node's ``peers=`` or
        :meth:`add_peer` so that node can reach this one."""
        return self.messenger.own_record(self._name)

    @property
    def build_info(self) -> dict[str, str]:
        """What this node runs, for logs, bug reports and dashboards: ``version`` (this
        package's), ``engine`` (the QUIC engine: ``aioquic`` or ``qh3``) and
        ``record_path`` (``compiled`` or ``pure-python``). The same labels are on the
        ``velomux_build_info`` gauge and in the ``node_start`` event."""
        return {
            "version": _distribution_version("velomux_quic") or "unknown",
            "engine": self.messenger.transport.engine.name,
            "record_path": RECORD_PATH,
        }

    def _warn_expiring(self) -> None:
        """A ``certificate_expiring`` event at WARNING for the node's certificate and each
        trust root that expires within ``TransportConfig.certificate_expiry_warning``."""
        window = self.messenger.transport.config.certificate_expiry_warning
        if window <= 0:
            return
        for each in expiring_certificates(self.credentials):
            if each.seconds_left < window:
                log_event(
                    logger,
                    logging.WARNING,
                    "certificate_expiring",
                    instance=self.instance_id,
                    which=each.which,
                    subject=each.subject,
                    not_after=utc_text(each.not_after),
                    days_left=f"{each.seconds_left / 86400:.1f}",
                    fix="renew it (velomux certs renew) and reload (SIGHUP, or "
                    "node.reload_credentials())",
                )

    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry holding every metric of this node."""
        return self.messenger.registry

    def add_peer(
        self, instance_id: InstanceId, address: tuple[str, int] | str, name: str = ""
    ) -> None:
        """Learn where a peer listens, so streams and requests can reach it.

        ``address`` is ``(host, port)`` or ``"host:port"`` (the form of the TOML
        configuration). It is only where to dial: the peer's identity is still proven by
        its certificate at the handshake. Adding a known peer again replaces its address.
        Raises :class:`~velomux_quic.errors.ConfigurationError` for a malformed address
        or an ``instance_id`` that is not an :class:`~velomux_quic.InstanceId`.
        Raises :class:`~velomux_quic.errors.WorkerIdCollision` if another known peer
        has the same WorkerId (practically never; the peer is refused).

        Adding a known peer at another address (it restarted there) also closes the
        connection this node dialed to the old one, which leads nowhere now; the next
        send dials the new address. Discovery treats a peer that moved the same way.
        """
        self._on_own_thread()
        self.messenger.add_peer(instance_id, address, name)

    def remove_peer(self, instance_id: InstanceId) -> None:
        """Evict a peer: forget its address; every stream this node produces to it ends
        (epoch death on its lanes), so its senders' cancel tokens fire and sends fail."""
        self._on_own_thread()
        self.messenger.remove_peer(instance_id)

    @property
    def peers(self) -> PeerRegistry:
        """The peers this node knows where to reach: configured, added, discovered.

        Read a record (``node.peers.get(instance_id)``), iterate them, or
        ``node.peers.subscribe(listener)`` to hear every join, move and leave as it
        happens (what ``velomux node`` prints). Change them with :meth:`add_peer` and
        :meth:`remove_peer`, which check what they are given.
        """
        return self.messenger.peers

    @property
    def discovery(self) -> PeerDiscovery | None:
        """The discovery backend the node was started with (its ``discovery=`` or its
        configuration's ``[discovery]``); None for a node with static peers only."""
        return self.messenger.discovery

    def peer_address(self, instance_id: InstanceId) -> tuple[str, int] | None:
        """Where this node dials ``instance_id``: the address it was added, configured or
        discovered at, else the one the peer's own verified connection came from (a node
        dials and listens on one UDP socket, so that is where it listens). None when
        neither is known: :meth:`resolve_peer` asks discovery."""
        self._on_own_thread()
        return self.messenger.transport.peer_address(instance_id)

    async def resolve_peer(self, instance_id: InstanceId) -> bool:
        """Whether this node knows where ``instance_id`` listens, asking discovery when it
        does not (the record discovery answers joins :attr:`peers`). False when nobody
        knows: :meth:`add_peer` it. Sends and calls do this on their own; a program that
        must know before it starts (a probe) asks here."""
        self._on_own_loop()
        return await self.messenger.resolve(instance_id)

    async def connect(self, instance_id: InstanceId) -> None:
        """Dial ``instance_id`` now and return once the mutual-TLS handshake has proven
        its certificate, asking discovery for its address first if need be.

        Sends and calls dial on their own when they need to; this is for a program that
        wants the handshake's outcome before anything else (a probe timing it, a
        startup check). Bounded by ``TransportConfig.handshake_timeout``. Raises
        :class:`~velomux_quic.errors.DialError` (``reason`` says why: the peer's
        certificate refused, ``handshake_timeout``, ``unreachable``, ...) or
        :class:`~velomux_quic.errors.PeerNotRegistered` (no address known:
        :meth:`add_peer` or discovery).
        """
        self._on_own_loop()
        await self.messenger.resolve(instance_id)
        await self.messenger.transport.connect(instance_id)

    @property
    def credentials(self) -> NodeCredentials:
        """The credentials new connections present: those the node started with, or the
        last set :meth:`reload_credentials` took (certificate, chain, trust roots)."""
        return self.messenger.transport.credentials

    # -- streams: the consumer's side ----------------------------------------------------

    def create_anchor(self, *, unattached_timeout: float | None = None) -> StreamAnchor[Any]:
        """Create a single-sender anchor: the consumer's end of one stream.

        Hand ``anchor.handle`` to the producer (in a request, say); read the items with
        ``async for item in anchor``. The anchor ends when its producer finalizes, and
        raises a :class:`~velomux_quic.errors.StreamError` subclass when the stream
        ends any other way. ``unattached_timeout`` (seconds; the streaming config's
        default when None) ends an anchor no sender attaches to in time.
        """
        self._on_own_thread()
        return self.anchors.create_anchor(unattached_timeout=unattached_timeout)

    def create_mpsc_anchor(
        self,
        *,
        max_senders: int | None = None,
        unattached_timeout: float | None = None,
        channel_capacity: int | None = None,
    ) -> MpscAnchor:
        """Create an anchor many producers write into (each item says which one sent it).

        It yields :class:`~velomux_quic.MpscItem` and, when a producer leaves or
        reports an error, :class:`~velomux_quic.MpscEvent`; one producer leaving does
        not end it. ``max_senders`` caps concurrent producers (a further attach raises
        :class:`~velomux_quic.errors.MaxSendersReached`), ``unattached_timeout`` ends it
        once no producer has been attached that long, ``channel_capacity`` bounds the
        items buffered for the consumer. None takes the streaming config's default.
        """
        self._on_own_thread()
        return self.anchors.create_mpsc_anchor(
            max_senders=max_senders,
            unattached_timeout=unattached_timeout,
            channel_capacity=channel_capacity,
        )

    def prebind_anchor(
        self, handle: StreamAnchorHandle, *, key: int | None = None
    ) -> StreamOpenTicket:
        """Bind a local anchor's mux slot now and return the ticket that opens it.

        The consumer calls this when it registers a request and sends ``ticket.encode()``
        with the handle to the producer, which opens the stream with
        :meth:`open_anchor_stream` and no attach round trip. One ticket opens one
        stream, once. ``key`` places the stream as in :meth:`attach_anchor`.

        Raises :class:`~velomux_quic.errors.TicketError` when the anchor cannot be
        pre-bound: the node runs without a mux, the anchor is an MPSC one, already
        attached or pre-bound, finished, or not this node's. Attach with
        :meth:`attach_anchor` instead in those cases.
        """
        self._on_own_thread()
        return self.anchors.prebind_anchor(handle, key=key)

    # -- streams: the producer's side ----------------------------------------------------

    async def attach_anchor(
        self, handle: StreamAnchorHandle, *, key: int | None = None
    ) -> StreamSender:
        """Attach a producer to a single-sender anchor, on this node or another.

        One round trip to the anchor's node, which settles the transport (the mux when
        both sides have it, a QUIC stream of its own otherwise). ``key`` (a u64) asks
        for lane ``splitmix64(key) % lanes``, so streams with one key to one consumer
        share a lane (a placement hint only); without it the consumer picks its least
        loaded lane.

        Raises an :class:`~velomux_quic.errors.AttachError` subclass:
        ``AnchorNotFound`` (no such anchor, or it ended), ``AlreadyAttached`` (it has a
        sender), ``WrongHandleKind`` (an MPSC handle: use :meth:`attach_mpsc_anchor`),
        ``AttachRefused`` (the anchor's node is unknown, unreachable or shares no
        transport: :meth:`add_peer` or discovery fixes the first).
        """
        self._on_own_loop()
        if self._tracing is None or not self._tracing.active():
            return await self.anchors.attach_anchor(handle, key=key)
        return await self._tracing.open_stream(
            "attach", handle, lambda: self.anchors.attach_anchor(handle, key=key)
        )

    async def attach_mpsc_anchor(
        self, handle: StreamAnchorHandle, *, key: int | None = None
    ) -> StreamSender:
        """Attach one more producer to an MPSC anchor (see :meth:`attach_anchor`).

        Raises :class:`~velomux_quic.errors.MaxSendersReached` when the anchor's
        ``max_senders`` producers are attached, and the other
        :class:`~velomux_quic.errors.AttachError` subclasses as :meth:`attach_anchor`.
        """
        self._on_own_loop()
        if self._tracing is None or not self._tracing.active():
            return await self.anchors.attach_mpsc_anchor(handle, key=key)
        return await self._tracing.open_stream(
            "attach", handle, lambda: self.anchors.attach_mpsc_anchor(handle, key=key)
        )

    async def open_anchor_stream(
        self, handle: StreamAnchorHandle, ticket: StreamOpenTicket
    ) -> StreamSender:
        """Producer side of a ticket from :meth:`prebind_anchor`: open the stream with no
        attach message (its first batch claims the pre-bound slot).

        Raises :class:`~velomux_quic.errors.TicketError` for a ticket already used,
        :class:`~velomux_quic.errors.WrongHandleKind` for an MPSC handle, and
        :class:`~velomux_quic.errors.AttachRefused` when the anchor's node is unknown
        or unreachable (:meth:`add_peer` or discovery).
        """
        self._on_own_loop()
        if self._tracing is None or not self._tracing.active():
            return await self.anchors.open_anchor_stream(handle, ticket)
        return await self._tracing.open_stream(
            "ticket", handle, lambda: self.anchors.open_anchor_stream(handle, ticket)
        )

    async def send_pass(
        self,
        pairs: Iterable[tuple[StreamSender, Any]],
        *,
        wait: bool = False,
        timeout: float | None = None,
    ) -> PassOutcome:
        """Hand a whole forward pass over in one call: ``(sender, item)`` pairs, each
        taken as ``sender.send(item)`` would take it (same credit, byte budgets, fences
        and flush policy; under ``AutoFlush`` the pass ends in one flush per peer and
        lane, under ``Manual`` call :meth:`flush_batch` after it).

        Never raises for one pair: the :class:`~velomux_quic.PassOutcome` says how many
        were taken, which were left over for lack of room (``left``, positions in pass
        order; every later pair of such a stream is left over too, so order holds) and
        which failed (``failed``: :class:`~velomux_quic.errors.ChannelClosed` for an
        ended or cancelled stream, :class:`~velomux_quic.errors.SerializationError` for
        an item MessagePack cannot encode). ``wait=True`` waits for room for the
        left-overs instead, for at most ``timeout`` seconds when given. Works for every
        sender, whatever its transport (mux, per-stream, same-node anchor).
        """
        self._on_own_loop()
        return await send_pass(pairs, wait=wait, timeout=timeout)

    def flush_batch(self) -> None:
        """Kick every mux batcher to write what is staged (one write per peer per pass).

        Call it after a pass that sent one record to many streams (a decode step, say)
        under ``MuxConfig(flush_policy=Manual())``; under the default ``AutoFlush`` it
        only writes sooner. Never blocks, never fails; without a mux it does nothing.
        """
        self._on_own_thread()
        if self.mux is not None:
            self.mux.flush_batch()

    # -- requests: the application's own active messages -----------------------------------

    def register_handler(
        self, name: str, handler: Handler, *, dispatch: Dispatch | None = None
    ) -> None:
        """Let peers call ``handler`` by ``name`` (with :meth:`send_message` or :meth:`call`).

        ``handler`` takes a :class:`~velomux_quic.Context` (``ctx.sender`` is the
        caller's InstanceId, proven by its certificate; ``ctx.payload`` the request
        bytes) and returns the answer's bytes, or None for an empty answer. It may be a
        plain function or a coroutine function. An exception it raises reaches a
        :meth:`call`-er as :class:`~velomux_quic.errors.HandlerFailed`.

        ``dispatch`` says how requests are run:

        - ``"inline"`` (the default for a plain function): on the receive path, in
          arrival order. It must not block; it may not be a coroutine function.
        - ``"ordered"`` (the default for a coroutine function): one at a time per
          (sender, lane), in arrival order, while other senders go on. A handler that
          awaits therefore serialises one sender's requests: a frontend's requests
          wait for each other. Measured here, first-token p50 of streams opened by an
          awaiting handler was 196-353 ms under ``"ordered"`` against 49-78 ms under
          ``"spawn"``.
        - ``"spawn"``: every request in a task of its own, concurrently, in no order.
          Use it for a handler that awaits (opens a stream, streams tokens, calls
          another node).

        Raises :class:`~velomux_quic.errors.HandlerExists` when ``name`` is taken or
        starts with ``_`` (reserved for the library's own handlers).
        """
        self._on_own_thread()
        self.messenger.register(name, handler, dispatch=dispatch)
        if self._tracing is not None:
            self._tracing.serve(name)

    async def send_message(
        self, peer: InstanceId, name: str, payload: bytes | bytearray | memoryview = b""
    ) -> None:
        """Send ``payload`` to the handler ``name`` of ``peer``, fire-and-forget.

        Returns once the transport took the message (it waits only for room on the
        connection); no answer comes back, and a failure after that point (no such
        handler, the handler raised) is logged by the peer, not reported here. Payloads
        of any size are accepted (large ones travel through rendezvous). Raises a
        :class:`~velomux_quic.errors.TransportError` subclass when the message cannot
        be sent (``PeerNotRegistered``: :meth:`add_peer` or discovery).
        """
        self._on_own_loop()
        headers = None if self._tracing is None else self._tracing.message_headers()
        await self.messenger.am_send(peer, name, payload, headers=headers)

    async def call(
        self,
        peer: InstanceId,
        name: str,
        payload: bytes | bytearray | memoryview = b"",
        *,
        timeout: float | None = None,
    ) -> bytes:
        """Call the handler ``name`` of ``peer`` with ``payload`` and return its answer.

        ``timeout`` (seconds) bounds the whole call; None takes the messenger's
        ``MessengerConfig.default_timeout`` (30 s unless configured). Raises a
        :class:`~velomux_quic.errors.CallError` subclass:
        ``UnknownHandler`` (the peer registered no such name), ``HandlerFailed`` (it
        raised; ``remote_message`` says what), ``RemoteRefused`` (malformed or too
        large for the peer), ``UnaryTimeout`` (no answer in time; the handler may still
        run), ``PeerGone`` (unreachable, or its connection died meanwhile), or
        ``MessengerClosed`` (this node is closing).
        """
        self._on_own_loop()
        if self._tracing is None or not self._tracing.active():
            return await self.messenger.unary(peer, name, payload, timeout=timeout)
        return await self._tracing.call(
            peer, name, lambda: self.messenger.unary(peer, name, payload, timeout=timeout)
        )

    # -- credentials ---------------------------------------------------------------------

    def reload_credentials(
        self, source: NodeCredentials | str | Path | None = None
    ) -> CertificateSummary:
        """Take a renewed certificate, key or trust roots without a restart.

        ``source`` is a :class:`NodeCredentials` or a credentials directory; None reads
        the directory the node was started from again. New connections, dialed and
        accepted, use the new set; connections already open keep theirs until they end,
        so streams in flight are not disturbed. Returns the new certificate's summary
        (serial, fingerprint, not-after), which ``snapshot().transport.certificate``
        reports from then on.

        Raises :class:`~velomux_quic.errors.CredentialsError`, and the node keeps the
        credentials it had, when a file is missing or unreadable, the key does not match
        the certificate, the InstanceId or trust domain differs from the running node's
        (restart for that), the certificate is expired or not yet valid, or it does not
        chain to one of the new trust roots.
        """
        self._on_own_thread()
        if self._closed:
            raise UsageError("the node is closed; there is nothing to reload")
        if source is None:
            if self._credentials_dir is None:
                raise UsageError(
                    "this node was started from NodeCredentials, not a directory: pass the "
                    "new NodeCredentials or a credentials directory to reload_credentials"
                )
            source = self._credentials_dir
        summary = self.messenger.transport.reload_credentials(source)
        self._warn_expiring()
        return summary

    # -- introspection -------------------------------------------------------------------

    def snapshot(self) -> NodeSnapshot:
        """A frozen picture of the node and each of its layers, for operators and tests.

        Costs a walk over live state (connections, slots, anchors): call it when looking,
        never per record.
        """
        self._on_own_thread()
        return NodeSnapshot(
            instance_id=self.instance_id,
            worker_id=self.worker_id,
            address=self.address,
            peers=tuple(self.messenger.peers),
            transport=self.messenger.transport.snapshot(),
            messenger=self.messenger.snapshot(),
            streaming=self.anchors.snapshot(),
            mux=self.mux.snapshot() if self.mux is not None else None,
            record_path=RECORD_PATH,
        )

    def metrics_text(self) -> str:
        """The node's metrics in the Prometheus text format (what a scrape would read)."""
        return generate_latest(self.registry).decode()

    async def serve_ops(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        config: OpsConfig | None = None,
        required_peers: Iterable[InstanceId] | None = None,
    ) -> tuple[str, int]:
        """Serve ``/metrics``, ``/healthz`` and ``/readyz`` over HTTP on ``host:port``.

        Off until called; returns the bound address (port 0: any free port) and the
        listener closes with the node. ``/readyz`` answers 200 when the endpoint is bound,
        the discovery backend (one that reports ``connected``) is connected, and every
        peer of ``required_peers`` is reachable; by default those are the peers the node
        was started with (``peers=``), the statically configured ones. ``config`` bounds
        the listener (request size, read timeout, connections; see
        :class:`~velomux_quic.OpsConfig`). Raises
        :class:`~velomux_quic.errors.ConfigurationError` when the address cannot be
        bound, :class:`~velomux_quic.errors.UsageError` when already serving or closed.
        """
        self._on_own_loop()
        if self._closed:
            raise UsageError("the node is closed; start a new one to serve its endpoints")
        if self._ops is not None:
            raise UsageError(f"operations endpoints already served on {self._ops.address}")
        config = config or OpsConfig()
        discovery = self.messenger.discovery
        transport = self.messenger.transport

        def connected_peers() -> set[InstanceId]:
            return {
                c.peer
                for c in transport.snapshot().connections
                if c.outbound and c.peer is not None and c.state == "established"
            }

        def discovery_connected() -> bool:
            return bool(getattr(discovery, "connected", True))

        readiness = PeerReadiness(
            required_peers=self._configured_peers if required_peers is None else required_peers,
            health=self.messenger,
            endpoint_bound=lambda: not self._closed and not transport.closing,
            connected_peers=connected_peers,
            discovery_connected=discovery_connected if discovery is not None else None,
            config=config,
        )
        server = OpsServer(
            self.registry,
            readiness.evaluate,
            config=config,
            identity={"instance_id": str(self.instance_id), "name": self._name, **self.build_info},
        )
        address = await server.start(host, port)
        self._ops, self._readiness = server, readiness
        return address

    @property
    def ops_address(self) -> tuple[str, int] | None:
        """Where :meth:`serve_ops` listens, None when the node serves no endpoints."""
        return self._ops.address if self._ops is not None else None

    # -- shutdown ------------------------------------------------------------------------

    async def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for this node's open streams to finish, for a
        graceful stop (SIGTERM): call it, then :meth:`close`. True when every sender
        handed over its terminal and every terminal left; False when some were still
        open (``close`` then ends them on the wire)."""
        self._on_own_loop()
        began = time.monotonic()
        drained = await self.anchors.drain(timeout)
        log_event(
            logger,
            logging.INFO,
            "node_drain",
            instance=self.instance_id,
            drained=drained,
            seconds=f"{time.monotonic() - began:.3f}",
        )
        return drained

    async def close(self) -> None:
        """End the node's streams, then close its messenger and transport.

        Streams this node produces end on the wire at once: what was finalized is flushed
        (up to ``StreamingConfig.close_flush_timeout``), and every stream still open ends
        with a shutdown terminal, so its consumer raises
        :class:`~velomux_quic.errors.SenderDropped` saying the producer shut down within
        a round trip, not after its watchdog. Anchors of this node end with
        :class:`~velomux_quic.errors.StreamCancelled`, its senders' sends fail, pending
        calls fail with ``MessengerClosed``. Closing twice is harmless.
        """
        self._on_own_loop()
        if self._closed:
            return
        self._closed = True
        await self._liveness.close()
        if self._ops is not None:
            await self._ops.close()
        if self._readiness is not None:
            await self._readiness.close()
        await self.anchors.close()
        await self.messenger.close()
        log_event(logger, logging.INFO, "node_close", instance=self.instance_id)


def open_node(
    credentials: NodeConfig | NodeCredentials | str | Path, **options: Unpack[_NodeKeywords]
) -> contextlib.AbstractAsyncContextManager[Node]:
    """Open a node for the length of an ``async with`` block::

        async with open_node("certs/dev/node-a", peers=[engine_record]) as node:
            ...

    The node starts on entry and closes when the block ends, however it ends. The
    arguments are those of :meth:`Node.start` (a NodeConfig or credentials, and keywords), which
    says what each means and what starting raises. Use ``await Node.start(...)`` to
    manage the lifetime yourself.
    """
    _check_options("open_node", options)
    return Node.open(credentials, **options)


def _with_configured_peers(
    peers: PeerRegistry | Iterable[PeerRecord] | None, configured: list[PeerRecord]
) -> PeerRegistry | Iterable[PeerRecord] | None:
    """The peers a NodeConfig names, added to those given as an argument."""
    if not configured:
        return peers
    if peers is None:
        return configured
    if isinstance(peers, PeerRegistry):
        for record in configured:
            peers.add(record)
        return peers
    return [*peers, *configured]


_NOT_ENTERED = (
    "open_node() and Node.open() return a context manager, not a node: write "
    "`async with open_node(...) as node:`, or `node = await Node.start(...)` and "
    "`await node.close()` when done"
)


class _Opened(contextlib.AbstractAsyncContextManager[Node]):
    """Start a node on entry (not before: an unentered block leaves nothing behind) and
    close it on exit. Used as if it were the node (an attribute read, an ``await``), it
    says how to open one, instead of an AttributeError about a context manager."""

    __slots__ = ("_node", "_start")

    def __init__(self, start: Callable[[], Awaitable[Node]]) -> None:
        self._start = start
        self._node: Node | None = None

    async def __aenter__(self) -> Node:
        if self._node is not None:
            raise UsageError("this open_node() block was entered already; open a new one")
        self._node = await self._start()
        return self._node

    async def __aexit__(self, *exc: object) -> None:
        if self._node is not None:
            await self._node.close()

    def __enter__(self) -> NoReturn:
        raise UsageError(f"{_NOT_ENTERED} (a plain `with` was used: the block needs `async with`)")

    def __exit__(self, *exc: object) -> None:
        """Never reached (``__enter__`` raises); present so ``with`` reaches ``__enter__``."""

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):  # protocol probes (copy, inspect) expect AttributeError
            raise AttributeError(name)
        raise UsageError(f"{_NOT_ENTERED} (read .{name} of the context manager)")

    def __await__(self) -> Generator[Any, None, NoReturn]:
        raise UsageError(_NOT_ENTERED)


def _opened(start: Callable[[], Awaitable[Node]]) -> contextlib.AbstractAsyncContextManager[Node]:
    return _Opened(start)
