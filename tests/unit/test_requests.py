"""Incoming request streams (sans-IO): what a peer dribbling or abandoning requests costs."""

from __future__ import annotations

from typing import cast

from velomux_quic.ids import new_instance_id
from velomux_quic.transport.aioquic_engine import EngineConnection
from velomux_quic.transport.requests import MAX_REQUEST, IncomingRequests


class _Stream:
    """Stands in for the QUIC connection: records what the request layer did to streams."""

    def __init__(self) -> None:
        self.refused: list[int] = []
        self.answered: dict[int, bytes] = {}

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        self.refused.append(stream_id)

    def stop_stream(self, stream_id: int, error_code: int) -> None:
        pass

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        self.answered[stream_id] = data


class _CountedBytes(bytes):
    """A chunk that counts how often anything asks its length (one visit of the chunk)."""

    visits = 0

    def __len__(self) -> int:
        _CountedBytes.visits += 1
        return super().__len__()


def _incoming(quic: _Stream, refusals: list[str] | None = None) -> IncomingRequests:
    async def serve(peer: object, request: bytes) -> bytes:
        return request[::-1]

    peer = new_instance_id()
    seen = refusals if refusals is not None else []
    return IncomingRequests(
        cast(EngineConnection, quic), lambda: None, serve, lambda: peer, seen.append
    )


async def test_one_byte_frames_cost_work_linear_in_their_number() -> None:
    quic = _Stream()
    requests = _incoming(quic)
    streams, chunks = 20, 200  # 4,000 frames: the old re-summing visited 400,000 chunks
    _CountedBytes.visits = 0
    for _ in range(chunks):
        for stream in range(streams):
            requests.data(4 * stream + 1, _CountedBytes(b"x"), end_stream=False)
    assert requests.partial_count == streams
    assert _CountedBytes.visits <= 2 * streams * chunks, _CountedBytes.visits
    assert quic.refused == []


async def test_a_request_past_max_request_is_refused_by_its_running_length() -> None:
    quic = _Stream()
    refusals: list[str] = []
    requests = _incoming(quic, refusals)
    chunk = bytes(1024)
    for _ in range(MAX_REQUEST // len(chunk)):
        requests.data(1, chunk, end_stream=False)
    assert quic.refused == [] and requests.partial_count == 1
    requests.data(1, b"!", end_stream=False)
    assert quic.refused == [1] and requests.partial_count == 0
    assert refusals == ["request_too_large"]


async def test_a_reset_request_stream_frees_its_partial_request() -> None:
    quic = _Stream()
    requests = _incoming(quic)
    requests.data(1, b"half a req", end_stream=False)
    requests.data(5, b"another", end_stream=False)
    assert requests.partial_count == 2
    requests.reset(1)
    assert requests.partial_count == 1
    requests.data(5, b"!", end_stream=True)
    assert requests.partial_count == 0
