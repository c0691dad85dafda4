"""`folio make-tiny-model DIR`: a tiny Llama-family checkpoint made locally: random weights
(fixed seed) and a BPE tokenizer trained here, saved with `save_pretrained` so `transformers`
loads it with no hub. The tests and benchmarks make theirs with `make_tiny_model(dir, TinySpec(...))`.
"""

from __future__ import annotations

import os
import random
import sysconfig
from dataclasses import dataclass

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


@dataclass
class TinySpec:
    arch: str = "llama"  # llama | mistral | qwen2
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    seed: int = 0
    init_std: float = 0.08  # wide enough that greedy argmax is far from ties
    tie_word_embeddings: bool | None = None  # None: the architecture's usual choice


def _corpus(max_chars: int = 3_000_000) -> list[str]:
    """Python's own standard library sources: plenty of varied text, no download, deterministic."""
    root = sysconfig.get_paths()["stdlib"]
    texts, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                try:
                    with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                        t = f.read()
                except (UnicodeDecodeError, OSError):
                    continue
                texts.append(t)
                total += len(t)
                if total >= max_chars:
                    return texts
    return texts


def train_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    random.seed(seed)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(min(3_000_000, 600 * vocab_size)), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


def make_tiny_model(out_dir: str, spec: TinySpec) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    tokenizer = train_tokenizer(spec.vocab_size, spec.seed)
    tokenizer.chat_template = CHAT_TEMPLATE
    vocab = len(tokenizer)
    tied = spec.tie_word_embeddings if spec.tie_word_embeddings is not None else spec.arch == "qwen2"
    common = dict(
        vocab_size=vocab, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6, initializer_range=spec.init_std, tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    if spec.arch == "llama":
        # Llama 3.1-style RoPE scaling, so the scaled path is what the tests exercise.
        extra = dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 256})
    elif spec.arch == "mistral":
        extra = dict(sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif spec.arch == "qwen2":
        extra = dict(use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    else:
        raise ValueError(f"unknown arch {spec.arch!r}: llama, mistral or qwen2")
    config = AutoConfig.for_model(spec.arch, **common, **extra)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # HF initialises norms to 1 and biases to 0; make them random so a model
            # that ignored them would not match.
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(spec.init_std * torch.randn_like(p))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)
    return out_dir


def add_parser(sub) -> None:
    p = sub.add_parser("make-tiny-model", help="write a tiny random Llama-family checkpoint + tokenizer")
    p.add_argument("dir")
    p.add_argument("--arch", choices=["llama", "mistral", "qwen2"], default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--init-std", type=float, default=0.08)


def main(args) -> int:
    spec = TinySpec(arch=args.arch, hidden_size=args.hidden_size, num_layers=args.num_layers,
                    num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                    intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
                    max_position_embeddings=args.max_position_embeddings, seed=args.seed,
                    init_std=args.init_std)
    make_tiny_model(args.dir, spec)
    print(f"wrote a tiny {args.arch} checkpoint to {args.dir}")
    return 0
