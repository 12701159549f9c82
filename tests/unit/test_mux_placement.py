"""Lane placement and the bind book, sans-IO: the chapter's lane rules one by one."""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

import asyncio
from typing import Any

from velomux_quic.ids import StreamAnchorHandle
from velomux_quic.mux.binds import BindBook
from velomux_quic.mux.credit import IngressSlot
from velomux_quic.mux.lanes import splitmix64
from velomux_quic.mux.placement import LaneLoads
from velomux_quic.streaming.anchor import AnchorEntry, RemoteSender
from velomux_quic.streaming.inbox import Inbox


def test_a_key_picks_its_hash_lane_and_one_lane_is_always_lane_zero() -> None:
    loads = LaneLoads()
    assert [loads.choose("p", key, 8) for key in range(20)] == [
        splitmix64(key) % 8 for key in range(20)
    ]
    assert {loads.choose("p", key, 1) for key in range(20)} == {0}
    assert loads.choose(None, None, 1) == 0


def test_unkeyed_attaches_weigh_one_senders_load_and_prebinds_the_nodes() -> None:
    loads = LaneLoads()
    # Four from peer p: lanes 0..3 in turn (unclaimed binds count, ties go low).
    placed = [loads.place("p", None, 4) for _ in range(4)]
    assert [p.lane for p in placed] == [0, 1, 2, 3]
    # Peer q sees none of p's load: it starts at lane 0 again.
    assert loads.place("q", None, 4).lane == 0
    # A pre-bind weighs the node: lane 0 has two streams, so lane 1 is next.
    prebind = loads.place(None, None, 4)
    assert prebind.lane == 1
    # Releasing p's lane-2 stream makes lane 2 the lightest on the node and for p.
    loads.release(placed[2])
    loads.release(placed[2])  # idempotent
    assert loads.place(None, None, 4).lane == 2
    assert loads.peer_loads("p", 4) == [1, 1, 0, 1]
    # A pre-bind claimed by p counts for p from then on.
    loads.assign(prebind, "p")
    assert loads.peer_loads("p", 4) == [1, 2, 0, 1]


def test_a_load_counts_on_the_chosen_lane_and_empty_peers_are_forgotten() -> None:
    loads = LaneLoads()
    placement = loads.place("p", 5, 8)  # chosen lane, whatever lane its batches ride
    assert loads.peer_loads("p", 8)[placement.lane] == 1
    loads.release(placement)
    assert loads.peers == frozenset()
    assert loads.node_loads(8) == [0] * 8


def entry_and_remote(
    local_id: int, session: int, node: Any = None
) -> tuple[AnchorEntry, RemoteSender]:
    entry = AnchorEntry(
        local_id=local_id,
        handle=StreamAnchorHandle.pack(1, local_id),
        mpsc=False,
        inbox=Inbox(8, ordered=True),
        heartbeat_interval=5.0,
    )
    remote = RemoteSender(
        node=node,
        sender_stream_id=0,
        session_id=session,
        transport_key="messenger-mux-v2",
        sender_id=1,
        prebound=node is None,
    )
    if node is None:
        entry.prebind = remote
    return entry, remote


async def test_a_prebind_is_claimed_by_any_peer_an_attach_only_by_its_own() -> None:
    book = BindBook(accept_window=180.0)
    pre_entry, pre = entry_and_remote(1, 10)
    book.add(pre_entry, pre, IngressSlot(4, 1024), lanes=4, now=0.0)
    att_entry, att = entry_and_remote(2, 20, node="p")
    book.add(att_entry, att, IngressSlot(4, 1024), lanes=4, now=0.0)
    assert book.claim("q", 0, 2, 20) is None  # not the attaching peer
    assert book.claim("q", 3, 1, 10) is not None  # a pre-bind: anyone with the ticket
    assert pre.node == "q" and not pre.prebound and pre_entry.attached
    assert pre_entry.prebind is None
    bind = book.get(1, 10)
    assert bind is not None and bind.arrival == ("q", 3)
    assert book.claim("p", 0, 2, 20) is not None
    assert book.waiting == 0
    await asyncio.sleep(0)


def test_the_accept_window_reaps_only_unclaimed_binds_in_deadline_order() -> None:
    book = BindBook(accept_window=10.0)
    binds = []
    for n in range(4):
        entry, remote = entry_and_remote(n + 1, n + 100)
        binds.append(book.add(entry, remote, IngressSlot(4, 1024), lanes=1, now=float(n)))
    book.claim("p", 0, 2, 101)  # claimed: no longer reaped
    book.remove(3, 102)  # the anchor let go: gone
    reaped: list[int] = []
    assert book.expired(10.5, lambda bind: reaped.append(bind.remote.session_id)) == 1
    assert reaped == [100]
    assert book.expired(13.0, lambda bind: reaped.append(bind.remote.session_id)) == 1
    assert reaped == [100, 103]
    assert book.expired(1e9, lambda bind: reaped.append(0)) == 0
    # Reaping tells the owner; the load goes when the owner lets go of the bind.
    assert book.loads.node_loads(1) == [3]
    book.remove(1, 100)
    book.remove(4, 103)
    assert book.loads.node_loads(1) == [1]
