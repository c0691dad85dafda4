"""A roofline estimate of tensor parallelism on H200s: Llama-3-8B and -70B at TP = 1, 2, 4, 8.

    python benchmarks/tp_roofline.py [--gpu H200] [--link NVLink4] [--measured [gpu_check.json]]

From cluster/sim/roofline.py: spec-sheet HBM bandwidth and bf16 peak at the efficiencies
vLLM-class kernels reach (80 % / 60 %), a fixed 2 ms per step, and the all-reduces at an
assumed NVLink busbw and latency (roofline.LINKS). None of it is measured on a GPU here: the
figures to replace with measured ones (kernel bandwidth and FLOP rate, NCCL all-reduce time)
come from benchmarks/gpu_check.py and nccl-tests once GPUs are lent: --measured takes the
first two from gpu_check.py's JSON (the all-reduce stays assumed: it needs several GPUs).
Writes benchmarks/results/tp_roofline.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from folio.cluster.sim.roofline import GPUS, LINKS, MODELS, GPUSpec, Roofline  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 16
CONTEXT = 2048  # tokens of context per decoding sequence
PREFILL = 2048  # tokens of one prefill step


def measured_gpu(path: str, spec: GPUSpec) -> tuple[GPUSpec, dict] | None:
    """The GPU as gpu_check.py measured it (a device-to-device copy's bytes/s, a bf16 matrix
    product's FLOP/s: rates kernels reach, so no efficiency factor on top), or None."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        k = json.load(f).get("kernels", {})
    if not k.get("copy_GBps") or not k.get("matmul_bf16_tflops"):
        return None
    gpu = replace(spec, hbm_bytes_per_s=k["copy_GBps"] * 1e9, flops_per_s=k["matmul_bf16_tflops"] * 1e12)
    return gpu, {"from": path, "device": k.get("device"), "copy_GBps": k["copy_GBps"],
                 "matmul_bf16_tflops": k["matmul_bf16_tflops"]}


def estimate(model: str, gpu: GPUSpec, link: str, tp: int, efficiency: tuple[float, float]) -> dict:
    r = Roofline(gpu, MODELS[model], tensor_parallel_size=tp, link=LINKS[link], memory_efficiency=efficiency[0],
                 compute_efficiency=efficiency[1])
    m = MODELS[model]
    if r.free_bytes_per_gpu <= 0:
        return {"tp": tp, "fits": False, "weights_per_gpu_gb": round(m.weight_bytes / tp / 1e9, 1)}
    kv_tokens = r.num_kv_blocks(BLOCK) * BLOCK
    out = {"tp": tp, "fits": True, "weights_per_gpu_gb": round(m.weight_bytes / tp / 1e9, 1),
           "kv_tokens_per_group": kv_tokens}
    for batch in (1, 64):
        batch_fit = min(batch, kv_tokens // CONTEXT)
        step = r.step_seconds([(1, CONTEXT)] * batch_fit)
        out[f"decode_b{batch}"] = {"batch": batch_fit, "step_ms": round(1e3 * step, 2),
                                   "tok_s_per_group": round(batch_fit / step, 1),
                                   "tok_s_per_gpu": round(batch_fit / step / tp, 1),
                                   "all_reduce_share": round(r.all_reduce_seconds(batch_fit) / step, 3)}
    step = r.step_seconds([(PREFILL, PREFILL)])
    out["prefill_2048_ms"] = round(1e3 * step, 1)
    out["prefill_all_reduce_share"] = round(r.all_reduce_seconds(PREFILL) / step, 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="H200", choices=sorted(GPUS))
    ap.add_argument("--link", default="NVLink4", choices=sorted(LINKS))
    ap.add_argument("--measured", nargs="?", const=os.path.join(HERE, "results", "gpu_check.json"),
                    help="the GPU's bandwidth and bf16 rate from gpu_check.py's JSON (default path when no value) "
                         "instead of the spec sheet's at 80 %% / 60 %%; the link stays assumed")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "tp_roofline.json"))
    args = ap.parse_args()
    gpu, efficiency, measured = GPUS[args.gpu], (0.8, 0.6), False
    if args.measured:
        found = measured_gpu(args.measured, gpu)
        if found is None:
            print(f"{args.measured}: no measured copy bandwidth and bf16 rate (run gpu_check.py on a GPU)",
                  file=sys.stderr)
            return 2
        (gpu, measured), efficiency = found, (1.0, 1.0)
    rows = {model: [estimate(model, gpu, args.link, tp, efficiency) for tp in (1, 2, 4, 8)]
            for model in ("llama-3-8b", "llama-3-70b")}
    link = LINKS[args.link]
    doc = {"benchmark": "tp_roofline", "date": time.strftime("%Y-%m-%d"), "measured": measured,
           "assumptions": {"gpu": vars(gpu), "link": vars(link), "memory_efficiency": efficiency[0],
                           "compute_efficiency": efficiency[1], "step_overhead_s": 0.002, "context_tokens": CONTEXT,
                           "block_size": BLOCK, "dtype": "bf16"},
           "estimates": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("| model | TP | weights / GPU (GB) | KV tokens | decode b1: ms / tok/s | decode b64: ms / tok/s per GPU "
          "| all-reduce share (b64) | prefill 2048 (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for model, rs in rows.items():
        for e in rs:
            if not e["fits"]:
                print(f"| {model} | {e['tp']} | {e['weights_per_gpu_gb']} | does not fit | | | | |")
                continue
            b1, b64 = e["decode_b1"], e["decode_b64"]
            print(f"| {model} | {e['tp']} | {e['weights_per_gpu_gb']} | {e['kv_tokens_per_group']:,} | "
                  f"{b1['step_ms']} / {b1['tok_s_per_group']} | {b64['step_ms']} / {b64['tok_s_per_gpu']} "
                  f"(batch {b64['batch']}) | {b64['all_reduce_share']} | {e['prefill_2048_ms']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
