"""MuxConfig and the flush policies, with the defaults the Batched streaming chapter sets.

``AutoFlush`` is a struct rather than more policy variants because its conditions compose:
a batcher can write at the end of every wake (``on_admission``), and/or after a linger
window (``max_linger``) ended early when every live slot already has a record in the batch
(``on_complete``) or when the batch reached about a segment (``at_bytes``). ``Manual``
writes only when the application calls ``flush_batch()`` (and a pending credit reply after
``reply_linger``).
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ConfigurationError

__all__ = [
    "CHAPTER_DISABLE_ENV",
    "DISABLE_ENV",
    "DISABLE_ENVS",
    "AutoFlush",
    "FlushPolicy",
    "Manual",
    "MuxConfig",
    "mux_disabled_by_env",
    "switch_is_on",
]

KiB = 1024
MiB = 1024 * KiB

CHAPTER_DISABLE_ENV = "VELO_MESSENGER_MUX_DISABLE"
"""The rollback variable, under the name the design chapter and its runbooks use:
``VELO_MESSENGER_MUX_DISABLE=1`` runs every node built in the process on the per-stream
path, however its configuration was made. The project's own switch is the setting
``MuxConfig.enabled`` (``[mux] enabled`` in the file, ``VELOMUX_MUX_ENABLED`` in the
environment, by the rule of :mod:`velomux_quic.config`)."""

DISABLE_ENV = "VELOMUX_MUX_DISABLE"
"""Deprecated: an earlier name of the switch, still read (with a DeprecationWarning) when a
configuration is loaded and when a node is built; set ``VELOMUX_MUX_ENABLED=false`` or
the chapter's variable instead."""

DISABLE_ENVS = (DISABLE_ENV, CHAPTER_DISABLE_ENV)
"""Every variable that can turn the mux off besides ``VELOMUX_MUX_ENABLED``."""
_TRUE = frozenset({"1", "true", "yes", "on"})


def switch_is_on(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the variable ``name`` is set to 1/true/yes/on (any case): a rollback switch
    reads only those, so a stray value never silently turns the mux off."""
    env = environ if environ is not None else os.environ
    return env.get(name, "").strip().lower() in _TRUE


def mux_disabled_by_env(environ: Mapping[str, str] | None = None) -> bool:
    """The chapter's ``VELO_MESSENGER_MUX_DISABLE`` (or the deprecated
    ``VELOMUX_MUX_DISABLE``) is set: read once at node build."""
    return any(switch_is_on(name, environ) for name in DISABLE_ENVS)


@dataclass(frozen=True, slots=True)
class AutoFlush:
    on_admission: bool = True
    """Write at the end of every wake, once the transport admitted the previous batch."""
    max_linger: float | None = None
    """Hold a batch up to this long after its oldest record (seconds)."""
    on_complete: bool = False
    """End the linger when every live slot on the lane already has a data record in it."""
    at_bytes: int | None = None
    """End the linger when the batch reaches this many bytes."""

    def __post_init__(self) -> None:
        if self.max_linger is not None and self.max_linger < 0:
            raise ConfigurationError("max_linger must be >= 0")
        if self.at_bytes is not None and self.at_bytes < 1:
            raise ConfigurationError("at_bytes must be positive")
        if not self.on_admission and self.max_linger is None:
            raise ConfigurationError("AutoFlush(on_admission=False) needs a max_linger window")


@dataclass(frozen=True, slots=True)
class Manual:
    """Only ``flush_batch()`` writes application records (plus every liveness record)."""


FlushPolicy = AutoFlush | Manual


@dataclass(frozen=True, slots=True)
class MuxConfig:
    enabled: bool = True
    """Install and advertise the mux; False is the rollback (``[mux] enabled = false``,
    ``VELOMUX_MUX_ENABLED=false``; or the chapter's ``VELO_MESSENGER_MUX_DISABLE=1``)."""
    mux_only: bool = False
    """Install no per-stream transport: refuse peers that need one."""
    max_batch_bytes: int = 60 * KiB
    initial_credit: int = 32
    """C: data records a slot may have outstanding; its buffer holds C + 1 (terminal reserve)."""
    credit_return_below: float = 0.5
    """Return drained credit once the sender holds fewer than this fraction of C (by the
    receiver's count); 1.0 returns it at every drain. Batching the grants keeps a consumer
    that keeps up from answering every record with a CreditUpdate of its own."""
    slot_byte_budget: int = 1 * MiB
    peer_byte_budget: int = 8 * MiB
    peer_queue_bytes: int = 2 * MiB
    """Bytes one (peer, lane) batcher may hold staged, across all its slots, before a
    producer whose stream already has records queued waits (``send()`` waits,
    ``send_pass`` leaves the pair over). It bounds the producer's memory and how long a
    record waits on this node: about ``peer_queue_bytes`` over the path's rate, which has
    to stay well inside the consumer's watchdog (3 heartbeat windows). See docs/tuning.md."""
    credit_sweep_interval: float = 0.2
    drain_visit_floor: float = 0.002
    batcher_idle_ttl: float = 60.0
    reply_linger: float = 0.001
    yield_before_ends: bool = True
    """Give up the CPU once (``sched_yield``) after a loop turn's records were handed to the
    kernel and before the stream ends handed over in that turn are staged (docs/mux.md,
    the terminal). A consumer on this host that those records woke is queued on this
    core (loopback delivers in the sender's context) and otherwise waits for the ends'
    bookkeeping; on an idle core the call returns at once. False keeps the CPU."""
    async_open_ack: bool = False
    max_slots_per_table: int = 65_536
    reject_lane_cap: int = 8_192
    max_refused_slots: int = 4_096
    """Refused slot ids one (peer, lane) table remembers, so that the refused stream's
    later records are dropped as ``unknown_slot``. The indices are the peer's choice, up
    to 2**24 per table: past this many the oldest is forgotten (counted in
    ``velo_streaming_mux_refusals_forgotten_total``), and a late record of it is dropped as
    ``closed_slot`` instead. It also bounds the slot ids a table remembers having told
    the sender about (``drop_notice_limit``)."""
    drop_notice_limit: int = 5
    """Drop notices (``CloseSlot`` UnknownSlot, or the reason the slot was refused with)
    one slot id gets at most: the close or rejection that ended it, then answers to the
    records its sender still sends. A notice can be lost with the connection it left on
    (a sender stopped past the idle timeout acknowledges nothing), and a sender that
    never hears it streams on into a slot nobody has; the bound keeps a peer that
    hammers a dropped slot from drawing answers without limit (the records past it are
    counted in ``velo_streaming_mux_drop_notices_total{outcome="limited"}``)."""
    drop_notice_interval: float = 1.0
    """Seconds from a drop notice to the earliest answer that repeats it; each later
    answer waits twice as long as the one before (1, 2, 4, 8 s: the five notices of the
    default limit span the 15 s QUIC idle timeout, within which a connection that took
    a notice down with it is replaced). Records of that slot meanwhile are dropped
    unanswered: the notice they would repeat may still be on its way."""
    health_check_interval: float = 5.0
    """While a batcher has live slots, ask its peer's messenger this often (0: never)."""
    health_check_timeout: float = 5.0
    """How long one check waits for the peer's answer before the peer counts as lost."""
    prebind_timeout: float = 180.0
    """The accept window: how long a bind (attach or pre-bind ticket) waits for the
    OpenSlot that claims it before it is reaped and its consumer reads Dropped."""
    flush_policy: FlushPolicy = field(default_factory=AutoFlush)

    def __post_init__(self) -> None:
        if not 0.0 < self.credit_return_below <= 1.0:
            raise ConfigurationError("credit_return_below must be a fraction in (0, 1]")
        if self.initial_credit <= 0:
            raise ConfigurationError(
                "initial_credit must be positive (0 on the wire means: no mux)"
            )
        if self.credit_sweep_interval <= 0:
            raise ConfigurationError("credit_sweep_interval must be positive")
        if not 0 <= self.drain_visit_floor <= 3600:
            raise ConfigurationError("drain_visit_floor must be 0 to 3600 s")
        if self.max_batch_bytes < 29:
            raise ConfigurationError(
                "max_batch_bytes must hold a header and one empty record (29 B)"
            )
        if self.slot_byte_budget <= 0 or self.peer_byte_budget <= 0:
            raise ConfigurationError("byte budgets must be positive")
        if self.peer_queue_bytes <= 0:
            raise ConfigurationError(
                "peer_queue_bytes must be positive: it bounds what producers stage per "
                "(peer, lane); raise it for a fast path, never turn it off"
            )
        if self.prebind_timeout <= 0 or self.health_check_interval < 0:
            raise ConfigurationError("prebind_timeout must be positive, health_check_interval >= 0")
        if self.health_check_timeout <= 0:
            raise ConfigurationError(
                "health_check_timeout must be positive; turn the check off with "
                "health_check_interval=0 instead"
            )
        if self.reply_linger < 0 or self.batcher_idle_ttl <= 0:
            raise ConfigurationError("reply_linger >= 0 and batcher_idle_ttl > 0")
        if self.max_refused_slots < 1:
            raise ConfigurationError("max_refused_slots must be at least 1")
        if self.drop_notice_limit < 1 or self.drop_notice_interval < 0:
            raise ConfigurationError(
                "drop_notice_limit must be at least 1 (the notice that ended the slot) and"
                " drop_notice_interval >= 0"
            )
        if not 1 <= self.max_slots_per_table <= 1 << 24:
            raise ConfigurationError("max_slots_per_table must be 1 to 2**24 (the u24 slot index)")
        if self.initial_credit >= 1 << 32 or self.slot_byte_budget >= 1 << 32:
            raise ConfigurationError("initial_credit and slot_byte_budget travel as u32")

    def effective_enabled(self, environ: Mapping[str, str] | None = None) -> bool:
        """Enabled in the config and not disabled by the chapter's rollback variable (or
        the deprecated one). A mux-only node cannot be rolled back this way: it would
        have no transport at all, so that is an error."""
        enabled = self.enabled and not mux_disabled_by_env(environ)
        if not enabled and self.mux_only:
            raise ConfigurationError(
                "the mux is disabled (MuxConfig.enabled=False, VELOMUX_MUX_ENABLED=false or "
                f"{CHAPTER_DISABLE_ENV}=1) on a mux-only node; remove mux_only to roll back"
            )
        return enabled
