"""`folio serve --tensor-parallel-size 2` as a user runs it: one worker whose model is sharded
over two ranks (two logical GPUs on this CPU), answering the OpenAI API with the text one
rank gives, the second rank a Ray actor (in the worker's placement group) that ends with the
server; its embedded Redis SIGKILLed under load costs no request more than a 503, and the same
group (same rank actor) answers the same text after it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import psutil
import redis

from folio.worker import LLM, SamplingParams
from conftest import PROMPTS, folio_serve, metric_series as series, process_running, redis_child, wait_for
from folio.cluster.state import ClusterState

MAX_TOKENS = 24


def complete(server, prompt: str) -> dict:
    body = {"model": os.path.basename(server["model"]), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True}
    req = urllib.request.Request(server["http"] + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def test_folio_serve_with_a_tp2_worker_answers_as_one_rank(model_dirs):
    model = model_dirs["qwen2"]
    expected = [o.outputs[0].text for o in LLM(model, block_size=8, num_kv_blocks=128).generate(
        PROMPTS[:2], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))]
    with folio_serve(model, "--num-workers", "1", "--tensor-parallel-size", "2", "--block-size", "8",
                     "--num-kv-blocks", "128", "--namespace", "fetp", "--grace-period-s", "1") as server:
        followers = [p for p in psutil.Process(server["pid"]).children(recursive=True)  # Ray's workers too
                     if "RankActor" in " ".join(p.cmdline())]
        assert len(followers) == 1, "the worker's second rank is not running"
        got = [complete(server, p)["choices"][0]["text"] for p in PROMPTS[:2]]
        assert got == expected
        statuses = redis_killed_under_load(server)
        assert set(statuses) <= {200, 503} and statuses.count(200) > 0, statuses
        assert [complete(server, p)["choices"][0]["text"] for p in PROMPTS[:2]] == expected
        assert [p.pid for p in psutil.Process(server["pid"]).children(recursive=True)
                if "RankActor" in " ".join(p.cmdline())] == [followers[0].pid], "the group was restarted"
        ok = statuses.count(200) + 2 * len(PROMPTS[:2])
        wait_for(lambda: tokens_on_metrics(server) >= ok * MAX_TOKENS, 10, "the TP worker's tokens on /metrics")
        text = urllib.request.urlopen(server["metrics"] + "/metrics", timeout=30).read().decode()
        assert "folio_cluster_state_up 1.0" in text
        assert len(series(text, "folio_requests_running{")) == 1, "the group is not one worker on /metrics"
        finished = series(text, "folio_requests_total{")
        assert sum(v for k, v in finished.items() if 'finish_reason="length"' in k) >= ok, finished
        errors = sum(v for k, v in finished.items() if 'finish_reason="error"' in k)
        assert errors <= statuses.count(503), (finished, statuses)  # a 503 counts as an error, nothing else did
    psutil.wait_procs(followers, timeout=30)
    assert not any(process_running(p) for p in followers), "a rank outlived serve"


def redis_killed_under_load(server) -> list:
    """SIGKILL the embedded Redis while two threads send completions: Redis back within 5 s,
    the TP worker registered again; the statuses of every request sent meanwhile."""
    stop, statuses = threading.Event(), []

    def load():
        while not stop.is_set():
            try:
                complete(server, PROMPTS[0])
                statuses.append(200)
            except urllib.error.HTTPError as e:
                statuses.append(e.code)
            except Exception as e:  # a reset connection or a timeout: as bad as a 500
                statuses.append(repr(e))
    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(statuses) >= 4, 120, "requests before the kill")
        victim = redis_child(server["pid"], server["redis"])
        victim.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        state = redis.Redis.from_url(server["redis"], socket_timeout=0.5, socket_connect_timeout=0.5)
        wait_for(state.ping, 5, "the embedded Redis to be back", ignore=(redis.RedisError,))
        assert time.monotonic() - t0 < 5
        wait_for(lambda: len(ClusterState(server["redis"], "fetp").live_loads()) == 1, 10, "the TP worker registered")
        n = len(statuses)
        wait_for(lambda: len(statuses) >= n + 4, 120, "requests after the kill")
    finally:
        stop.set()
        for t in threads:
            t.join()
    return statuses


def tokens_on_metrics(server) -> float:
    """The TP worker's generated tokens, as /metrics reports them (from its heartbeats)."""
    text = urllib.request.urlopen(server["metrics"] + "/metrics", timeout=30).read().decode()
    return sum(series(text, "folio_generation_tokens_total{").values())
