"""OpsConfig: the bounds of a node's operations listener and of its readiness checks."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigurationError

__all__ = ["OpsConfig"]


@dataclass(frozen=True, slots=True)
class OpsConfig:
    """Bounds of the operations listener; the defaults suit a scraper and a probe."""

    max_request_bytes: int = 8192
    """The most bytes of request line and headers read from one client (431 above)."""
    read_timeout: float = 5.0
    """Seconds a client has to send its whole request head (408 after)."""
    max_connections: int = 64
    """Connections served at once; the next is answered 503 and closed."""
    readiness_timeout: float = 2.0
    """The bound on one ``/readyz`` evaluation's health checks of unconnected peers."""
    health_fresh_seconds: float = 10.0
    """How long a peer's successful health answer counts as reachable."""

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_connections"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"OpsConfig.{name} must be a positive int, got {value!r}")
        for name in ("read_timeout", "readiness_timeout", "health_fresh_seconds"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigurationError(
                    f"OpsConfig.{name} must be a positive number of seconds, got {value!r}"
                )
