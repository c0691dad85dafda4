"""Load a llama.cpp GGUF checkpoint: its config, its weights (dequantized at load) and its tokenizer.

A GGUF file carries everything a Hugging Face directory does: the shape in its metadata
(`llama.block_count`, ...), the tokenizer and chat template (`tokenizer.ggml.*`, `tokenizer.chat_template`)
and the tensors under llama.cpp's names, possibly quantized. This module turns them into what
`loader.load_model` expects: a ModelConfig and a state dict under Hugging Face names, float32.

llama.cpp's converter permutes the rows of Llama's Q and K projections (it rotates pairs of
adjacent dimensions, HF rotates the two halves of a head); `_unpermute` undoes that.
"""

from __future__ import annotations

import os
import re

import torch

from folio.worker.errors import ModelLoadError
from folio.worker.models.gguf_quant import dequantize, torch_shape

GGUF_MAGIC = b"GGUF"
# GGUF architecture -> (the HF architecture, Q/K rows permuted by the converter)
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "mistral": ("MistralForCausalLM", True),
                      "qwen2": ("Qwen2ForCausalLM", False)}

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# llama.cpp rope.scaling.type -> Folio's rope_type
_ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}


def find_gguf(path: str) -> str | None:
    """The GGUF file `path` names: a file, or a directory without config.json that holds one .gguf.
    None for a Hugging Face directory (it has a config.json)."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
    if len(found) > 1:
        raise ModelLoadError(f"{path!r} holds several GGUF files ({', '.join(found)}): name one of them")
    return os.path.join(path, found[0]) if found else None


_readers: dict[tuple, object] = {}  # (path, size, mtime) -> reader: parsing the metadata takes seconds


def open_gguf(path: str):
    """A gguf.GGUFReader on `path`; any defect of the file (magic, version, truncation) is a ModelLoadError.
    One reader per file and version (a read-only memory map): the config, the weights and the tokenizer
    all read it."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _readers:
        _readers.clear()  # one file at a time: a process serves one model
        _readers[key] = _open(path)
    return _readers[key]


def _open(path: str):
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path!r} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    import gguf

    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # a header that does not parse, tensors past the end of the file
        raise ModelLoadError(f"cannot read GGUF file {path!r} (truncated or corrupt?): {e}") from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(f"GGUF file {path!r} is truncated: tensor {t.name!r} ends past the file's end")
    return reader


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None or not f.data:
        return default
    vals = [f.parts[i] for i in f.data]
    import gguf

    def one(v):
        if f.types and f.types[-1] == gguf.GGUFValueType.STRING:
            return bytes(v).decode("utf-8")
        return v.tolist()[0]
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        return [one(v) for v in vals]
    return one(vals[0])


def architecture(reader, path: str) -> tuple[str, str, bool]:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF file {path!r}: unsupported architecture {arch!r}; "
                             f"Folio runs {', '.join(GGUF_ARCHITECTURES)}")
    return (arch, *GGUF_ARCHITECTURES[arch])


def config_dict(path: str, reader=None) -> dict:
    """The file's metadata as a Hugging Face config.json dict (ModelConfig.from_dict reads it)."""
    reader = reader or open_gguf(path)
    arch, hf_arch, _ = architecture(reader, path)

    def get(key: str, default=None, required: bool = True):
        v = _field(reader, f"{arch}.{key}", default)
        if v is None and required:
            raise ModelLoadError(f"GGUF file {path!r} lacks the metadata {arch}.{key}")
        return v

    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(f"GGUF file {path!r}: per-frequency RoPE factors (rope_freqs) are not supported")
    heads, hidden = get("attention.head_count"), get("embedding_length")
    vocab = get("vocab_size", required=False) or len(_field(reader, "tokenizer.ggml.tokens", []) or [])
    if not vocab:
        raise ModelLoadError(f"GGUF file {path!r} has neither {arch}.vocab_size nor a tokenizer vocabulary")
    rope = {"rope_theta": float(get("rope.freq_base", 10000.0))}
    kind = get("rope.scaling.type", "none")
    if kind not in _ROPE_TYPES:
        raise ModelLoadError(f"GGUF file {path!r}: RoPE scaling {kind!r} is not supported")
    rope["rope_type"] = _ROPE_TYPES[kind]
    if kind != "none":
        rope["factor"] = float(get("rope.scaling.factor"))
        orig = get("rope.scaling.original_context_length", required=False)
        if orig:
            rope["original_max_position_embeddings"] = int(orig)
    key_len = get("attention.key_length", required=False)
    return {
        "architectures": [hf_arch],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(key_len or get("rope.dimension_count", None, required=False) or hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope,
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
    }


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation. Its converter stored each head's rows, seen as (2 halves, d/2),
    transposed to (d/2, 2): the halves' rows interleaved. Read them back as (d/2, 2) and transpose."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


class GGUFTensors:
    """The file's tensors under Hugging Face names, decoded when asked and only the part asked
    for (loader.Weights reads a GGUF file through it): a rank of N reads about 1/N of the
    file, and no process holds a dequantized copy of the whole model beside the model it builds
    (each tensor is decoded once, into the tensor the model keeps)."""

    def __init__(self, path: str) -> None:
        reader = open_gguf(path)
        arch, _, permuted = architecture(reader, path)
        cfg = config_dict(path, reader)
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self._tensors: dict[str, tuple[object, int | None]] = {}  # HF name -> (tensor, heads to un-permute)
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is None:
                raise ModelLoadError(f"GGUF file {path!r}: tensor {t.name!r} has no place in a {arch} model")
            n = (heads if ".q_proj." in name else kv_heads if ".k_proj." in name else None) if permuted else None
            self._tensors[name] = (t, n)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return torch_shape(self._tensors[name][0])

    def get(self, name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor, or its rows (dim 0) / columns (dim 1) [start, stop). A row range of a
        permuted Q/K projection must fall on head boundaries (a rank's heads always do): the
        permutation stays within a head, so those rows un-permute on their own."""
        t, n_head = self._tensors[name]
        shape = self.shape(name)
        if part is not None and len(shape) == 1:  # a bias: small, decoded whole
            return dequantize(t)[part[1]:part[2]]
        rows = (part[1], part[2]) if part is not None and part[0] == 0 else None
        cols = (part[1], part[2]) if part is not None and part[0] == 1 else None
        w = dequantize(t, rows, cols)
        if n_head is not None:
            per_head = shape[0] // n_head
            a, b = rows or (0, shape[0])
            if a % per_head or b % per_head:
                raise ModelLoadError(f"GGUF tensor {name!r}: rows [{a}, {b}) cut a head of {per_head} rows")
            w = _unpermute(w, (b - a) // per_head)
        return w


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The file's tensors under Hugging Face names, dequantized to float32, Q/K un-permuted."""
    tensors = GGUFTensors(path)
    return {name: tensors.get(name) for name in tensors.names()}


def load_tokenizer(path: str):
    """The tokenizer (with its chat template) that transformers builds from the file's metadata."""
    from transformers import AutoTokenizer

    open_gguf(path)  # a clear error before transformers reads it
    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from GGUF file {path!r}: {e}") from e
