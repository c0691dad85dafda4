"""The model's shape, read from a checkpoint's config.json (no transformers needed)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from folio.worker.errors import ModelLoadError
from folio.worker.models.rope import SUPPORTED_ROPE_TYPES

def unreadable(e: OSError, path: str, what: str = "") -> ModelLoadError:
    """A checkpoint this user may not read (a directory or file), with the OS's reason."""
    return ModelLoadError(f"cannot read {what}{e.filename or path!r}: {e.strerror}")


# architecture -> (qkv bias, o_proj bias) rule; Llama reads `attention_bias` for both
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# a config.json without "architectures" names its family by model_type, as transformers reads it
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: list[int]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        """From a Hugging Face directory's config.json, or from a GGUF file's metadata (a .gguf file,
        or a directory without config.json that holds one)."""
        from folio.worker.models import gguf_loader

        if not os.path.exists(path):
            raise ModelLoadError(f"{path!r} does not exist: give a checkpoint directory or a GGUF file")
        cfg_path = os.path.join(path, "config.json")
        try:
            gguf_file = gguf_loader.find_gguf(path)
            raw = None
            if gguf_file is None and os.path.isfile(cfg_path):
                with open(cfg_path, "rb") as f:
                    raw = f.read()
        except OSError as e:
            raise unreadable(e, path) from e
        if gguf_file is not None:
            return cls.from_dict(gguf_loader.config_dict(gguf_file))
        if raw is None:
            raise ModelLoadError(f"no config.json in {path!r}: not a Hugging Face checkpoint directory")
        try:
            c = json.loads(raw)
        except ValueError as e:  # not JSON (or not UTF-8)
            raise ModelLoadError(f"{cfg_path!r} is not valid JSON: {e}") from e
        if not isinstance(c, dict):
            raise ModelLoadError(f"{cfg_path!r} must hold a JSON object")
        return cls.from_dict(c)

    @classmethod
    def from_dict(cls, c: dict) -> "ModelConfig":
        archs = c.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if not archs:
            arch = MODEL_TYPES.get(c.get("model_type"))
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or c.get('model_type')!r}; Folio runs {', '.join(ARCHITECTURES)}")
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act {act!r} is not supported (only silu)")
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        rope = dict(c.get("rope_parameters") or {})
        if not rope or "rope_theta" not in rope:  # transformers 4.x layout
            rope = dict(c.get("rope_scaling") or {}) | rope
            rope.setdefault("rope_theta", c.get("rope_theta", 10000.0))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        if "partial_rotary_factor" in c:
            rope.setdefault("partial_rotary_factor", c["partial_rotary_factor"])
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"rope_type {rope['rope_type']!r} is not supported "
                                 f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if rope["rope_type"] in ("llama3", "yarn"):
            rope.setdefault("original_max_position_embeddings", c.get("max_position_embeddings"))
        sliding = c.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not c.get("use_sliding_window", False):
            sliding = None
        eos = c.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(c.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope=rope,
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(c.get("mlp_bias", False)),
            sliding_window=sliding,
            eos_token_ids=eos_ids,
            bos_token_id=c.get("bos_token_id"),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def generation_eos_ids(path: str) -> set[int]:
    """EOS ids from the checkpoint's generation_config.json, if it has one."""
    f = os.path.join(path, "generation_config.json")
    if not os.path.isfile(f):
        return set()
    with open(f) as fh:
        eos = json.load(fh).get("eos_token_id")
    return {eos} if isinstance(eos, int) else set(eos or [])
