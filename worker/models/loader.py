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
from folio.worker.tensor_parallel import Group, pad_vocab, single


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


Part = tuple[int, int, int]  # (dim, start, stop): the slice of a weight a tensor-parallel rank reads


class Weights:
    """A checkpoint's tensors by name, read on demand: a rank reads only its slice of each
    (safetensors' get_slice; a GGUF file's rows and blocks, gguf_loader.GGUFTensors), so N
    ranks hold one copy of the weights between them."""

    def __init__(self, path: str) -> None:
        try:
            gguf_file = gguf_loader.find_gguf(path)
            files = [] if gguf_file is not None else _weight_files(path)
        except OSError as e:
            raise unreadable(e, path) from e
        except ValueError as e:  # model.safetensors.index.json
            raise ModelLoadError(f"the weight index in {path!r} is not valid JSON: {e}") from e
        self.gguf = gguf_loader.GGUFTensors(gguf_file) if gguf_file is not None else None
        self.files: dict[str, tuple[str, object]] = {}  # name -> (file, its open safetensors handle)
        for f in files:
            try:
                open(f, "rb").close()  # safetensors reports an unreadable file as "No such file or directory"
                st = safe_open(f, framework="pt", device="cpu")
                self.files.update((k, (f, st)) for k in st.keys())
            except OSError as e:
                raise unreadable(e, f, "weight file ") from e
            except Exception as e:  # a truncated or foreign file
                raise ModelLoadError(f"cannot read weight file {f!r}: {e}") from e

    def __contains__(self, name: str) -> bool:
        return name in self.files if self.gguf is None else name in self.gguf

    def names(self) -> list[str]:
        return list(self.files) if self.gguf is None else self.gguf.names()

    def shape(self, name: str) -> tuple[int, ...]:
        if self.gguf is not None:
            return self.gguf.shape(name)
        return tuple(self.files[name][1].get_slice(name).get_shape())

    def get(self, name: str, part: Part | None = None) -> torch.Tensor:
        """The tensor, or its rows (dim 0) / columns (dim 1) [start, stop)."""
        if self.gguf is not None:
            return self.gguf.get(name, part)
        f, st = self.files[name]
        try:
            if part is None:
                return st.get_tensor(name)
            s = st.get_slice(name)
            dim, a, b = part
            return s[a:b] if dim == 0 else s[:, a:b]
        except Exception as e:  # a file cut short after its header
            raise ModelLoadError(f"cannot read weight {name!r} from {f!r}: {e}") from e


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, whole."""
    w = Weights(path)
    return {name: w.get(name) for name in w.names()}


def load_model(path: str, dtype: torch.dtype, device: torch.device, max_len: int,
               config: ModelConfig | None = None, group: Group | None = None) -> LlamaModel:
    """The model, or under tensor parallelism `group`'s rank's shard of it (tensor_parallel.py)."""
    config = config or ModelConfig.from_dir(path)
    group = group or single(config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size)
    sd = Weights(path)
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...] | None = None, optional: bool = False,
             part: Part | None = None) -> torch.Tensor | None:
        if name not in sd:
            if optional:
                return None
            raise ModelLoadError(f"weight {name!r} is missing from the checkpoint in {path!r}")
        if shape is not None and sd.shape(name) != shape:
            raise ModelLoadError(f"weight {name!r} has shape {sd.shape(name)}, expected {shape}")
        used.add(name)
        return sd.get(name, part).to(device=device, dtype=dtype).contiguous()

    def cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
        return None if ts[0] is None else torch.cat(ts, dim=0).contiguous()

    sh = group.shards
    whole = sh.size == 1

    def heads(r: range, dim: int = 0) -> Part | None:
        """This rank's rows (dim 0) or columns (dim 1) of a projection: its heads, head_dim each."""
        return None if whole else (dim, r.start * D, r.stop * D)

    def mlp(dim: int = 0) -> Part | None:
        return None if whole else (dim, sh.intermediate.start, sh.intermediate.stop)

    def once(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if sh.rank == 0 else None  # a row-parallel layer's bias is added once, by rank 0

    backend = linear_backend(device, dtype)

    def linear(w: torch.Tensor, b: torch.Tensor | None) -> Linear:
        return Linear(w, b, backend)

    c = config
    H, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    q_out, kv_out = c.num_heads * D, c.num_kv_heads * D
    qh, kvh = sh.heads, sh.kv_heads
    vocab = None if whole else (0, sh.vocab.start, sh.vocab.stop)
    embed = take("model.embed_tokens.weight", (c.vocab_size, H), part=vocab)
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight", (H,)),
            qkv=linear(cat(take(a + "q_proj.weight", (q_out, H), part=heads(qh)),
                           take(a + "k_proj.weight", (kv_out, H), part=heads(kvh)),
                           take(a + "v_proj.weight", (kv_out, H), part=heads(kvh))),
                       cat(take(a + "q_proj.bias", (q_out,), part=heads(qh)),
                           take(a + "k_proj.bias", (kv_out,), part=heads(kvh)),
                           take(a + "v_proj.bias", (kv_out,), part=heads(kvh))) if c.qkv_bias else None),
            o=linear(take(a + "o_proj.weight", (H, q_out), part=heads(qh, dim=1)),
                     once(take(a + "o_proj.bias", (H,))) if c.o_bias else None),
            post_norm=take(p + "post_attention_layernorm.weight", (H,)),
            gate_up=linear(cat(take(m + "gate_proj.weight", (I, H), part=mlp()),
                               take(m + "up_proj.weight", (I, H), part=mlp())),
                           cat(take(m + "gate_proj.bias", (I,), part=mlp()), take(m + "up_proj.bias", (I,), part=mlp()))
                           if c.mlp_bias else None),
            down=linear(take(m + "down_proj.weight", (H, I), part=mlp(dim=1)),
                        once(take(m + "down_proj.bias", (H,))) if c.mlp_bias else None),
        ))
    norm = take("model.norm.weight", (H,))
    head = embed if c.tie_word_embeddings else take("lm_head.weight", (c.vocab_size, H), part=vocab)
    if not whole:  # shards of ceil(V / N) rows: the last one zero-padded
        embed, head = pad_vocab(embed, sh), pad_vocab(head, sh)
    return LlamaModel(c, embed, layers, norm, linear(head, None), max_len, get_ops(device), group)
