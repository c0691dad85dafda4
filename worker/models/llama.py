"""Llama-family decoder (Llama, Mistral, Qwen2) over paged KV. Nothing but the model.

Weights are fused at load time (loader.py): qkv = [q; k; v], gate_up = [gate; up]. Under
tensor parallelism (tensor_parallel.py) each rank's model holds its heads, its MLP columns
and its vocabulary rows; `group` sums the row-parallel outputs and gathers the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from folio import kernels
from folio.kernels.linear import Linear
from folio.worker.models.model_config import ModelConfig
from folio.worker.models.rope import RotaryEmbedding
from folio.worker.tensor_parallel import Group, single


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    plan: kernels.AttentionPlan | None = None  # derived layout shared by every layer (torch path)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class LlamaModel:
    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: Linear, max_len: int, ops: kernels.KernelOps,
                 group: Group | None = None) -> None:
        self.config = config
        self.group = group or single(config.num_heads, config.num_kv_heads, config.intermediate_size,
                                     config.vocab_size)
        shards = self.group.shards
        self.num_heads = len(shards.heads)  # this rank's
        self.num_kv_heads = len(shards.kv_heads)
        self.ops = ops  # write_kv / paged_attention implementations (kernels.get_ops)
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.rope = RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings,
                                    max_len, embed.dtype, embed.device)
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (after the last norm)."""
        c = self.config
        eps = c.rms_norm_eps
        g = self.group
        nh, nkv = self.num_heads, self.num_kv_heads
        h = g.embed(input_ids, self.embed)
        T = h.shape[0]
        cos, sin = self.rope.cos_sin(positions)
        qk_size = self.q_size + self.kv_size
        ops = self.ops
        # rotation and the KV write in one op where the backend has it and it applies (every layer alike)
        fused = ops.rope_write_kv if self.rope.rot_dim == c.head_dim else None
        # each residual add is fused with the norm after it (the next layer's input norm, or the last)
        x = ops.rms_norm(h, self.layers[0].input_norm, eps) if self.layers else h
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            qkv = layer.qkv(x)
            q = fused(qkv, cos, sin, nh, nkv, k_cache, v_cache, meta.slot_mapping) if fused else None
            if q is None:
                # q and k rotate together: [T, heads + kv_heads, head_dim] views of the fused output
                qk = self.rope.rotate(qkv[:, :qk_size].view(T, nh + nkv, c.head_dim), cos, sin)
                q, k = qk.split([nh, nkv], dim=1)
                v = qkv[:, qk_size:].view(T, nkv, c.head_dim)
                ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, self.scale, plan=meta.plan)
            h, x = ops.add_rms_norm(h, g.all_reduce(layer.o(attn.reshape(T, self.q_size))), layer.post_norm, eps)
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            h, x = ops.add_rms_norm(h, g.all_reduce(layer.down(ops.silu_mul(layer.gate_up(x)))), nxt, eps)
        return x if self.layers else ops.rms_norm(h, self.norm, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.gather_vocab(self.lm_head(hidden))

    def collective_plan(self, num_tokens: int, logit_rows: list[int]) -> list[tuple[str, tuple, torch.dtype]]:
        """The collectives, in order, of forward over `num_tokens` tokens and one compute_logits
        call per entry of `logit_rows` (its row count): what a tensor-parallel rank whose part
        of a step raised still takes part in (Group.drain). Kept beside forward: the two
        change together (the runner checks every step that they agree)."""
        hidden = (num_tokens, self.config.hidden_size)
        dtype = self.embed.dtype
        plan = [("all_reduce", hidden, dtype)] * (1 + 2 * len(self.layers))  # embed; o and down per layer
        return plan + [("all_gather", (rows, self.group.shards.vocab_shard_size), dtype) for rows in logit_rows]
