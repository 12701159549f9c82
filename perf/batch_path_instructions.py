"""Instructions per batch of the mux's per-batch path, stage by stage, two nodes in process.

An engine node and a frontend node in one process, on real QUIC over loopback UDP with
mutual TLS (certificates made on demand in a temporary directory), on the QUIC engine
``--engine`` names. The engine has ``--records`` streams open to the frontend's anchors;
each pass sends one 48-byte token on every stream in one loop turn and waits until the
frontend's readers have all of them, so a pass is one batch (plus what the transport and
the mux answer with). Valgrind's callgrind counts, pass after pass, only the calls of one
stage (``perf/_callgrind.py``), so each figure is that stage's instructions per batch,
whatever the machine's load:

* ``write``: the engine's batcher driver, from its poll to the batch's bytes on the QUIC
  stream (the envelope, the lane's framing and admission, the engine's stream write);
* ``transmit``: the engine's connection building and sending the datagrams;
* ``receive``: the frontend's endpoint, from each datagram or GRO burst to the records in
  their slots (the QUIC engine's receive, the stream data, the frame decoder, the envelope,
  the mux's ingress); the readers it wakes run later and are not counted;
* ``answer``: the frontend's transmits (acknowledgements) and its batcher driver
  (credit returns);
* ``acks``: the engine's endpoint receiving those answers.

Each window is a Python wrapper around the method: ``empty`` is a wrapped call that does
nothing, the wrapper's own cost, which every other figure includes once per call (the
calls per batch are shown beside each stage). A call of another stage's method made inside
a window (a receive's transmit of an acknowledgement that is due) is left out of it.

    python perf/batch_path_instructions.py
    python perf/batch_path_instructions.py --engine qh3 --records 1 256 --datagram-size 1452
    python perf/batch_path_instructions.py --tree <checkout before the change>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _callgrind import ENV_DIR, ClientRequests, read_window, run_in_tree  # noqa: E402

STAGES = ("write", "transmit", "receive", "answer", "acks")
TOKEN = {"t": 12345, "s": 1, "p": "x" * 24}
"""About the 48-byte token frame of ``perf/tokens.py``."""
WARM_PASSES = 20
"""Passes before the first window: the handshake's and the streams' opening are done."""


class Windows:
    """Callgrind's counting switched on only inside the wrapped calls of the stage that is
    measured now, and each stage's count."""

    def __init__(self, out_dir: Path) -> None:
        self.requests = ClientRequests()
        if not self.requests.on_valgrind():
            raise SystemExit("not on valgrind: run this script without --child")
        self.out_dir = out_dir
        self.stage: str | None = None
        self.calls = 0
        self.depth = 0

    def wrap(self, cls: type, name: str, stage: str, mine: Callable[[Any], bool]) -> None:
        """Count ``cls.name`` while ``stage`` is measured, for the instances ``mine`` picks."""
        original = getattr(cls, name)
        toggle = self.requests.toggle

        def toggled(instance: Any, args: Any, kwargs: Any, inside: int, after: int) -> Any:
            """Run the call with counting switched the other way and ``depth`` at
            ``inside``, then switch it back."""
            self.depth = inside
            toggle()
            try:
                return original(instance, *args, **kwargs)
            finally:
                toggle()
                self.depth = after

        def counted(instance: Any, *args: Any, **kwargs: Any) -> Any:
            if self.stage != stage and self.depth == 1 and mine(instance):
                # Another stage's call inside the one counted (the acknowledgement a receive
                # sends at once when one is due, which callgrind's slowed clock makes due
                # now and then): it is that stage's work, so it is left out of this window.
                return toggled(instance, args, kwargs, 2, 1)
            if self.stage != stage or self.depth or not mine(instance):
                return original(instance, *args, **kwargs)
            self.calls += 1
            # A call of the same stage inside it is counted as part of it (depth 1).
            return toggled(instance, args, kwargs, 1, 0)

        setattr(cls, name, counted)

    def begin(self, stage: str) -> None:
        self.stage = stage
        self.calls = 0
        self.requests.start()
        self.requests.toggle()  # counting is off until a wrapped call of the stage

    def end(self) -> tuple[int, int]:
        """(instructions, calls) of the stage just measured."""
        self.stage = None
        self.requests.toggle()  # on, so that the dump's request is in a counted stretch
        self.requests.stop()
        return read_window(self.out_dir), self.calls


class Empty:
    """The wrapper's own cost: a wrapped method that does nothing."""

    def call(self) -> None:
        pass


async def measure(windows: Windows, records: int, passes: int, engine_name: str,
                  datagram_size: int | None) -> dict[str, Any]:  # fmt: skip
    from velomux_quic import StreamSender, TransportConfig, ensure_dev_cluster
    from velomux_quic.mux.driver import BatcherDriver
    from velomux_quic.node import Node
    from velomux_quic.transport.connection import PeerConnection
    from velomux_quic.transport.endpoint import QuicEndpoint

    transport = TransportConfig(engine=engine_name, max_datagram_size=datagram_size)
    with tempfile.TemporaryDirectory(prefix="batch-path-") as certs:
        dirs = ensure_dev_cluster(Path(certs), ("engine", "frontend"))
        engine = await Node.start(dirs["engine"], transport=transport)
        frontend = await Node.start(dirs["frontend"], transport=transport)
        try:
            engine.add_peer(frontend.instance_id, frontend.address)
            frontend.add_peer(engine.instance_id, engine.address)
            anchors = [frontend.create_anchor() for _ in range(records)]
            senders: list[StreamSender] = await asyncio.gather(
                *(engine.anchors.attach_anchor(anchor.handle) for anchor in anchors)
            )
            got = 0
            all_in = asyncio.Event()

            async def read(anchor: Any) -> None:
                nonlocal got
                async for _ in anchor:
                    got += 1
                    if got == records:
                        all_in.set()

            readers = [asyncio.ensure_future(read(anchor)) for anchor in anchors]

            async def one_pass() -> None:
                nonlocal got
                got = 0
                all_in.clear()
                for sender in senders:
                    if not sender.try_send(TOKEN):
                        raise SystemExit("a send found no room: the pass is not one batch")
                await asyncio.wait_for(all_in.wait(), 30)

            engine_endpoint = engine.messenger.transport
            frontend_endpoint = frontend.messenger.transport
            windows.wrap(BatcherDriver, "_run", "write",
                         lambda d: d.messenger is engine.messenger)  # fmt: skip
            windows.wrap(PeerConnection, "transmit", "transmit",
                         lambda c: c.endpoint is engine_endpoint)  # fmt: skip
            windows.wrap(QuicEndpoint, "datagram_received", "receive",
                         lambda e: e is frontend_endpoint)  # fmt: skip
            windows.wrap(QuicEndpoint, "datagrams_received", "receive",
                         lambda e: e is frontend_endpoint)  # fmt: skip
            windows.wrap(PeerConnection, "transmit", "answer",
                         lambda c: c.endpoint is frontend_endpoint)  # fmt: skip
            windows.wrap(BatcherDriver, "_run", "answer",
                         lambda d: d.messenger is frontend.messenger)  # fmt: skip
            windows.wrap(QuicEndpoint, "datagram_received", "acks",
                         lambda e: e is engine_endpoint)  # fmt: skip
            windows.wrap(QuicEndpoint, "datagrams_received", "acks",
                         lambda e: e is engine_endpoint)  # fmt: skip
            windows.wrap(Empty, "call", "empty", lambda _: True)

            for _ in range(WARM_PASSES):
                await one_pass()
            result: dict[str, Any] = {"engine": engine.messenger.transport.engine.name}
            for stage in STAGES:
                windows.begin(stage)
                for _ in range(passes):
                    await one_pass()
                await asyncio.sleep(0.05)  # the answers to the last pass (not synchronisation:
                # a stage counts whatever of its calls fall in its window)
                instructions, calls = windows.end()
                result[stage] = (instructions / passes, calls / passes)
            empty = Empty()
            windows.begin("empty")
            for _ in range(passes):
                empty.call()
            instructions, _ = windows.end()
            result["empty"] = (instructions / passes, 1.0)
            for sender in senders:
                await sender.finalize()
            await asyncio.wait_for(asyncio.gather(*readers), 30)
            return result
        finally:
            await frontend.close()
            await engine.close()


def child(args: argparse.Namespace) -> None:
    windows = Windows(Path(os.environ[ENV_DIR]))
    from velomux_quic.programs.runtime import run
    from velomux_quic.recordpath import IMPLEMENTATION

    results = []
    for records in args.records:
        result = run(measure(windows, records, args.passes, args.engine, args.datagram_size))
        results.append({"records": records, **result})
    print(json.dumps({"record_path": IMPLEMENTATION, "results": results}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--engine", choices=("aioquic", "qh3"), default="aioquic")
    parser.add_argument("--records", type=int, nargs="+", default=[1, 256],
                        help="records per batch (streams, one token each a pass)")  # fmt: skip
    parser.add_argument("--passes", type=int, default=30, help="batches counted per stage")
    parser.add_argument("--datagram-size", type=int, default=None,
                        help="pin both nodes' datagram size (default: per path)")  # fmt: skip
    parser.add_argument("--tree", type=Path, default=None, help="a checkout to measure instead")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    tree = (args.tree or HERE.parent).resolve()
    arguments = [f"--engine={args.engine}", f"--passes={args.passes}", "--records"]
    arguments += [str(records) for records in args.records]
    if args.datagram_size is not None:
        arguments.append(f"--datagram-size={args.datagram_size}")
    report: dict[str, Any] = run_in_tree(__file__, arguments, tree)
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "batch_path", "tree": str(tree), **report}))
    size = args.datagram_size or "per path"
    print(f"{tree} ({report['record_path']}), datagram size {size}: instructions per batch")
    for result in report["results"]:
        print(f"  {result['engine']}, {result['records']} records a batch")
        total = 0.0
        for stage in (*STAGES, "empty"):
            instructions, calls = result[stage]
            if stage != "empty":
                total += instructions
            print(f"    {stage:<9} {instructions:10,.0f}  ({calls:.2f} calls)")
        print(f"    {'total':<9} {total:10,.0f}")


if __name__ == "__main__":
    main()
