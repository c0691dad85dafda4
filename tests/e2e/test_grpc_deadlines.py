"""A gRPC client that stops reading a stream cannot hold its call (deploy/grpc_server.py:
a message that waits the send timeout for the client ends the call with DEADLINE_EXCEEDED and
closes the servicer's stream, which is what aborts a request on the worker).

grpcio's real server and client on loopback, through `add_generation_servicer` (what `folio
serve` uses), with a servicer whose stream is large messages (64 KiB of text each), so that
HTTP/2 flow control fills after a few MiB, and a send timeout of 1 s: the slow reader's longest
gap between two window updates (~0.2 s) stays well inside it on a loaded host, where the client's
reads (in this process, beside the server's thread) can stall for a few tenths of a second."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from folio.deploy.grpc_server import add_generation_servicer
from folio.v1 import generate_pb2 as pb
from folio.v1 import generate_pb2_grpc as pb_grpc

T = 1.0


class BigStreams:
    """GenerateStream: `max_tokens` messages of 64 KiB; records how each stream ended."""

    def __init__(self) -> None:
        self.closed: list[str] = []  # request ids whose stream was closed (the request's abort)
        self.sent: dict[str, int] = {}

    async def GenerateStream(self, request, context):
        rid = request.request_id
        self.sent[rid] = 0
        try:
            for i in range(request.sampling.max_tokens):
                yield pb.GenerateStreamResponse(request_id=rid, deltas=[pb.Completion(text="x" * 65536)],
                                                finished=i == request.sampling.max_tokens - 1)
                self.sent[rid] += 1
        finally:
            self.closed.append(rid)

    async def Generate(self, request, context):
        return pb.GenerateResponse(request_id=request.request_id)

    async def Abort(self, request, context):
        return pb.AbortResponse(aborted=False)

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo()


@pytest.fixture(scope="module")
def served():
    servicer, loop, ready = BigStreams(), asyncio.new_event_loop(), threading.Event()
    holder = {}

    async def start():
        server = grpc.aio.server()
        add_generation_servicer(servicer, server, send_timeout_s=T)
        holder["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        holder["server"] = server
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop)
    assert ready.wait(10)
    channel = grpc.insecure_channel(f"127.0.0.1:{holder['port']}")
    yield servicer, pb_grpc.GenerationStub(channel)
    channel.close()
    asyncio.run_coroutine_threadsafe(holder["server"].stop(1), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def req(rid: str, n: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, sampling=pb.SamplingParameters(max_tokens=n))


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_stream_the_client_stops_reading_ends_deadline_exceeded_and_is_closed(served):
    servicer, stub = served
    stream = stub.GenerateStream(req("unread", 2000))  # 125 MiB: far past any window
    next(stream)  # then never read
    assert wait_for(lambda: "unread" in servicer.closed, T + 5), "the servicer's stream was never closed"
    assert servicer.sent["unread"] < 2000
    got = 0
    with pytest.raises(grpc.RpcError) as e:
        for _ in stream:  # what was in flight, then the status
            got += 1
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "took none of the stream's" in e.value.details()
    assert got < 1999


def test_a_slow_reader_that_keeps_reading_gets_its_whole_stream(served):
    servicer, stub = served
    t0, n = time.monotonic(), 0
    for m in stub.GenerateStream(req("slow", 320)):  # 20 MiB, read at < 10 MiB/s: the window's
        n += 1                                        # updates (every ~2 MiB) come ~0.2 s apart
        time.sleep(T / 160)
    assert n == 320 and m.finished
    assert time.monotonic() - t0 > 1.5 * T  # it waited on the client longer than the timeout in all


def test_a_client_cancel_is_still_a_cancel(served):
    servicer, stub = served
    stream = stub.GenerateStream(req("cancelled", 2000))
    next(stream)
    stream.cancel()
    assert wait_for(lambda: "cancelled" in servicer.closed, 5)
    assert servicer.sent["cancelled"] < 2000
