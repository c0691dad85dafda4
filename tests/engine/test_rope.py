"""RoPE variants against transformers' own initialisers, and config parsing of both layouts."""

from __future__ import annotations

import pytest
import torch

from folio.worker.errors import ModelLoadError
from folio.worker.models.model_config import ModelConfig
from folio.worker.models.rope import inv_freq_and_scaling

VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.7,
                    "mscale_all_dim": 0.5, "original_max_position_embeddings": 512, "beta_fast": 16},
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_inv_freq_matches_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(VARIANTS[name])
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=2048, rope_parameters=rope)
    kind = rope["rope_type"]
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        expected, scaling = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"))
    got, got_scaling = inv_freq_and_scaling(64, rope, 2048)
    torch.testing.assert_close(got, expected.float(), rtol=0, atol=0)
    assert got_scaling == pytest.approx(scaling)


def test_config_reads_legacy_rope_layout_and_rejects_unknown():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    c = ModelConfig.from_dict(base | {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert c.rope == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    with pytest.raises(ModelLoadError, match="rope_type"):
        ModelConfig.from_dict(base | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ModelLoadError, match="hidden_act"):
        ModelConfig.from_dict(base | {"hidden_act": "gelu"})
