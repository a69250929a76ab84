"""Our Llama-family model against transformers' implementation of the same checkpoint (fp32)."""
import pytest
import torch

from sparsespec.config import ModelConfig
from sparsespec.kv.cache import KVCache
from sparsespec.model import Transformer, rope_inv_freq
from sparsespec.provision import resolve_model
from tests.helpers import BOOK, real_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids():
    tok = real_engine().tokenizer
    return tok(BOOK.read_text(encoding="utf-8-sig")[5000:8000], return_tensors="pt").input_ids[:, :600]


def test_logits_match_transformers_all_paths(hf_model, prompt_ids):
    model = real_engine().model
    with torch.no_grad():
        ref = hf_model(prompt_ids).logits[0]  # [T, V]
    T = prompt_ids.shape[1]
    # one dense forward
    cache = KVCache(model.cfg, 1, T + 8, torch.float32, "cpu")
    logits, _ = model.forward_dense(prompt_ids, cache)
    assert (logits[0] - ref).abs().max().item() < 2e-3
    # chunked prefill (SDPA path) then a K+1 verify-shaped forward then a single decode step
    cache = KVCache(model.cfg, 1, T + 8, torch.float32, "cpu")
    last, _ = model.prefill(prompt_ids[:, : T - 9], cache, chunk_size=128)
    assert (last[0] - ref[T - 10]).abs().max().item() < 2e-3
    ver, _ = model.forward_dense(prompt_ids[:, T - 9 :], cache)
    assert (ver[0] - ref[T - 9 :]).abs().max().item() < 2e-3
    cache.rollback(cache.length - 9)  # rollback by length, then decode position T-9 again
    dec, _ = model.forward_dense(prompt_ids[:, T - 9 : T - 8], cache)
    assert (dec[0, 0] - ref[T - 9]).abs().max().item() < 2e-3


def test_importance_rows_are_attention_probabilities(prompt_ids):
    model = real_engine().model
    T = prompt_ids.shape[1]
    cache = KVCache(model.cfg, 1, T, torch.float32, "cpu")
    _, rows = model.prefill(prompt_ids, cache, chunk_size=256, want_rows=16)
    cfg = model.cfg
    assert rows.shape == (cfg.num_layers, 1, cfg.num_kv_heads, 16, T)
    # each query row sums to 1 per query head -> G per KV head; causal: zero past the query
    torch.testing.assert_close(rows.sum(-1), torch.full(rows.shape[:-1], float(cfg.group_size)), atol=1e-4, rtol=0)
    assert rows[..., 0, T - 15 :].abs().max().item() == 0.0


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = dict(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )
    ours = rope_inv_freq(ModelConfig.from_hf_config({**hf_cfg, "model_type": "llama"}))
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**hf_cfg), "cpu")
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=1e-9)


def test_a_checkpoint_in_two_files_loads_every_tensor_exactly(tmp_path):
    """``from_folder`` reads each tensor from whichever file holds it (q/k/v and gate/up fused,
    bf16 converted); a mis-shaped one is an error naming it."""
    import json

    from safetensors.torch import save_file

    L, E, I, V, H, Hkv = 2, 8, 16, 16, 2, 1
    D = E // H
    cfg = {"model_type": "llama", "vocab_size": V, "hidden_size": E, "intermediate_size": I, "num_hidden_layers": L,
           "num_attention_heads": H, "num_key_value_heads": Hkv, "max_position_embeddings": 64,
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    t = {"model.embed_tokens.weight": r(V, E), "model.norm.weight": r(E), "lm_head.weight": r(V, E)}
    for i in range(L):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": r(E), p + "post_attention_layernorm.weight": r(E),
              p + "self_attn.q_proj.weight": r(H * D, E), p + "self_attn.k_proj.weight": r(Hkv * D, E),
              p + "self_attn.v_proj.weight": r(Hkv * D, E), p + "self_attn.o_proj.weight": r(E, H * D),
              p + "mlp.gate_proj.weight": r(I, E), p + "mlp.up_proj.weight": r(I, E),
              p + "mlp.down_proj.weight": r(E, I).bfloat16()}
    names = sorted(t)
    save_file({n: t[n] for n in names[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: t[n] for n in names[1::2]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    m = Transformer.from_folder(tmp_path)
    assert torch.equal(m.embed, t["model.embed_tokens.weight"]) and torch.equal(m.lm_head, t["lm_head.weight"])
    assert torch.equal(m.norm, t["model.norm.weight"])
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        assert torch.equal(layer.wqkv, torch.cat([t[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
        assert torch.equal(layer.w_gate_up, torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]]))
        assert torch.equal(layer.wo, t[p + "self_attn.o_proj.weight"])
        assert torch.equal(layer.ln_mlp, t[p + "post_attention_layernorm.weight"])
        assert layer.w_down.dtype == torch.float32 and torch.equal(layer.w_down, t[p + "mlp.down_proj.weight"].float())
    t["model.layers.1.mlp.up_proj.weight"] = r(I + 1, E)
    for k, part in enumerate((names[::2], names[1::2])):
        save_file({n: t[n] for n in part}, str(tmp_path / f"model-0000{k + 1}-of-00002.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.gate_up has shape \(33, 8\), expected \(32, 8\)"):
        Transformer.from_folder(tmp_path)


def test_missing_tensor_is_a_clear_error(tmp_path):
    import json

    from safetensors.torch import save_file

    cfg = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": torch.zeros(16, 8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        Transformer.from_folder(tmp_path)
