"""Discovery on etcd v3: each node's record under a lease, and a watch on the prefix.

A node registers its :class:`~velomux_quic.discovery.PeerRecord` as the value of
``<prefix>/<instance-uuid>``, attached to a lease of ``lease_ttl`` seconds that a task
keeps alive. Closing revokes the lease, so the key goes at once; a node that dies without
closing (SIGKILL, a lost host) stops renewing, and etcd deletes the key when the lease
expires, at most ``lease_ttl`` seconds later. Every node watches the prefix and hears
joins, moves and leaves as they happen (:class:`~velomux_quic.discovery.PeerWatch`),
besides answering the pull protocol from the same view.

The store is shared, so every value is read as hostile: a value that is not a record,
larger than ``max_record_bytes``, under a key that is not a canonical InstanceId, or
naming another InstanceId than its key is ignored, logged and counted
(``velo_discovery_records_rejected_total{backend="etcd",reason}``). A well-formed record
can still lie about the address: the mutual-TLS handshake then refuses whoever answers
there, because the certificate, not the record, proves who a peer is.

Losing etcd is survivable: the node keeps its last view and its connections,
``connected`` turns False (readiness reports it), and the backend reconnects with bounded,
jittered backoff, trying the endpoints in turn. Each new session grants a new lease,
puts the record again, reads the prefix, diffs it against the view it had (peers that
left meanwhile are removed) and watches from the revision it read, so no change between
the read and the watch is missed.

The client is `aetcd <https://pypi.org/project/aetcd/>`_ (the ``etcd`` extra:
``pip install 'velomux-quic[etcd]'``), imported when an :class:`EtcdPeers` is made, so
the library works without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import random
import traceback
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..errors import ConfigurationError, PeerRecordError, UsageError
from ..ids import InstanceId
from .backend import PeerListener
from .records import PEER_RECORD_MAX_BYTES, PeerRecord

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "DEFAULT_CLOSE_TIMEOUT",
    "DEFAULT_ETCD_PREFIX",
    "DEFAULT_LEASE_TTL",
    "REJECT_REASONS",
    "EtcdPeers",
    "parse_endpoint",
]

_log = logging.getLogger(__name__)

DEFAULT_ETCD_PREFIX = "/velomux/nodes"
"""Where the records are unless configured: ``/velomux/nodes/<instance-uuid>``."""

DEFAULT_LEASE_TTL = 10
"""Seconds a SIGKILLed node's record outlives it, at most."""

DEFAULT_MAX_RECORDS = 10_000
"""Records held in the view at most: a writer flooding the prefix cannot exhaust memory."""

REJECT_REASONS = ("bad_key", "too_large", "malformed", "instance_mismatch", "too_many")
"""The ``reason`` label of ``velo_discovery_records_rejected_total``."""

DEFAULT_CLOSE_TIMEOUT = 10.0
"""Seconds :meth:`EtcdPeers.close` waits for the session to stop after cancelling it."""

_INSTALL_HINT = "pip install 'velomux-quic[etcd]'"
_MIN_BACKOFF = 0.1
_CHILD_STOP_TIMEOUT = 2.0
"""Seconds a session waits for its watch and renewal tasks to end once it cancelled them."""
_RECANCEL_INTERVAL = 0.1
_T = TypeVar("_T")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for an IPv6 literal) as a pair; ConfigurationError else."""
    if not isinstance(text, str):
        raise ConfigurationError(f"an etcd endpoint is host:port, got {text!r}")
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigurationError(f"an etcd endpoint is host:port, got {text!r}")
    return host, int(port)


def _read_file(what: str, path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigurationError(
            f"etcd {what} {path}: cannot read it ({exc.strerror}); check the path"
        ) from None


def _import_aetcd() -> Any:
    try:
        # By name: aetcd ships no type information, and an optional module is not
        # part of what a user's type checker must resolve.
        aetcd = importlib.import_module("aetcd")
    except ImportError:
        raise ConfigurationError(
            f"etcd discovery needs the aetcd client: {_INSTALL_HINT}"
        ) from None
    return aetcd


def _client_class(aetcd: Any) -> Any:
    """aetcd's Client, able to speak TLS: aetcd opens only plaintext channels itself, so
    the subclass opens a ``grpc.aio.secure_channel`` with the given credentials and sets
    up the same stubs its ``connect`` does."""
    grpc = importlib.import_module("grpc")

    class Client(aetcd.Client):  # type: ignore[misc]
        def __init__(self, *args: Any, credentials: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._velomux_credentials = credentials

        async def connect(self) -> None:
            if self._velomux_credentials is None or self._connected.is_set():
                await super().connect()
                return
            rpc, watcher = aetcd.rpc, aetcd.watcher
            target = f"{self._host}:{self._port}"
            self.channel = grpc.aio.secure_channel(
                target, self._velomux_credentials, options=list(self._options.items())
            )
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()

    return Client


async def _close_client(client: Any) -> None:
    """Close a session's client, bounded, and its gRPC channel whatever aetcd's close did.

    aetcd's close first shuts its watcher down, which can wait on a full request queue of
    a dead stream; the channel must still close, or gRPC keeps its threads and sockets.
    """
    with contextlib.suppress(Exception):
        async with asyncio.timeout(2.0):
            await asyncio.shield(client.close())
    channel = getattr(client, "channel", None)
    if channel is not None:  # aetcd's close did not get that far
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await channel.close()


class _SessionLost(Exception):
    """The watch stream ended or a renewal found the lease gone: start a new session."""


async def _rpc(call: Awaitable[_T], timeout: float) -> _T:
    """Await one etcd call, bounded (``TimeoutError`` past ``timeout``).

    ``asyncio.timeout``, never ``asyncio.wait_for``: on Python 3.11, when the call
    completes in the same turn of the loop as a cancel of the awaiting task, ``wait_for``
    returns the call's result and the cancel is lost. The renewal task lost ``close()``'s
    cancel that way, went on renewing the lease, and ``close()`` waited on it for ever.
    A call cancelled under us (the session closed its channel meanwhile) is a
    ``ConnectionError``, so only a cancel of our own task is one.
    """
    try:
        async with asyncio.timeout(timeout):
            return await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise ConnectionError("the etcd channel closed during the call") from None


async def _cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]], within: float
) -> set[asyncio.Task[Any]]:
    """Cancel ``tasks`` and wait until they end, at most ``within`` seconds; return the
    ones still running then.

    The cancel is repeated while a task runs on, because a library under it may have
    swallowed one: aetcd awaits through ``asyncio.wait_for``, which on Python 3.11 loses a
    cancel that arrives in the turn its call completes (see :func:`_rpc`). Only for tasks
    with nothing to clean up: a repeated cancel cuts a ``finally`` short.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    running = {task for task in tasks if not task.done()}
    while running:
        for task in running:
            task.cancel()
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        _, running = await asyncio.wait(running, timeout=min(remaining, _RECANCEL_INTERVAL))
    return running


def _observe_failure(task: asyncio.Task[Any]) -> None:
    """Mark a session worker's failure as retrieved, releasing its frames (the session
    raises or has logged it; see :func:`_release_frames`)."""
    if not task.cancelled() and (failure := task.exception()) is not None:
        _release_frames(failure)


def _release_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames an exception's tracebacks hold, through its
    causes and contexts.

    An error that ends a session comes back through frames that hold it: aetcd re-raises
    a failed watch stream's error from its watch iterator's ``event``, a task keeps the
    exception it ended with and the frames that raised it hold the task. Each is a cycle
    through the session's client, which keeps its gRPC channel, and so gRPC's asyncio
    machinery, until the cycle collector runs (see :meth:`EtcdPeers._run`). A logged error
    is also kept by its log record, which a handler may hold for as long as it likes (a
    test's log capture holds them to the end of the test), and the collector cannot free
    that. The backend has logged the error; its frames are of no use to anyone after that.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]


def _where(task: asyncio.Task[Any]) -> str:
    """Where a task waits, as ``function (file:line)``, for a log line about a stuck task."""
    frames = task.get_stack(limit=1)
    if not frames:
        return "an unknown place"
    code = frames[-1].f_code
    return f"{code.co_name} ({Path(code.co_filename).name}:{frames[-1].f_lineno})"


class EtcdPeers:
    """Discovery through etcd v3: a leased key per node, and a watch on the prefix.

    ``endpoints`` are ``host:port`` client URLs of the etcd cluster's members, tried in
    turn when a session fails. ``prefix`` is where the records are (one key per node:
    ``<prefix>/<instance-uuid>``); nodes that should see each other share it.
    ``lease_ttl`` (whole seconds, etcd's unit; etcd raises values below its minimum, about
    2 s with default settings) bounds how long a node that died without closing stays
    listed. ``ca_file`` verifies etcd's server certificate and switches the connection
    to TLS; ``cert_file`` and ``key_file`` are this node's client certificate for an etcd
    run with ``--client-cert-auth`` (both or neither). ``connect_timeout`` bounds how long
    :meth:`publish` waits for the first registration before it returns with
    ``connected`` False (the backend keeps trying; the node starts without etcd rather
    than not at all); ``rpc_timeout`` bounds each etcd call; the pause between sessions
    grows from 0.1 s to ``max_backoff``; ``close_timeout`` bounds how long :meth:`close`
    waits for the session to stop. A value larger than ``max_record_bytes`` is
    ignored, and the view holds at most ``max_records`` records (new ones past it are
    ignored as ``too_many``), so what the store holds cannot exhaust this process.

    Files are read here, so a wrong path fails at construction, with a
    :class:`~velomux_quic.errors.ConfigurationError` naming it; so does a missing aetcd.
    ``registry`` exports the metrics there (a node's messenger does it itself through
    :meth:`bind_metrics`). The object belongs to one event loop.
    """

    def __init__(
        self,
        endpoints: Sequence[str] = ("127.0.0.1:2379",),
        *,
        prefix: str = DEFAULT_ETCD_PREFIX,
        lease_ttl: int = DEFAULT_LEASE_TTL,
        ca_file: str | Path | None = None,
        cert_file: str | Path | None = None,
        key_file: str | Path | None = None,
        connect_timeout: float = 5.0,
        rpc_timeout: float = 5.0,
        max_backoff: float = 5.0,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
        max_record_bytes: int = PEER_RECORD_MAX_BYTES,
        max_records: int = DEFAULT_MAX_RECORDS,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        self._endpoints = [parse_endpoint(endpoint) for endpoint in endpoints]
        if not self._endpoints:
            raise ConfigurationError("etcd endpoints: give at least one host:port")
        if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.rstrip("/") == "":
            raise ConfigurationError(
                f"etcd prefix must be an absolute key path such as {DEFAULT_ETCD_PREFIX!r}, "
                f"got {prefix!r}"
            )
        if isinstance(lease_ttl, bool) or not isinstance(lease_ttl, int) or lease_ttl < 1:
            raise ConfigurationError(
                f"lease_ttl must be a whole number of seconds, at least 1, got {lease_ttl!r}"
            )
        for what, value in (
            ("connect_timeout", connect_timeout),
            ("rpc_timeout", rpc_timeout),
            ("max_backoff", max_backoff),
            ("close_timeout", close_timeout),
        ):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigurationError(f"{what} must be a positive number, got {value!r}")
        if (cert_file is None) != (key_file is None):
            raise ConfigurationError(
                "etcd client certificate: give both cert_file and key_file, or neither"
            )
        self.prefix = prefix.rstrip("/")
        """The key prefix (without a trailing slash)."""
        self.lease_ttl = lease_ttl
        """Seconds of the lease the record is attached to."""
        self._key_prefix = (self.prefix + "/").encode()
        self._connect_timeout = float(connect_timeout)
        self._rpc_timeout = float(rpc_timeout)
        self._max_backoff = float(max_backoff)
        self._close_timeout = float(close_timeout)
        self._max_record_bytes = max_record_bytes
        self._max_records = max_records
        self._aetcd = _import_aetcd()
        self._credentials: Any = None
        if ca_file is not None or cert_file is not None:
            grpc = importlib.import_module("grpc")
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=None if ca_file is None else _read_file("CA file", ca_file),
                private_key=None if key_file is None else _read_file("key file", key_file),
                certificate_chain=(
                    None if cert_file is None else _read_file("certificate file", cert_file)
                ),
            )
        self._client_type = _client_class(self._aetcd)
        self._record: PeerRecord | None = None
        self._view: dict[InstanceId, PeerRecord] = {}
        self._listeners: list[PeerListener] = []
        self._client: Any = None
        self._lease_id: int | None = None
        self._put_record: PeerRecord | None = None
        """The record put on the current lease (None: none yet)."""
        self._register_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._live = asyncio.Event()
        self._gave_up_waiting = False
        self._closing = asyncio.Event()
        """Set when :meth:`close` begins: no new session starts, the backend takes no
        record."""
        self._stopping = asyncio.Event()
        """Set by :meth:`close` once the lease is revoked: the session stops at its next
        step even if the cancel that follows is lost (see :func:`_rpc`)."""
        self._sessions = 0
        self.reconnects = 0
        """Sessions established after the first (each a reconnection to etcd)."""
        self.rejected: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
        """Records ignored, by reason (see :data:`REJECT_REASONS`)."""
        self.events: dict[str, int] = {"join": 0, "change": 0, "leave": 0}
        """Changes of the view pushed to listeners, by kind."""
        self.stuck_tasks = 0
        """Tasks still running when a bounded wait for their end gave up (each logged)."""
        self._collector = _EtcdCollector(self)
        if registry is not None:
            self.bind_metrics(registry)

    # -- state ---------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """True while a session is live: the lease is kept, the view is watched."""
        return self._live.is_set()

    @property
    def endpoints(self) -> list[str]:
        """The configured endpoints, as ``host:port``."""
        return [f"{host}:{port}" for host, port in self._endpoints]

    @property
    def view_size(self) -> int:
        """Records in the current view."""
        return len(self._view)

    def key_of(self, instance_id: InstanceId) -> str:
        """The key a node's record is stored under."""
        return f"{self.prefix}/{instance_id}"

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        """Export this backend's series in ``registry``; binding one registry twice is a no-op."""
        with contextlib.suppress(ValueError):  # already registered there
            registry.register(self._collector)

    # -- the pull protocol ---------------------------------------------------------------

    async def publish(self, record: PeerRecord) -> None:
        """Register ``record`` under a lease and keep it there until :meth:`close`.

        Starts the session on first use and waits up to ``connect_timeout`` for the
        record to be in etcd; if etcd cannot be reached by then it returns anyway, with
        ``connected`` False, and the record is put as soon as a session is live.
        """
        if self._closing.is_set():
            raise UsageError("EtcdPeers is closed: make a new one")
        self._record = record
        self._start()
        await self._wait_live()
        if self.connected and self._client is not None:
            try:
                await self._register(self._client)
            except Exception as exc:
                # The session is failing too; its next start puts the record.
                _log.warning("etcd: publishing %s failed (%r)", record.instance_id, exc)
                _release_frames(exc)  # the log record keeps exc: not the client its frames hold

    async def withdraw(self, instance_id: InstanceId) -> None:
        """Remove a node's record: ours by revoking the lease, another's by deleting it."""
        if self._record is not None and instance_id == self._record.instance_id:
            self._record = None
            await self._revoke()
            return
        client = self._client
        if client is not None and self.connected:
            await _rpc(client.delete(self.key_of(instance_id).encode()), self._rpc_timeout)

    async def lookup(self, instance_id: InstanceId) -> PeerRecord | None:
        """The record of ``instance_id`` in the watched view, None if it has none."""
        self._start()
        await self._wait_live()
        return self._view.get(instance_id)

    async def snapshot(self) -> list[PeerRecord]:
        """Every record in the watched view (the last one, while etcd is unreachable)."""
        self._start()
        await self._wait_live()
        return sorted(self._view.values(), key=lambda record: record.instance_id)

    def watch(self, listener: PeerListener) -> Callable[[], None]:
        """Tell ``listener`` every record known now, then every join, change and leave."""
        self._start()
        self._listeners.append(listener)
        for record in list(self._view.values()):
            _call(listener, record, record.instance_id)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return unsubscribe

    async def close(self) -> None:
        """Revoke the lease (our key goes at once), stop the session, close the client.

        Waits at most ``close_timeout`` for the session to stop; a session still running
        then is left behind with a warning saying where it waits, and counted in
        ``velo_discovery_stuck_tasks_total``, so a node's shutdown never hangs on etcd.
        """
        if self._closing.is_set():
            return
        self._closing.set()
        self._listeners.clear()
        with contextlib.suppress(Exception):
            # Bounded tighter than other calls: a close should not hang on a silent etcd.
            await self._revoke(timeout=min(self._rpc_timeout, 2.0))
        self._stopping.set()  # not sooner: the session's channel carries the revoke
        task, self._task = self._task, None
        self._live.clear()
        if task is None:
            return
        task.cancel()
        await asyncio.wait({task}, timeout=self._close_timeout)
        if not task.done():
            self.stuck_tasks += 1
            _log.warning(
                "etcd discovery at %s: the session did not stop within %.1f s of close(), "
                "waiting in %s; leaving it behind (its gRPC channel closes when it ends)",
                ", ".join(self.endpoints),
                self._close_timeout,
                _where(task),
            )
        elif not task.cancelled():
            task.result()  # raises what ended the session task, if anything did

    # -- the session ---------------------------------------------------------------------

    def _start(self) -> None:
        if self._closing.is_set():
            raise UsageError("EtcdPeers is closed: make a new one")
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="velomux-etcd-discovery"
            )

    async def _wait_live(self) -> None:
        """Wait (bounded) for the first session; later outages never make callers wait:
        they get the last view."""
        if self.connected or self._sessions > 0 or self._gave_up_waiting:
            return
        try:
            async with asyncio.timeout(self._connect_timeout):
                await self._live.wait()
        except TimeoutError:
            self._gave_up_waiting = True  # the next callers get the (empty) view at once
            _log.warning(
                "etcd at %s not reachable within %.1f s; going on without it and retrying",
                ", ".join(self.endpoints),
                self._connect_timeout,
            )

    async def _run(self) -> None:
        # Hold gRPC's asyncio stack for the backend's whole life: it starts and stops its
        # poller thread as its count of live channels goes 0 -> 1 -> 0, and that stop has
        # raced with the loop in some gRPC versions; without the hold, every reconnection
        # would stop and start it again.
        #
        # A channel counts until its object is freed, not until it is closed, so no
        # reference cycle may hold a client: one would keep the stack, its threads and its
        # binding to this loop after close() until the cycle collector ran, in whatever
        # loop or thread runs then. Errors make such cycles (an exception whose traceback
        # holds a frame that holds it, as asyncio.wait_for's inner task did for every
        # failed call); the session clears the frames of the error that ends it.
        aio = importlib.import_module("grpc.aio")
        aio.init_grpc_aio()
        try:
            await self._sessions_until_closed()
        finally:
            aio.shutdown_grpc_aio()

    async def _sessions_until_closed(self) -> None:
        failures = 0
        while not self._closing.is_set():
            host, port = self._endpoints[(self._sessions + failures) % len(self._endpoints)]
            client = self._client_type(
                host=host,
                port=port,
                timeout=self._rpc_timeout,
                credentials=self._credentials,
                # HTTP/2 pings on the watch stream notice a silent network loss; no
                # more often than etcd's --grpc-keepalive-min-time (5 s) allows.
                options={"grpc.keepalive_time_ms": 10000, "grpc.keepalive_timeout_ms": 5000},
            )
            established = False
            try:
                await self._session(client, f"{host}:{port}")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                established = self._client is client
                level = logging.WARNING if established or failures == 0 else logging.DEBUG
                _log.log(level, "etcd session at %s:%d ended: %r", host, port, exc)
                _release_frames(exc)
            finally:
                self._live.clear()
                self._client = None
                await _close_client(client)
            if self._closing.is_set():
                return
            failures = 0 if established else failures + 1
            delay = min(self._max_backoff, _MIN_BACKOFF * 2 ** min(failures, 16))
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))

    async def _session(self, client: Any, endpoint: str) -> None:
        timeout = self._rpc_timeout
        previous_lease = self._lease_id
        self._lease_id = None
        await _rpc(client.connect(), timeout)
        await self._register(client)
        if previous_lease is not None:
            # The record now hangs on the new lease; the old one holds nothing of ours.
            with contextlib.suppress(Exception):
                await _rpc(client.revoke_lease(previous_lease), timeout)
        listing = await _rpc(client.get_prefix(self._key_prefix), timeout)
        watch = await _rpc(
            client.watch_prefix(self._key_prefix, start_revision=listing.header.revision + 1),
            timeout,
        )
        try:
            if self._closing.is_set():
                return  # close() began while we set up: no session goes live after it
            self._resync((kv.key, kv.value) for kv in listing)
            self._client = client
            if self._sessions > 0:
                self.reconnects += 1
            self._sessions += 1
            self._live.set()
            _log.info("etcd session at %s live (%d records)", endpoint, len(self._view))
            await self._serve(client, watch, endpoint)
            if not self._stopping.is_set():
                raise _SessionLost("the watch stream ended")
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await asyncio.shield(watch.cancel())

    async def _serve(self, client: Any, watch: Any, endpoint: str) -> None:
        """Apply the watch and renew the lease until either ends (raising what ended it,
        if anything did) or :meth:`close` asks.

        Both tasks stop before this returns, however it returns: a cancel of the session
        cancels them, and one that a library under them swallowed is repeated.
        """
        loop = asyncio.get_running_loop()
        workers = {
            loop.create_task(self._consume(watch)),
            loop.create_task(self._keep_alive(client)),
        }
        for worker in workers:
            # Every worker's failure is retrieved as it ends, whatever this coroutine is
            # doing then (a cancel of the session may land while the workers stop), so
            # asyncio never logs one with a traceback that keeps the client, and gRPC's
            # poller thread, alive. Both often end with the same failure (the channel went).
            worker.add_done_callback(_observe_failure)
        stopping = loop.create_task(self._stopping.wait())
        done: set[asyncio.Task[Any]] = set()
        try:
            done, _ = await asyncio.wait({*workers, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            for task in await _cancel_and_wait(workers, _CHILD_STOP_TIMEOUT):
                self.stuck_tasks += 1
                _log.warning(
                    "etcd session at %s: a task did not stop within %.1f s of its cancel, "
                    "waiting in %s; leaving it behind",
                    endpoint,
                    _CHILD_STOP_TIMEOUT,
                    _where(task),
                )
        ended = next(
            (
                failure
                for task in done & workers
                if not task.cancelled() and (failure := task.exception()) is not None
            ),
            None,
        )
        if ended is not None:
            raise ended  # what ended the session

    async def _consume(self, watch: Any) -> None:
        async for event in watch:
            if event.kind == "PUT":
                self._put(event.kv.key, event.kv.value)
            else:
                self._delete(event.kv.key)

    async def _keep_alive(self, client: Any) -> None:
        """Renew the lease every third of its TTL; a lease found gone is granted again."""
        interval = max(0.5, self.lease_ttl / 3)
        while True:
            await asyncio.sleep(interval)
            lease_id = self._lease_id
            if lease_id is None:
                if self._record is not None:
                    await self._register(client)
                continue
            reply = await _rpc(client.refresh_lease(lease_id), self._rpc_timeout)
            if reply is None or reply.TTL <= 0:
                _log.warning("etcd lease %x expired under us: registering again", lease_id)
                if self._lease_id == lease_id:
                    self._lease_id = None
                await self._register(client)

    async def _register(self, client: Any) -> None:
        """Grant a lease if there is none and put the record on it (unless it is there)."""
        async with self._register_lock:
            record = self._record
            if record is None:
                return
            if self._lease_id is None:
                lease = await _rpc(client.lease(self.lease_ttl), self._rpc_timeout)
                self._lease_id = lease.id
                self._put_record = None
            if self._put_record == record:
                return
            key = self.key_of(record.instance_id).encode()
            await _rpc(client.put(key, _encode(record), lease=self._lease_id), self._rpc_timeout)
            self._put_record = record

    async def _revoke(self, timeout: float | None = None) -> None:
        lease_id, self._lease_id = self._lease_id, None
        self._put_record = None
        client = self._client
        if lease_id is None or client is None:
            return
        try:
            await _rpc(client.revoke_lease(lease_id), timeout or self._rpc_timeout)
        except Exception as exc:
            _log.warning("etcd: revoking lease %x failed (%r); it lapses in its TTL", lease_id, exc)
            _release_frames(exc)  # the log record keeps exc: not the client its frames hold

    # -- the view ------------------------------------------------------------------------

    def _decode(self, key: bytes, value: bytes) -> tuple[InstanceId | None, PeerRecord | None]:
        """The key's InstanceId and its record; a None record for a rejected value."""
        suffix = key[len(self._key_prefix) :]
        try:
            text = suffix.decode("ascii")
            instance_id = InstanceId.parse(text)
        except (UnicodeDecodeError, ValueError):
            self._reject("bad_key", key, "the key is not <prefix>/<instance-uuid>")
            return None, None
        if str(instance_id) != text:
            self._reject("bad_key", key, "the key's UUID is not in canonical form")
            return None, None
        if len(value) > self._max_record_bytes:
            why = f"{len(value)} bytes, more than {self._max_record_bytes}"
            self._reject("too_large", key, why)
            return instance_id, None
        try:
            record = PeerRecord.from_bytes(value)
        except PeerRecordError as exc:
            self._reject("malformed", key, str(exc))
            return instance_id, None
        if record.instance_id != instance_id:
            self._reject("instance_mismatch", key, f"the record describes {record.instance_id}")
            return instance_id, None
        return instance_id, record

    def _reject(self, reason: str, key: bytes, why: str) -> None:
        self.rejected[reason] += 1
        _log.warning("etcd: ignoring the record at %r: %s", key[:200], why)

    def _put(self, key: bytes, value: bytes) -> None:
        instance_id, record = self._decode(key, value)
        if instance_id is not None:
            # A key overwritten with junk no longer says where its node is.
            self._set(instance_id, record)

    def _delete(self, key: bytes) -> None:
        text = key[len(self._key_prefix) :].decode("ascii", errors="replace")
        try:
            instance_id = InstanceId.parse(text)
        except ValueError:
            return
        # Only the canonical key is a node's: deleting another spelling of its UUID
        # (a key the view never took) must not remove the node.
        if str(instance_id) == text:
            self._set(instance_id, None)

    def _resync(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        fresh: dict[InstanceId, PeerRecord] = {}
        for key, value in items:
            instance_id, record = self._decode(key, value)
            if instance_id is not None and record is not None:
                fresh[instance_id] = record
        for instance_id in [known for known in self._view if known not in fresh]:
            self._set(instance_id, None)
        for instance_id, record in fresh.items():
            self._set(instance_id, record)

    def _set(self, instance_id: InstanceId, record: PeerRecord | None) -> None:
        previous = self._view.get(instance_id)
        if previous == record:
            return
        if previous is None and len(self._view) >= self._max_records:
            key = self.key_of(instance_id).encode()
            self._reject("too_many", key, f"the view already holds {self._max_records} records")
            return
        if record is None:
            del self._view[instance_id]
            self.events["leave"] += 1
        else:
            self._view[instance_id] = record
            self.events["join" if previous is None else "change"] += 1
        for listener in list(self._listeners):
            _call(listener, record, instance_id)


def _encode(record: PeerRecord) -> bytes:
    return json.dumps(record.to_json(), sort_keys=True).encode()


def _call(listener: PeerListener, record: PeerRecord | None, instance_id: InstanceId) -> None:
    try:
        listener(record, instance_id)
    except Exception:
        _log.exception("etcd discovery listener %r failed for %s", listener, instance_id)


class _EtcdCollector(Collector):
    """The backend's counters as Prometheus series, read at scrape time."""

    def __init__(self, peers: EtcdPeers) -> None:
        self._peers = peers

    def collect(self) -> Iterator[Metric]:
        peers = self._peers
        connected = GaugeMetricFamily(
            "velo_discovery_connected",
            "1 while the discovery backend's session is live, else 0",
            labels=["backend"],
        )
        connected.add_metric(["etcd"], 1.0 if peers.connected else 0.0)
        yield connected
        reconnects = CounterMetricFamily(
            "velo_discovery_reconnects",
            "Sessions with the discovery store re-established after a loss",
            labels=["backend"],
        )
        reconnects.add_metric(["etcd"], peers.reconnects)
        yield reconnects
        rejected = CounterMetricFamily(
            "velo_discovery_records_rejected",
            "Records in the discovery store ignored as unusable, by reason",
            labels=["backend", "reason"],
        )
        for reason, count in peers.rejected.items():
            rejected.add_metric(["etcd", reason], count)
        yield rejected
        events = CounterMetricFamily(
            "velo_discovery_peer_events",
            "Peers that joined, changed address or record, or left, as discovery heard it",
            labels=["backend", "event"],
        )
        for event, count in peers.events.items():
            events.add_metric(["etcd", event], count)
        yield events
        stuck = CounterMetricFamily(
            "velo_discovery_stuck_tasks",
            "Tasks of the discovery backend still running when a bounded wait for their end "
            "gave up: a close() that returned before its session stopped, or a session's "
            "watch or renewal task left behind",
            labels=["backend"],
        )
        stuck.add_metric(["etcd"], peers.stuck_tasks)
        yield stuck
        peers_gauge = GaugeMetricFamily(
            "velo_discovery_peers",
            "Records in the discovery backend's current view",
            labels=["backend"],
        )
        peers_gauge.add_metric(["etcd"], peers.view_size)
        yield peers_gauge
