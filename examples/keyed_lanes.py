"""Keyed lane placement: streams with one key share a lane, the others spread out.

Each peer connection has 1 to 16 ordered lanes (``TransportConfig(lanes=4)`` here, on
both nodes). Records on one lane arrive in order; lanes do not wait for each other, so a
burst on one lane never holds up another. Where a stream goes:

- ``attach_anchor(handle, key=K)`` asks for lane ``splitmix64(K) % lanes``: give every
  stream of one conversation (one user, one shard) the same key and they share a lane;
- without a key the consumer puts the stream on its least-loaded lane.

It opens six keyed streams (keys 1, 2, 3, each twice) and four unkeyed ones, prints
``sender.lane`` for each, then the consumer's per-lane load and the producer's live slots
per lane from ``node.snapshot()`` while they are open, then streams a record on each and
checks that the snapshot's slots are back to zero after they finalize.

Run it with ``python examples/keyed_lanes.py [CERT_DIR]``. Only root imports.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections import Counter
from pathlib import Path

from velomux_quic import Node, StreamSender, TransportConfig, ensure_dev_cluster, open_node

LANES = 4
KEYS = (1, 2, 3, 1, 2, 3)
UNKEYED = 4


def egress_slots_by_lane(producer: Node) -> dict[int, int]:
    """Live slots this node's batchers hold, by lane (what it is sending on each)."""
    mux = producer.snapshot().mux
    assert mux is not None, "the mux is on by default"
    return {
        lane: view.live_slots
        for (_peer, lane), view in sorted(mux.egress.items(), key=lambda kv: kv[0][1])
    }


async def main(certs: Path) -> int:
    dirs = ensure_dev_cluster(certs, ("consumer", "producer"))
    config = TransportConfig(lanes=LANES)
    async with (
        open_node(dirs["consumer"], transport=config) as consumer,
        open_node(dirs["producer"], transport=config, peers=[consumer.record]) as producer,
    ):
        keyed: list[tuple[int, StreamSender]] = []
        anchors = []
        for key in KEYS:
            anchor = consumer.create_anchor()
            anchors.append(anchor)
            keyed.append((key, await producer.attach_anchor(anchor.handle, key=key)))
        unkeyed: list[StreamSender] = []
        for _ in range(UNKEYED):
            anchor = consumer.create_anchor()
            anchors.append(anchor)
            unkeyed.append(await producer.attach_anchor(anchor.handle))

        lanes_by_key: dict[int, set[int | None]] = {}
        for key, sender in keyed:
            lanes_by_key.setdefault(key, set()).add(sender.lane)
            print(f"key {key}: lane {sender.lane}")
        print(f"unkeyed: lanes {[sender.lane for sender in unkeyed]}")
        one_lane_per_key = all(len(lanes) == 1 for lanes in lanes_by_key.values())
        print(f"every key kept to one lane: {one_lane_per_key}")

        mux = consumer.snapshot().mux
        assert mux is not None
        loads = mux.lane_loads[producer.instance_id]
        print(f"consumer's lane loads for the producer: {list(loads)}")
        print(f"producer's live slots by lane: {egress_slots_by_lane(producer)}")
        senders = [sender for _, sender in keyed] + unkeyed
        lanes_seen = Counter(sender.lane for sender in senders)
        loads_match = all(
            loads[lane] == count for lane, count in lanes_seen.items() if lane is not None
        )
        print(f"snapshot agrees with sender.lane: {loads_match}")

        for index, sender in enumerate(senders):
            await sender.send({"stream": index})
            sender.finalize()
        received = [[item async for item in anchor] for anchor in anchors]
        await asyncio.gather(*(sender.retired() for sender in senders))  # slots handed back
        everything_arrived = received == [[{"stream": index}] for index in range(len(senders))]
        after = egress_slots_by_lane(producer)
        print(f"every stream delivered: {everything_arrived}; producer's live slots after: {after}")

        ok = one_lane_per_key and loads_match and everything_arrived and sum(after.values()) == 0
        print("keyed lanes OK" if ok else "keyed lanes FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(asyncio.run(main(Path(sys.argv[1]))))
    with tempfile.TemporaryDirectory() as scratch:
        sys.exit(asyncio.run(main(Path(scratch))))
