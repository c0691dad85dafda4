"""The cluster for real: Ray actors (two logical GPUs on this CPU machine), an embedded
redis-server, the router and the coordinator, on the tiny Llama model. One cluster is
shared by the module; the tests that break it (Redis restart, a killed worker) run last."""

import asyncio
import contextlib
import time

import pytest

ray = pytest.importorskip("ray")

from folio.cluster.launcher import ClusterConfig, FolioCluster  # noqa: E402
from folio.cluster.router import Router  # noqa: E402
from folio.cluster.state import ClusterState  # noqa: E402
from folio.worker import LLM, SamplingParams  # noqa: E402
from folio.worker.errors import UnavailableError  # noqa: E402
from folio.worker.hashing import hash_full_blocks  # noqa: E402
from folio.worker.messages import GenerateRequest  # noqa: E402

from conftest import PROMPTS, ray_step_delay, until  # noqa: E402

ENGINE = dict(block_size=8, num_kv_blocks=24, num_cpu_blocks=96, max_model_len=256, preemption_mode="swap")
TIMEOUT_S = 120
FROZEN_S = 3.0  # the cluster's worker_frozen_s: a worker silent this long and deaf to a ping is restarted
START_S = 20.0  # its worker_start_s: a restarted worker's time to publish. The tiny model loads in ~3.4 s, but
# with another server loading beside the tests a start took over 10 s (2026-12-07, Ray's raylet log: 13 s from
# the kill to the next kill), and the frozen-mid-move test counted a second restart


@pytest.fixture(scope="module")
def cluster(model_dirs):
    c = FolioCluster(ClusterConfig(model=model_dirs["llama"], num_workers=2, engine_args=ENGINE,
                                   router="least-loaded", namespace="ftest", worker_frozen_s=FROZEN_S,
                                   worker_start_s=START_S)).start()
    yield c
    c.shutdown(grace_s=2)


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs["llama"])


def offline(model, prompts_ids, params):
    return [o.token_ids for o in LLM(model, **ENGINE).generate(prompts_ids, params)]


async def run(router, req, worker_id=None):
    """(output tokens of completion 0, the workers that streamed them)."""
    tokens, workers = [], []

    async def go():
        async for chunk in router.generate(req, worker_id=worker_id):
            for d in chunk.deltas:
                tokens.extend(d.token_ids)
            workers.append(chunk.worker_id)
    await asyncio.wait_for(go(), TIMEOUT_S)
    return tokens, workers


def stats(cluster):
    return {w: ray.get(h.stats.remote()) for w, h in cluster.workers.items()}


def assert_idle_and_consistent(cluster):
    deadline = time.monotonic() + 10
    while True:
        st = stats(cluster)
        if all(s["num_free_blocks"] == s["num_kv_blocks"] and s["num_streams"] == 0 for s in st.values()):
            break
        assert time.monotonic() < deadline, f"blocks or streams left behind: {st}"
        time.sleep(0.05)
    ray.get([h.check_invariants.remote() for h in cluster.workers.values()])


def pause_coordinator(cluster, paused: bool):
    ray.get((cluster.coordinator.stop if paused else cluster.coordinator.start).remote())


def test_greedy_through_the_cluster_matches_offline_and_hf(cluster, tokenizer, model_dirs, hf_reference):
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    reqs = [GenerateRequest(request_id=f"g{i}", prompt_token_ids=x, params=params) for i, x in enumerate(ids)]

    async def main():
        return await asyncio.gather(*(run(cluster.router, r) for r in reqs))
    results = asyncio.run(main())
    assert [t for t, _ in results] == offline(model_dirs["llama"], ids, params)
    assert [t for t, _ in results] == hf_reference(model_dirs["llama"], PROMPTS, 16)
    assert {w for _, ws in results for w in ws} == {"w0", "w1"}  # least-loaded used both
    assert_idle_and_consistent(cluster)


def test_bad_request_is_rejected_and_leaves_nothing(cluster):
    from folio.worker.errors import InvalidRequestError

    async def main():
        for bad in ([], [10 ** 9], list(range(400))):
            with pytest.raises(InvalidRequestError):
                await run(cluster.router, GenerateRequest(request_id="bad", prompt_token_ids=bad,
                                                          params=SamplingParams(max_tokens=4)))
    asyncio.run(main())
    assert_idle_and_consistent(cluster)


def test_an_id_left_and_sent_again_at_once_runs_on_its_worker(cluster):
    """A reader that leaves a stream, and the same id sent again at once to the same worker (a
    client's retry): the new request runs, alone. The id waits on the frontend's channel for
    the old request's last chunk, which came to the new request before: the router read it as
    a worker that skipped tokens and refused the request (gRPC UNAVAILABLE, in an attack)."""
    prompt, params = list(range(20, 30)), SamplingParams(max_tokens=4, temperature=0.0)
    long = SamplingParams(max_tokens=150, ignore_eos=True, temperature=0.0)  # 170 tokens: 22 of 24 blocks

    async def main():
        want, _ = await run(cluster.router, GenerateRequest(request_id="fresh", prompt_token_ids=prompt,
                                                            params=params), worker_id="w0")
        for k in range(8):
            rid = f"again-{k}"
            gen = cluster.router.generate(GenerateRequest(request_id=rid, prompt_token_ids=list(range(20, 40)),
                                                          params=long), worker_id="w0")
            await gen.__anext__()
            await gen.aclose()  # the reader leaves: its abort goes out, the last chunk comes later
            got, workers = await run(cluster.router, GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                                                     params=params), worker_id="w0")
            assert got == want and set(workers) == {"w0"}
    asyncio.run(main())
    assert_idle_and_consistent(cluster)


def test_policies_route_as_specified(cluster, tokenizer):
    pause_coordinator(cluster, True)  # loads stay where the test puts them
    try:
        state = ClusterState(cluster.redis_url, "ftest")
        rr = Router(state, cluster.router.client, "round-robin")
        ll = Router(state, cluster.router.client, "least-loaded")
        pa = Router(state, cluster.router.client, "prefix-aware")
        probe = GenerateRequest(request_id="p", prompt_token_ids=list(range(10, 20)),
                                params=SamplingParams(max_tokens=4))

        async def main():
            assert [await rr.pick(probe) for _ in range(4)] == ["w0", "w1", "w0", "w1"]
            # uneven load: long requests pinned to w0, each growing to 23 of its 24 blocks, so w0 has
            # < 8 free from a request's 98th token on, whatever the schedule. Eight of them keep it so
            # for seconds: with three, the engine (faster since 2026-12-05) finished the burst within
            # ~2 heartbeats, and 2 of ~15 runs never saw w0 loaded in 120 s
            long = [GenerateRequest(request_id=f"l{i}", prompt_token_ids=list(range(30 + i, 60 + i)),
                                    params=SamplingParams(max_tokens=150, ignore_eos=True))
                    for i in range(8)]
            tasks = [asyncio.create_task(run(cluster.router, r, worker_id="w0")) for r in long]
            # the router's own snapshot shows w0 loaded and w1 idle (w0 swaps under this burst, and
            # a heartbeat taken just after a swap-out showed it with room: 2 runs of 5 picked w0
            # first when this waited on a separate read of Redis)
            async def w0_loaded():
                loads = await ll._live_now(refresh=True)
                w1 = loads["w1"]
                return (loads["w0"].num_free_blocks < 8 and w1.num_free_blocks == w1.num_kv_blocks
                        and not (w1.num_running or w1.num_waiting or w1.num_swapped))
            await until(w0_loaded, "w0's heartbeat to show the burst and w1's to show it idle", TIMEOUT_S)
            # and the picks below decide on that snapshot: refreshed in between, a heartbeat taken
            # as w0 swapped one of the burst out showed it with room (a clean-clone CI run, 2026-12-04,
            # picked ['w1', 'w1', 'w0', 'w1']); the policy, not the burst's timing, is under test
            ll.refresh_s = float("inf")
            snapshot = {w: (l.num_free_blocks, l.num_running, l.num_waiting, l.num_swapped, l.queued_tokens)
                        for w, l in (await ll._live_now()).items()}
            picks = [await ll.pick(probe) for _ in range(4)]
            assert picks == ["w1"] * 4, (picks, snapshot)
            short = [GenerateRequest(request_id=f"s{i}", prompt_token_ids=list(range(11 + i, 20 + i)),
                                     params=SamplingParams(max_tokens=4))
                     for i in range(3)]
            placed = await asyncio.gather(*(run(ll, r) for r in short))
            assert [ws[0] for _, ws in placed] == ["w1"] * 3, (placed, snapshot)
            await asyncio.gather(*tasks)

            # prefix-aware: a long shared prefix cached on w1 draws requests that share it
            prefix = list(range(100, 164))  # 8 full blocks of 8
            await run(cluster.router, GenerateRequest(request_id="seed", prompt_token_ids=prefix + [5],
                                                      params=SamplingParams(max_tokens=2)),
                      worker_id="w1")
            hashes = hash_full_blocks(prefix, 8)
            seeded = time.time()
            await until(lambda: state.prefix_matches(["w0", "w1"], hashes)["w1"] == 8, "w1 to publish the prefix")
            # and loads measured after the seed ended: the heartbeat that published its blocks may
            # have been taken while it ran, showing w1 loaded (then w0 is the right pick: failed
            # once in a clean-clone CI run with ['w0', 'w1', 'w1'])
            await until(lambda: all(l.timestamp > seeded and not (l.num_running or l.num_waiting)
                                    for l in state.live_loads().values()), "idle heartbeats after the seed")
            hits_before = stats(cluster)["w1"]["prefix_cache_hits"]
            shared = [GenerateRequest(request_id=f"pa{i}", prompt_token_ids=prefix + [200 + i, 7],
                                      params=SamplingParams(max_tokens=2)) for i in range(3)]
            placed = [await run(pa, r) for r in shared]
            assert [ws[0] for _, ws in placed] == ["w1"] * 3
            assert stats(cluster)["w1"]["prefix_cache_hits"] >= hits_before + 3 * 8
        asyncio.run(main())
    finally:
        pause_coordinator(cluster, False)
    assert_idle_and_consistent(cluster)


def moves_by_hand(cluster, main) -> None:
    """Run `main()` with the coordinator paused (the test moves requests itself) and w1's steps
    10 ms slower (what it runs outlasts the test's checks on any CPU); then all must be idle."""
    pause_coordinator(cluster, True)
    ray_step_delay(cluster.workers["w1"], 0.01)
    try:
        asyncio.run(main())
    finally:
        ray_step_delay(cluster.workers["w1"], 0)
        pause_coordinator(cluster, False)
    assert_idle_and_consistent(cluster)


async def moved_unread(cluster, rid: str, params):
    """The router's stream of a request on w0 whose reader took one chunk and no more, then
    moved to w1: the move waits, unread, in the frontend's inbox (the channel reads on)."""
    client = cluster.router.client
    gen = cluster.router.generate(GenerateRequest(request_id=rid, prompt_token_ids=list(range(20, 40)),
                                                  params=params), worker_id="w0")
    await gen.__anext__()
    await client.move("w0", "w1", rid)
    inbox = client._live_channel("w0").inboxes[rid]
    await until(lambda: any(i.migrated_to == "w1" for i in inbox.items), "the move in the inbox", 30)
    return gen


def test_an_abort_finds_a_request_that_moved_before_its_reader_read_the_move(cluster):
    """The router still has the request on its source (its reader has not read the move): an
    Abort (gRPC's) looks on the other workers too, finds it on its destination, and the stream,
    read on, ends with "abort" there. It tried the source only and answered False (16 of 60
    stalled readers' Aborts in an attack, 2026-12-06); the request ran on to its end."""
    router = cluster.router
    long = SamplingParams(max_tokens=150, ignore_eos=True, temperature=0.0)

    async def main():
        for k in range(3):
            rid = f"abort-moved-{k}"
            gen = await moved_unread(cluster, rid, long)
            assert await router.abort(rid)
            rest = [c async for c in gen]
            assert rest[-1].finished and rest[-1].worker_id == "w1" and rest[-1].deltas[0].finish_reason == "abort"
            assert sum(len(d.token_ids) for c in rest for d in c.deltas) < 140
    moves_by_hand(cluster, main)


def test_a_coordinator_that_dies_comes_back_and_plans_again(cluster):
    """Its process killed (Ray restarts it, as a worker), the coordinator's rounds go on by
    themselves: nobody calls `start` on a restart. Before, it was not restarted at all, and the
    cluster never moved a request again (an attack, 2026-12-06). The next test's moves are
    then planned by the restarted one. The old process can still answer a call sent just after the
    kill (its rounds >= 3 at once): the new one is told by its process id, or the next test could
    take the dying process's id (a clean clone's run: its SIGSTOP found "No such process")."""
    old = asyncio.run(until(lambda: coordinator_pid(cluster), "the coordinator's answer", 30))
    ray.kill(cluster.coordinator, no_restart=False)
    asyncio.run(until(lambda: coordinator_pid(cluster) not in (None, old), "a new coordinator process", 60))
    deadline = time.monotonic() + 60
    while True:
        try:
            if ray.get(cluster.coordinator.stats.remote(), timeout=5)["rounds"] >= 3:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
            pass  # restarting
        assert time.monotonic() < deadline, "the coordinator did not come back"
        time.sleep(0.2)


def test_a_frozen_coordinator_is_restarted_by_the_frontends_watch(cluster):
    """SIGSTOP the coordinator's process: it planned no move and restarted no frozen worker for as
    long as it stayed stopped, and nothing restarted it (Ray restarts a process that exits). The
    watch every frontend replica runs (CoordinatorWatch, run here as a replica runs it) kills it
    once its heartbeat has lapsed past frozen_s and a ping went unanswered; Ray restarts it, and it
    publishes and plans again."""
    import os
    import signal

    from folio.cluster.liveness import CoordinatorWatch

    pid = asyncio.run(until(lambda: coordinator_pid(cluster), "the coordinator's answer", 30))
    watch = CoordinatorWatch(ClusterState(cluster.redis_url, "ftest"), "ftest", frozen_s=FROZEN_S,
                             ping_timeout_s=2.0, check_s=0.2)

    async def main():
        task = asyncio.create_task(watch.run())
        try:
            await until(lambda: watch.live, "the coordinator's heartbeat", 10)
            assert watch.silent_s() == 0
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            await until(lambda: watch.silent_s() > 0, "its heartbeat lapsed", 10)
            await until(lambda: watch.restarts == 1, "the coordinator restarted", 30)
            killed_s = time.monotonic() - t0
            await until(lambda: watch.live, "the new coordinator's heartbeat", RESTART_BOUND_S)
            return killed_s
        finally:
            task.cancel()
    try:
        killed_s = asyncio.run(main())
    finally:  # a failed test leaves no stopped process behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert FROZEN_S < killed_s < FROZEN_S + 2.0 + 5.0, killed_s  # the bound, the ping, a few checks
    assert asyncio.run(until(lambda: coordinator_pid(cluster), "the new coordinator's answer", 30)) != pid
    rounds = ray.get(cluster.coordinator.stats.remote())["rounds"]
    asyncio.run(until(lambda: ray.get(cluster.coordinator.stats.remote())["rounds"] > rounds + 2,
                      "the new coordinator's rounds", 10))


def coordinator_pid(cluster) -> int | None:
    """Its process id; None while Ray restarts it (a call can fail just after a restart: "Socket closed")."""
    try:
        return ray.get(cluster.coordinator.pid.remote(), timeout=5)
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


@ray.remote(num_cpus=0.01)
class _DiesExporting:
    def export(self):
        import os
        os._exit(1)


def test_an_import_whose_source_died_mid_export_is_unavailable_not_a_fault(cluster):
    """A move's source killed while it exports: the import on the destination cannot get its
    input. That is a worker's death (a FolioError, logged as a failed move), not Ray's
    exception raw (the coordinator logged it as an unexpected fault, with its traceback), and
    the destination is neither blamed nor touched."""
    lost = _DiesExporting.remote().export.remote()
    with pytest.raises(UnavailableError, match="import_request on w1: an actor it needed died"):
        asyncio.run(cluster.router.client.call("w1", "import_request", lost, []))
    assert "w1" in cluster.router.client._handles and stats(cluster)["w1"]["num_streams"] == 0


def test_cross_gpu_preemption_resumes_requests_on_the_other_worker(cluster, tokenizer, model_dirs):
    """A burst pinned to w0 needs ~8x its KV: w0 swaps requests out and the coordinator
    resumes them on w1; every stream is complete, in order, and equal to the offline engine.
    (Once, w0 finished the burst before the coordinator moved one, 1 run in ~10 after the data
    plane left Ray, 2026-12-02: the prompts twice, and w0's steps 10 ms slower, as a larger
    model's, so that the burst outlasts the coordinator's rounds on any CPU.)"""
    ids = [tokenizer(p).input_ids for p in PROMPTS] * 2
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    before = stats(cluster)
    reqs = [GenerateRequest(request_id=f"x{i}", prompt_token_ids=x, params=params) for i, x in enumerate(ids)]

    async def main():
        return await asyncio.gather(*(run(cluster.router, r, worker_id="w0") for r in reqs))
    ray_step_delay(cluster.workers["w0"], 0.01)
    try:
        results = asyncio.run(main())
    finally:
        ray_step_delay(cluster.workers["w0"], 0)
    assert [t for t, _ in results] == offline(model_dirs["llama"], ids, params)
    after = stats(cluster)
    assert after["w0"]["preemptions_by_mode"]["swap"] > before["w0"]["preemptions_by_mode"]["swap"]
    assert after["w1"]["num_migrations_in"] > before["w1"]["num_migrations_in"]
    assert any("w1" in ws for _, ws in results)  # streams that continued on the other worker
    assert ray.get(cluster.coordinator.stats.remote())["moves"] >= 1
    assert_idle_and_consistent(cluster)


def test_a_reader_gone_before_it_read_its_move_leaves_nothing_behind(cluster):
    """A request moves while its reader is not reading, and the reader leaves (its stream
    closed, or first its connection lost: the HTTP server's early abort) before it read the
    move: the frontend drops the import on the destination at once, and the id runs on either
    worker again. Before, the abort went to the source, where the request no longer was; it
    ran on to its end on the destination, unread, and its id stayed "in use" there for good (an
    attack of 60 stalled gRPC streams, 2026-12-06: as many left running as moves in the stall)."""
    router = cluster.router
    long = SamplingParams(max_tokens=150, ignore_eos=True, temperature=0.0)
    short = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)

    async def main():
        for k, early in enumerate((False, True, False, True)):
            rid = f"unread-move-{k}"
            gen = await moved_unread(cluster, rid, long)
            if early:
                router.abort_soon(rid)
            await gen.aclose()

            async def dropped():
                st = await cluster.workers["w1"].stats.remote()
                return st["num_streams"] == 0 and st["num_running"] == 0 and st["num_swapped"] == 0
            await until(dropped, "the import dropped on w1", 10)  # it ran 150 tokens x 10 ms there
            for w in ("w0", "w1"):
                tokens, workers = await run(router, GenerateRequest(request_id=rid, prompt_token_ids=list(range(20, 30)),
                                                                    params=short), worker_id=w)
                assert len(tokens) == 4 and set(workers) == {w}
    moves_by_hand(cluster, main)


def test_redis_restart_mid_load_keeps_serving(cluster, model_dirs):
    """Redis restarts (all cluster state gone) while four requests run: they finish, exact, and
    the workers register again. Steps 20 ms slower (as a larger model's): the 60 tokens run
    past the restart on any CPU (they ended before it on this one, ~0.1 s, when they were not)."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    ids = [list(range(40 + i, 60 + i)) for i in range(4)]
    state = ClusterState(cluster.redis_url, "ftest")

    async def main():
        tasks = [asyncio.create_task(run(cluster.router,
                                         GenerateRequest(request_id=f"rr{i}", prompt_token_ids=x,
                                                         params=params))) for i, x in enumerate(ids)]
        await until(lambda: sum(l.num_running for l in state.live_loads().values()) >= 2, "requests running")
        assert not any(t.done() for t in tasks)
        state.r.set("ftest:sentinel", b"before")
        cluster.redis.restart()  # all cluster state is gone
        assert state.r.get("ftest:sentinel") is None, "Redis kept its state: it was not restarted"
        results = await asyncio.gather(*tasks)
        # the next heartbeats rebuild it
        await until(lambda: sorted(state.live_loads()) == ["w0", "w1"], "both workers to register again")
        after = await run(cluster.router, GenerateRequest(request_id="after", prompt_token_ids=ids[0], params=params))
        return results, after
    for h in cluster.workers.values():
        ray_step_delay(h, 0.02)
    try:
        results, after = asyncio.run(main())
    finally:
        for h in cluster.workers.values():
            ray_step_delay(h, 0)
    expected = offline(model_dirs["llama"], ids, params)
    assert [t for t, _ in results] == expected and after[0] == expected[0]
    assert_idle_and_consistent(cluster)


RESTART_BOUND_S = 30.0  # kill -> back in the registry and serving (benchmarks/worker_restart.py measures it)
# kill -> the in-flight request failed: ~0.01-0.2 s measured. Ray's default death-info wait for a restartable
# actor (RAY_timeout_ms_task_wait_for_death_info=1000, on a 1 s tick; cluster/launcher.py sets 0) made it 1.0-2.0 s
IN_FLIGHT_FAIL_BOUND_S = 1.0
# stopped -> its in-flight request failed: the heartbeat's TTL (1.5 s) + FROZEN_S + the ping's 5 s + the kill
# of a stopped process (~5 s: Ray asks it to exit first) + the coordinator's round
FROZEN_FAIL_BOUND_S = 40.0


def test_ray_processes_get_the_fast_death_setting(cluster):
    """Who calls a worker (this driver, the coordinator, Serve replicas) is a process of the Ray started
    here: each must fail a call on a dead worker at once, not after Ray's death-info wait; and the
    raylet kills a stopped process 1 s after asking it to exit, not 5 (its config, read in a worker)."""
    import os

    key = "RAY_timeout_ms_task_wait_for_death_info"
    assert ray.get(ray.remote(num_cpus=0.01)(lambda: os.environ.get(key)).remote()) == os.environ[key] == "0"

    def kill_timeout_ms():
        from ray._raylet import Config
        return Config.kill_worker_timeout_milliseconds()
    assert ray.get(ray.remote(num_cpus=0.01)(kill_timeout_ms).remote()) == 1000


def test_killed_worker_fails_or_reroutes_its_requests_and_is_restarted(cluster, model_dirs):
    """SIGKILL w1's process under load: its streaming request fails fast with a clear error,
    w0's finishes, new requests are re-run on w0, and Ray restarts w1 (a new engine, which
    registers again): a request pinned to it then matches the offline engine."""
    import os
    import signal

    fail_s = fault_under_load(cluster, model_dirs, lambda pid: os.kill(pid, signal.SIGKILL))
    assert fail_s and max(fail_s) < IN_FLIGHT_FAIL_BOUND_S, fail_s  # fast: the death is seen, not timed out


def test_a_frozen_worker_is_restarted_and_its_requests_end(cluster, model_dirs):
    """SIGSTOP w1's process under load (a hang that holds the GIL looks the same from outside): its
    stream stalled for as long as the process stayed stopped, with no error (30 s stopped: a 30.0 s
    gap, 2026-12-07), and nothing restarted it: Ray restarts a process that exits, and the step
    watchdog runs inside the stopped one. The coordinator's watch (cluster/liveness.py) kills it once
    its heartbeat has lapsed past worker_frozen_s (3 s in this module) and a ping went unanswered
    (5 s): then as a killed worker, its stream fails with a clear error and Ray restarts it."""
    import os
    import signal

    restarts = ray.get(cluster.coordinator.stats.remote())["frozen_restarts"]
    stopped = []

    def freeze(pid):
        stopped.append(pid)
        os.kill(pid, signal.SIGSTOP)
    try:
        fail_s = fault_under_load(cluster, model_dirs, freeze)
    finally:
        for pid in stopped:  # a failed test leaves no stopped process behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert fail_s and FROZEN_S < min(fail_s) and max(fail_s) < FROZEN_FAIL_BOUND_S, fail_s
    assert ray.get(cluster.coordinator.stats.remote())["frozen_restarts"] == restarts + 1


def test_a_restarted_worker_stuck_in_its_start_is_restarted_again(cluster, model_dirs):
    """w1 stopped: the watch kills it and Ray starts a new process, which is stopped in its
    __init__ (a start stuck for good: a hung device init, a model on storage that stopped
    answering). The watch waited for its first heartbeat for ever, and the cluster ran a worker
    short (2026-12-07): a ping to it fails at once (Ray's answer while an actor restarts), which
    the watch left to Ray. Now, once worker_start_s has passed since the kill, it is killed again,
    and the third process serves as the offline engine does."""
    import os
    import signal

    psutil = pytest.importorskip("psutil")
    w1 = cluster.workers["w1"]
    first = ray.get(w1.pid.remote())
    raylet = psutil.Process(first).ppid()
    restarts = ray.get(cluster.coordinator.stats.remote())["frozen_restarts"]
    stopped = [first]

    def starting():  # w1's next process, in its __init__ (Ray's process title: "ray::<name>:<class>.__init__")
        for p in psutil.Process(raylet).children():
            with contextlib.suppress(psutil.Error):
                title = " ".join(p.cmdline())
                if p.pid not in stopped and title.startswith("ray::ftest-worker-w1:EngineWorker.__init__"):
                    return p.pid

    def serving():
        with contextlib.suppress(Exception):
            return ray.get(w1.pid.remote(), timeout=1) not in stopped
    probe = (list(range(70, 90)), SamplingParams(max_tokens=8, temperature=0.0))
    os.kill(first, signal.SIGSTOP)
    try:
        second = asyncio.run(until(starting, "w1's second process", 60, interval_s=0.005))
        os.kill(second, signal.SIGSTOP)
        stopped.append(second)
        t = time.monotonic()
        asyncio.run(until(serving, "w1's third process", START_S + 30, interval_s=0.2))
        third_s = time.monotonic() - t
        asyncio.run(until(lambda: "w1" in cluster.router.state.live_loads(), "w1 registered again", 30))
        pinned = asyncio.run(run(cluster.router, GenerateRequest(request_id="third", prompt_token_ids=probe[0],
                                                                  params=probe[1]), worker_id="w1"))
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    print(f"the stuck start replaced after {third_s:.1f} s")
    assert START_S - 2 < third_s  # not before its start had run out (counted from the kill, just before t)
    assert ray.get(cluster.coordinator.stats.remote())["frozen_restarts"] == restarts + 2
    assert pinned[0] == offline(model_dirs["llama"], [probe[0]], probe[1])[0]
    assert_idle_and_consistent(cluster)


def test_a_worker_frozen_mid_move_is_restarted_and_the_coordinator_goes_on(cluster, tokenizer, model_dirs):
    """A burst pinned to w0 starves it, the coordinator moves requests to w1, and w1's process is
    stopped (SIGSTOP) while it takes them: for up to its heartbeat's TTL it still looks free, so moves
    to it go on being planned, and their import waits on a process that never answers. Every
    request ends (w1's with a clear error, the rest with the offline engine's tokens), w1 is
    restarted, and the coordinator's rounds go on: no call of a round waits on one worker for ever."""
    import os
    import signal

    ids = [tokenizer(p).input_ids for p in PROMPTS] * 2
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    w1 = cluster.workers["w1"]
    pid = ray.get(w1.pid.remote())
    restarts = ray.get(cluster.coordinator.stats.remote())["frozen_restarts"]
    stopped = []

    async def main():
        on_w1 = asyncio.Event()

        async def one(i, x):
            tokens = []
            async for chunk in cluster.router.generate(GenerateRequest(request_id=f"z{i}", prompt_token_ids=x,
                                                                       params=params), worker_id="w0"):
                tokens += chunk.deltas[0].token_ids
                if chunk.worker_id == "w1":
                    on_w1.set()
            return tokens
        tasks = [asyncio.create_task(asyncio.wait_for(one(i, x), TIMEOUT_S)) for i, x in enumerate(ids)]
        await asyncio.wait_for(on_w1.wait(), TIMEOUT_S)
        stopped.append(pid)
        os.kill(pid, signal.SIGSTOP)  # while moves to w1 are under way
        return await asyncio.gather(*tasks, return_exceptions=True)
    ray_step_delay(cluster.workers["w0"], 0.01)  # the burst outlasts the coordinator's rounds on any CPU
    try:
        results = asyncio.run(main())
    finally:
        ray_step_delay(cluster.workers["w0"], 0)
        for p in stopped:  # a failed test leaves no stopped process behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert failed and all(isinstance(e, UnavailableError) and "w1" in str(e) for e in failed), failed
    expected = offline(model_dirs["llama"], ids, params)
    done = [(r, e) for r, e in zip(results, expected) if not isinstance(r, BaseException)]
    assert done and all(r == e for r, e in done)
    assert ray.get(cluster.coordinator.stats.remote())["frozen_restarts"] == restarts + 1

    def new_pid():
        try:
            return ray.get(w1.pid.remote(), timeout=5)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            return None  # restarting
    assert asyncio.run(until(new_pid, "w1 back", RESTART_BOUND_S)) != pid
    rounds = ray.get(cluster.coordinator.stats.remote())["rounds"]
    asyncio.run(until(lambda: ray.get(cluster.coordinator.stats.remote())["rounds"] > rounds + 2,
                      "the coordinator's next rounds", 10))
    assert_idle_and_consistent(cluster)


def fault_under_load(cluster, model_dirs, fault) -> list[float]:
    """`fault(pid)` on w1's process while one request streams from it and one from w0: the one on
    w1 fails with a clear error (no hang), w0's finishes, fresh requests are served whole (on w0,
    or on w1 once back), and w1 comes back (a new process, registered again, serving a pinned
    request as the offline engine does and picked by the router again). Returns how long after
    the fault the request on w1 failed."""
    import redis

    params = SamplingParams(max_tokens=170, temperature=0.0, ignore_eos=True)  # 24 blocks: one per worker
    rr = Router(ClusterState(cluster.redis_url, "ftest"), cluster.router.client, "round-robin")
    w1 = cluster.workers["w1"]
    pid = ray.get(w1.pid.remote())
    ray_step_delay(w1, 0.01)  # its 170 tokens outlast the fault on any CPU (the restarted w1: its own speed)
    probe = (list(range(70, 90)), SamplingParams(max_tokens=8, temperature=0.0))

    async def main():
        streaming_on_w1 = asyncio.Event()
        failed_at = {}

        async def long(i):
            n = 0
            try:
                async for chunk in rr.generate(GenerateRequest(request_id=f"k{i}",
                                                               prompt_token_ids=list(range(10 + i,
                                                                                           30 + i)), params=params)):
                    n += sum(len(d.token_ids) for d in chunk.deltas)
                    if chunk.worker_id == "w1" and n >= 5 and not chunk.finished:
                        streaming_on_w1.set()
            except UnavailableError:
                failed_at[i] = time.monotonic()
                raise
            return n
        tasks = [asyncio.create_task(asyncio.wait_for(long(i), TIMEOUT_S)) for i in range(2)]
        await asyncio.wait_for(streaming_on_w1.wait(), TIMEOUT_S)
        fault(pid)
        t_fault = time.monotonic()
        # right after the fault Redis still lists w1 for up to its TTL: requests sent there
        # before they stream anything are re-run on w0 (or wait for the restarted w1): none fails
        # (ignore_eos: they are sampled, and a clean-clone run, 2026-12-07 late, drew EOS second, [789, 2],
        # about a 1 % chance a run here: served whole by w0, no split, yet "not 3 tokens")
        fresh = [await run(rr, GenerateRequest(request_id=f"f{i}", prompt_token_ids=list(range(50 + i, 60 + i)),
                                               params=SamplingParams(max_tokens=3, ignore_eos=True)))
                 for i in range(4)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        fail_s = [t - t_fault for t in failed_at.values()]
        # back: registered again (a heartbeat newer than the fault) and serving a pinned request
        while True:
            try:
                load = rr.state.live_loads().get("w1")
            except redis.RedisError:  # a read timed out (0.5 s) on a busy machine: poll again
                load = None
            if load is not None and load.timestamp > time.time() - (time.monotonic() - t_fault):
                break
            assert time.monotonic() - t_fault < max(fail_s, default=0) + RESTART_BOUND_S, "w1 did not register again"
            await asyncio.sleep(0.05)
        registered_s = time.monotonic() - t_fault
        pinned = await run(rr, GenerateRequest(request_id="after", prompt_token_ids=probe[0], params=probe[1]),
                           worker_id="w1")
        serving_s = time.monotonic() - t_fault
        routed = []  # the router picks w1 again once its load snapshot holds w1's new heartbeat
        deadline = time.monotonic() + 15
        while "w1" not in routed and time.monotonic() < deadline:
            routed.append(await rr.pick(GenerateRequest(request_id=f"p{len(routed)}", prompt_token_ids=probe[0],
                                                            params=probe[1])))
            await asyncio.sleep(0.1)  # lets the background refresh of the loads run
        return results, fresh, fail_s, registered_s, pinned, serving_s, routed
    results, fresh, fail_s, registered_s, pinned, serving_s, routed = asyncio.run(main())
    print(f"fault -> in-flight failed {fail_s} s, registered {registered_s:.2f} s, serving {serving_s:.2f} s")
    failed = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(e, UnavailableError) and "w1" in str(e) for e in failed), failed
    assert len(failed) == 1  # round-robin put one of the two on w1: it fails clearly, none hangs
    assert [r for r in results if not isinstance(r, BaseException)] == [170]  # w0's finishes
    # each served whole by one worker: w0, or the restarted w1 when the Ray call that opens a channel to it
    # came while Ray restarted it (Ray queues such a call until the restart). A clean-clone run, 2026-12-07,
    # failed "all on w0 with 3 tokens" once, w1 back 3.4 s after the fault; which half failed was not
    # recorded (the message now prints them)
    assert all(len(t) == 3 and len(set(ws)) == 1 for t, ws in fresh), fresh
    assert ray.get(w1.pid.remote()) != pid  # a new process
    assert pinned[1] == ["w1"] * len(pinned[1]) and pinned[0] == offline(model_dirs["llama"], [probe[0]], probe[1])[0]
    assert serving_s < max(fail_s) + RESTART_BOUND_S
    assert "w1" in routed  # the router uses it again (no longer held dead)
    assert_idle_and_consistent(cluster)
    return fail_s


def test_folio_drain_stops_admission_on_a_live_cluster(cluster):
    """`folio drain` (the chart's preStop hook) joins the running Ray cluster by address."""
    import subprocess
    import sys

    from folio.worker.errors import UnavailableError

    address = ray.get_runtime_context().gcs_address
    r = subprocess.run([sys.executable, "-m", "folio.deploy.cli", "drain", "--address", address, "--namespace",
                        "ftest", "--redis-url", cluster.redis_url, "--grace-period-s", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "w0 drained, 0 requests aborted" in r.stdout, r.stderr[-2000:]

    async def main():
        with pytest.raises(UnavailableError, match="draining"):
            await run(cluster.router, GenerateRequest(request_id="late", prompt_token_ids=[1, 2, 3],
                                                      params=SamplingParams(max_tokens=2)),
                      worker_id="w0")
    asyncio.run(main())

