"""Which QUIC engine a transport runs, and how its connections are made.

``TransportConfig.engine`` names it (the node's TOML ``[transport] engine``); a node that
names none takes ``VELOMUX_QUIC_ENGINE`` from its environment, so a whole test run or a
fleet can be switched; otherwise aioquic, the default. qh3 is the optional extra
``velomux_quic[qh3]``: choosing it without it installed is a ``ConfigurationError`` that
says what to install. An :class:`EngineFactory` holds what every connection of one
transport is made from (configurations, verifier, reset key) and makes one engine per
dial or accept, so the endpoint never names an engine's classes. An engine's modules are
imported when it is chosen, not before, so a node on qh3 loads nothing of aioquic.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Protocol

from ..errors import ConfigurationError
from ..ids import InstanceId
from ..security.certs import NodeCredentials
from ..security.verify import PeerVerifier
from .config import TransportConfig
from .pmtu import plan_path
from .resets import StatelessResets
from .seam import ENGINE_NAMES, EngineFeatures, EngineName, QuicEngine

__all__ = [
    "ENGINE_ENVIRONMENT",
    "QH3_RANGE",
    "EngineFactory",
    "engine_features",
    "make_engine_factory",
    "resolve_engine",
]

ENGINE_ENVIRONMENT = "VELOMUX_QUIC_ENGINE"
"""The environment variable naming the engine of nodes whose configuration names none."""

QH3_RANGE = ">=2.1,<2.2"
"""The qh3 versions ``tests/unit/test_qh3_assumptions.py`` passes on (see pyproject.toml)."""


def resolve_engine(config: TransportConfig) -> EngineName:
    """The engine ``config`` runs: its own choice, else ``VELOMUX_QUIC_ENGINE``, else aioquic."""
    named = config.engine
    if named is None:
        named = os.environ.get(ENGINE_ENVIRONMENT, "").strip().lower()
    if not named:
        return "aioquic"
    for name in ENGINE_NAMES:
        if named == name:
            return name
    raise ConfigurationError(
        f"{ENGINE_ENVIRONMENT}={named!r} names no QUIC engine; use one of "
        f"{', '.join(ENGINE_NAMES)} (or unset it for aioquic)"
    )


def engine_features(name: EngineName) -> EngineFeatures:
    """What the engine ``name`` does (ConfigurationError when it is not installed)."""
    if name == "qh3":
        _require_qh3()
        from .qh3_engine import QH3_FEATURES

        return QH3_FEATURES
    from .aioquic_engine import AIOQUIC_FEATURES

    return AIOQUIC_FEATURES


def _require_qh3() -> None:
    try:
        version = importlib.metadata.version("qh3")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigurationError(
            "the qh3 QUIC engine is not installed: install the extra with "
            "pip install 'velomux_quic[qh3]', or choose engine = \"aioquic\" (or unset "
            "VELOMUX_QUIC_ENGINE)"
        ) from None
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) != (2, 1):
        raise ConfigurationError(
            f"qh3 {version} is installed, but this velomux_quic is tested with qh3 "
            f"{QH3_RANGE}: pip install 'velomux_quic[qh3]' gets a tested version"
        )


class EngineFactory(Protocol):
    """Makes the engines of one transport's connections (see the module docstring)."""

    @property
    def features(self) -> EngineFeatures: ...

    @property
    def supported_versions(self) -> list[int]: ...

    def client(self, expected_peer: InstanceId, local: str, remote: str) -> QuicEngine: ...

    def server(
        self,
        original_cid: bytes,
        retry_source_cid: bytes | None,
        local: str,
        remote: str,
    ) -> QuicEngine: ...


class _AioquicFactory:
    def __init__(
        self,
        credentials: NodeCredentials,
        config: TransportConfig,
        verifier: PeerVerifier,
        resets: StatelessResets,
    ) -> None:
        from ..security.tls import make_quic_configuration
        from .aioquic_engine import AIOQUIC_FEATURES

        self.features = AIOQUIC_FEATURES
        self._config = config
        self._verifier = verifier
        self._resets = resets
        self._client, self._server = (
            make_quic_configuration(
                credentials,
                is_client=is_client,
                max_datagram_size=config.base_datagram_size,
                idle_timeout=config.idle_timeout,
                max_stream_data=config.stream_window,
                max_data=config.connection_window,
            )
            for is_client in (True, False)
        )
        self.supported_versions = list(self._server.supported_versions)

    def client(self, expected_peer: InstanceId, local: str, remote: str) -> QuicEngine:
        from .aioquic_engine import EngineConnection

        return EngineConnection(
            configuration=self._client,
            verifier=self._verifier,
            peer_role="server",
            expected_peer=expected_peer,
            max_concurrent_streams=self._config.max_concurrent_streams,
            resets=self._resets,
        )

    def server(
        self, original_cid: bytes, retry_source_cid: bytes | None, local: str, remote: str
    ) -> QuicEngine:
        from .aioquic_engine import EngineConnection

        return EngineConnection(
            configuration=self._server,
            original_destination_connection_id=original_cid,
            retry_source_connection_id=retry_source_cid,
            verifier=self._verifier,
            peer_role="client",
            expected_peer=None,
            max_concurrent_streams=self._config.max_concurrent_streams,
            resets=self._resets,
        )


class _Qh3Factory:
    """qh3 fixes a connection's datagram size when it is made, so each connection's
    configuration is made from its path plan (the size aioquic would switch to once
    established; a path MTU search stays at its base size)."""

    def __init__(
        self,
        credentials: NodeCredentials,
        config: TransportConfig,
        verifier: PeerVerifier,
        resets: StatelessResets,
    ) -> None:
        from .qh3_engine import QH3_FEATURES

        self.features = QH3_FEATURES
        self.supported_versions = [1]
        self._credentials = credentials
        self._config = config
        self._verifier = verifier
        self._resets = resets

    def _datagram_size(self, local: str, remote: str) -> int:
        return plan_path(self._config, local, remote, self.features.loopback_datagram_size).size

    @property
    def _stream_window(self) -> int:
        """The receive credit qh3's core grants every stream: ``lane_window`` where that is
        larger than ``stream_window``. The core has one window for all streams and no call
        to raise one stream's (aioquic's lanes are raised to ``lane_window`` as they open),
        and a lane held to ``stream_window`` moves at most that much a round trip: 64 KiB
        over a 20 ms path is 3 MB/s. A per-stream stream gets the same credit; what its
        reader has not taken is still bounded by its hold and cut (a ``per_stream_window``
        ahead, ``READER_LAG_WINDOWS`` of them) and by ``connection_window``."""
        config = self._config
        return max(config.stream_window, config.lane_window)

    def client(self, expected_peer: InstanceId, local: str, remote: str) -> QuicEngine:
        from ..security.qh3_tls import make_qh3_configuration
        from .qh3_engine import Qh3Connection

        config = self._config
        return Qh3Connection(
            configuration=make_qh3_configuration(
                self._credentials,
                is_client=True,
                max_datagram_size=self._datagram_size(local, remote),
                idle_timeout=config.idle_timeout,
                max_stream_data=self._stream_window,
                max_data=config.connection_window,
            ),
            verifier=self._verifier,
            peer_role="server",
            expected_peer=expected_peer,
            max_concurrent_streams=config.max_concurrent_streams,
            resets=self._resets,
        )

    def server(
        self, original_cid: bytes, retry_source_cid: bytes | None, local: str, remote: str
    ) -> QuicEngine:
        from ..security.qh3_tls import make_qh3_configuration
        from .qh3_engine import Qh3Connection

        config = self._config
        return Qh3Connection(
            configuration=make_qh3_configuration(
                self._credentials,
                is_client=False,
                max_datagram_size=self._datagram_size(local, remote),
                idle_timeout=config.idle_timeout,
                max_stream_data=self._stream_window,
                max_data=config.connection_window,
            ),
            original_destination_connection_id=original_cid,
            retry_source_connection_id=retry_source_cid,
            verifier=self._verifier,
            peer_role="client",
            expected_peer=None,
            max_concurrent_streams=config.max_concurrent_streams,
            resets=self._resets,
        )


def make_engine_factory(
    credentials: NodeCredentials,
    config: TransportConfig,
    verifier: PeerVerifier,
    resets: StatelessResets,
) -> EngineFactory:
    """The factory of the engine ``config`` resolves to (raises ConfigurationError when
    that engine is not installed)."""
    name = resolve_engine(config)
    if name == "qh3":
        _require_qh3()
        return _Qh3Factory(credentials, config, verifier, resets)
    return _AioquicFactory(credentials, config, verifier, resets)
