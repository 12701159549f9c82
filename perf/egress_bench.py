"""Cost per record on the mux's send path, in process (no sockets): the egress batcher.

The shape ``perf/tokens.py`` measures on its engine: one peer, one lane, ``--streams`` open
slots (default 1,024), and per engine pass one 48-byte token frame offered to every slot.
Each slot is written to through its :class:`MuxChannel`, on a :class:`BatcherDriver` whose
messenger admits every batch at once, so a record pays everything it pays on a node
between the sender's channel and the messenger:

* ``stage``: ``try_send`` on every slot's channel (the slot's checks, its queue, the lane
  queue bound, the ready set, the driver's wake scheduled once per pass);
* ``poll``: the driver's wake that follows, run by the event loop (the flush policy, the
  packing of every ready slot into batches, each batch handed to the messenger);
* ``credit``: the consumer's credit coming back, every ``--grant`` passes, as the peer's
  CreditUpdates would (``on_credit`` per slot).

The three take turns for ``--repeat`` rounds of ``--passes`` passes and the median and best
round of each are shown, in CPU time of the benchmark's thread (``thread_time_ns``) per
record. ``--instructions`` runs the script again under valgrind's callgrind (``make
valgrind``), once per step, counting only that step's instructions: a figure the machine's
load does not move, to compare two trees or the two record paths by (run the same command
with each tree's Python, and with ``VELOMUX_PURE_PYTHON=1`` for the pure path).

    python perf/egress_bench.py
    python perf/egress_bench.py --streams 256 --passes 128 --repeat 9
    python perf/egress_bench.py --instructions --repeat 1
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from _callgrind import ENV_DIR as CALLGRIND_DIR
from _callgrind import ClientRequests, read_window
from _callgrind import command as callgrind_command

from velomux_quic.ids import InstanceId
from velomux_quic.messenger import Messenger
from velomux_quic.mux.config import MuxConfig
from velomux_quic.mux.driver import BatcherDriver, MuxChannel
from velomux_quic.mux.egress import EgressBatcher
from velomux_quic.recordpath import IMPLEMENTATION
from velomux_quic.streaming.frames import encode_item

STEPS = ("stage", "poll", "credit")
TOKEN = {"t": 12345, "s": 1, "p": "x" * 24}
"""About the 48-byte token frame of ``perf/tokens.py``."""
PEER = InstanceId.parse("00000000-0000-4000-8000-000000000001")


class _Messenger:
    """The messenger's place: admits every batch at once and counts the records."""

    def __init__(self) -> None:
        self.batches = 0
        self.bytes = 0

    def send_message_on_lane(
        self, peer: Any, lane: int, handler: str, payload: bytes, **_: Any
    ) -> None:
        self.batches += 1
        self.bytes += len(payload)


class Bench:
    """One batcher and its driver with ``streams`` open slots, each with its channel."""

    def __init__(self, streams: int, grant: int) -> None:
        config = MuxConfig()
        if grant > config.initial_credit:
            raise SystemExit(
                f"--grant {grant} is above the initial credit of {config.initial_credit}"
            )
        self.grant = grant
        self.messenger = _Messenger()
        self.batcher = EgressBatcher(0, config, epochs=itertools.count(1).__next__)
        self.driver = BatcherDriver(cast(Messenger, self.messenger), PEER, self.batcher)
        self.slots = [
            self.batcher.open_slot(anchor_id=index + 1, session_id=index + 1)
            for index in range(streams)
        ]
        self.channels = [MuxChannel(self.driver, slot) for slot in self.slots]
        self.token = encode_item(TOKEN)

    def stage(self) -> None:
        token = self.token
        for channel in self.channels:
            if not channel.try_send(token):
                raise SystemExit("a channel refused a token: the bench's credit ran out")

    async def poll(self) -> None:
        await asyncio.sleep(0)  # the driver's wake runs: poll, write
        if self.batcher.has_ready:
            raise SystemExit("a poll left records behind: the bench's shape is wrong")

    def credit(self) -> None:
        on_credit = self.batcher.on_credit
        now = self.driver.now()
        for slot in self.slots:
            on_credit(slot.slot_id, self.grant, now)


class _Counted:
    """Callgrind's count of one step (``--count``): on while that step runs, off otherwise."""

    def __init__(self, step: str | None) -> None:
        self.step = step
        self.requests: ClientRequests | None = None
        if step is not None:
            self.requests = ClientRequests()
            if not self.requests.on_valgrind():
                raise SystemExit(f"{CALLGRIND_DIR} is set but this process is not on valgrind")
        self.started = False

    def toggle(self, step: str) -> None:
        """Before and after ``step``: the count goes on and off again."""
        if self.requests is None or step != self.step:
            return
        if self.started:
            self.requests.toggle()
        else:
            self.requests.start()  # instrumentation on, counting from zero
            self.started = True

    def instructions(self) -> int | None:
        if self.requests is None:
            return None
        self.requests.toggle()  # on again, so the dump closes a window that counts
        self.requests.stop()
        return read_window(Path(os.environ[CALLGRIND_DIR]))


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(args.streams, args.grant)
    await asyncio.sleep(0)  # the OpenSlots go out
    counted = _Counted(args.count)
    clock = time.thread_time_ns  # CPU time of this thread: steadier than wall time under load
    rounds: dict[str, list[float]] = {step: [] for step in STEPS}
    records = credited = 0
    for _ in range(args.repeat):
        spent = dict.fromkeys(STEPS, 0)
        for index in range(args.passes):
            counted.toggle("stage")
            start = clock()
            bench.stage()
            spent["stage"] += clock() - start
            counted.toggle("stage")
            counted.toggle("poll")
            start = clock()
            await bench.poll()
            spent["poll"] += clock() - start
            counted.toggle("poll")
            records += args.streams
            if index % args.grant == args.grant - 1:
                counted.toggle("credit")
                start = clock()
                bench.credit()
                spent["credit"] += clock() - start
                counted.toggle("credit")
                credited += args.streams
        per_round = args.passes * args.streams
        for step, total in spent.items():
            rounds[step].append(total / per_round)
    result: dict[str, Any] = {
        "implementation": IMPLEMENTATION,
        "records": records,
        "credited": credited,
        "batches": bench.messenger.batches,
        "token": len(bench.token),
        "ns": {step: [statistics.median(values), min(values)] for step, values in rounds.items()},
    }
    instructions = counted.instructions()
    if instructions is not None:
        result["instructions"] = instructions
        per = credited if args.count == "credit" else records
        result["instructions_per_record"] = instructions / max(1, per)
    bench.driver.close()
    return result


def _under_callgrind(args: argparse.Namespace, argv: list[str]) -> None:
    """Each step in a process of its own under callgrind, counting that step alone."""
    print(
        f"{args.streams} slots, one token each per pass, {args.passes} passes x {args.repeat} "
        f"rounds, credit back every {args.grant} passes; record path: {IMPLEMENTATION} "
        "(instructions per record; per slot granted for credit)"
    )
    for step in args.steps:
        with tempfile.TemporaryDirectory(prefix="egress-callgrind-") as out:
            command = [*callgrind_command(Path(out)), sys.executable, __file__, *argv]
            command += ["--count", step]
            env = {**os.environ, CALLGRIND_DIR: out}
            shown = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
        result = json.loads(shown.stdout.strip().splitlines()[-1])
        print(f"  {step:<8} {result['instructions_per_record']:9,.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--streams", type=int, default=1024, help="open slots (one token each per pass)"
    )
    parser.add_argument("--passes", type=int, default=64, help="passes per round")
    parser.add_argument("--repeat", type=int, default=7, help="rounds; median and best shown")
    parser.add_argument("--grant", type=int, default=16, help="passes between credit grants")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count each step's instructions under valgrind's callgrind (make valgrind)",
    )
    parser.add_argument(
        "--steps", nargs="+", choices=STEPS, default=list(STEPS), help="what --instructions counts"
    )
    parser.add_argument("--count", choices=STEPS, help=argparse.SUPPRESS)  # the child's step
    args = parser.parse_args(argv)
    if args.instructions and args.count is None:
        forwarded = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--instructions"]
        _under_callgrind(args, forwarded)
        return
    result = asyncio.run(_run(args))
    if args.count is not None:
        print(json.dumps(result))
        return
    print(
        f"{args.streams} slots, one {result['token']}-byte token each per pass, {args.passes} "
        f"passes x {args.repeat} rounds, credit back every {args.grant} passes; record path: "
        f"{IMPLEMENTATION} (CPU ns per record)"
    )
    for step, (median, best) in result["ns"].items():
        print(f"  {step:<8} median {median:7.0f}   best {best:7.0f}")


if __name__ == "__main__":
    main()
