"""Rotary position embeddings: inverse frequencies for the scaling variants, a cos/sin table.

Matches transformers' `modeling_rope_utils` for the variants implemented here
(default, linear, llama3, yarn); other variants are refused when loading.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, p: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = p.get("factor")
    orig = p["original_max_position_embeddings"]
    if factor is None:
        factor = max_pos / orig

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return inter * (1 - keep) + extra * keep, attention_factor


def inv_freq_and_scaling(head_dim: int, rope: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """`rope` is the checkpoint's rope_parameters (rope_type, rope_theta, and the variant's keys)."""
    base = float(rope.get("rope_theta", 10000.0))
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / rope["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if kind == "yarn":
        return _yarn(base, dim, rope, max_position_embeddings)
    raise ValueError(f"rope_type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


class RotaryEmbedding:
    """cos/sin for every position up to max_len, computed exactly as transformers does per call."""

    def __init__(self, head_dim: int, rope: dict, max_position_embeddings: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        inv_freq, scaling = inv_freq_and_scaling(head_dim, rope, max_position_embeddings)
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(dtype=dtype, device=device)  # [max_len, rot_dim]
        self.sin = (emb.sin() * scaling).to(dtype=dtype, device=device)
        self.rot_dim = emb.shape[-1]

    def apply(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KVH, D] -> rotated (rotate-half layout, as in Llama checkpoints)."""
        cos, sin = self.cos_sin(positions)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, rot_dim] each: looked up once per forward, shared by every layer."""
        return self.cos.index_select(0, positions)[:, None, :], self.sin.index_select(0, positions)[:, None, :]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D]: any heads, so q and k (adjacent in the fused qkv output) rotate in one pass."""
        return _rotate(x, cos, sin, self.rot_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    if rot_dim < x.shape[-1]:
        x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
        return torch.cat((_rotate(x_rot, cos, sin, rot_dim), x_pass), dim=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
