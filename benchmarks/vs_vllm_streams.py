"""`folio serve` against `vllm serve` at a fixed number of concurrent streams, measured by two
load tools: `folio bench` and vLLM's own `vllm bench serve` (a tool no one here wrote).

    python benchmarks/vs_vllm_streams.py --model models/tiny-llama-8l [--streams 32] [--requests 128]
        [--input-len 128] [--output-len 128]

One server runs at a time, fresh for every pass, in the order folio, vLLM, vLLM, folio (A B B A:
this machine drifts), and each pass drives it with both tools (`folio bench`, then `vllm bench
serve`): `streams` requests at a time, `requests` in all, random prompts of `input-len` tokens,
`output-len` tokens each (EOS ignored), greedy, HTTP streaming /v1/completions. Same model,
float32, the same KV budget in tokens (1,024 blocks of 16 for Folio, 512 of 32 for vLLM, whose
CPU attention needs multiples of 32), max model length 1,024. Output tok/s per tool and server
(mean of the two passes) to benchmarks/results/vs_vllm_streams.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from serve_local import free_port, start_server, stop_server  # noqa: E402
from vllm_bench_serve import SHIM, VLLM_PY  # noqa: E402
from vs_peers_serving import VLLM_ENV, wait_ready  # noqa: E402
from vs_peers_serving import stop as stop_vllm  # noqa: E402

KV_TOKENS = 16384
NAME = "tiny"  # the model's name on both servers


def start_vllm(model: str, work: str):
    port = free_port()
    cmd = [VLLM_PY, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", NAME,
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--block-size", "32",
           "--num-gpu-blocks-override", str(KV_TOKENS // 32), "--max-model-len", "1024", "--seed", "0",
           "--max-num-seqs", "256"]
    log = open(os.path.join(work, f"vllm-{time.time():.0f}.log"), "w")
    proc = subprocess.Popen(cmd, env=VLLM_ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=work)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, "vllm")
    return proc, url


def folio_bench(url: str, args, out: str) -> float:
    cmd = [sys.executable, "-m", "folio.deploy.cli", "bench", "--target", url, "--model", NAME, "--workload", "random",
           "--input-unit", "tokens", "--token-id-range", "16-8000", "--input-len", f"fixed:{args.input_len}",
           "--output-len", f"fixed:{args.output_len}", "--max-concurrency", str(args.streams), "--quiet"]
    subprocess.run(cmd + ["--num-requests", "8", "--out", out], check=True, capture_output=True)  # warm-up
    subprocess.run(cmd + ["--num-requests", str(args.requests), "--out", out], check=True, capture_output=True)
    s = json.load(open(out))["runs"][0]["summary"]
    if s.get("failed"):
        raise SystemExit(f"folio bench: {s['failed']} failed requests against {url}")
    return s["output_throughput"]


def vllm_bench(url: str, args, work: str, tok_dir: str, tag: str) -> float:
    res = os.path.join(work, f"vb-{tag}")
    cmd = [VLLM_PY, os.path.join(work, "vllm_cli.py"), "bench", "serve", "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", tok_dir, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.requests), "--max-concurrency", str(args.streams), "--seed", "0",
           "--ignore-eos", "--save-result", "--result-dir", res]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    files = glob.glob(os.path.join(res, "*.json"))
    if p.returncode != 0 or not files:
        raise SystemExit(f"vllm bench serve failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    full = json.load(open(files[0]))
    if full.get("completed") != args.requests:
        raise SystemExit(f"vllm bench serve: {full.get('completed')} of {args.requests} completed against {url}")
    return full["output_throughput"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "vs_vllm_streams.json"))
    args = ap.parse_args()
    if not os.path.exists(VLLM_PY):
        raise SystemExit("no vLLM venv: run benchmarks/vs_peers_offline.py --setup-vllm first")
    model = os.path.abspath(args.model)
    work = tempfile.mkdtemp(prefix="folio-vs-vllm-")  # outside the checkout (its kernels/ shadows vLLM's)
    with open(os.path.join(work, "vllm_cli.py"), "w") as f:
        f.write(SHIM)
    runs = []
    for k, server in enumerate(["folio", "vllm", "vllm", "folio"]):
        if server == "folio":
            proc, http, _ = start_server(model, 1, "--served-model-name", NAME, "--block-size", "16",
                                         "--num-kv-blocks", str(KV_TOKENS // 16), "--max-model-len", "1024",
                                         "--max-num-requests", "1024", "--namespace", f"vv{os.getpid()}{k}")
            url = f"http://127.0.0.1:{http}"
        else:
            proc, url = start_vllm(model, work)
        try:
            got = {"folio bench": folio_bench(url, args, os.path.join(work, f"fb-{k}.json")),
                   "vllm bench serve": vllm_bench(url, args, work, model, str(k))}
        finally:
            if server == "folio":
                stop_server(proc)
            else:
                stop_vllm(proc)
        runs.append({"server": server, "output_tokens_per_s": {t: round(v, 1) for t, v in got.items()}})
        print(server, runs[-1]["output_tokens_per_s"], flush=True)
    mean = {s: {t: round(sum(r["output_tokens_per_s"][t] for r in runs if r["server"] == s) / 2, 1)
                for t in runs[0]["output_tokens_per_s"]} for s in ("folio", "vllm")}
    doc = {"benchmark": "vs_vllm_streams", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv), "streams": args.streams, "requests": args.requests,
           "input_len": args.input_len, "output_len": args.output_len, "kv_budget_tokens": KV_TOKENS,
           "order": "folio, vllm, vllm, folio (a fresh server per pass)", "runs": runs, "mean": mean,
           "folio_over_vllm": {t: round(mean["folio"][t] / mean["vllm"][t], 3) for t in mean["folio"]}}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print("folio / vLLM:", doc["folio_over_vllm"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
