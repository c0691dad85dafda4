"""A roofline model of one engine step on a named GPU and model (for the simulated engine).

A decode step reads every weight once and the KV of every context token it attends
to; a prefill step is bound by its FLOPs. The step takes whichever bound is larger,
at the efficiency real kernels reach, plus a fixed per-step overhead (scheduling,
launches). Swaps add their bytes over the host link.

Figures are public spec-sheet numbers; the efficiencies are typical of vLLM-class
engines (memory-bound kernels near 80 % of HBM bandwidth, GEMMs near 60 % of peak).
With tensor_parallel_size N each GPU reads and computes 1/N of the step (KV heads
replicated when fewer than N) in parallel, and the step adds its all-reduces over `link`
(latency + ring bytes each, not overlapped with compute).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    flops_per_s: float  # dense bf16 tensor-core peak
    host_link_bytes_per_s: float  # device <-> pinned host memory


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    bytes_per_param: int = 2  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.bytes_per_param


@dataclass(frozen=True)
class LinkSpec:
    """The GPUs' interconnect as a tensor-parallel all-reduce sees it."""

    name: str
    bus_bytes_per_s: float  # all-reduce bus bandwidth at large messages (nccl-tests' busbw)
    latency_s: float  # one small all-reduce (launch + the ring's hops)


# Order-of-magnitude figures, not measured here: NVLink 4 (H100 / H200 SXM, 900 GB/s per GPU
# both ways) reaches a busbw of ~360 GB/s or more in nccl-tests on 8 GPUs, and a small
# all-reduce takes ~10-30 us.
LINKS = {"NVLink4": LinkSpec("NVLink4", 360e9, 20e-6), "PCIe5": LinkSpec("PCIe5", 40e9, 30e-6)}

GPUS = {
    "H200": GPUSpec("H200", 141e9, 4.8e12, 989e12, 55e9),
    "H100": GPUSpec("H100", 80e9, 3.35e12, 989e12, 55e9),
    "A100": GPUSpec("A100", 80e9, 2.0e12, 312e12, 25e9),
}
MODELS = {
    "llama-3-8b": ModelSpec("llama-3-8b", 8.03e9, 32, 4096, 32, 8, 128, 128256, 8192),
    "llama-3-70b": ModelSpec("llama-3-70b", 70.6e9, 80, 8192, 64, 8, 128, 128256, 8192),
}


@dataclass(frozen=True)
class Roofline:
    gpu: GPUSpec
    model: ModelSpec
    memory_efficiency: float = 0.8
    compute_efficiency: float = 0.6
    step_overhead_s: float = 0.002
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1  # GPUs of one group: weights, heads and FLOPs split N ways
    link: LinkSpec = LINKS["NVLink4"]  # what the group's all-reduces cross (unused at N = 1)

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        m, n = self.model, self.tensor_parallel_size
        return m.kv_bytes_per_token * max(m.num_kv_heads, n) / m.num_kv_heads / n  # replicated when fewer than N

    def all_reduce_seconds(self, tokens: int) -> float:
        """A step's collectives: one all-reduce of [tokens, hidden] for the embedding and two per
        layer (after o and down), ring cost 2(N-1)/N of the bytes each."""
        n = self.tensor_parallel_size
        if n == 1:
            return 0.0
        m = self.model
        count = 1 + 2 * m.num_layers
        size = tokens * m.hidden_size * m.bytes_per_param
        return count * (self.link.latency_s + 2 * (n - 1) / n * size / self.link.bus_bytes_per_s)

    @classmethod
    def named(cls, gpu: str = "H200", model: str = "llama-3-8b", **kw) -> "Roofline":
        return cls(GPUS[gpu], MODELS[model], **kw)

    @property
    def free_bytes_per_gpu(self) -> float:
        """What each GPU keeps for the KV cache beside its share of the weights (<= 0: it does not fit)."""
        return self.gpu.memory_bytes * self.gpu_memory_utilization - self.model.weight_bytes / self.tensor_parallel_size

    def num_kv_blocks(self, block_size: int) -> int:
        """Blocks that fit beside the weights, as vLLM sizes its cache."""
        return max(int(self.free_bytes_per_gpu // (self.kv_bytes_per_token_per_gpu * block_size)), 1)

    def step_seconds(self, scheduled: list[tuple[int, int]], swap_bytes: int = 0) -> float:
        """`scheduled`: (new tokens, context length after them) per sequence in the step."""
        if not scheduled and not swap_bytes:
            return 0.0
        m = self.model
        swap_s = swap_bytes / self.gpu.host_link_bytes_per_s
        if not scheduled:
            return swap_s
        tokens = sum(n for n, _ in scheduled)
        tp = self.tensor_parallel_size  # each GPU: its share of weights, KV heads and FLOPs, in parallel
        kv_read = sum(ctx for _, ctx in scheduled) * self.kv_bytes_per_token_per_gpu
        attn_flops = sum(4 * m.num_layers * m.num_heads * m.head_dim * n * ctx for n, ctx in scheduled) / tp
        flops = 2 * m.num_params * tokens / tp + attn_flops
        mem_s = (m.weight_bytes / tp + kv_read) / (self.gpu.hbm_bytes_per_s * self.memory_efficiency)
        compute_s = flops / (self.gpu.flops_per_s * self.compute_efficiency)
        return max(mem_s, compute_s) + self.all_reduce_seconds(tokens) + swap_s + self.step_overhead_s
