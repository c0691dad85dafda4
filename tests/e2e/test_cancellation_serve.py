"""Cancellation through `folio serve` itself: rounds of streaming clients that leave early
(HTTP connections closed after 0-5 SSE chunks or before the headers, gRPC streams cancelled
after 0-5 messages, gRPC deadlines that expire mid-stream; max_tokens 1000, ignore_eos)
leave nothing behind: the workers go idle with every KV block free, and their generation
counter moves past what the clients read by < 5 % of the possible tokens (a request whose
abort was lost runs on to its 1,000). The round is benchmarks/cancellation_stress.py's (20 runs x 5 rounds x 200 clients
there); this server is its own, not conftest's `folio_server`, whose admission limit (6)
and KV cache (48 blocks of 8) cannot take 60 concurrent long requests."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))

import cancellation_stress as cs  # noqa: E402
from folio.cluster.state import ClusterState  # noqa: E402

CLIENTS, ROUNDS = 60, 2


@pytest.fixture(scope="module")
def server(model_dirs):
    srv = cs.start_server(model_dirs["llama"], "ccancel", workers=2, kv_blocks=512)
    yield srv
    assert cs.stop_server(srv) == 0, open(srv["log"]).read()[-3000:]


def test_clients_that_leave_through_serve_leave_nothing_running(server):
    state = ClusterState(server["redis"], server["namespace"])
    pids = cs.worker_pids(server)
    assert sum(k.startswith("worker") for k in pids) == 2
    for rnd in range(ROUNDS):
        r = cs.one_round(server, state, pids, CLIENTS, seed=rnd, idle_timeout_s=60.0)
        kinds = r["by_kind"]
        print(f"round {rnd}: generated {r['generated_tokens']} of {r['possible_tokens']} possible, "
              f"read {r['read_tokens']}, idle after {r['idle_after_s']} s, rss {r['rss_mb_after']}, "
              f"deadlines capped at {kinds['deadline_cap_s']} s, by messages read [0..7+] "
              f"{kinds['grpc_deadline']['messages_before_deadline']}")
        assert r["by_kind"]["num_errors"] == 0, kinds["errors"]
        assert {k: kinds[k]["clients"] for k in ("http", "grpc_cancel", "grpc_deadline")} == {
            "http": CLIENTS // 2, "grpc_cancel": CLIENTS // 4, "grpc_deadline": CLIENTS // 4}
        assert r["idle"], f"round {rnd}: requests or blocks left behind: {r['loads_after']}"
        assert all(w["kv_usage"] == 0 and w["running"] + w["waiting"] + w["swapped"] == 0
                   for w in r["loads_after"].values())
        assert r["generated_tokens"] - r["read_tokens"] < cs.MISS_SHARE * r["possible_tokens"], r
        assert r["generated_tokens"] >= r["read_tokens"] > 0  # the counter is the one that moves
        assert not r["misses"], r["misses"]
