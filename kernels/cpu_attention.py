"""The CPU's paged attention in C++, reading each context in place through its block table.
Decode rows (cpu_attention.cpp): the torch reference gathers every context into a padded
buffer and runs SDPA over it, which writes and rereads each K/V byte: SmolLM2-135M's decode
at batch 64 x 160 tokens spent ~2.2-3.4 ms per layer there, ~0.85 here
(benchmarks/cpu_attention.py). Prefill rows (cpu_prefill.cpp, more than one new token):
flash-style tiles with GQA folded into the rows and causal tasks balanced across the threads;
torch's CPU flash attention ran at ~75 GFLOP/s on a 512-token prompt of the tiny Llama
(benchmarks/prefill_latency.py's profile), about half of vLLM's C++ kernel. Head dims past
256 go to the reference.

The library is compiled on first use with the system's C++ compiler ($CXX, else c++) against
the installed torch, for this CPU (-march=native), into a cache keyed by the source, the
flags, torch's version and the CPU's flags ($FOLIO_KERNEL_CACHE, else ~/.cache/folio/kernels);
concurrent builders each write their own file and rename it into place, so no lock can be
left stale by a killed process. `make venv` builds it ahead. Without a compiler the CPU
path stays the torch reference (backend.py says why, once).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import subprocess
import tempfile
import threading

import torch

from folio.kernels import reference
from folio.kernels.attention_plan import AttentionPlan, plan_attention, prefill_plan
from folio.kernels.errors import KernelInputError

log = logging.getLogger("folio.kernels")
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_attention.cpp")
# the library's sources: the attention (decode, prefill), the small fused ops of cpu_ops.py and the
# linear layers of linear.py (float32 on AVX-512, bfloat16 on AMX)
# (one .so, one load)
SOURCES = (SOURCE, *(os.path.join(os.path.dirname(SOURCE), name)
                     for name in ("cpu_prefill.cpp", "cpu_ops.cpp", "cpu_linear.cpp", "cpu_linear_amx.cpp")))
HEADERS = (os.path.join(os.path.dirname(SOURCE), "cpu_simd.h"),)  # in the cache key with the sources
# -ffast-math when compiling only (it lets expf vectorize through glibc's libmvec): linked
# with it, gcc adds crtfastmath.o, whose constructor turns on flush-to-zero for the whole
# process when the library loads, and every torch op would lose subnormals.
COMPILE = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17", "-c"]
LINK = ["-shared", "-fopenmp"]
# cpu_ops.cpp: no FMA contraction, so that a rotation's x * cos + y * sin rounds three times,
# as torch's chain of ops does (bit-identical float32 rope)
PER_SOURCE = {"cpu_ops.cpp": ["-ffp-contract=off"]}
FLAGS = COMPILE + LINK + [f for extra in PER_SOURCE.values() for f in extra]
DTYPES = (torch.float32, torch.bfloat16)
MAX_PREFILL_HEAD_DIM = 256
_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": True, or "error": why it is not


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def library_path() -> str:
    """Where this source, built for this CPU and this torch, lives."""
    src = b""
    for source in SOURCES + HEADERS:
        with open(source, "rb") as f:
            src += f.read() + b"\0"
    cxx = os.environ.get("CXX", "c++")
    key = hashlib.sha256(b"\0".join([src, " ".join([cxx] + FLAGS).encode(), torch.__version__.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:20]
    cache = os.environ.get("FOLIO_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "folio", "kernels")
    return os.path.join(cache, f"cpu_attention-{key}.so")


def build(path: str) -> None:
    """Compile the library to `path` (atomically: a temporary file renamed into place)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    objs = [f"{tmp[:-3]}.{i}.o" for i in range(len(SOURCES))]
    cxx = os.environ.get("CXX", "c++")
    abi = int(torch.compiled_with_cxx11_abi())
    compiles = [[cxx, *COMPILE, *PER_SOURCE.get(os.path.basename(source), []), f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                 *[f"-I{p}" for p in include_paths()], source, "-o", obj] for source, obj in zip(SOURCES, objs)]
    link = [cxx, *LINK, *objs, "-o", tmp, *[f"-L{p}" for p in library_paths()], "-lc10", "-ltorch_cpu"]

    def run(cmd: list[str]) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{cmd[0]} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    try:
        # the sources side by side, one compiler per core (35 s one after another on 2 cores)
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(compiles), os.cpu_count() or 1)) as pool:
            for f in [pool.submit(run, cmd) for cmd in compiles]:
                f.result()
        run(link)
        os.replace(tmp, path)
    finally:
        for f in (tmp, *objs):
            if os.path.exists(f):
                os.unlink(f)


def load() -> str | None:
    """Build (if needed) and load the library once per process: None when it is loaded, else
    why it cannot be (no compiler, a failed build)."""
    with _lock:
        if "loaded" not in _state and "error" not in _state:
            try:
                path = library_path()
                if not os.path.exists(path):
                    log.info("building the CPU attention kernel (%s): once per CPU and torch version", path)
                    build(path)
                torch.ops.load_library(path)
                _state["loaded"] = True
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _state["error"] = f"the CPU attention kernel could not be built or loaded: {e}"
        return _state.get("error")


def prefill_by_sdpa(dtype: torch.dtype) -> bool:
    """bfloat16 prefills go through the torch path (gather + SDPA) on a CPU with AMX: SDPA's
    flash attention multiplies by oneDNN, which runs bf16 on AMX's tiles, where this library's
    prefill kernel runs float32 FMAs. On the 2-core Xeon with AMX, SmolLM2's shapes, per layer
    (ad hoc, each way twice): 16 prompts x 128 tokens 2.6 -> 1.8 ms, 4 x 512 7.0 -> 4.4, 1 x
    1,536 13.4 -> 5.7-6.2; float32 the other way (2.7 against 6.5 ms: no AMX for it), and on the
    EPYC without AMX the kernel won for both."""
    if "amx" not in _state:
        _state["amx"] = "amx_bf16" in _cpu_flags().split()
    return dtype == torch.bfloat16 and bool(_state["amx"])


def plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
         kv_bytes_per_token: int) -> AttentionPlan:
    """The decode rows and the prefill rows, each as one set for the kernels."""
    return plan_attention(block_tables, seq_lens, query_start_loc, block_size, kv_bytes_per_token, in_place=True)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, plan: AttentionPlan | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """reference.paged_attention's contract, through the C++ kernels."""
    if (q.dtype not in DTYPES or k_cache.dtype != q.dtype or q.device.type != "cpu"
            or ("loaded" not in _state and load() is not None)):
        return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                         out=out)
    if plan is None or plan.decode_rows is None or plan.prefill_rows is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1], 0, in_place=True)
    out = torch.empty_like(q) if out is None else out
    d, p = plan.decode_rows, plan.prefill_rows
    try:  # their checks: the same class of error as the reference's
        if d.rows.numel():
            torch.ops.folio_cpu.decode_attention(q, k_cache, v_cache, d.block_tables, d.seq_lens, d.rows, out, scale)
        if p.q_lens.numel():
            if q.shape[2] <= MAX_PREFILL_HEAD_DIM and not prefill_by_sdpa(q.dtype):
                torch.ops.folio_cpu.prefill_attention(q, k_cache, v_cache, p.block_tables, p.seq_lens, p.q_starts,
                                                      p.q_lens, out, scale)
            else:
                if plan.torch_prefills is None:  # the first layer's call plans them for all
                    plan.torch_prefills = prefill_plan(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
                reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                          plan=plan.torch_prefills, out=out)
    except RuntimeError as e:
        raise KernelInputError(str(e).split("\n")[0]) from None
    return out


if __name__ == "__main__":  # `make venv` / `make test`: build it ahead (a no-op once built)
    why = load()
    print(why or f"CPU attention kernel: {library_path()}")
