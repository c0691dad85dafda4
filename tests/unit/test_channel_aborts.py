"""A frontend's channel to a worker (cluster/channel.py) sends a stream's abort at once, even
while an earlier batch waits for its reply, and never more than once; every abort still goes
out after its request's submit.

The channel is real, on a real loopback socket with the data plane's own framing; the worker's
end is scripted (`Peer`: it takes the hello, records each frame, and answers a batch only when
the test says), so that a batch can be held unanswered, which a real worker never does for
long; tests/cluster/test_data_plane.py covers the real worker."""

import asyncio
import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.cluster.channel import Channel
from folio.worker import data_plane
from folio.worker.errors import ShuttingDownError
from folio.worker.messages import GenerateRequest, StreamChunk
from folio.worker.sampling_params import SamplingParams


class Peer:
    def __init__(self) -> None:
        self.frames: list = []  # (seq, [(kind, arg), ...]) in the order they came
        self.writer = None
        self.came = asyncio.Event()

    async def start(self) -> "Peer":
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _conn(self, reader, writer) -> None:
        await reader.readline()  # the hello
        self.writer = writer
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                self.frames.append(await data_plane.read_frame(reader))
                self.came.set()

    async def frame(self, timeout: float = 5.0):
        """The next frame not yet taken."""
        async def one():
            while len(self.frames) <= self._taken:
                self.came.clear()
                await self.came.wait()
        await asyncio.wait_for(one(), timeout)
        self._taken += 1
        return self.frames[self._taken - 1]
    _taken = 0

    def answer(self, seq: int, n: int) -> None:
        data_plane.write_frame(self.writer, ("r", seq, [None] * n))

    def messages(self) -> list:
        return [m for _, batch in self.frames for m in batch]

    async def stop(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.server.close()


class Client:  # what Channel asks of RayWorkerClient: the worker's data address (a Ray call there)
    def __init__(self, port: int) -> None:
        self.port = port

    async def call(self, wid, method, *args):
        assert method == "data_address"
        return "127.0.0.1", self.port, "token"

    def forget(self, wid) -> None:
        pass

    dropped: list

    def drop_moved(self, wid, rid) -> None:
        self.__dict__.setdefault("dropped", []).append((wid, rid))


def _submit(rid: str) -> tuple:
    return "submit", GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4))


async def _open(ch: Channel, rid: str):
    """A stream whose submit is queued; its reader waits for its first chunk."""
    gen = ch.stream(rid, _submit(rid))
    task = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0)
    return gen, task


async def _answered(rid: str):
    """A peer, a channel to it, and a stream on it whose submit's batch has been answered."""
    peer = await Peer().start()
    ch = Channel(Client(peer.port), "w")
    stream = await _open(ch, rid)
    seq, _ = await peer.frame()
    peer.answer(seq, 1)
    return peer, ch, stream


async def _leave(gen, task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
        await task
    await gen.aclose()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_an_abort_goes_out_while_a_batch_waits_for_its_reply():
    async def main():
        peer = await Peer().start()
        ch = Channel(Client(peer.port), "w")
        a = await _open(ch, "a")
        assert (await peer.frame())[1] == [_submit("a")]  # batch 1, never answered here
        b = await _open(ch, "b")  # queued behind batch 1's reply (a submit waits for it, as before)
        await _leave(*a)
        seq, batch = await peer.frame(timeout=2.0)  # it waited for batch 1's reply until 2026-12-06
        assert (seq, batch) == (0, [("abort", "a")])
        peer.answer(1, 1)
        assert (await peer.frame())[1] == [_submit("b")]
        await _leave(*b)
        assert (await peer.frame())[1] == [("abort", "b")]
        await peer.stop()
    run(main())


def test_abort_soon_sends_one_abort_and_the_close_none():
    async def main():
        peer, ch, a = await _answered("a")
        ch.abort_soon("a")
        ch.abort_soon("a")
        assert (await peer.frame())[1] == [("abort", "a")]
        await _leave(*a)  # the reader sees its client gone later: nothing more goes out for "a"
        c = await _open(ch, "c")
        assert (await peer.frame())[1] == [_submit("c")]
        ch.abort_soon("unknown")  # not streamed here: nothing
        await _leave(*c)
        assert (await peer.frame())[1] == [("abort", "c")]
        assert [m for m in peer.messages() if m[0] == "abort"] == [("abort", "a"), ("abort", "c")]
        await peer.stop()
    run(main())


def test_leaving_after_the_connection_closed_under_the_channel_does_not_raise():
    """uvloop (Ray's loop) raises on a write to a closed transport: a stream left between the
    connection's loss and its reader seeing it must not raise from its close."""
    import uvloop

    async def main():
        peer, ch, a = await _answered("a")
        await asyncio.sleep(0.05)
        ch.connected.result().transport.abort()  # closed at once; the reader learns it a turn later
        await _leave(*a)
        await peer.stop()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        r.run(asyncio.wait_for(main(), 30))


OPS = st.lists(st.one_of(st.tuples(st.sampled_from(["open", "leave", "soon"]), st.integers(0, 5)),
                         st.just(("answer", 0)), st.just(("cut", 0))), max_size=30)
CUT = ShuttingDownError("the replica stopped")


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_any_interleaving_sends_each_abort_once_and_after_its_submit(ops):
    """Streams opened, left, aborted early and cut (a drain's end) in any order, the worker's
    replies coming at any point: each request left or cut gets exactly one abort, after its
    submit; none is sent for the rest."""
    async def main():
        peer = await Peer().start()
        ch = Channel(Client(peer.port), "w")
        streams: dict[int, tuple] = {}
        left: set[str] = set()
        opened: list[str] = []
        answered = 0
        for op, k in ops:
            if op == "open" and k not in streams:
                rid = f"r{len(opened)}"
                opened.append(rid)
                streams[k] = (rid, *await _open(ch, rid))
            elif op == "leave" and k in streams:
                rid, gen, task = streams.pop(k)
                await _leave(gen, task)
                left.add(rid)
            elif op == "soon" and k in streams:
                ch.abort_soon(streams[k][0])
                left.add(streams[k][0])
            elif op == "cut":  # a drain's end (Channel.cut): every open stream ends with the error
                ch.cut(CUT)
                for rid, gen, task in streams.values():
                    with pytest.raises(ShuttingDownError):
                        await task
                    await gen.aclose()
                    left.add(rid)
                streams.clear()
            elif op == "answer":
                await asyncio.sleep(0.01)
                for seq, batch in peer.frames[answered:]:
                    if seq:
                        peer.answer(seq, len(batch))
                answered = len(peer.frames)
            await asyncio.sleep(0)
        for rid, gen, task in streams.values():
            await _leave(gen, task)
            left.add(rid)
        for _ in range(100):  # answer whatever is still waiting until every abort is out
            await asyncio.sleep(0.01)
            for seq, batch in peer.frames[answered:]:
                if seq:
                    peer.answer(seq, len(batch))
            answered = len(peer.frames)
            if sum(m[0] == "abort" for m in peer.messages()) == len(left):
                break
        msgs = peer.messages()
        for rid in opened:
            aborts = [i for i, m in enumerate(msgs) if m == ("abort", rid)]
            submits = [i for i, m in enumerate(msgs) if m[0] == "submit" and m[1].request_id == rid]
            assert len(aborts) == (rid in left), (rid, msgs)
            assert not aborts or (submits and submits[0] < aborts[0]), (rid, msgs)
        await peer.stop()
    run(main())


def test_a_reader_gone_before_it_read_its_move_has_the_import_dropped_where_it_went():
    """The worker's move marker (the request runs on w2 now) is in the inbox unread when the
    reader leaves (its stream closed, or its client lost first: abort_soon), or comes after
    the reader left: the import is dropped on w2, once, and no abort goes to this worker,
    where the request no longer is (there it found nothing, and the request ran on, unread)."""
    def marker(rid):
        return ("c", [(rid, StreamChunk(request_id=rid, worker_id="w", deltas=[], migrated_to="w2"))])

    async def main():
        for how in ("close", "soon", "marker-after"):
            peer, ch, (gen, task) = await _answered("a")
            if how != "marker-after":
                data_plane.write_frame(peer.writer, ("c", [("a", StreamChunk(request_id="a", worker_id="w",
                                                                              deltas=[]))]))
                await task  # the reader took that chunk, and reads no more
                data_plane.write_frame(peer.writer, marker("a"))
                for _ in range(500):
                    if ch.inboxes["a"].items:
                        break
                    await asyncio.sleep(0.01)
                if how == "soon":
                    ch.abort_soon("a")
                    ch.abort_soon("a")
                await gen.aclose()
                assert not [m for m in peer.messages() if m[0] == "abort"], how
            else:
                await _leave(gen, task)  # the abort goes here; the move comes after it
                assert (await peer.frame())[1] == [("abort", "a")]
                data_plane.write_frame(peer.writer, marker("a"))
                for _ in range(500):
                    if getattr(ch.client, "dropped", None):
                        break
                    await asyncio.sleep(0.01)
            assert ch.client.dropped == [("w2", "a")], how
            await peer.stop()
    run(main())


def test_a_cut_ends_each_stream_with_its_error_after_what_came_and_aborts_only_what_runs():
    """Channel.cut (a frontend replica's drain at its end): a stream gets the tokens already
    come first, then the error, and its request is aborted on the worker, once; a request whose
    last chunk came ends as it is (no abort); one whose move marker is unread has its import
    dropped where it went (no abort here, where it no longer runs) and never reads the move."""
    def chunk(rid, **kw):
        return rid, StreamChunk(request_id=rid, worker_id="w", deltas=[], **kw)

    async def main():
        peer = await Peer().start()
        client = Client(peer.port)
        ch = Channel(client, "w")
        streams = {rid: await _open(ch, rid) for rid in ("run", "done", "moved")}
        seq, _ = await peer.frame()
        peer.answer(seq, 3)
        data_plane.write_frame(peer.writer, ("c", [chunk("run"), chunk("done"), chunk("moved")]))
        for gen, task in streams.values():
            await task  # each read its first chunk
        data_plane.write_frame(peer.writer, ("c", [chunk("run"), chunk("done", finished=True),
                                                   chunk("moved", migrated_to="w2")]))
        for _ in range(500):
            if all(ch.inboxes[rid].items for rid in streams):
                break
            await asyncio.sleep(0.01)
        ch.cut(CUT)
        ch.cut(CUT)  # a second cut sends nothing more
        got = {}
        for rid, (gen, _) in streams.items():
            got[rid] = []
            try:
                async for c in gen:
                    got[rid].append((c.finished, c.migrated_to))
            except ShuttingDownError:
                got[rid].append("error")
        assert got == {"run": [(False, None), "error"], "done": [(True, None)], "moved": ["error"]}, got
        assert (await peer.frame())[1] == [("abort", "run")]
        assert client.dropped == [("w2", "moved")]
        await asyncio.sleep(0.05)
        assert [m for m in peer.messages() if m[0] == "abort"] == [("abort", "run")]
        await peer.stop()
    run(main())
