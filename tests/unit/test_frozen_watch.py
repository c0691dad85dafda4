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
def test_only_a_worker_silent_past_the_bound_and_deaf_to_a_ping_is_restarted_once(history):
    client = Client()

    async def main():
        watch = FrozenWatch(client, frozen_s=FROZEN_S, ping_timeout_s=0.002)
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
                last_live = None  # watched again once it publishes
            elif mode == "answers":
                asked = t
            # "fails": dead or restarting, Ray's business; asked again next second
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
