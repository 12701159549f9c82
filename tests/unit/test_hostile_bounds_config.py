"""The settings that bound what a hostile peer can make a node hold: defaults and refusals."""

from __future__ import annotations

import pytest

from velomux_quic.errors import ConfigurationError
from velomux_quic.messenger import MessengerConfig
from velomux_quic.transport.config import TransportConfig


def test_the_defaults_bound_every_hostile_resource() -> None:
    transport, messenger = TransportConfig(), MessengerConfig()
    assert 0 < transport.retry_threshold <= transport.max_half_open_handshakes
    assert transport.max_half_open_per_source <= transport.max_half_open_handshakes
    assert transport.half_open_idle_timeout < transport.handshake_timeout
    assert messenger.max_pulls_per_peer >= 1
    assert messenger.max_pull_bytes_per_peer >= messenger.staged_payload_max
    assert messenger.max_pending_reply_bytes > 0


@pytest.mark.parametrize(
    "options",
    [
        {"max_half_open_handshakes": 0},
        {"max_half_open_per_source": 0},
        {"retry_threshold": -1},
        {"retry_threshold": 300, "max_half_open_handshakes": 256},
        {"half_open_idle_timeout": 0},
    ],
)
def test_transport_refuses_bounds_that_bound_nothing(options: dict[str, int]) -> None:
    with pytest.raises(ConfigurationError):
        TransportConfig(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"max_pulls_per_peer": 0}, "max_pulls_per_peer"),
        ({"max_pull_bytes_per_peer": 0}, "max_pull_bytes_per_peer"),
        ({"max_pending_reply_bytes": -1}, "max_pending_reply_bytes"),
    ],
)
def test_messenger_refuses_bounds_that_bound_nothing(options: dict[str, int], names: str) -> None:
    with pytest.raises(ConfigurationError, match=names):
        MessengerConfig(**options)  # type: ignore[arg-type]


def test_retry_for_every_dial_is_allowed() -> None:
    assert TransportConfig(retry_threshold=0).retry_threshold == 0
