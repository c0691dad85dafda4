"""Load a local Hugging Face checkpoint (config.json + safetensors) or a GGUF file into a Folio model.

Checkpoint quirks (sharding, tied embeddings, fused projections) live here, not in forward.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from folio.kernels import get_ops
from folio.kernels.linear import Linear, linear_backend
from folio.worker.errors import ModelLoadError
from folio.worker.models import gguf_loader
from folio.worker.models.model_config import ModelConfig, unreadable
from folio.worker.models.llama import LayerWeights, LlamaModel
from folio.worker.tensor_parallel import Group, single, vocab_rows


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"weight files listed in the index are missing: {missing}")
        return files
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weight files in {path!r}")
    return files


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    try:
        gguf_file = gguf_loader.find_gguf(path)
        files = [] if gguf_file is not None else _weight_files(path)
    except OSError as e:
        raise unreadable(e, path) from e
    except ValueError as e:  # model.safetensors.index.json
        raise ModelLoadError(f"the weight index in {path!r} is not valid JSON: {e}") from e
    if gguf_file is not None:  # llama.cpp's format: dequantized, under Hugging Face names
        return gguf_loader.load_state_dict(gguf_file)
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            open(f, "rb").close()  # safetensors reports an unreadable file as "No such file or directory"
            with safe_open(f, framework="pt", device="cpu") as st:
                for k in st.keys():
                    sd[k] = st.get_tensor(k)
        except OSError as e:
            raise unreadable(e, f, "weight file ") from e
        except Exception as e:  # a truncated or foreign file
            raise ModelLoadError(f"cannot read weight file {f!r}: {e}") from e
    return sd


def load_model(path: str, dtype: torch.dtype, device: torch.device, max_len: int,
               config: ModelConfig | None = None, group: Group | None = None) -> LlamaModel:
    """The model, or under tensor parallelism `group`'s rank's shard of it (tensor_parallel.py)."""
    config = config or ModelConfig.from_dir(path)
    group = group or single(config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size)
    sd = load_state_dict(path)
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...] | None = None, optional: bool = False) -> torch.Tensor | None:
        if name not in sd:
            if optional:
                return None
            raise ModelLoadError(f"weight {name!r} is missing from the checkpoint in {path!r}")
        t = sd[name]
        if shape is not None and tuple(t.shape) != shape:
            raise ModelLoadError(f"weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
        used.add(name)
        return t.to(device=device, dtype=dtype).contiguous()

    def cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
        return None if ts[0] is None else torch.cat(ts, dim=0).contiguous()

    sh = group.shards
    whole = sh.size == 1

    def rows(t: torch.Tensor | None, heads: range | None = None, cols: bool = False) -> torch.Tensor | None:
        """This rank's share of `t`: the rows (or columns) of `heads` (head_dim each) or of its MLP slice."""
        if t is None or whole:
            return t
        r = range(heads.start * D, heads.stop * D) if heads is not None else sh.intermediate
        return (t[:, r.start: r.stop] if cols else t[r.start: r.stop]).contiguous()

    def row_bias(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if sh.rank == 0 else None  # a row-parallel layer's bias is added once, by rank 0

    backend = linear_backend(device, dtype)

    def linear(w: torch.Tensor, b: torch.Tensor | None) -> Linear:
        return Linear(w, b, backend)

    c = config
    H, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    q_out, kv_out = c.num_heads * D, c.num_kv_heads * D
    embed = take("model.embed_tokens.weight", (c.vocab_size, H))
    qh, kvh = sh.heads, sh.kv_heads
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight", (H,)),
            qkv=linear(cat(rows(take(a + "q_proj.weight", (q_out, H)), qh),
                           rows(take(a + "k_proj.weight", (kv_out, H)), kvh),
                           rows(take(a + "v_proj.weight", (kv_out, H)), kvh)),
                       cat(rows(take(a + "q_proj.bias", (q_out,)), qh), rows(take(a + "k_proj.bias", (kv_out,)), kvh),
                           rows(take(a + "v_proj.bias", (kv_out,)), kvh)) if c.qkv_bias else None),
            o=linear(rows(take(a + "o_proj.weight", (H, q_out)), qh, cols=True),
                     row_bias(take(a + "o_proj.bias", (H,))) if c.o_bias else None),
            post_norm=take(p + "post_attention_layernorm.weight", (H,)),
            gate_up=linear(cat(rows(take(m + "gate_proj.weight", (I, H))), rows(take(m + "up_proj.weight", (I, H)))),
                           cat(rows(take(m + "gate_proj.bias", (I,))), rows(take(m + "up_proj.bias", (I,))))
                           if c.mlp_bias else None),
            down=linear(rows(take(m + "down_proj.weight", (H, I)), cols=True),
                        row_bias(take(m + "down_proj.bias", (H,))) if c.mlp_bias else None),
        ))
    norm = take("model.norm.weight", (H,))
    head = embed if c.tie_word_embeddings else take("lm_head.weight", (c.vocab_size, H))
    if not whole:
        embed, head = vocab_rows(embed, sh).contiguous(), vocab_rows(head, sh).contiguous()
    return LlamaModel(c, embed, layers, norm, linear(head, None), max_len, get_ops(device), group)
