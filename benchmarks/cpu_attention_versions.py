"""Versions of the C++ CPU decode attention against each other, in one process: each source
(a file, or `REV:path` read from git) is built with the kernel's own flags under its own op
namespace, and the calls alternate round by round (A B ... B A), so the host's drift hits every
version alike. This machine's tok/s moves 10-30 % between processes; within one it does not.

    python benchmarks/cpu_attention_versions.py HEAD~1:kernels/cpu_attention.cpp kernels/cpu_attention.cpp
        [--dtypes bfloat16,float32] [--rounds 10] [--out results/cpu_attention_versions.json]

Per case: the median ms per layer over 30 layers of a block-major cache (every layer's K and V
of a block side by side, blocks at random: the engine's layout; K/V come from memory, 8 MB a
layer at SmolLM2's b64 x 160), and over one layer again and again (from the cache: the kernel's
compute alone). Every version's output is checked against float64 attention first.
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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from folio.kernels import cpu_attention, reference  # noqa: E402

SHAPES = {  # name: (heads, kv heads, head dim, batch, context)
    "SmolLM2-135M b64 x 160": (9, 3, 64, 64, 160),
    "tiny-llama-8l b64 x 128": (8, 4, 64, 64, 128),
    "Llama-8B-like b16 x 1000": (32, 8, 128, 16, 1000),
}


def load_version(spec: str, tag: str, workdir: str):
    """Build `spec` (a path, or REV:path) as op namespace folio_v<tag>; return its op."""
    if os.path.exists(spec):
        with open(spec) as f:
            src = f.read()
    else:
        src = subprocess.run(["git", "show", spec], capture_output=True, text=True, check=True).stdout
    ns = f"folio_v{tag}"
    src = src.replace("TORCH_LIBRARY(folio_cpu,", f"TORCH_LIBRARY({ns},")
    from torch.utils.cpp_extension import include_paths, library_paths

    cpp, obj, so = (os.path.join(workdir, f"v{tag}{ext}") for ext in (".cpp", ".o", ".so"))
    with open(cpp, "w") as f:
        f.write(src)
    cxx, abi = os.environ.get("CXX", "c++"), int(torch.compiled_with_cxx11_abi())
    subprocess.run([cxx, *cpu_attention.COMPILE, "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                    *[f"-I{p}" for p in include_paths()], cpp, "-o", obj], check=True)
    subprocess.run([cxx, *cpu_attention.LINK, obj, "-o", so, *[f"-L{p}" for p in library_paths()],
                    "-lc10", "-ltorch_cpu"], check=True)
    torch.ops.load_library(so)
    return getattr(torch.ops, ns).decode_attention


def case(shape, dtype, layers=30, block_size=16, seed=0):
    H, KVH, D, B, ctx = shape
    g = torch.Generator().manual_seed(seed)
    per = -(-ctx // block_size)
    big = torch.randn(B * per + 8, layers, 2, block_size, KVH, D, generator=g).to(dtype)
    tables = torch.randperm(big.shape[0], generator=g)[: B * per].view(B, per).to(torch.int32)
    lens = torch.tensor([max(1, ctx - (i * 7) % 13) for i in range(B)], dtype=torch.int64)  # ragged, some odd
    q = torch.randn(B, H, D, generator=g).to(dtype)
    return big, tables, lens, q


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("versions", nargs="+", help="kernel sources: paths or REV:path")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_attention_versions.json"))
    args = ap.parse_args()
    doc = {"benchmark": "cpu_attention_versions", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv), "threads": torch.get_num_threads(),
           "versions": args.versions, "cases": {}}
    with tempfile.TemporaryDirectory() as wd:
        ops = [load_version(v, str(i), wd) for i, v in enumerate(args.versions)]
        for dname in args.dtypes.split(","):
            dtype = getattr(torch, dname)
            for name, shape in SHAPES.items():
                big, tables, lens, q = case(shape, dtype)
                B, D = q.shape[0], q.shape[2]
                rows, scale = torch.arange(B, dtype=torch.int64), D ** -0.5
                qsl = torch.arange(B + 1, dtype=torch.int32)
                kc, vc = big[:, 0, 0], big[:, 0, 1]
                ref = reference.paged_attention(q.double(), kc.double(), vc.double(), tables, lens.to(torch.int32),
                                                qsl, scale)
                out = torch.empty_like(q)
                errs = []
                for op in ops:
                    op(q, kc, vc, tables, lens, rows, out, scale)
                    errs.append((out.double() - ref).abs().max().item())
                res = {}
                for where, nl in (("memory (30 layers)", big.shape[1]), ("cache (1 layer)", 1)):
                    ts = [[] for _ in ops]
                    for r in range(args.rounds):
                        order = list(range(len(ops)))
                        for i in (order if r % 2 == 0 else order[::-1]):
                            t = time.perf_counter()
                            for _ in range(2):
                                for l in range(nl):
                                    ops[i](q, big[:, l, 0], big[:, l, 1], tables, lens, rows, out, scale)
                            ts[i].append((time.perf_counter() - t) / nl / 2 * 1e3)
                    res[where] = [round(statistics.median(t), 3) for t in ts]
                doc["cases"][f"{name} {dname}"] = {"ms_per_layer": res, "max_abs_err_vs_f64": errs}
                print(f"{name} {dname}: ms/layer {res}  err {['%.1e' % e for e in errs]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
