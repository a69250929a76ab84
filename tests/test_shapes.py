"""Random-weight models at real shapes (sparsespec.shapes): the configs and the init scale."""
import pytest
import torch

from sparsespec.kv.cache import KVCache
from sparsespec.shapes import SHAPES, get_shape, random_engine, random_transformer


def test_llama_31_8b_shape_is_the_checkpoint_config():
    c = SHAPES["llama-3.1-8b"]
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (32, 4096, 32, 8, 128)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta) == (14336, 128256, 500000.0)
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}
    assert {"llama-3.2-3b", "qwen2.5-7b", "smollm2-135m", "tiny"} <= set(SHAPES)
    assert SHAPES["qwen2.5-7b"].attention_bias and SHAPES["smollm2-135m"].group_size == 3
    with pytest.raises(ValueError, match="known"):
        get_shape("llama-9b")


def test_random_weights_give_spread_attention_and_logits():
    model = random_transformer("tiny", torch.float32, "cpu", seed=0)
    again = random_transformer("tiny", torch.float32, "cpu", seed=0)
    assert torch.equal(model.layers[0].wqkv, again.layers[0].wqkv)  # deterministic per seed
    ids = torch.randint(0, model.cfg.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
    cache = KVCache(model.cfg, 1, 256, torch.float32, "cpu")
    logits, rows = model.prefill(ids, cache, want_rows=4)  # [1, V], [L, 1, H_kv, 4, 200]
    assert 0.5 < logits.std().item() < 2.0
    assert torch.softmax(logits, -1).max().item() < 0.5  # not a one-hot echo of the input token
    assert rows.max().item() / model.cfg.group_size < 0.5  # no query puts all its mass on one key


def test_random_engine_decodes_token_ids():
    engine = random_engine("tiny", seed=0)
    out = engine.generate([[5, 6, 7, 8]], method="ar", max_new_tokens=3, ignore_eos=True)[0]
    assert len(out.token_ids) == 3 and out.text == " ".join(map(str, out.token_ids))
