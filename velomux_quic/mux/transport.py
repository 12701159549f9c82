"""MuxTransport: the messenger mux as a streaming transport (``messenger-mux-v2``).

It owns no socket and no connection: every stream to a peer is a slot in that peer's
``_stream_batch`` messages on the messenger. Producer side, one :class:`EgressBatcher`
(driven by a :class:`BatcherDriver`) per (peer, lane); consumer side, one
:class:`IngressTable` per (peer, lane), whose slots are the anchors' feeds. Replies (credit,
closes) go back through the batcher of the same (peer, lane). One sweep task per node
returns credit nothing else names and evicts idle batchers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ..errors import ChannelClosed
from ..ids import InstanceId
from ..messenger import Context, Messenger
from ..streaming.control import MESSENGER_MUX_KEY
from ..streaming.frames import DETACHED
from ..streaming.transports import AttachTerms, BindTerms
from .binds import Bind, BindBook
from .config import MuxConfig
from .credit import IngressSlot, PeerBudget
from .driver import BatcherDriver, MuxChannel
from .egress import RECORDS_PER_BATCH_BUCKETS, EgressBatcher, wall_clock_epochs
from .handlers import BATCH_HANDLER_NAMES, MUX_SLOT, MUX_SLOT_HEADER
from .health import PeerHealth
from .ingress import IngressTable, MuxIngressStats
from .protocol import (
    MAX_LANES,
    CloseReason,
    LifecycleAction,
    MalformedBatch,
    decode_batch_owned,
)
from .singleton import REFUSAL_OUTCOMES, SingletonCounters, apply_staged_refusal
from .snapshot import MuxSnapshot, PeerBudgetSnapshot

if TYPE_CHECKING:
    from ..messenger import StagedRefusal
    from ..streaming.anchor import AnchorEntry, RemoteSender

__all__ = ["MuxTransport"]

logger = logging.getLogger(__name__)


class _Replies:
    """The ReplySink of one (peer, lane): this node's ingress about the peer's slots, into
    its batcher as replies to write."""

    __slots__ = ("_driver", "_rejects")

    def __init__(self, driver: BatcherDriver) -> None:
        self._driver = driver
        self._rejects = 0

    def credit(self, slot_id: int, delta: int) -> None:
        self._driver.batcher.reply_credit(slot_id, delta, self._driver.now())
        self._driver.wake()

    def close(self, slot_id: int, reason: CloseReason) -> None:
        self._driver.batcher.reply_close(slot_id, reason)
        self._driver.wake()

    def reject(self, slot_id: int, reason: CloseReason) -> bool:
        """Rejections of OpenSlots ingress never admitted: the one capped control lane."""
        batcher = self._driver.batcher
        if batcher.pending_closes() >= batcher.config.reject_lane_cap:
            return False
        self.close(slot_id, reason)
        return True

    def lifecycle(self, session: int, action: LifecycleAction) -> None:
        """Stop or cancel the peer's stream ``session`` (coalesced, urgent)."""
        self._driver.batcher.reply_lifecycle(session, action)
        self._driver.wake()


class _Control:
    """The EgressControl of one (peer, lane): the peer's word about *this* node's slots (a
    grant, a close, a stop or cancel), into its batcher."""

    __slots__ = ("_driver",)

    def __init__(self, driver: BatcherDriver) -> None:
        self._driver = driver

    def credits(self, grants: list[tuple[int, int]]) -> None:
        driver = self._driver
        driver.batcher.on_credits(grants, driver.now())
        driver.wake()

    def closed_by_peer(self, slot_id: int, reason: CloseReason) -> None:
        self._driver.batcher.on_peer_close(slot_id, reason)
        self._driver.wake()

    def lifecycle(self, session: int, action: LifecycleAction) -> None:
        # The wake releases a producer waiting for space on a slot a cancel just closed.
        self._driver.batcher.on_lifecycle(session, action)
        self._driver.wake()


class MuxTransport(Collector):
    """See the module docstring. Installed by the AnchorManager when the mux is enabled."""

    key = MESSENGER_MUX_KEY

    def __init__(self, messenger: Messenger, config: MuxConfig) -> None:
        self._messenger = messenger
        self.config = config
        self._loop = asyncio.get_running_loop()
        self._binds = BindBook(config.prebind_timeout)
        self.on_bind_expired: Callable[[AnchorEntry, RemoteSender], None] | None = None
        """Set by the anchor manager: reap a bind whose accept window closed unclaimed."""
        self._drivers: dict[tuple[InstanceId, int], BatcherDriver] = {}
        self._epochs = wall_clock_epochs()
        """One epoch source for every batcher this node makes, so a batcher re-created
        after idle eviction never reuses an epoch of its predecessor."""
        self._tables: dict[tuple[InstanceId, int], IngressTable] = {}
        self._budgets: dict[InstanceId, PeerBudget] = {}
        self._visits: dict[tuple[InstanceId, int], asyncio.Handle] = {}
        self.ingress = MuxIngressStats()
        self._egress_retired = [0] * 5  # batches, records, control_refused, epoch_deaths,
        # queue_full: what evicted batchers had counted
        self._dropped_batches = 0
        self._closed = False
        # The mux's batches reach it through the messenger's generic hooks: one inline
        # handler per lane under its reserved names, and its one header's codec.
        for lane, name in enumerate(BATCH_HANDLER_NAMES):
            messenger.register_system(name, partial(self._on_batch, lane), dispatch="inline")
        messenger.register_header(MUX_SLOT)
        messenger.add_lane_reset_hook(self._lane_reset)
        self._singletons = SingletonCounters()
        messenger.add_staged_refusal_hook(self._on_staged_refusal)
        messenger.registry.register(self)
        self._health = PeerHealth(messenger, config, self._drivers_of)
        self._unsubscribe = messenger.peers.subscribe(self._peer_changed)
        self._sweeper = self._loop.create_task(self._sweep())

    # -- StreamTransport: consumer -------------------------------------------------------

    def lanes_to(self, peer: InstanceId | None) -> int:
        """Mux lanes to ``peer`` (its transport's count, at most 16); with no peer (a
        pre-bind) the most lanes any transport here keeps."""
        transport = self._messenger.transport
        lanes = transport.config.lanes if peer is None else transport.lanes(peer)
        return max(1, min(lanes, MAX_LANES))

    def bind(self, entry: AnchorEntry, remote: RemoteSender) -> BindTerms:
        """Bind the stream's slot and choose its lane (``remote.node`` None: a pre-bind)."""
        credit = self.config.initial_credit
        slot = IngressSlot(
            credit,
            self.config.slot_byte_budget,
            wake=entry.inbox.wake,
            return_below=max(1, math.ceil(credit * self.config.credit_return_below)),
        )
        bind = self._binds.add(
            entry, remote, slot, lanes=self.lanes_to(remote.node), now=self._loop.time()
        )
        remote.lane = bind.placement.lane
        entry.inbox.install_feed(slot, remote.sender_id)
        remote.receiver = slot
        bound_at = remote.last_arrival

        def probe() -> tuple[float, bool]:
            # A window is live when something arrived, or when the sender holds no data
            # credit and nothing waits behind a gap: that silence is the consumer's.
            # Before a pre-bind meets its sender no window counts (the accept window is
            # the backstop).
            if remote.prebound:
                return self._loop.time(), True
            exempt = slot.opened and not slot.sender_has_credit and not slot.gap_waiting
            return max(bound_at, slot.last_arrival), exempt

        remote.probe = probe
        if not entry.mpsc:

            def arrived(body: bytes) -> None:
                # A Detached in the slot frees the anchor for the next sender now; the
                # inbox reads that sender only after this one (ordered feeds).
                if body == DETACHED:
                    entry.attached = False

            slot.on_terminal = arrived
        return BindTerms(
            initial_credit=self.config.initial_credit,
            slot_byte_budget=self.config.slot_byte_budget,
            lane=bind.placement.lane,
        )

    def adopt(self, entry: AnchorEntry, remote: RemoteSender, peer: InstanceId) -> BindTerms:
        """An ordinary attach from ``peer`` takes over the unclaimed pre-bind ``remote``:
        same slot, session and lane; the accept window is not restarted."""
        bind = self._binds.get(entry.local_id, remote.session_id)
        if bind is None:
            raise LookupError("no pre-bind waits for this stream")
        self._binds.adopt(bind, peer)
        return BindTerms(
            initial_credit=self.config.initial_credit,
            slot_byte_budget=self.config.slot_byte_budget,
            lane=bind.placement.lane,
        )

    def claimed(self, entry: AnchorEntry, remote: RemoteSender) -> bool:
        """Whether an OpenSlot already claimed this stream's bind."""
        slot = remote.receiver
        return isinstance(slot, IngressSlot) and slot.opened

    def post_stream_lifecycle(
        self, entry: AnchorEntry, remote: RemoteSender, *, stop: bool
    ) -> None:
        """Tell a claimed stream's producer to stop (gracefully) or cancel, by session, on
        the lane its OpenSlot arrived on: a ticket sender has no cancel handle to message."""
        bind = self._binds.get(entry.local_id, remote.session_id)
        if bind is None or bind.arrival is None:
            return  # not claimed: unbinding answers a later OpenSlot with UnknownSlot
        peer, lane = bind.arrival
        action = LifecycleAction.STOP if stop else LifecycleAction.CANCEL
        self.post_lifecycle(peer, lane, remote.session_id, action)  # type: ignore[arg-type]

    def unbind(self, entry: AnchorEntry, remote: RemoteSender) -> None:
        """Forget the stream's bind, and drop the closures :meth:`bind` gave its sender and
        slot: each refers back to what refers to it, so kept they would leave every ended
        stream to the cyclic collector (whose full passes then grow with the streams)."""
        self._binds.remove(entry.local_id, remote.session_id)
        remote.probe = None
        slot = remote.receiver
        if isinstance(slot, IngressSlot):
            slot.on_terminal = None

    def _reap(self, bind: Bind) -> None:
        """Counted by the manager (``velo_streaming_unclaimed_bind_reaped_total``)."""
        if self.on_bind_expired is not None:
            self.on_bind_expired(bind.entry, bind.remote)
        else:
            self._binds.remove(bind.entry.local_id, bind.remote.session_id)
            bind.slot.end(None)

    # -- StreamTransport: producer -------------------------------------------------------

    async def connect(self, terms: AttachTerms) -> MuxChannel:
        if terms.initial_credit <= 0:
            # A mux answer with no window: a fallback would reach nothing that listens.
            raise ChannelClosed("the receiver answered the mux key without a credit window")
        lanes = self._messenger.transport.lanes(terms.peer)
        driver = self._driver(terms.peer, terms.lane % lanes)
        slot = driver.batcher.open_slot(
            terms.handle.local_id,
            terms.routing_session_id,
            credit=terms.initial_credit,
            budget=terms.slot_byte_budget or self.config.slot_byte_budget,
        )
        opened: asyncio.Future[bool] = self._loop.create_future()
        slot.guard = opened  # the batch carrying the OpenSlot resolves it on admission
        driver.wake()
        self._health.watch(terms.peer)
        if not self.config.async_open_ack and not await opened:
            raise ChannelClosed(f"the OpenSlot to {terms.peer} was refused (epoch death)")
        return MuxChannel(driver, slot)

    def _drivers_of(self, peer: InstanceId) -> list[BatcherDriver]:
        return [driver for (to, _), driver in self._drivers.items() if to == peer]

    def _driver(self, peer: InstanceId, lane: int) -> BatcherDriver:
        key = (peer, lane)
        driver = self._drivers.get(key)
        if driver is None or driver.closed:
            cap = self._messenger.eager_budget(peer)
            batcher = EgressBatcher(
                lane,
                self.config,
                byte_cap=cap,
                eager_budget=cap,
                counters=self._singletons,
                epochs=self._epochs,
            )
            driver = self._drivers[key] = BatcherDriver(
                self._messenger, peer, batcher, self._messenger.transport.on_delivered
            )
        return driver

    # -- ingress -------------------------------------------------------------------------

    def _on_batch(self, lane: int, ctx: Context) -> None:
        try:
            header, records = decode_batch_owned(ctx.payload)
        except MalformedBatch as exc:
            self._dropped_batches += 1
            logger.debug("dropping a malformed batch from %s lane %d: %s", ctx.sender, lane, exc)
            return
        table = self._table(ctx.sender, lane)
        headers = ctx.headers
        if headers is not None and MUX_SLOT_HEADER in headers:
            table.handle_staged_batch(header, records, self._loop.time())
        else:
            table.handle_batch(header, records, self._loop.time())

    # -- singletons and lifecycle ----------------------------------------------------------

    def _on_staged_refusal(self, refusal: StagedRefusal) -> None:
        """The messenger refused a staged payload or failed to pull it: if it was a
        singleton batch, end the one stream its ``_mux_slot`` header names (see
        :mod:`.singleton`)."""
        outcome = apply_staged_refusal(refusal, self._tables, self._binds, self.ingress)
        if outcome is not None:
            # Counted by outcome; a peer can send refusable descriptors cheaply, so the log
            # stays at DEBUG (the consumer of an ended stream reads the sizes anyway).
            logger.debug(
                "staged singleton of %d bytes from %s refused (%s, bound %d): %s",
                refusal.size,
                refusal.peer,
                refusal.reason,
                refusal.limit,
                outcome,
            )

    def post_lifecycle(
        self, peer: InstanceId, lane: int, session: int, action: LifecycleAction
    ) -> None:
        """Send ``LifecycleSlot{session, action}`` to the producer of one of this node's
        streams, on the lane its batches arrive on (replies go back on the arrival lane).

        Stop asks the producer to finish gracefully; cancel ends its slot (its next send
        fails). It names the session, not the slot id, so a late one cannot reach a later
        stream on a reused slot; a stop and a cancel for one session coalesce into the
        cancel. Never blocks, never fails (after close it does nothing)."""
        if self._closed:
            return
        driver = self._driver(peer, lane)
        driver.batcher.reply_lifecycle(session, action)
        driver.wake()

    def _table(self, peer: InstanceId, lane: int) -> IngressTable:
        key = (peer, lane)
        table = self._tables.get(key)
        if table is None:
            driver = self._driver(peer, lane)
            budget = self._budgets.get(peer)
            if budget is None:
                budget = self._budgets[peer] = PeerBudget(self.config.peer_byte_budget)
            table = self._tables[key] = IngressTable(
                peer,
                lane,
                self.config,
                registry=self._binds,
                replies=_Replies(driver),
                control=_Control(driver),
                peer_budget=budget,
                stats=self.ingress,
                doorbell=partial(self._doorbell, peer, lane),
                clock=self._loop.time,
            )
        return table

    def _doorbell(self, peer: InstanceId, lane: int) -> None:
        """A consumer drained a slot of this table: visit its dirty set soon (rate-limited)."""
        key = (peer, lane)
        if key in self._visits or self._closed:
            return
        table = self._tables.get(key)
        at = table.next_visit_at if table is not None else None
        if at is None or at <= self._loop.time():
            self._visits[key] = self._loop.call_soon(self._visit, key)
        else:
            self._visits[key] = self._loop.call_at(at, self._visit, key, at)

    def _visit(self, key: tuple[InstanceId, int], due: float = 0.0) -> None:
        """``due``: the time a deferred visit was armed for. The loop may run it up to its
        clock's resolution early; visited at the loop's time, the floor would still hold,
        and the visit would be re-armed for the same past time at every loop iteration."""
        self._visits.pop(key, None)
        table = self._tables.get(key)
        if table is None:
            return
        now = self._loop.time()
        if not table.visit_dirty(due if due > now else now) and len(table.dirty):
            self._doorbell(*key)  # the floor held us back: come back when it allows

    # -- the node-wide pieces --------------------------------------------------------------

    def flush_batch(self) -> None:
        """Kick every batcher: write what is staged now. Never blocks, never fails."""
        for driver in self._drivers.values():
            driver.batcher.kick()
            driver.wake()

    async def _sweep(self) -> None:
        """The periodic backstop: credit for slots nothing names, idle batcher eviction."""
        interval = self.config.credit_sweep_interval
        while not self._closed:
            await asyncio.sleep(interval)  # the sweep's own period, not synchronisation
            now = self._loop.time()
            self._binds.expired(now, self._reap)
            for table in list(self._tables.values()):
                if table.live_slots:
                    table.sweep(now)
            if self._drivers:
                self._evict_idle(now)

    def _evict_idle(self, now: float) -> None:
        ttl = self.config.batcher_idle_ttl
        for key, driver in list(self._drivers.items()):
            table = self._tables.get(key)
            idle = driver.batcher.live_slots == 0 and (table is None or table.live_slots == 0)
            if idle and now - driver.last_activity >= ttl:
                self._retire_stats(driver.batcher)
                driver.close()
                del self._drivers[key]
                self._tables.pop(key, None)

    def _retire_stats(self, batcher: EgressBatcher) -> None:
        stats = batcher.stats
        self._egress_retired[0] += stats.batches_sent
        self._egress_retired[1] += stats.records_sent
        self._egress_retired[2] += stats.control_refused
        self._egress_retired[3] += stats.epoch_deaths
        self._egress_retired[4] += stats.queue_full

    def _peer_changed(self, record: object, peer: InstanceId) -> None:
        """Peer eviction (discovery or the application removed the peer) is epoch death on
        every lane to it: its producers' streams end now, not at a failed send."""
        if record is not None:
            return
        for driver in self._drivers_of(peer):
            if driver.batcher.live_slots:
                logger.info("peer %s evicted: ending its %d slots", peer, driver.batcher.live_slots)
                driver.peer_lost()

    def _lane_reset(self, peer: InstanceId, lane: int) -> None:
        """The peer cut one lane's stream: the batches in flight on it are lost, so every
        slot it carried has a gap that can never close. End them now (``Dropped``) rather
        than at their watchdogs; the peer's other lanes are not touched."""
        table = self._tables.get((peer, lane))
        if table is not None:
            retired = table.retire_all()
            logger.info("lane %d from %s was reset: %d slots ended", lane, peer, retired)

    async def close(self) -> None:
        self._closed = True
        self._unsubscribe()
        self._sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._sweeper
        await self._health.close()
        for handle in self._visits.values():
            handle.cancel()
        self._visits.clear()
        for driver in self._drivers.values():
            driver.batcher.epoch_death()
            driver.close()
        for table in self._tables.values():
            table.retire_all()
        with contextlib.suppress(KeyError):
            self._messenger.registry.unregister(self)

    # -- introspection ---------------------------------------------------------------------

    def snapshot(self) -> MuxSnapshot:
        """A frozen picture of this node's mux: every batcher and ingress table by
        (peer, lane), the binds still waiting, the peers' byte budgets and lane loads.

        O(live slots + binds): for operators and tests, never per record. Holding the
        result keeps nothing alive and changes nothing."""
        pending, prebinds = self._binds.waiting_by_kind()
        loads = self._binds.loads
        return MuxSnapshot(
            egress=MappingProxyType(
                {key: driver.batcher.snapshot() for key, driver in self._drivers.items()}
            ),
            ingress=MappingProxyType(
                {key: table.snapshot() for key, table in self._tables.items()}
            ),
            pending_binds=pending,
            unclaimed_prebinds=prebinds,
            peer_budgets=MappingProxyType(
                {
                    peer: PeerBudgetSnapshot(used=budget.used, limit=budget.limit)
                    for peer, budget in self._budgets.items()
                }
            ),
            lane_loads=MappingProxyType(
                {
                    peer: tuple(loads.peer_loads(peer, self.lanes_to(peer)))  # type: ignore[arg-type]
                    for peer in loads.peers
                }
            ),
            health_checks_running=self._health.running,
        )

    # -- metrics (velo_streaming_mux_*) ----------------------------------------------------

    def _batchers(self) -> Iterator[EgressBatcher]:
        return (driver.batcher for driver in self._drivers.values())

    def collect(
        self,
    ) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        batchers = list(self._batchers())
        sent_batches = self._egress_retired[0] + sum(b.stats.batches_sent for b in batchers)
        sent_records = self._egress_retired[1] + sum(b.stats.records_sent for b in batchers)
        ing = self.ingress
        batches = CounterMetricFamily(
            "velo_streaming_mux_batches", "Batches packed / decoded", labels=["direction"]
        )
        batches.add_metric(["sent"], sent_batches)
        batches.add_metric(["received"], ing.batches_received)
        yield batches
        records = CounterMetricFamily(
            "velo_streaming_mux_records", "Records in batches", labels=["direction"]
        )
        records.add_metric(["sent"], sent_records)
        records.add_metric(["received"], ing.records_received)
        yield records
        dropped = CounterMetricFamily(
            "velo_streaming_mux_records_dropped", "Records discarded", labels=["reason"]
        )
        for reason, count in sorted(ing.drops.items()):
            dropped.add_metric([reason], count)
        yield dropped
        notices = CounterMetricFamily(
            "velo_streaming_mux_drop_notices",
            "Records of a slot this node does not have: answered again with a drop notice,"
            " or left unanswered by drop_notice_limit and its backoff",
            labels=["outcome"],
        )
        for outcome, count in ing.drop_notices.items():
            notices.add_metric([outcome], count)
        yield notices
        for name, value, documentation in (
            ("reader_stall", ing.reader_stall, "Deliveries into reserved space that failed (bug)"),
            ("generation_mismatch", ing.generation_mismatch, "Records for another generation"),
            ("hold_overflow", ing.hold_overflow, "Slots closed because their hold overflowed"),
            ("batch_seq_gaps", ing.batch_seq_gaps, "Batches missing within an epoch"),
            ("drain_visits", ing.drain_visits, "Doorbell reconciles performed"),
            ("slot_limit", ing.slot_limit, "OpenSlots refused: index past max_slots_per_table"),
            (
                "refusals_forgotten",
                ing.refusals_forgotten,
                "Refused slot ids forgotten past max_refused_slots (oldest first)",
            ),
            ("malformed_batches", self._dropped_batches, "Batches that did not decode"),
            ("credit_lost", 0, "Credit that found no home (must stay 0)"),
            (
                "control_refused",
                ing.control_refused
                + self._egress_retired[2]
                + sum(b.stats.control_refused for b in batchers),
                "Control for a never-allocated index, or reject lane full",
            ),
            (
                "epoch_deaths",
                self._egress_retired[3] + sum(b.stats.epoch_deaths for b in batchers),
                "Epochs that died",
            ),
            (
                "queue_full",
                self._egress_retired[4] + sum(b.stats.queue_full for b in batchers),
                "Records refused (the producer waits) because the (peer, lane) queue bound "
                "peer_queue_bytes was full",
            ),
            ("health_checks", self._health.checks, "Peer health checks made by batchers"),
            (
                "health_check_failures",
                self._health.failures,
                "Peer health checks that failed (epoch death on every lane to that peer)",
            ),
        ):
            family = CounterMetricFamily(f"velo_streaming_mux_{name}", documentation)
            family.add_metric([], value)
            yield family
        exhausted = CounterMetricFamily(
            "velo_streaming_slot_credit_exhausted", "Mux slots that ran out of credit"
        )
        exhausted.add_metric([], sum(b.stats.credit_exhausted for b in batchers))
        yield exhausted
        waiting = GaugeMetricFamily(
            "velo_streaming_mux_unclaimed_binds", "Binds (attach or pre-bind) not yet claimed"
        )
        waiting.add_metric([], self._binds.waiting)
        yield waiting
        live = GaugeMetricFamily("velo_streaming_mux_live_slots", "Egress + ingress slots")
        live.add_metric([], sum(b.live_slots for b in batchers) + ing.live_slots)
        yield live
        refused = GaugeMetricFamily(
            "velo_streaming_mux_refused_slots",
            "Refused slot ids remembered (at most max_refused_slots per peer and lane)",
        )
        refused.add_metric([], ing.refused_slots)
        yield refused
        cap = GaugeMetricFamily(
            "velo_streaming_mux_slots_per_table_limit",
            "Live slots one (peer, lane) may hold: max_slots_per_table",
        )
        cap.add_metric([], self.config.max_slots_per_table)
        yield cap
        held = GaugeMetricFamily("velo_streaming_mux_held_records", "Records in holds")
        held.add_metric([], ing.held_records)
        yield held
        queued = [b.queued_records() for b in batchers]
        staged = GaugeMetricFamily(
            "velo_streaming_mux_staged_records",
            "Records staged with credit, not yet written (a plateau under Manual: a missing "
            "flush_batch)",
        )
        staged.add_metric([], sum(q[0] for q in queued))
        yield staged
        withheld = GaugeMetricFamily(
            "velo_streaming_mux_withheld_records", "Records waiting for credit (or a fence)"
        )
        withheld.add_metric([], sum(q[1] for q in queued))
        yield withheld
        queued_bytes = GaugeMetricFamily(
            "velo_streaming_mux_queued_bytes",
            "Bytes staged in the batchers, not yet handed to the transport (each (peer, lane) "
            "bounded by peer_queue_bytes plus one record per live slot)",
        )
        queued_bytes.add_metric([], sum(b.queued_bytes for b in batchers))
        yield queued_bytes
        by_type = CounterMetricFamily(
            "velo_streaming_mux_records_sent", "Records in written batches", labels=["record_type"]
        )
        names = ("data", "open_slot", "close_slot", "credit_update", "slot_heartbeat", "lifecycle")
        totals = [sum(b.stats.record_types[i] for b in batchers) for i in range(6)]
        for name, total in zip(names, totals, strict=True):
            by_type.add_metric([name], total)
        yield by_type
        yield from self._singleton_metrics()
        wakes = CounterMetricFamily(
            "velo_streaming_mux_batcher_wakes", "Real batcher wakes", labels=["source"]
        )
        wakes.add_metric(["wake"], sum(d.wakes[0] for d in self._drivers.values()))
        wakes.add_metric(["linger"], sum(d.wakes[1] for d in self._drivers.values()))
        yield wakes
        histogram = HistogramMetricFamily(
            "velo_streaming_mux_records_per_batch",
            "Records per written batch",
            labels=["direction"],
        )
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, index in zip(RECORDS_PER_BATCH_BUCKETS, range(12), strict=True):
            cumulative += sum(b.stats.batch_size_buckets[index] for b in batchers)
            buckets.append((str(float(bound)), cumulative))
        live_batches = sum(b.stats.batches_sent for b in batchers)
        buckets.append(("+Inf", live_batches))
        live_records = sum(b.stats.records_sent for b in batchers)
        histogram.add_metric(["sent"], buckets, sum_value=live_records)
        yield histogram

    def _singleton_metrics(self) -> Iterator[CounterMetricFamily]:
        """Singletons, fences, staged refusals and LifecycleSlot records."""
        counts = self._singletons
        singletons = CounterMetricFamily(
            "velo_streaming_mux_singletons",
            "Records too large for any batch, sent alone (inline, or staged by rendezvous)",
            labels=["path"],
        )
        singletons.add_metric(["inline"], counts.inline)
        singletons.add_metric(["staged"], counts.staged)
        yield singletons
        fences = CounterMetricFamily(
            "velo_streaming_mux_fences_raised",
            "Slots fenced by a staged singleton until its admission",
        )
        fences.add_metric([], counts.fences_raised)
        yield fences
        refusals = CounterMetricFamily(
            "velo_streaming_mux_staged_refusals",
            "Staged singletons this node refused for their size, by outcome",
            labels=["outcome"],
        )
        for outcome in REFUSAL_OUTCOMES:
            refusals.add_metric([outcome], self.ingress.refusals[outcome])
        yield refusals
        lifecycle = CounterMetricFamily(
            "velo_streaming_mux_lifecycle_records",
            "LifecycleSlot records (stop or cancel, by session)",
            labels=["direction"],
        )
        lifecycle.add_metric(["sent"], counts.lifecycle_sent)
        lifecycle.add_metric(["received"], self.ingress.lifecycle_received)
        yield lifecycle

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        return iter(())
