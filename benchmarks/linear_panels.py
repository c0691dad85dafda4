"""Linear layers: Folio's panels (kernels/cpu_linear.cpp for float32, cpu_linear_amx.cpp's AMX
tiles for bfloat16) against oneDNN's reordered weight and torch's F.linear, at decode and
prefill row counts, on a model's shapes.

    python benchmarks/linear_panels.py [--model models/SmolLM2-135M-Instruct.Q4_1-f32] [--rows 1,16,64,256,2048]
                                       [--dtype float32|bfloat16]

Each "step" runs every layer's four linears (qkv, o, gate-up, down) on that layer's own
weights, as a forward does, so the weights come from memory the way they do in the engine
(a model's layers are larger than the caches); the LM head is timed on its own. The backends
alternate A B C, C B A for --rounds rounds, 2 threads. Writes GFLOP/s per backend and row count
to benchmarks/results/linear_panels.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from folio.kernels.linear import Linear, panels_available
from folio.worker.models.model_config import ModelConfig

HERE = os.path.dirname(os.path.abspath(__file__))

BACKENDS = ("panels", "onednn", "torch")


def shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of one layer's qkv, o, gate-up and down."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return [((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), (h, cfg.num_heads * d), (2 * i, h), (h, i)]


def timed(fn, flops: float, min_seconds: float = 0.3) -> float:
    fn()  # warm: oneDNN builds its primitive for this row count
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_seconds:
            return flops * n / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(os.path.dirname(HERE), "models", "SmolLM2-135M-Instruct.Q4_1-f32"))
    ap.add_argument("--rows", default="1,16,64,128,256,2048")
    ap.add_argument("--layers", type=int, default=0, help="default: the model's")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "linear_panels.json"))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if not panels_available(dtype):
        raise SystemExit(f"no panels kernel for {args.dtype} here (AVX-512 for float32, AMX for bfloat16, and a C++ "
                         "compiler)")
    torch.set_num_threads(2)
    cfg = ModelConfig.from_dir(args.model)
    layers = args.layers or cfg.num_layers
    g = torch.Generator().manual_seed(0)
    plain = [[(torch.randn(o, i, generator=g) * 0.02).to(dtype) for o, i in shapes(cfg)] for _ in range(layers)]
    head = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02).to(dtype)
    made = {b: ([[Linear(w, None, b) for w in ws] for ws in plain], Linear(head, None, b)) for b in BACKENDS}
    doc = {"benchmark": "linear_panels", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": args.model,
           "dtype": args.dtype,
           "command": " ".join(["python"] + sys.argv), "threads": 2, "layers": layers,
           "shapes": shapes(cfg), "lm_head": [cfg.vocab_size, cfg.hidden_size], "rows": {}}
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            xs = {i: torch.randn(rows, i, generator=g).to(dtype) for _, i in shapes(cfg)}
            xh = torch.randn(rows, cfg.hidden_size, generator=g).to(dtype)
            got: dict[str, dict[str, list[float]]] = {b: {"layers": [], "lm_head": []} for b in BACKENDS}
            for r in range(args.rounds):
                for b in (BACKENDS if r % 2 == 0 else BACKENDS[::-1]):
                    lins, lm = made[b]

                    def step(lins=lins) -> None:
                        for layer in lins:
                            for lin, (_, i) in zip(layer, shapes(cfg)):
                                lin(xs[i])
                    layer_flops = 2 * rows * sum(o * i for o, i in shapes(cfg)) * layers
                    got[b]["layers"].append(round(timed(step, layer_flops), 1))
                    got[b]["lm_head"].append(round(timed(lambda lm=lm: lm(xh), 2 * rows * head.numel()), 1))
            check = made["panels"][1](xh[:4])
            torch.testing.assert_close(check.float(), F.linear(xh[:4].float(), head.float()),
                                       **({"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}))
            doc["rows"][rows] = {b: {k: {"gflops": v, "median": statistics.median(v)} for k, v in parts.items()}
                                 for b, parts in got.items()}
            print(rows, {b: {k: v["median"] for k, v in parts.items()} for b, parts in doc["rows"][rows].items()},
                  flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
