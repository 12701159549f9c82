"""How a node finds the others, as configured: its static peers and its ``[discovery]``
section, and the backend that section describes.

:class:`PeerEntry` is one ``[[peers]]`` table (a static peer); :class:`DiscoveryConfig`
is the ``[discovery]`` section (none, a shared directory, or etcd) and builds its backend
(:meth:`DiscoveryConfig.backend_for`) when the node starts. Both validate on
construction, so a node's configuration in hand is a usable one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigurationError, PeerRecordError
from ..ids import InstanceId
from .backend import PeerDiscovery
from .directory import DirectoryPeers
from .etcd import DEFAULT_ETCD_PREFIX, DEFAULT_LEASE_TTL, EtcdPeers, parse_endpoint
from .records import PeerRecord

__all__ = ["DISCOVERY_BACKENDS", "DiscoveryConfig", "PeerEntry"]


@dataclass(frozen=True, slots=True)
class PeerEntry:
    """One statically configured peer: who it is (its certificate's InstanceId) and where."""

    instance_id: str
    """The peer's InstanceId (the UUID in its certificate's URI SAN)."""
    address: str
    """``host:port`` where it listens."""
    name: str = ""
    """A label for logs and records."""

    def record(self) -> PeerRecord:
        """The PeerRecord this entry describes; ConfigurationError when it is malformed."""
        host, sep, port = self.address.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigurationError(f"address must be host:port, got {self.address!r}")
        try:
            return PeerRecord(
                InstanceId.parse(self.instance_id), (host.strip("[]"), int(port)), self.name
            )
        except PeerRecordError as error:
            raise ConfigurationError(str(error)) from None
        except (ValueError, TypeError) as error:
            raise ConfigurationError(f"instance_id is not a UUID: {error}") from None


DISCOVERY_BACKENDS = ("none", "directory", "etcd")
"""The values of ``[discovery] backend``."""


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """How a node finds the other nodes: the ``[discovery]`` section.

    ``backend = "none"`` (the default) is static peers only (``[[peers]]``, ``add_peer``;
    ``[node] peer_directory`` still selects a directory, as before). ``"directory"`` is
    :class:`~velomux_quic.DirectoryPeers` on ``directory``, for the processes of one host.
    ``"etcd"`` is :class:`~velomux_quic.EtcdPeers`: a leased key per node under
    ``etcd_prefix`` on the etcd cluster at ``etcd_endpoints``, watched, with TLS when
    ``etcd_ca`` is set (and a client certificate with ``etcd_cert`` and ``etcd_key``).
    Validated on construction; files are read when the node starts.
    """

    backend: str = "none"
    """``"none"``, ``"directory"`` or ``"etcd"``."""
    directory: str | None = None
    """The shared directory of ``backend = "directory"`` (required there, unused elsewhere)."""
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    """``host:port`` of each etcd member, tried in turn."""
    etcd_prefix: str = DEFAULT_ETCD_PREFIX
    """Key prefix of the records: ``<etcd_prefix>/<instance-uuid>``."""
    lease_ttl: int = DEFAULT_LEASE_TTL
    """Seconds of the record's lease: how long a killed node stays listed, at most."""
    etcd_ca: str | None = None
    """CA file that verifies etcd's certificate; set, the connection is TLS."""
    etcd_cert: str | None = None
    """This node's client certificate for etcd's ``--client-cert-auth`` (with ``etcd_key``)."""
    etcd_key: str | None = None
    """The private key of ``etcd_cert``."""

    def __post_init__(self) -> None:
        if self.backend not in DISCOVERY_BACKENDS:
            raise ConfigurationError(
                f"backend must be one of {', '.join(map(repr, DISCOVERY_BACKENDS))}, "
                f"got {self.backend!r}"
            )
        if self.backend == "directory" and not self.directory:
            raise ConfigurationError('directory: backend = "directory" needs a directory path')
        if self.directory is not None and self.backend != "directory":
            raise ConfigurationError(
                f'directory is used only with backend = "directory" (backend is '
                f"{self.backend!r}): remove it or change the backend"
            )
        if not isinstance(self.etcd_endpoints, tuple):
            raise ConfigurationError(
                f"etcd_endpoints must be a list of host:port, got {self.etcd_endpoints!r}"
            )
        if not self.etcd_endpoints:
            raise ConfigurationError("etcd_endpoints must name at least one host:port")
        for endpoint in self.etcd_endpoints:
            try:
                parse_endpoint(endpoint)
            except ConfigurationError:
                raise ConfigurationError(f"etcd_endpoints: {endpoint!r} is not host:port") from None
        prefix = self.etcd_prefix
        if not isinstance(prefix, str) or not prefix.startswith("/") or not prefix.strip("/"):
            raise ConfigurationError(
                f"etcd_prefix must be an absolute key path such as {DEFAULT_ETCD_PREFIX!r}, "
                f"got {prefix!r}"
            )
        ttl = self.lease_ttl
        if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= 86400:
            raise ConfigurationError(
                f"lease_ttl must be a whole number of seconds, 1 to 86400, got {ttl!r}"
            )
        if (self.etcd_cert is None) != (self.etcd_key is None):
            raise ConfigurationError(
                "etcd_cert and etcd_key: give both (the client certificate and its key) or neither"
            )

    def backend_for(self, peer_directory: str | None = None) -> PeerDiscovery | None:
        """The discovery backend this section describes (None for ``"none"``), or the
        :class:`DirectoryPeers` of a ``[node] peer_directory``; ConfigurationError when a
        file it names cannot be read or the etcd client is not installed."""
        if self.backend == "etcd":
            return EtcdPeers(
                self.etcd_endpoints,
                prefix=self.etcd_prefix,
                lease_ttl=self.lease_ttl,
                ca_file=self.etcd_ca,
                cert_file=self.etcd_cert,
                key_file=self.etcd_key,
            )
        if self.backend == "directory" and self.directory is not None:
            return DirectoryPeers(self.directory)
        if peer_directory is not None:
            return DirectoryPeers(peer_directory)
        return None
