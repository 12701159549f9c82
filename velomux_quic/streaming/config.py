"""Streaming settings."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StreamingConfig"]


@dataclass(frozen=True, slots=True)
class StreamingConfig:
    heartbeat_interval: float = 5.0
    """The consumer's heartbeat window, sent to producers in the attach response."""
    attach_timeout: float = 10.0
    per_stream_window: int = 64 * 1024
    """Receive window of one per-stream QUIC stream: how far its producer runs ahead."""
    per_stream_send_buffer: int = 64 * 1024
    anchor_capacity: int = 256
    """Records an anchor's own channel holds (same-worker senders write there)."""
    close_flush_timeout: float = 5.0
    """How long closing a node waits for the terminals of its streams (finalized ones and
    the shutdown terminal of open ones) to be handed to the transport before it cancels
    what is left."""

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0 or self.attach_timeout <= 0:
            raise ValueError("heartbeat_interval and attach_timeout must be positive")
        if self.close_flush_timeout < 0:
            raise ValueError("close_flush_timeout must be >= 0")
        if self.per_stream_window < 4096 or self.anchor_capacity < 1:
            raise ValueError("per_stream_window >= 4 KiB and anchor_capacity >= 1")
