"""A worker whose whole node stopped (its raylet with it, so no kill lands) kept its frontends' streams
open for as long as it stayed stopped: 45-100 s in a two-node attack (2026-12-08). The frontend now fails
them itself (cluster/liveness.py SilentChannelWatch, Channel.cut_if_silent) once the worker's heartbeat
has lapsed for the bound, Redis reachable, and its channel has carried nothing as long; a worker that
still streams (cut off from Redis only) is never cut, nor one that beats.

The channel is real, on a loopback socket with the data plane's framing; the worker's end is a peer
that takes the hello and the frames and then answers nothing (a stopped process keeps its socket),
or one that sends a frame every 50 ms (a live worker)."""

import asyncio
import contextlib

import pytest
from hypothesis import given, settings, strategies as st

from folio.cluster.channel import Channel, WorkerDiedError
from folio.cluster.liveness import SilentChannelWatch
from folio.worker import data_plane
from folio.worker.messages import GenerateRequest, StreamChunk
from folio.worker.sampling_params import SamplingParams

from test_channel_aborts import Client, Peer


class Talker(Peer):
    """A live worker: a (no-op) frame for another request every 50 ms."""

    async def _conn(self, reader, writer) -> None:
        await reader.readline()
        self.writer = writer
        with contextlib.suppress(ConnectionError):
            while not writer.is_closing():
                data_plane.write_frame(writer, ("c", [("other", StreamChunk(request_id="other", worker_id="w1"))]))
                await asyncio.sleep(0.05)


def _req(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4))


async def _stream_error(ch: Channel, rid: str) -> BaseException | None:
    try:
        async for _ in ch.stream(rid, ("submit", _req(rid))):
            pass
    except BaseException as e:  # noqa: BLE001
        return e
    return None


@pytest.mark.parametrize("peer_cls, cut", [(Peer, True), (Talker, False)])
def test_a_silent_channel_is_cut_and_a_talking_one_is_not(peer_cls, cut):
    async def main():
        peer = await peer_cls().start()
        ch = Channel(Client(peer.port), "w1")
        task = asyncio.get_running_loop().create_task(_stream_error(ch, "r1"))
        await asyncio.sleep(0.4)
        ch.cut_if_silent(10.0)  # not silent for that long
        assert not task.done()
        ch.cut_if_silent(0.3)
        done, _ = await asyncio.wait([task], timeout=2.0)
        if cut:
            err = task.result()
            assert isinstance(err, WorkerDiedError) and "heartbeat lapsed" in str(err) and ch.dead is not None
            await asyncio.sleep(0.1)
            assert ch.connected.result().is_closing()  # the connection closes with them
        else:
            assert not done and ch.dead is None
            ch.cut(WorkerDiedError("w1", "test over"))
            await task
        await peer.stop()

    asyncio.run(main())


class FakeState:
    def __init__(self) -> None:
        self.live: dict | None = {}

    async def alive_loads(self):
        if self.live is None:
            raise ConnectionError("redis away")
        return self.live


class FakeClient:
    def __init__(self, wids) -> None:
        self.wids, self.cuts = set(wids), []

    def channel_workers(self):
        return set(self.wids)

    def cut_silent(self, wid, bound_s):
        self.cuts.append(wid)
        return 1


# each step: (seconds later, what Redis says: "live" (w1 beats), "lapsed" (it does not), "away" (Redis down))
@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.floats(0.1, 12.0), st.sampled_from(["live", "lapsed", "away"])), max_size=25))
def test_the_watch_cuts_only_after_the_bound_of_lapse_seen_with_redis_up(steps):
    """The model: w1 is cut at a check where its heartbeat has been seen lapsed, at every check since the
    first such one with no live beat and no Redis outage between, for at least the bound."""
    bound = 30.0
    state, client = FakeState(), FakeClient(["w1"])
    watch = SilentChannelWatch(state, client, bound_s=bound)
    now, since, expected = 1000.0, None, []

    async def run():
        nonlocal now, since
        for dt, what in steps:
            now += dt
            state.live = {"w1": object()} if what == "live" else {} if what == "lapsed" else None
            before = len(client.cuts)
            await watch.check(now)
            if what == "lapsed":
                since = now if since is None else since
                expected.append(now - since >= bound)
            else:
                since = None
                expected.append(False)
            assert (len(client.cuts) > before) == expected[-1], (steps, now, since)
    asyncio.run(run())


def test_the_watch_looks_at_every_worker_it_has_a_channel_to():
    state, client = FakeState(), FakeClient(["w0", "w1", "w2"])
    watch = SilentChannelWatch(state, client, bound_s=5.0)
    state.live = {"w0": object()}
    asyncio.run(watch.check(0.0))
    asyncio.run(watch.check(6.0))
    assert sorted(client.cuts) == ["w1", "w2"]
