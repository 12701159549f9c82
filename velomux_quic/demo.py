"""``velomux demo``: a decode engine streaming tokens to a frontend in another process.

The frontend (node-b, a child process) creates one anchor per request and hands the
handles over. The engine (node-a, this process) attaches a sender to each, then runs
forward passes: one token per live request per pass, the shape of LLM decoding. The
frontend reads every stream with its own task, checks each arrived complete and in order,
and reports back, including who it verified the engine to be. Both nodes authenticate
each other with certificates made on demand.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .ids import InstanceId, StreamAnchorHandle
from .node import Node
from .runtime import run
from .security.certs import ensure_dev_cluster

__all__ = ["add_demo_commands"]


async def _frontend(args: argparse.Namespace) -> int:
    """node-b: anchors in, tokens checked, report out."""
    async with await Node.start(args.credentials) as node:
        anchors = [node.create_anchor() for _ in range(args.streams)]
        print(
            json.dumps(
                {
                    "instance": str(node.instance_id),
                    "address": node.address,
                    "handles": [
                        [a.handle.to_wire()["hi"], a.handle.to_wire()["lo"]] for a in anchors
                    ],
                }
            ),
            flush=True,
        )

        async def read(index: int) -> tuple[int, bool]:
            expected = 0
            in_order = True
            async for token in anchors[index]:
                in_order &= token == [index, expected]
                expected += 1
            return expected, in_order

        results = await asyncio.wait_for(
            asyncio.gather(*map(read, range(args.streams))), args.timeout
        )
        print(
            json.dumps(
                {
                    "tokens": sum(count for count, _ in results),
                    "in_order": all(ok for _, ok in results),
                    "metrics": {
                        line.split()[0]: float(line.split()[1])
                        for line in node.metrics_text().splitlines()
                        if line.startswith("velo_streaming_frames_received_total")
                    },
                }
            ),
            flush=True,
        )
    return 0


async def _demo(args: argparse.Namespace) -> int:
    nodes = ensure_dev_cluster(args.certs, ("node-a", "node-b"))
    async with await Node.start(nodes["node-a"]) as engine:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "velomux_quic.cli", "demo-frontend",
            "--credentials", str(nodes["node-b"]), "--streams", str(args.streams),
            "--timeout", str(args.timeout),
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            assert child.stdout is not None
            hello = json.loads(await asyncio.wait_for(child.stdout.readline(), args.timeout))
            frontend = InstanceId.parse(hello["instance"])
            engine.add_peer(frontend, (hello["address"][0], hello["address"][1]))
            print(
                f"engine   node-a {engine.instance_id} on {engine.address[0]}:{engine.address[1]}"
            )
            print(f"frontend node-b {frontend} on {hello['address'][0]}:{hello['address'][1]} "
                  f"(child pid {child.pid}), {args.streams} requests")  # fmt: skip
            started = time.perf_counter()
            handles = [StreamAnchorHandle.pack(hi, lo) for hi, lo in hello["handles"]]
            senders = await asyncio.gather(*(engine.attach_anchor(h) for h in handles))
            attach_ms = 1e3 * (time.perf_counter() - started)
            keys = {str(s.negotiated_transport()) for s in senders}
            print(
                f"attached {len(senders)} streams in {attach_ms:.0f} ms, transport {sorted(keys)}"
            )
            started = time.perf_counter()
            for step in range(args.tokens):
                for index, sender in enumerate(senders):
                    await sender.send([index, step])
                engine.flush_batch()  # one write per peer per pass, once the mux is in
            retired = await asyncio.gather(*(s.finalize() for s in senders))
            report: dict[str, Any] = json.loads(
                await asyncio.wait_for(child.stdout.readline(), args.timeout)
            )
            elapsed = time.perf_counter() - started
            tokens = args.streams * args.tokens
            print(f"{args.tokens} forward passes: {tokens} tokens in {elapsed:.2f} s "
                  f"({tokens / elapsed:,.0f} tokens/s)")  # fmt: skip
            print(f"frontend received {int(report['tokens'])} tokens, every stream in order: "
                  f"{report['in_order']}; all {len(retired)} streams retired as "
                  f"{sorted({r.value for r in retired})}")  # fmt: skip
            ok = report["in_order"] and report["tokens"] == tokens
            print("demo OK" if ok else "demo FAILED")
            exit_code = await asyncio.wait_for(child.wait(), args.timeout)
            return 0 if ok and exit_code == 0 else 1
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()


def add_demo_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser("demo", help="an engine streams tokens to a frontend process")
    demo.add_argument("--certs", type=Path, default=Path("certs/dev"),
                      help="where dev certificates live (made on demand)")  # fmt: skip
    demo.add_argument("--streams", type=int, default=256, help="concurrent requests")
    demo.add_argument("--tokens", type=int, default=64, help="tokens per request")
    demo.add_argument("--timeout", type=float, default=120.0)
    demo.set_defaults(handler=lambda args: run(_demo(args)))

    frontend = commands.add_parser("demo-frontend", help=argparse.SUPPRESS)
    frontend.add_argument("--credentials", type=Path, required=True)
    frontend.add_argument("--streams", type=int, default=256)
    frontend.add_argument("--timeout", type=float, default=120.0)
    frontend.set_defaults(handler=lambda args: run(_frontend(args)))
