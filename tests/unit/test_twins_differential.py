"""Differential properties: the compiled record path and its pure-Python twin, fed the same
inputs (hostile batches included), give the same bytes out, the same deliveries, the same
replies, the same errors and the same counters.

Each example runs a scenario of ``tests/unit/twin_scenarios.py`` in this process and in a
process of the other twin (``tests/unit/twin_oracle.py``, started once per module with
``VELOMUX_PURE_PYTHON`` set the other way), and compares the two results whole. The
default run is compiled, so the oracle is pure; the pure pass of ``.ci/run`` reverses them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit import twin_scenarios
from velomux_quic.mux.protocol import (
    BatchHeader,
    CloseReason,
    LifecycleAction,
    RecordType,
    close_slot_body,
    credit_body,
    encode_batch,
    lifecycle_body,
    open_slot_body,
    slot_id,
)
from velomux_quic.recordpath import IMPLEMENTATION, PURE_PYTHON_ENV
from velomux_quic.streaming.frames import DROPPED, FINALIZED, HEARTBEAT, encode_item

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = int(os.environ.get("VELOMUX_TWIN_EXAMPLES", "60"))
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Oracle:
    """The other twin's process: one JSON request and one JSON answer per line."""

    def __init__(self) -> None:
        other = "0" if IMPLEMENTATION == "pure-python" else "1"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.unit.twin_oracle"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, PURE_PYTHON_ENV: other},
        )
        assert self.process.stdout is not None
        self.implementation = json.loads(self.process.stdout.readline())

    def run(self, name: str, *args: Any) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps([name, args]) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, "the other twin's process died"
        return json.loads(line)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture(scope="module")
def oracle() -> Iterator[Oracle]:
    other = Oracle()
    try:
        yield other
    finally:
        other.close()


def both(oracle: Oracle, name: str, *args: Any) -> Any:
    """The scenario on this twin and on the other; they must agree whole."""
    # A JSON round trip, so both results compare in the same shapes (lists, not tuples).
    here = json.loads(json.dumps(twin_scenarios.SCENARIOS[name](*json.loads(json.dumps(args)))))
    there = oracle.run(name, *args)
    assert here == there
    return here


def test_the_oracle_runs_the_other_twin(oracle: Oracle) -> None:
    assert {oracle.implementation, IMPLEMENTATION} == {"compiled", "pure-python"}


# -- batches, well formed and hostile -------------------------------------------------------

u32 = st.integers(0, 0xFFFF_FFFF)
control_bodies = st.sampled_from(
    [
        (int(RecordType.OPEN_SLOT), open_slot_body(7, 9)),
        (int(RecordType.CLOSE_SLOT), close_slot_body(CloseReason.TERMINAL_SENT)),
        (int(RecordType.CLOSE_SLOT), b"\x09"),
        (int(RecordType.CREDIT_UPDATE), credit_body(4)),
        (int(RecordType.CREDIT_UPDATE), b"\x00\x01"),
        (int(RecordType.SLOT_HEARTBEAT), b""),
        (int(RecordType.LIFECYCLE_SLOT), lifecycle_body(5, LifecycleAction.STOP)),
        (9, b"\x00"),
    ]
)
records = st.lists(
    st.one_of(
        st.tuples(st.just(0), u32, u32, st.binary(max_size=40)),
        st.tuples(control_bodies, u32, u32).map(lambda r: (r[0][0], r[1], r[2], r[0][1])),
    ),
    max_size=12,
)


def _batch(recs: list[tuple[int, int, int, bytes]], lane: int, epoch: int, seq: int) -> bytes:
    try:
        return encode_batch(BatchHeader(lane, len(recs), epoch, seq), recs)
    except ValueError:  # a control body the encoder refuses: send it raw below
        parts = [bytes([2, lane]) + len(recs).to_bytes(2, "big") + epoch.to_bytes(8, "big")]
        parts.append(seq.to_bytes(4, "big"))
        for kind, slot, frame, body in recs:
            parts.append(
                bytes([kind]) + slot.to_bytes(4, "big") + frame.to_bytes(4, "big")
                + len(body).to_bytes(4, "big") + body
            )  # fmt: skip
        return b"".join(parts)


@st.composite
def hostile_batches(draw: st.DrawFn) -> bytes:
    data = _batch(draw(records), draw(st.integers(0, 15)), draw(u32), draw(u32))
    how = draw(st.sampled_from(["as is", "cut", "extend", "flip", "count", "junk"]))
    if how == "cut":
        return data[: draw(st.integers(0, len(data)))]
    if how == "extend":
        return data + draw(st.binary(min_size=1, max_size=8))
    if how == "flip" and data:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    if how == "count" and len(data) >= 4:
        return data[:2] + draw(st.integers(0, 0xFFFF)).to_bytes(2, "big") + data[4:]
    if how == "junk":
        return draw(st.binary(max_size=64))
    return data


@PROPERTY
@given(data=hostile_batches())
def test_decoding_a_batch_agrees(oracle: Oracle, data: bytes) -> None:
    both(oracle, "decode", data.hex())


build_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.sampled_from([0, 1, 2, 3, 4, 5, 6, 300]),
            st.integers(-1, 1 << 33),
            u32,
            st.binary(max_size=24).map(bytes.hex),
        ),
        st.tuples(
            st.just("add_data"), u32, st.integers(0, 1 << 33), st.binary(max_size=24).map(bytes.hex)
        ),
        st.tuples(
            st.just("add_credit"),
            st.one_of(u32, st.integers(-1, 1 << 33)),
            st.one_of(u32, st.integers(-1, 1 << 33)),
        ),
        st.tuples(st.just("if_fits"), u32, u32, st.binary(max_size=60).map(bytes.hex)),
        st.tuples(st.just("fits"), st.integers(0, 200)),
        st.tuples(st.just("finish"), st.integers(-1, 17), st.integers(0, 1 << 65), u32),
        st.tuples(st.just("reset")),
    ).map(list),
    max_size=20,
)


@PROPERTY
@given(cap=st.integers(20, 160), ops=build_ops)
def test_building_a_batch_agrees(oracle: Oracle, cap: int, ops: list[list[Any]]) -> None:
    both(oracle, "build", cap, ops)


# -- egress -------------------------------------------------------------------------------

egress_ops = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.integers(1, 50), st.integers(1, 1 << 40)),
        st.tuples(st.just("offer"), st.integers(0, 9), st.integers(0, 90)),
        st.tuples(st.just("offer"), st.integers(0, 9), st.integers(0, 90)),
        st.tuples(st.just("offer"), st.integers(0, 9), st.integers(0, 12)),
        st.tuples(st.just("poll")),
        st.tuples(st.just("poll")),
        st.tuples(st.just("terminal"), st.integers(0, 9)),
        st.tuples(st.just("credit"), st.integers(0, 9), st.integers(1, 6)),
        st.tuples(st.just("peer_close"), st.integers(0, 9)),
        st.tuples(st.just("cancel"), st.integers(0, 9)),
        st.tuples(st.just("lifecycle"), st.integers(0, 9), st.sampled_from([1, 2])),
        st.tuples(st.just("kick")),
        st.tuples(st.just("reply_credit"), u32, st.integers(1, 9)),
        st.tuples(st.just("epoch_death")),
    ).map(list),
    max_size=60,
)
egress_configs = st.fixed_dictionaries(
    {
        "max_batch_bytes": st.sampled_from([29, 90, 160, 400, 60 * 1024]),
        "initial_credit": st.integers(1, 5),
        "slot_byte_budget": st.sampled_from([40, 150, 1 << 20]),
        "peer_queue_bytes": st.sampled_from([60, 300, 1 << 21]),
        "linger": st.sampled_from([None, 0.001]),
    }
)


@PROPERTY
@given(config=egress_configs, ops=egress_ops)
def test_an_egress_batcher_agrees(
    oracle: Oracle, config: dict[str, Any], ops: list[list[Any]]
) -> None:
    # Two streams open and announced first, so most examples stage and pack records.
    opened = [["open", 1, 11], ["open", 2, 22], ["poll"]]
    both(oracle, "egress", config, opened + ops)


# -- a pass through senders ---------------------------------------------------------------

items = st.one_of(
    st.integers(-(2**70), 2**70),  # past MessagePack's 64 bits: SerializationError
    st.text(max_size=30),
    st.lists(st.integers(0, 9), max_size=4),
    st.dictionaries(st.sampled_from(["t", "s", "x"]), st.integers(0, 2**40), max_size=3),
)
pass_steps = st.lists(
    st.one_of(
        st.tuples(st.just("pass"), st.lists(st.tuples(st.integers(0, 9), items), max_size=12)),
        st.tuples(st.just("pass"), st.lists(st.tuples(st.integers(0, 9), items), max_size=12)),
        st.tuples(st.just("send"), st.integers(0, 9), items),
        st.tuples(st.just("try_send"), st.integers(0, 9), items),
        st.tuples(st.just("credit"), st.integers(0, 9), st.integers(1, 6)),
        st.tuples(st.just("finalize"), st.integers(0, 9)),
        st.tuples(st.just("cancel"), st.integers(0, 9)),
        st.tuples(st.just("settle")),
        st.tuples(st.just("settle")),
    ).map(list),
    max_size=25,
)
pass_configs = st.fixed_dictionaries(
    {
        "max_batch_bytes": st.sampled_from([90, 400, 60 * 1024]),
        "initial_credit": st.integers(1, 5),
        "slot_byte_budget": st.sampled_from([40, 150, 1 << 20]),
        "peer_queue_bytes": st.sampled_from([60, 300, 1 << 21]),
    }
)


@PROPERTY
@given(config=pass_configs, streams=st.integers(1, 6), steps=pass_steps)
def test_a_pass_through_senders_agrees(
    oracle: Oracle, config: dict[str, Any], streams: int, steps: list[list[Any]]
) -> None:
    """``send_pass``'s loop, ``send`` and ``try_send`` staging into mux channels (the
    compiled ones call each other in C): the same outcomes, errors, batches and counters."""
    both(oracle, "passes", config, streams, steps)


# -- ingress ------------------------------------------------------------------------------

BINDS = 4


RECORD_MIX = ["item"] * 80 + ["terminal", "close", "heartbeat", "credit", "lifecycle", "dropped"]
RECORD_MIX.append("open")  # a second OpenSlot of a live slot ends it (slot_collision): rare
STEP_MIX = ["batch"] * 4 + ["take"] * 3 + ["visit", "sweep", "withdraw"]


@st.composite
def ingress_steps(draw: st.DrawFn) -> list[list[Any]]:
    """Batches a sender might write (OpenSlots, items in order, duplicates, gaps, terminals,
    closes, heartbeats, control), now and then corrupted, with the consumers' takes between."""
    expected = [0] * (BINDS + 2)  # per slot index: the next frame_seq this sender writes
    epoch = 50
    batch_seq = 0
    steps: list[list[Any]] = []
    if draw(st.integers(0, 9)):  # most senders open their streams first
        opens = [(1, slot_id(i, 0), 0, open_slot_body(100 + i, 200 + i)) for i in range(BINDS)]
        expected[:BINDS] = [1] * BINDS
        batch_seq += 1
        steps.append(["batch", _batch(opens, 0, epoch, batch_seq).hex(), False])
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(
            st.sampled_from(
                ["batch", "batch", "batch", "take", "take", "visit", "sweep", "withdraw"]
            )
        )
        if kind != "batch":
            steps.append([kind, draw(st.integers(0, BINDS)), draw(st.integers(1, 6))])
            continue
        recs: list[tuple[int, int, int, bytes]] = []
        for _ in range(draw(st.integers(0, 10))):
            index = draw(
                st.integers(0, BINDS - 1) if draw(st.integers(0, 9)) else st.integers(0, BINDS + 1)
            )
            sid = slot_id(index, 0 if draw(st.integers(0, 9)) else 1)
            what = draw(st.sampled_from(RECORD_MIX))
            if what == "open":
                recs.append((1, sid, 0, open_slot_body(100 + index, 200 + index)))
                expected[index] = 1
                continue
            if what == "credit":
                recs.append((3, sid, 0, credit_body(draw(st.integers(1, 4)))))
                continue
            if what == "lifecycle":
                recs.append((5, 0, 0, lifecycle_body(200 + index, LifecycleAction.STOP)))
                continue
            step = 0 if draw(st.integers(0, 5)) else draw(st.sampled_from([-1, 1, 2]))
            seq = max(0, expected[index] + step)
            if seq >= expected[index]:
                expected[index] = seq + 1
            if what == "item":
                body = encode_item({"t": draw(st.integers(0, 1000))})
                recs.append((0, sid, seq, body))
            elif what == "terminal":
                recs.append((0, sid, seq, FINALIZED))
            elif what == "dropped":
                recs.append((0, sid, seq, DROPPED))
            elif what == "heartbeat":
                recs.append((4, sid, seq, b"" if draw(st.booleans()) else HEARTBEAT))
            else:
                recs.append((2, sid, seq, close_slot_body(CloseReason.TERMINAL_SENT)))
        if draw(st.integers(0, 19)) == 0:
            epoch += 1
            batch_seq = 0
        batch_seq += draw(st.sampled_from([1, 1, 1, 2, 0]))
        data = _batch(recs, 0 if draw(st.integers(0, 19)) else 1, epoch, batch_seq)
        if draw(st.integers(0, 11)) == 0 and data:
            at = draw(st.integers(0, len(data) - 1))
            data = data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :]
        steps.append(["batch", data.hex(), draw(st.integers(0, 19)) == 0])
    # Every consumer reads what is left, then the credit those reads owe goes back.
    return [*steps, *(["take", index, 40] for index in range(BINDS)), ["visit", 0, 0]]


ingress_configs = st.fixed_dictionaries(
    {
        "initial_credit": st.sampled_from([1, 3, 32, 32]),
        "slot_byte_budget": st.sampled_from([30, 120, 1 << 20]),
        "peer_byte_budget": st.sampled_from([60, 1 << 23]),
        "drain_visit_floor": st.sampled_from([0.0, 0.002]),
        "max_slots_per_table": st.sampled_from([3, 65_536]),
        "max_refused_slots": st.sampled_from([1, 8]),
    }
)


@PROPERTY
@given(config=ingress_configs, steps=ingress_steps())
def test_an_ingress_table_and_its_consumers_agree(
    oracle: Oracle, config: dict[str, Any], steps: list[list[Any]]
) -> None:
    both(oracle, "ingress", config, BINDS, steps)


def test_a_differential_scenario_can_fail(oracle: Oracle) -> None:
    """The comparison is not vacuous: the two twins' results differ when the inputs do."""
    one = oracle.run("decode", _batch([(0, 1, 1, b"x")], 0, 1, 1).hex())
    other = twin_scenarios.decode(_batch([(0, 1, 2, b"x")], 0, 1, 1).hex())
    assert json.loads(json.dumps(other)) != one
