"""Tensor-parallel workers in a real cluster (Ray, Redis, router): two TP=2 workers (each a
placement group of two logical GPUs: the worker actor in bundle 0, its second rank a Ray actor
in bundle 1) beside a TP=1 worker.
Each serves transformers' greedy tokens; a request moves between the TP=2 workers with every
rank's KV and is refused by the TP=1 one; a killed rank fails its group, which restarts whole."""

import asyncio
import os
import signal

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from folio.cluster.launcher import ClusterConfig, FolioCluster  # noqa: E402
from folio.worker import SamplingParams  # noqa: E402
from folio.worker.errors import FolioError  # noqa: E402
from folio.worker.messages import GenerateRequest  # noqa: E402
from conftest import PROMPTS, ray_step_delay, wait_for  # noqa: E402

ENGINE = dict(block_size=8, num_kv_blocks=64, num_cpu_blocks=64, max_model_len=256, preemption_mode="swap")
TIMEOUT_S = 120
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def cluster(model_dirs):
    c = FolioCluster(ClusterConfig(model=model_dirs["llama"], num_workers=3, tensor_parallel_sizes=[2, 2, 1],
                                   engine_args=ENGINE, coordinator=False, torch_threads=1,
                                   namespace="fttp")).start()
    yield c
    c.shutdown(grace_s=2)


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs["llama"])


def request(rid, tokenizer, prompt, max_tokens=MAX_TOKENS):
    return GenerateRequest(request_id=rid, prompt_token_ids=tokenizer(prompt).input_ids,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def collect(cluster, req, worker_id, on_token=None):
    tokens, workers = [], []
    async for chunk in cluster.router.generate(req, worker_id=worker_id):
        tokens += chunk.deltas[0].token_ids if chunk.deltas else []
        workers.append(chunk.worker_id)
        if on_token is not None and not chunk.finished:
            await on_token(len(tokens))
    return tokens, workers


def followers(cluster, wid):
    """(the worker's pid, its follower ranks' processes)."""
    pid, *ranks = ray.get(cluster.workers[wid].process_ids.remote())
    return pid, [psutil.Process(p) for p in ranks]


def dead(p: psutil.Process) -> bool:
    return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE


def test_a_tp2_worker_is_a_placement_group_with_one_rank_actor_per_bundle(cluster):
    from ray.util import placement_group_table

    assert set(cluster.groups) == {"w0", "w1"}  # the TP=1 worker needs none
    for wid in ("w0", "w1"):
        table = placement_group_table(cluster.groups[wid])
        assert table["state"] == "CREATED" and table["strategy"] == "STRICT_PACK"
        assert [b.get("GPU") for b in table["bundles"].values()] == [1.0, 1.0]
        pid, (rank1,) = followers(cluster, wid)
        assert "RankActor" in " ".join(rank1.cmdline())  # a Ray actor, not a child process of the worker
        assert rank1.pid not in {c.pid for c in psutil.Process(pid).children(recursive=True)}


def test_tp2_and_tp1_workers_serve_hf_tokens(cluster, tokenizer, model_dirs, hf_reference):
    loads = cluster.state.live_loads()
    assert {w: l.tensor_parallel_size for w, l in loads.items()} == {"w0": 2, "w1": 2, "w2": 1}
    assert [len(followers(cluster, w)[1]) for w in ("w0", "w1", "w2")] == [1, 1, 0]
    ref = hf_reference(model_dirs["llama"], PROMPTS[:3], MAX_TOKENS)

    async def main():
        return await asyncio.gather(*(asyncio.wait_for(collect(cluster, request(f"h{i}", tokenizer, PROMPTS[i]), w),
                                                       TIMEOUT_S) for i, w in enumerate(("w0", "w1", "w2"))))
    for i, (tokens, workers) in enumerate(asyncio.run(main())):
        assert tokens == ref[i] and set(workers) == {f"w{i}"}


def test_a_request_moves_between_tp2_workers_and_a_tp1_worker_refuses_it(cluster, tokenizer, model_dirs,
                                                                        hf_reference):
    ref = hf_reference(model_dirs["llama"], [PROMPTS[2]], MAX_TOKENS)[0]
    client = cluster.router.client

    async def main():
        moved, refused = [], []

        async def on_token(n):
            if n >= 5 and not refused:
                try:
                    await client.move("w0", "w2", "m")
                except FolioError as e:
                    refused.append(e)
            if n >= 8 and not moved:
                moved.append(True)
                await client.move("w0", "w1", "m")
        tokens, workers = await asyncio.wait_for(collect(cluster, request("m", tokenizer, PROMPTS[2]), "w0",
                                                         on_token), TIMEOUT_S)
        return tokens, workers, refused
    ray_step_delay(cluster.workers["w0"], 0.02)  # its tokens outlast both moves on any CPU
    try:
        tokens, workers, refused = asyncio.run(main())
    finally:
        ray_step_delay(cluster.workers["w0"], 0)
    assert refused and "tensor-parallel" in str(refused[0]), refused
    assert tokens == ref
    assert workers[0] == "w0" and workers[-1] == "w1"
    st = {w: ray.get(h.stats.remote()) for w, h in cluster.workers.items()}
    assert st["w1"]["num_migrations_in"] == 1 and st["w2"]["num_migrations_in"] == 0
    assert st["w1"]["swapped_in_blocks"] > 0  # resumed from the moved KV of both ranks


def test_a_killed_rank_fails_its_group_which_restarts_whole(cluster, tokenizer, model_dirs, hf_reference):
    pid, (follower,) = followers(cluster, "w1")
    worker = psutil.Process(pid)
    follower.send_signal(signal.SIGKILL)
    wait_for(lambda: dead(follower), 10, "the killed rank to die")

    async def after_kill():
        try:
            await asyncio.wait_for(collect(cluster, request("k", tokenizer, PROMPTS[0]), "w1"), TIMEOUT_S)
        except FolioError as e:
            return e
    err = asyncio.run(after_kill())
    assert isinstance(err, FolioError), "a request on the broken group did not fail"
    def restarted():  # Ray restarts the worker: a new process, a new rank actor, registered again
        try:
            new_pid, fs = followers(cluster, "w1")
        except Exception:  # the old process is gone, the new one not up yet
            return None
        return (new_pid, fs) if new_pid != pid and len(fs) == 1 and "w1" in cluster.state.live_loads() else None
    new_pid, (new_follower,) = wait_for(restarted, TIMEOUT_S, "the group to restart", interval_s=0.2)
    assert dead(worker) and new_follower.pid != follower.pid

    async def again():
        return await asyncio.wait_for(collect(cluster, request("k2", tokenizer, PROMPTS[0]), "w1"), TIMEOUT_S)
    assert asyncio.run(again())[0] == hf_reference(model_dirs["llama"], [PROMPTS[0]], MAX_TOKENS)[0]
    assert os.getpid() != new_pid
