"""Shared fixtures: tiny checkpoints made once per session, and Hugging Face references."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Without a GPU the Triton kernels run in triton's interpreter; the flag must be set
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from folio.deploy.tiny_model import TinySpec, make_tiny_model

SPECS = {
    # Llama with plain multi-head attention (kv heads = heads) and llama3 RoPE scaling
    "llama": TinySpec(arch="llama", num_heads=4, num_kv_heads=4, seed=4),
    # Qwen2: grouped-query attention 4/2, qkv bias, tied embeddings
    "qwen2": TinySpec(arch="qwen2", num_heads=4, num_kv_heads=2, seed=2),
    # Mistral: GQA 4/1
    "mistral": TinySpec(arch="mistral", num_heads=4, num_kv_heads=1, seed=3),
}

# Lengths chosen to end mid-block and on block boundaries for the block sizes tested.
PROMPTS = [
    "def hello(world):",
    "import os\nimport sys\n",
    "class Foo(object):\n    def __init__(self, x):\n        self.x = x\n\n    def bar(self):\n        return",
    "x = 1",
    "for i in range(10):\n    print(i)\n",
    "# Copyright 2001 Python Software Foundation.\n\"\"\"Utilities for",
]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(str(root / name), spec) for name, spec in SPECS.items()}


_hf_cache: dict = {}

# A greedy step whose top-2 logits differ by less than this is a tie that any reordering
# of float32 sums may break either way; such a reference cannot judge token identity.
MIN_REFERENCE_MARGIN = 1e-5


def hf_greedy(model_dir: str, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers `generate`, greedy, float32, one prompt at a time (no padding effects).

    Fails if any step of the reference is a near-tie (then change the test's prompts or seed).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir not in _hf_cache:
        _hf_cache[model_dir] = (AutoTokenizer.from_pretrained(model_dir),
                                AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    tok, model = _hf_cache[model_dir]
    out = []
    for p in prompts:
        key = (model_dir, p, max_new_tokens)
        if key not in _hf_cache:
            ids = tok(p, return_tensors="pt").input_ids
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True)
            margins = [float(s[0].topk(2).values.diff().abs()) for s in gen.scores]
            assert min(margins) > MIN_REFERENCE_MARGIN, (
                f"reference near-tie ({min(margins):.1e}) for {p!r} on {model_dir}: pick other test data")
            _hf_cache[key] = gen.sequences[0, ids.shape[1]:].tolist()
        out.append(_hf_cache[key])
    return out


@pytest.fixture(scope="session")
def hf_reference():
    return hf_greedy
