"""The engine's speed on the lent device, for gpu_check.py (its part 3): output tokens/s of a
decode step at batch 1-256, where a batch-1 step's time goes (kernel launches, device time,
the host's top ops), and the backend's fused small ops against torch's chains, alternated in
one engine. Each takes gpu_check's parsed arguments (device, quick) and returns its rows."""

from __future__ import annotations

import time


def decode_rate(name: str, model: str, dtype: str, args) -> list[dict]:
    """Output tokens/s of a decode step at each batch (prompts of 128 random tokens, greedy)."""
    import torch

    from folio.worker import LLM
    from profile_step import add_random_requests, prefill_all

    batches = [1, 16] if args.quick else [1, 4, 16, 64, 128, 256]
    steps, ctx = (3, 32) if args.quick else (10, 128)
    per_seq = ctx + 3 * steps + 16
    llm = LLM(model, device=args.device, dtype=dtype, block_size=16, max_num_seqs=max(batches),
              num_kv_blocks=max(batches) * (-(-per_seq // 16)) + 16, max_model_len=512, enable_prefix_caching=False,
              max_num_batched_tokens=8192)
    eng, rows = llm.engine, []
    for b in batches:
        add_random_requests(eng, b, ctx, 3 * steps + 4, prefix=f"{b}-", seed=b)
        prefill_all(eng)
        for _ in range(2):
            eng.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()  # returns sampled ids on the host: each step ends synchronised
        ms = (time.perf_counter() - t0) / steps * 1e3
        rows.append({"model": name, "dtype": dtype, "batch": b, "context": ctx, "step_ms": round(ms, 3),
                     "out_tok_per_s": round(b / ms * 1e3, 1)})
        print(f"decode {name} {dtype} batch {b}: {ms:.2f} ms/step, {b / ms * 1e3:.0f} tok/s", flush=True)
        while eng.has_unfinished_requests():
            eng.step()
    del llm
    torch.cuda.empty_cache() if args.device == "cuda" else None
    return rows


LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")  # the host's kernel launches


def profiled_steps(eng, steps: int, device: str):
    """The torch profiler's per-op averages over `steps` engine steps (CUDA activity on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
    return prof.key_averages()


def step_profile(name: str, model: str, dtype: str, args) -> dict:
    """Where one batch-1 decode step's wall time goes: the torch profiler over 5 steps, the ops with
    the most host time, and how many device kernels a step launches (a step that launches
    hundreds of small kernels is bound by the host, not the GPU)."""
    import torch

    from folio.worker import LLM
    from profile_step import add_random_requests, prefill_all

    llm = LLM(model, device=args.device, dtype=dtype, block_size=16, num_kv_blocks=64, max_model_len=512,
              enable_prefix_caching=False)
    eng, steps = llm.engine, 5
    add_random_requests(eng, 1, 128, steps + 8, prefix="p", seed=1)
    prefill_all(eng)
    for _ in range(2):
        eng.step()
    ev = profiled_steps(eng, steps, args.device)
    dev = [e for e in ev if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
    launches = sum(e.count for e in ev if e.key in LAUNCH_CALLS)
    top = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    out = {"model": name, "dtype": dtype, "steps": steps,
           "kernel_launches_per_step": launches / steps,
           "device_kernel_us_per_step": sum(e.self_device_time_total for e in dev) / steps if dev else None,
           "host_top_ops": [{"op": e.key, "calls_per_step": e.count / steps,
                             "self_cpu_us_per_step": round(e.self_cpu_time_total / steps, 1)} for e in top],
           "ok": True}
    print(f"step profile {name} {dtype}: {out['kernel_launches_per_step']:.0f} launches/step, device "
          f"{out['device_kernel_us_per_step']} us/step; top host ops: "
          + ", ".join(f"{t['op']} {t['self_cpu_us_per_step']}" for t in out["host_top_ops"][:6]), flush=True)
    while eng.has_unfinished_requests():
        eng.step()
    del llm
    torch.cuda.empty_cache() if args.device == "cuda" else None
    return out


def fused_ops_ab(name: str, model: str, dtype: str, args) -> dict:
    """The backend's small ops (on CUDA: triton_ops' one-launch norms, SiLU*up and rotary + KV
    write for 16-bit models) against torch's reference chains, alternated A B B A in one engine at batch 1 and
    64: decode ms per step and device-kernel launches per step each way."""
    import dataclasses

    import torch

    from folio.kernels import reference
    from folio.worker import LLM
    from profile_step import add_random_requests, prefill_all

    rows = []
    for batch in ((1, 16) if args.quick else (1, 64)):
        llm = LLM(model, device=args.device, dtype=dtype, block_size=16, max_num_seqs=batch,
                  num_kv_blocks=batch * 16 + 16, max_model_len=512, enable_prefix_caching=False)
        eng = llm.engine
        m = eng.runner.model
        fused = m.ops
        ref = dataclasses.replace(fused, rms_norm=reference.rms_norm, add_rms_norm=reference.add_rms_norm,
                                  silu_mul=reference.silu_mul, rope_write_kv=None)
        add_random_requests(eng, batch, 64, 100, prefix=f"ab{batch}-", seed=batch)
        prefill_all(eng)
        ms = {"fused": [], "reference": []}
        launches = {}
        for which in ("fused", "reference", "reference", "fused") * (1 if args.quick else 3):
            m.ops = fused if which == "fused" else ref
            eng.step()
            t0 = time.perf_counter()
            for _ in range(5):
                eng.step()
            ms[which].append(round((time.perf_counter() - t0) / 5 * 1e3, 3))
            if which not in launches:
                launches[which] = sum(e.count for e in profiled_steps(eng, 1, args.device) if e.key in LAUNCH_CALLS)
        m.ops = fused
        rows.append({"model": name, "dtype": dtype, "batch": batch, "backend": fused.name,
                     "fused_ops": fused.rms_norm.__module__, "step_ms": ms, "launches_per_step": launches})
        print(f"fused ops A/B {name} {dtype} batch {batch} ({fused.rms_norm.__module__}): {ms}, launches "
              f"{launches}", flush=True)
        del llm
        torch.cuda.empty_cache() if args.device == "cuda" else None
    return {"rows": rows, "ok": True}
