"""The frozen-worker watch (cluster/liveness.py), over generated histories: which workers'
heartbeats are live each second, and how each answers a ping (at once, failing at once as a dead
or restarting actor does, or never, as a stopped process). The client is a stand-in for
RayWorkerClient's two calls; the watch against real Ray actors and a real SIGSTOP is
tests/cluster/test_cluster_ray.py::test_a_frozen_worker_is_restarted_and_its_requests_end."""

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.cluster.liveness import FrozenWatch
from folio.worker.errors import UnavailableError

FROZEN_S = 3.5
START_S = 6.0  # a restarting worker's time to publish before it is asked again
WORKERS = ("w0", "w1", "w2")


class Client:
    def __init__(self) -> None:
        self.mode: dict[str, str] = {}
        self.restarted: list[tuple[int, str]] = []
        self.tick = 0

    async def call(self, wid: str, method: str):
        assert method == "ping"
        if self.mode[wid] == "fails":
            raise UnavailableError(f"worker {wid} is restarting")
        if self.mode[wid] == "hangs":
            await asyncio.sleep(3600)
        return wid

    async def restart(self, wid: str) -> None:
        self.restarted.append((self.tick, wid))


# live one second in four, deaf half the time: silences long enough to count come often
tick = st.fixed_dictionaries({w: st.tuples(st.sampled_from([True, False, False, False]),
                                           st.sampled_from(["answers", "fails", "hangs", "hangs"]))
                              for w in WORKERS})


@settings(max_examples=60, deadline=None)
@given(st.lists(tick, min_size=1, max_size=30))
def test_only_a_worker_silent_past_the_bound_and_deaf_to_a_ping_is_restarted(history):
    """Once per silence; and one restarting (a ping fails at once) for over START_S since its last
    sign of life or its last restart (a start stuck for good was never looked at again before
    2026-12-07)."""
    client = Client()

    async def main():
        watch = FrozenWatch(client, frozen_s=FROZEN_S, ping_timeout_s=0.002, start_s=START_S)
        for t, state in enumerate(history):
            client.tick = t
            client.mode = {w: mode for w, (_, mode) in state.items()}
            watch.observe({w: None for w, (live, _) in state.items() if live}, now=float(t))
            await watch.settle()  # the pings of this second are answered, failed or timed out
        await watch.stop()
        return watch.restarts

    restarts = asyncio.run(main())
    assert restarts == len(client.restarted)
    # replay: when may each worker be restarted, and when must it be
    expected = []
    for w in WORKERS:
        last_live = asked = None  # the last second it was live; when the watch last asked it (or restarted it)
        for t, state in enumerate(history):
            live, mode = state[w]
            if live:
                last_live = asked = t
                continue
            if last_live is None or t - asked <= FROZEN_S:
                continue
            if mode == "hangs":
                expected.append((t, w))
                asked = t  # its new process's start counts from here
            elif mode == "answers":
                asked = t
            elif t - asked > START_S:  # "fails" (dead or restarting) past its start: stuck starting
                expected.append((t, w))
                asked = t
            # "fails" within its start: Ray's business; asked again next second
    assert sorted(client.restarted) == sorted(expected), history


def test_a_worker_that_publishes_again_while_its_ping_waits_is_not_restarted():
    """A pause a little longer than the bound: the ping goes out, the worker comes back (its
    heartbeat is live again) before the ping's timeout: it is not killed."""
    client = Client()
    client.mode = {"w0": "hangs"}

    async def main():
        watch = FrozenWatch(client, frozen_s=FROZEN_S, ping_timeout_s=0.05)
        watch.observe({"w0": None}, now=0.0)
        watch.observe({}, now=FROZEN_S + 1)  # lapsed: the ping goes out
        watch.observe({"w0": None}, now=FROZEN_S + 1.5)  # back while it waits
        await watch.settle()
        return watch.restarts

    assert asyncio.run(main()) == 0 and client.restarted == []


def test_a_restarted_worker_stuck_in_its_start_is_restarted_again():
    """Killed as frozen, its new process stuck in its __init__: pings fail at once (Ray's answer
    for an actor restarting), and once `start_s` has passed since the kill it is killed again,
    and again after that. One that publishes within its start is left."""
    client = Client()
    client.mode = {"w0": "hangs", "w1": "hangs"}

    async def main():
        watch = FrozenWatch(client, frozen_s=FROZEN_S, ping_timeout_s=0.002, start_s=START_S)
        for t in range(40):
            client.tick = t
            live = {"w0": None, "w1": None} if t == 0 else {"w1": None} if t >= 5 else {}
            watch.observe(live, now=float(t))
            await watch.settle()
            if client.restarted:  # after the first kill, w0 is restarting for good
                client.mode = {"w0": "fails", "w1": "hangs"}
        await watch.stop()

    asyncio.run(main())
    restarts_of = {w: [t for t, x in client.restarted if x == w] for w in ("w0", "w1")}
    assert restarts_of["w0"] == [4, 11, 18, 25, 32, 39]  # frozen at 4; then 6 s of start past each kill
    assert restarts_of["w1"] == [4]  # its new process published from 5 on
