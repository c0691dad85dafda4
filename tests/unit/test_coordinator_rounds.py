"""The coordinator's rounds never wait on one worker for ever (cluster/coordinator.py), over
generated clusters: some workers stop answering (every call to them waits until they are
restarted, as a SIGSTOPped process's calls do), and their heartbeats lapse a few rounds later.
The state and the client are stand-ins for ClusterState's read and RayWorkerClient's calls; the
same against real Ray actors and a real SIGSTOP mid-move is tests/cluster/test_cluster_ray.py::
test_a_worker_frozen_mid_move_is_restarted_and_the_coordinator_goes_on."""

import asyncio
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.cluster.coordinator import Coordinator
from folio.cluster.liveness import FrozenWatch
from folio.cluster.channel import WorkerDiedError
from folio.worker.messages import RequestSummary, WorkerLoad

QUERY_S, MOVE_WAIT_S = 0.02, 0.02
ROUNDS = 40


class State:
    """live_loads(): every worker full of starving requests, or empty; a stopped one lapses
    from it `lapse_after` rounds after it stopped, and is back once restarted."""

    def __init__(self, coord_rounds, spec: dict, lapse_after: int) -> None:
        self.rounds, self.spec, self.lapse_after = coord_rounds, spec, lapse_after
        self.stopped_at: dict[str, int] = {}

    def live_loads(self) -> dict:
        out = {}
        for w, (starving, priority) in self.spec.items():
            t = self.stopped_at.get(w)
            if t is not None and self.rounds() - t > self.lapse_after:
                continue
            reqs = [RequestSummary(request_id=f"{w}-{i}", state="waiting", priority=priority,
                                   arrival_time=float(i), num_blocks=4) for i in range(starving)]
            out[w] = WorkerLoad(worker_id=w, timestamp=time.time(), num_kv_blocks=16, num_free_blocks=0 if reqs else 16,
                                block_size=8, requests=reqs, max_running_priority=priority + 1 if reqs else None)
        return out


class Client:
    def __init__(self, state: State, rounds) -> None:
        self.state, self.rounds = state, rounds
        self.died: dict[str, asyncio.Event] = {}
        self.in_flight: dict[str, int] = {}  # worker -> the round that started a move on it
        self.late_overlaps: list[tuple] = []
        self.moves = self.restarts = 0

    def stop(self, wid: str) -> None:
        self.state.stopped_at[wid] = self.rounds()
        self.died[wid] = asyncio.Event()

    async def _answer(self, *wids: str) -> None:
        for w in wids:
            if w in self.died:  # stopped: no answer until it is killed
                await self.died[w].wait()
                raise WorkerDiedError(w, "killed")
        await asyncio.sleep(0)

    async def move(self, src: str, dst: str, request_id: str, preempt=()) -> None:
        now = self.rounds()
        for w in (src, dst):  # a move of an earlier round still on this worker: planned on stale figures
            if self.in_flight.get(w, now) != now:
                self.late_overlaps.append((w, self.in_flight[w], now))
            self.in_flight[w] = now
        try:
            self.moves += 1
            await self._answer(src, dst)
        finally:
            for w in (src, dst):
                self.in_flight.pop(w, None)

    async def running_requests(self, wid: str, min_priority=None) -> list:
        await self._answer(wid)
        return []

    async def call(self, wid: str, method: str):
        assert method == "ping"
        await self._answer(wid)

    async def restart(self, wid: str) -> None:
        self.restarts += 1
        self.died.pop(wid).set()  # its calls fail now; it comes back with a new process
        self.state.stopped_at.pop(wid)


workers = st.dictionaries(st.sampled_from(["w0", "w1", "w2", "w3"]),
                          st.tuples(st.integers(0, 3), st.sampled_from([0, 5])), min_size=2, max_size=4)


@settings(max_examples=40, deadline=None)
@given(workers, st.data())
def test_stopped_workers_hold_no_round_and_are_restarted(spec, data):
    names = sorted(spec)
    stops = data.draw(st.dictionaries(st.sampled_from(names), st.integers(0, ROUNDS // 2), max_size=len(names) - 1))
    check(spec, stops, data.draw(st.integers(0, 4)))


def test_a_worker_stopped_while_moves_to_it_are_planned():
    """w0 starves, w1 is free and stops answering, and still looks free for 3 more rounds: the
    moves planned to it wait, and the rounds and the watch go on without them."""
    client = check({"w0": (3, 0), "w1": (0, 0), "w2": (2, 5)}, {"w1": 1}, 3)
    assert client.moves >= 1


def check(spec: dict, stops: dict, lapse_after: int) -> "Client":
    names = sorted(spec)

    async def main():
        coord = None
        state = State(lambda: coord.rounds, spec, lapse_after)
        client = Client(state, lambda: coord.rounds)
        coord = Coordinator(state, client, interval_s=0.0, cooldown_s=0.0, query_timeout_s=QUERY_S,
                            move_wait_s=MOVE_WAIT_S, watch_interval_s=0.005)
        coord.watch = FrozenWatch(client, frozen_s=0.01, ping_timeout_s=0.01)
        coord.start()
        t0 = time.monotonic()
        while len(coord.watch.seen) < len(names):  # the watch's first read: every worker live
            await asyncio.sleep(0.001)
            assert time.monotonic() - t0 < 5, "the watch never read the cluster"
        base, slowest, done = coord.rounds, 0.0, set()
        while coord.rounds < base + ROUNDS:
            r, t = coord.rounds, time.monotonic()
            for w, at in stops.items():
                if base + at <= r and w not in done:
                    done.add(w)
                    client.stop(w)
            while coord.rounds == r:
                await asyncio.sleep(0.001)
                assert time.monotonic() - t < 5, f"round {r} held: {coord.moving}"
            slowest = max(slowest, time.monotonic() - t)
        # every stopped worker is restarted by the watch, whatever the rounds were waiting on
        deadline = time.monotonic() + 5
        while client.died and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await coord.stop()
        return client, slowest

    client, slowest = asyncio.run(main())
    assert not client.died, f"never restarted: {sorted(client.died)}"
    assert client.restarts == len(stops)
    assert client.late_overlaps == [], client.late_overlaps
    assert slowest < 1.0  # a round takes a query timeout and a move wait at most (plus a loaded host's delays)
    return client
