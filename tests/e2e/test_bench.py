"""The load harness: its arithmetic on hand-checked timings, its workloads and load
shapes, and end to end against the shared `folio serve` (HTTP and gRPC targets)."""

import json
import os
import random
import subprocess
import sys

import pytest

from folio.deploy.bench import report
from folio.deploy.bench.client import LoadShape, Record
from folio.deploy.bench.workloads import build, parse_dist

from conftest import FOLIO_SERVER_KEY, FOLIO_SERVER_LIMIT


# ---- the arithmetic, on a fixture with hand-checked numbers ------------------------------
RECORDS = [
    Record(start=0.0, ttft=0.1, latency=1.1, itl=[0.1] * 10, prompt_tokens=5, output_tokens=11),
    Record(start=0.5, ttft=0.3, latency=0.5, itl=[0.1, 0.1], prompt_tokens=7, output_tokens=3),
    Record(start=0.7, error="429"),
    Record(start=0.8, error="429"),
    Record(start=0.9, error="timeout"),
]


def test_summary_metrics_match_hand_computed_values():
    s = report.summarize(RECORDS, wall_s=2.0, slo={"ttft": 0.2})
    assert (s["requests"], s["completed"], s["failed"]) == (5, 2, 3)
    assert s["errors"] == {"429": 2, "timeout": 1}
    assert s["request_throughput"] == pytest.approx(1.0)  # 2 completed / 2 s
    assert s["output_throughput"] == pytest.approx(7.0)  # 14 tokens / 2 s
    assert s["total_token_throughput"] == pytest.approx(13.0)  # (14 + 12) / 2 s
    assert s["ttft_s"] == pytest.approx({"mean": 0.2, "median": 0.2, "p90": 0.28, "p99": 0.298})
    # TPOT: (1.1 - 0.1) / 10 = 0.1 and (0.5 - 0.3) / 2 = 0.1
    assert s["tpot_s"]["mean"] == pytest.approx(0.1) and s["tpot_s"]["p99"] == pytest.approx(0.1)
    assert s["itl_s"]["mean"] == pytest.approx(0.1) and len(RECORDS[0].itl) + len(RECORDS[1].itl) == 12
    assert s["e2e_s"]["median"] == pytest.approx(0.8)
    assert s["normalized_latency_s"]["mean"] == pytest.approx((1.1 / 11 + 0.5 / 3) / 2)
    assert s["goodput"] == pytest.approx(0.5)  # only the first meets TTFT <= 0.2 s: 1 request / 2 s
    assert report.summarize(RECORDS, 2.0, {"ttft": 0.2, "tpot": 0.05})["goodput"] == 0.0
    assert report.summarize(RECORDS, 2.0)["goodput"] is None


def test_slo_and_distribution_specs():
    assert report.parse_slo("ttft=0.5,tpot=0.05") == {"ttft": 0.5, "tpot": 0.05}
    for bad in ("ttfx=1", "ttft="):
        with pytest.raises(ValueError):
            report.parse_slo(bad)
    rng = random.Random(0)
    assert {parse_dist("fixed:7")(rng) for _ in range(5)} == {7}
    assert all(3 <= parse_dist("uniform:3-9")(rng) <= 9 for _ in range(100))
    ln = [parse_dist("lognormal:50,1.0,400")(rng) for _ in range(2000)]
    assert 35 < sorted(ln)[1000] < 65 and max(ln) <= 400 and max(ln) > 200  # median ~50, a long tail
    for bad in ("fixed", "uniform:9-3", "pareto:1", "lognormal:x"):
        with pytest.raises(ValueError):
            parse_dist(bad)


def test_the_load_client_runs_on_uvloop_unless_told_not_to(monkeypatch):
    # it shares the server's cores in every one-machine comparison: uvloop's loop took ~20 % less
    # CPU per output token (benchmarks/results/served_ab_uvloop_2026-12-04.json); the e2e tests
    # below drive HTTP and gRPC targets through it
    import uvloop

    from folio.deploy.bench import command

    monkeypatch.delenv("FOLIO_BENCH_UVLOOP", raising=False)
    assert command._loop_factory() is uvloop.new_event_loop
    monkeypatch.setenv("FOLIO_BENCH_UVLOOP", "0")
    assert command._loop_factory() is None


def test_workloads_and_load_shapes(tmp_path):
    sp = build("shared-prefix", 8, prefixes=2, prefix_len=20)
    heads = {j.group: " ".join(j.turns[0].text.split()[:20]) for j in sp.jobs}
    assert len(heads) == 2 and all(" ".join(j.turns[0].text.split()[:20]) == heads[j.group] for j in sp.jobs)
    mt = build("multi-turn", 12, turns=3)
    assert len(mt.jobs) == 4 and mt.num_requests == 12
    assert all(j.at_once for j in build("burst", 5).jobs)
    data = [{"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "a b c d"}]},
            {"conversations": [{"from": "human", "value": "only a question"}]}]
    (tmp_path / "sg.json").write_text(json.dumps(data))
    sg = build("sharegpt", 3, sharegpt_path=str(tmp_path / "sg.json"))
    assert [(j.turns[0].text, j.turns[0].max_tokens) for j in sg.jobs] == [("hello there", 4)] * 3
    ids = build("random", 20, input_len="uniform:3-9", unit="tokens", id_range=(16, 40))
    assert all(isinstance(j.turns[0].text, list) and 3 <= len(j.turns[0].text) <= 9
               and all(16 <= t < 40 for t in j.turns[0].text) for j in ids.jobs)
    assert len({tuple(j.turns[0].text) for j in ids.jobs}) > 10  # seeded, not constant
    assert [j.turns[0].text for j in build("random", 20, input_len="uniform:3-9", unit="tokens",
                                           id_range=(16, 40)).jobs] == [j.turns[0].text for j in ids.jobs]
    spt = build("shared-prefix", 6, prefixes=2, prefix_len=5, input_len="fixed:3", unit="tokens")
    assert all(len(j.turns[0].text) == 8 for j in spt.jobs)
    assert len({(j.group, tuple(j.turns[0].text[:5])) for j in spt.jobs}) == 2
    for name in ("multi-turn", "sharegpt"):
        with pytest.raises(ValueError, match="--input-unit words"):
            build(name, 4, unit="tokens", sharegpt_path=str(tmp_path / "sg.json"))
    rng = random.Random(1)
    poisson = LoadShape(rate=20.0).gaps(4000, rng)
    assert sum(poisson) / 4000 == pytest.approx(0.05, rel=0.05)
    bursty = LoadShape(rate=20.0, arrival="gamma", burstiness=0.25).gaps(4000, rng)
    assert sum(bursty) / 4000 == pytest.approx(0.05, rel=0.1)  # same rate...
    var = lambda xs: sum((x - 0.05) ** 2 for x in xs) / len(xs)  # noqa: E731
    assert var(bursty) > 2.5 * var(poisson)  # ...burstier (gamma CV^2 = 1/shape = 4)
    assert LoadShape(rate=None).gaps(3, rng) == [0.0, 0.0, 0.0]


# ---- end to end against folio serve -------------------------------------------------------
def bench(server, *args, tmp=None):
    cmd = [sys.executable, "-m", "folio.deploy.cli", "bench", "--api-key", FOLIO_SERVER_KEY, "--quiet",
           "--input-len", "uniform:4-24", "--output-len", "uniform:4-12", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


CAP = ["--max-concurrency", str(FOLIO_SERVER_LIMIT)]  # at most the server's admission limit: no 429 here


@pytest.mark.parametrize("workload, shape", [
    ("random", ["--rate", "20", *CAP]),
    ("random", ["--endpoint", "chat", "--rate", "20", *CAP]),  # /v1/chat/completions
    ("shared-prefix", ["--rate", "20", "--arrival", "gamma", "--burstiness", "0.5", "--prefix-len", "16", *CAP]),
    # lengths that keep 3 turns within max_model_len 256 (past it the server answers 400, never clamps)
    ("multi-turn", ["--max-concurrency", "2", "--turns", "3", "--input-len", "fixed:8", "--output-len", "fixed:8"]),
    ("burst", CAP),
])
def test_every_workload_and_shape_completes_over_http(folio_server, tmp_path, workload, shape):
    out = tmp_path / "r.json"
    bench(folio_server, "--target", folio_server["http"], "--workload", workload, "--num-requests", "6",
          "--out", str(out), *shape)
    doc = json.loads(out.read_text())
    s = doc["runs"][0]["summary"]
    assert (s["completed"], s["failed"]) == (6, 0) and s["output_tokens"] >= 6 * 4, s["errors"]
    assert s["ttft_s"]["p99"] <= s["e2e_s"]["p99"]
    assert s["folio"]["generation_tokens"] >= s["output_tokens"]  # the server's counters moved with it


@pytest.mark.parametrize("api", ["http", "grpc"])
def test_token_id_prompts_have_exactly_the_asked_length(folio_server, tmp_path, api):
    out = tmp_path / "r.json"
    target = folio_server["http"] if api == "http" else "grpc://" + folio_server["grpc"]
    bench(folio_server, "--target", target, "--workload", "random", "--num-requests", "6", "--input-unit", "tokens",
          "--input-len", "fixed:13", "--token-id-range", "16-200", "--out", str(out), *CAP)
    s = json.loads(out.read_text())["runs"][0]["summary"]
    assert (s["completed"], s["prompt_tokens"]) == (6, 6 * 13), s
    # the client's own CPU over the run (its start-up left out): some, and no more than it could take
    assert 0 < s["client_cpu_s"] <= s["duration_s"] * os.cpu_count() + 0.05, s
    assert s["client_cpu_s_per_1k_output_tokens"] == pytest.approx(1e3 * s["client_cpu_s"] / s["output_tokens"])


@pytest.mark.parametrize("api", ["http", "grpc"])
def test_a_stream_interval_reaches_the_server_over_either_api(folio_server, tmp_path, api):
    """--stream-interval 4: 16 tokens come in at most 5 chunks (1, 4, 4, 4, 3), so a record
    has at most 4 gaps between chunks; every token is counted."""
    out = tmp_path / "r.json"
    target = folio_server["http"] if api == "http" else "grpc://" + folio_server["grpc"]
    bench(folio_server, "--target", target, "--workload", "random", "--num-requests", "4", "--output-len", "fixed:16",
          "--stream-interval", "4", "--out", str(out), *CAP)
    run = json.loads(out.read_text())["runs"][0]
    assert run["summary"]["completed"] == 4 and run["summary"]["output_tokens"] == 4 * 16, run["summary"]
    assert all(len(r["itl"]) <= 4 for r in run["records"]), [len(r["itl"]) for r in run["records"]]


def test_grpc_target_sweep_sharegpt_plots_and_compare(folio_server, tmp_path):
    data = [{"conversations": [{"from": "human", "value": f"question {i} " * 5},
                               {"from": "gpt", "value": "word " * (4 + i)}]} for i in range(4)]
    (tmp_path / "sg.json").write_text(json.dumps(data))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    bench(folio_server, "--target", "grpc://" + folio_server["grpc"], "--workload", "sharegpt", "--dataset",
          str(tmp_path / "sg.json"), "--num-requests", "4", "--sweep", "5,50", *CAP, "--metrics-url",
          folio_server["metrics"], "--out", str(a), "--plots", str(tmp_path / "plots"), "--label", "grpc")
    doc = json.loads(a.read_text())
    assert [r["rate"] for r in doc["runs"]] == [5.0, 50.0]
    assert all(r["summary"]["completed"] == 4 for r in doc["runs"])
    pngs = sorted(os.listdir(tmp_path / "plots"))
    assert len(pngs) == 4 and all(p.endswith(".png") and os.path.getsize(tmp_path / "plots" / p) > 1000
                                  for p in pngs)
    bench(folio_server, "--target", folio_server["http"], "--workload", "sharegpt", "--dataset",
          str(tmp_path / "sg.json"), "--num-requests", "4", "--sweep", "5,50", *CAP, "--out", str(b), "--label", "http")
    table = subprocess.run([sys.executable, "-m", "folio.deploy.cli", "bench", "compare", str(a), str(b)],
                           capture_output=True, text=True, timeout=60).stdout
    assert "grpc" in table and "http" in table and "rate=50.0 output tok/s" in table


def test_errors_are_counted_by_code(folio_server, tmp_path):
    out = tmp_path / "r.json"
    # 18 at once against an admission limit of 6: the excess is refused with 429, counted, not raised
    bench(folio_server, "--target", folio_server["http"], "--workload", "burst", "--num-requests", "18",
          "--output-len", "fixed:40", "--out", str(out))
    s = json.loads(out.read_text())["runs"][0]["summary"]
    assert s["errors"].get("429", 0) >= FOLIO_SERVER_LIMIT and s["completed"] + s["failed"] == 18
    assert s["completed"] >= 1
    # a wrong key: every request fails with 401
    r = subprocess.run([sys.executable, "-m", "folio.deploy.cli", "bench", "--target", folio_server["http"],
                        "--model", "m", "--api-key", "wrong", "--num-requests", "3", "--quiet", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    assert json.loads(out.read_text())["runs"][0]["summary"]["errors"] == {"401": 3}


def test_bad_bench_arguments_fail_clearly(folio_server):
    r = subprocess.run([sys.executable, "-m", "folio.deploy.cli", "bench", "--target", "ftp://x", "--quiet"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "grpc://host:port or http://host:port" in r.stderr
    r = subprocess.run([sys.executable, "-m", "folio.deploy.cli", "bench", "--target", "grpc://" + folio_server["grpc"],
                        "--endpoint", "chat", "--quiet"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--endpoint chat needs an http:// target" in r.stderr
    r = subprocess.run([sys.executable, "-m", "folio.deploy.cli", "bench", "--target", folio_server["http"],
                        "--api-key", FOLIO_SERVER_KEY, "--output-len", "gaussian:3", "--quiet"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bad length distribution" in r.stderr
    for extra, msg in ((["--endpoint", "chat", "--input-unit", "tokens"], "--input-unit tokens needs the completions"),
                       (["--input-unit", "tokens", "--token-id-range", "9-3"], "bad token id range"),
                       (["--input-unit", "tokens", "--token-id-range", "x"], "bad token id range")):
        r = subprocess.run([sys.executable, "-m", "folio.deploy.cli", "bench", "--target", folio_server["http"],
                            "--api-key", FOLIO_SERVER_KEY, "--quiet", *extra], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and msg in r.stderr, (extra, r.stderr[-500:])
