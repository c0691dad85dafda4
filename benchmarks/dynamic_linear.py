"""A lead for the served share (issue #15): a linear layer whose two OpenMP threads take its
output columns in chunks as they come free (`schedule(dynamic)`), each chunk one oneDNN
call on that chunk's own packed weights, against the one oneDNN call (a static split of the
work) the engine makes now. A static split waits at its end for a thread another process
took off its core; a dynamic one gives the rest of the work to the thread still running.

    python benchmarks/dynamic_linear.py [--rounds 3] [--share 0.3]

Per shape (64 rows, the tiny Llama's and SmolLM2-135M's linear layers and LM heads), the
mean time of the current op ("full") and of the chunked op with 4 and 8 chunks, quiet and
beside a process spinning `share` of one core (cpu_contention.py's thief), the two alternated
quiet / thief / thief / quiet per round. Every chunked result is checked bit-identical to the
full op. The op is compiled here (torch's cpp_extension), not part of Folio's kernels: an
experiment. Results: benchmarks/results/dynamic_linear.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from cpu_contention import THIEF  # noqa: E402

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

// x [M, K] times each packed chunk of W (rows n0..n1 of [N, K]) into out[:, n0:n1], the chunks
// taken by the OpenMP team as its threads come free; each oneDNN call runs on one thread (it is
// inside a parallel region).
torch::Tensor chunked_linear(torch::Tensor x, std::vector<torch::Tensor> packed, std::vector<int64_t> rows) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<int64_t> off;
  int64_t n = 0;
  for (auto r : rows) { off.push_back(n); n += r; }
  auto out = torch::empty({x.size(0), n}, x.options());
  int chunks = (int)packed.size();
  #pragma omp parallel for schedule(dynamic, 1)
  for (int i = 0; i < chunks; i++) {
    torch::jit::Stack st{x, packed[i], c10::IValue(), std::string("none"),
                         c10::List<std::optional<at::Scalar>>(), std::string("")};
    op.callBoxed(&st);
    out.narrow(1, off[i], rows[i]).copy_(st[0].toTensor());
  }
  return out;
}
"""

SHAPES = {  # (in, out) of each linear layer at 64 rows
    "tiny qkv": (512, 1024), "tiny o": (512, 512), "tiny gate_up": (512, 2816), "tiny down": (1408, 512),
    "tiny lm_head": (512, 32000),
    "smollm2 qkv": (576, 960), "smollm2 o": (576, 576), "smollm2 gate_up": (576, 3072),
    "smollm2 down": (1536, 576), "smollm2 lm_head": (576, 49152),
}
ROWS = 64


def mean_ms(fn, seconds: float = 0.3) -> float:
    """Mean time of back-to-back calls over ~`seconds` (a mean, not a median: the thief hits a
    share of the calls, and a median of short calls would leave those out)."""
    for _ in range(3):
        fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return 1e3 * (time.perf_counter() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--share", type=float, default=0.3, help="of one core, taken by the thief")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "dynamic_linear.json"))
    args = ap.parse_args()
    import torch
    from torch.utils.cpp_extension import load_inline

    build = os.path.join(tempfile.gettempdir(), "folio-dynamic-linear")
    os.makedirs(build, exist_ok=True)
    mod = load_inline("folio_dynamic_linear", cpp_sources=SOURCE, functions=["chunked_linear"],
                      extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], build_directory=build)
    torch.manual_seed(0)
    ops = {}
    for name, (k, n) in SHAPES.items():
        x, w = torch.randn(ROWS, k), torch.randn(n, k) / k ** 0.5
        full_w = torch.ops.mkldnn._reorder_linear_weight(w, ROWS)
        variants = {"full": (lambda x=x, p=full_w: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))}
        for c in (4, 8):
            parts = [p.contiguous() for p in w.chunk(c)]
            packed = [torch.ops.mkldnn._reorder_linear_weight(p, ROWS) for p in parts]
            rows = [p.shape[0] for p in parts]
            variants[f"chunks{c}"] = (lambda x=x, p=packed, r=rows: mod.chunked_linear(x, p, r))
        ref = variants["full"]()
        for v, fn in variants.items():
            if not torch.equal(fn(), ref):
                raise SystemExit(f"{name}: {v} differs from the full op")
        ops[name] = variants
    times: dict = {}
    for r in range(args.rounds):
        for cond in ("quiet", "thief", "thief", "quiet"):
            thief = (subprocess.Popen([sys.executable, "-c", THIEF, str(args.share), "5"]) if cond == "thief" else None)
            try:
                time.sleep(0.2 if thief else 0)
                for name, variants in ops.items():
                    for v, fn in variants.items():
                        times.setdefault(name, {}).setdefault(v, {}).setdefault(cond, []).append(mean_ms(fn))
            finally:
                if thief:
                    thief.kill()
                    thief.wait()
    summary = {}
    for group in ("tiny", "smollm2"):
        for part, names in (("layers", [n for n in SHAPES if n.startswith(group) and "lm_head" not in n]),
                            ("lm_head", [n for n in SHAPES if n.startswith(group) and "lm_head" in n])):
            row = {}
            for v in ("full", "chunks4", "chunks8"):
                q = sum(statistics.median(times[n][v]["quiet"]) for n in names)
                t = sum(statistics.median(times[n][v]["thief"]) for n in names)
                row[v] = {"quiet_ms": round(q, 3), "thief_ms": round(t, 3),
                          "amplification": round((t / q - 1) / (args.share / os.cpu_count()), 2)}
            for v in ("chunks4", "chunks8"):
                row[v]["quiet_over_full"] = round(row[v]["quiet_ms"] / row["full"]["quiet_ms"], 3)
                row[v]["thief_over_full"] = round(row[v]["thief_ms"] / row["full"]["thief_ms"], 3)
            summary[f"{group} {part}"] = row
    doc = {"benchmark": "dynamic_linear", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv), "rows": ROWS, "threads": torch.get_num_threads(),
           "thief_share_of_one_core": args.share, "cores": os.cpu_count(),
           "amplification": "(thief ms / quiet ms - 1) / (share / cores): 1 = loses only the CPU taken",
           "summary": summary, "times_ms": times}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
