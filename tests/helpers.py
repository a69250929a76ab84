"""Shared test utilities (real model loaded once per test process)."""
from __future__ import annotations

import contextlib
import functools
import uuid
from pathlib import Path

import torch

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
BOOK = SHARED_DATA / "public_domain_books" / "11-0.txt"  # Alice in Wonderland (public domain)


@functools.lru_cache(maxsize=None)
def real_engine():
    from sparsespec import Engine

    torch.set_num_threads(max(1, torch.get_num_threads()))
    return Engine.from_pretrained("smollm2-135m", dtype="float32")


@contextlib.contextmanager
def fresh_pg_database(admin_url: str):
    """A new, empty PostgreSQL database on ``admin_url``'s server for one test; yields its URL and
    drops it afterwards. Each test gets its own, so tests on several pytest-xdist workers never
    create or drop the same tables at once (sharing ``admin_url``'s database raced:
    ``UniqueViolation`` on ``pg_type_typname_nsp_index`` when two workers created a table of one
    name together)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"sparsespec_test_{uuid.uuid4().hex[:16]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")  # CREATE/DROP DATABASE: no transaction
    try:
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as c:
                c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def chat_prompt(tokenizer, user: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def book_prompt(tokenizer, offset: int, num_tokens: int, question: str) -> list[int]:
    text = BOOK.read_text(encoding="utf-8-sig")
    ids = tokenizer(text, add_special_tokens=False).input_ids[offset : offset + num_tokens]
    return chat_prompt(tokenizer, tokenizer.decode(ids) + "\n\n" + question)


def write_tiny_llama(folder: Path, *, vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, intermediate: int = 128, max_pos: int = 4096, seed: int = 0,
                     scale: float = 0.05, embed_scale: float | None = None, eos_token_id: int = 2) -> Path:
    """Write a random-weight Llama checkpoint (HF config + safetensors names) into a new ``folder``."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    E, L, H, Hkv, I = hidden, layers, heads, kv_heads, intermediate
    D = E // H
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size,
           "hidden_size": E, "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": H,
           "num_key_value_heads": Hkv, "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": eos_token_id}
    (folder / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=scale):
        return torch.randn(*shape, generator=g) * s

    t = {"model.embed_tokens.weight": rnd(vocab_size, E, s=embed_scale or scale), "model.norm.weight": torch.ones(E)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": torch.ones(E), p + "post_attention_layernorm.weight": torch.ones(E),
                  p + "self_attn.q_proj.weight": rnd(H * D, E), p + "self_attn.k_proj.weight": rnd(Hkv * D, E),
                  p + "self_attn.v_proj.weight": rnd(Hkv * D, E), p + "self_attn.o_proj.weight": rnd(E, H * D),
                  p + "mlp.gate_proj.weight": rnd(I, E), p + "mlp.up_proj.weight": rnd(I, E),
                  p + "mlp.down_proj.weight": rnd(E, I)})
    save_file(t, str(folder / "model.safetensors"))
    return folder


def tiny_model_like(folder: Path, preset: str = "smollm2-135m", *, seed: int = 0, max_pos: int = 8192,
                    **kwargs) -> Path:
    """A random-weight tiny Llama with ``preset``'s tokenizer (its vocabulary, chat template and
    EOS id): a real local Hugging Face folder that every layer (planner, workers, engine) loads
    as a model, and that decodes in milliseconds."""
    import json
    import shutil

    from sparsespec.provision import resolve_model

    src = Path(resolve_model(preset))
    cfg = json.loads((src / "config.json").read_text())
    eos = cfg.get("eos_token_id", 2)
    write_tiny_llama(folder, vocab_size=int(cfg["vocab_size"]), max_pos=max_pos, seed=seed,
                     eos_token_id=eos[0] if isinstance(eos, list) else eos, **kwargs)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    return folder


_EAGLE3_HEADS: dict[tuple, tuple] = {}  # (id(model), settings) -> (model, folder): the model is kept so its id is not reused


def greedy_windows(model, n: int, seq_len: int, seed: int) -> torch.Tensor:
    """``[n, seq_len]`` windows: a random first half, then the model's greedy continuation."""
    from sparsespec.kv.cache import KVCache

    g = torch.Generator().manual_seed(seed)
    half = seq_len // 2
    ids = torch.randint(0, model.cfg.vocab_size, (n, half), generator=g)
    with torch.inference_mode():
        cache = KVCache(model.cfg, n, seq_len, model.dtype, model.device)
        logits, _ = model.forward_dense(ids, cache, logits_for="last")
        out = [ids]
        for _ in range(seq_len - half):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            logits, _ = model.forward_dense(nxt, cache)
    return torch.cat(out, dim=1)[:, :seq_len]


def eagle3_head(model, *, windows: int = 24, seq_len: int = 64, steps: int = 300, draft_vocab: int | None = None,
                seed: int = 0, lr: float = 3e-3) -> str:
    """The folder of an EAGLE-3 head trained (``sparsespec.train_eagle3``, a few seconds on a tiny
    model) on ``model``'s own greedy continuations of random prompts, saved in the checkpoint
    format; made once per model object and settings per test process. ``draft_vocab`` below the vocabulary
    exercises the draft-to-target map (ids outside it are never drafted)."""
    import tempfile

    from sparsespec.eagle3_head import Eagle3Config
    from sparsespec.train_eagle3 import TrainConfig, choose_draft_vocab, init_head, teacher_pass, train

    key = (id(model), windows, seq_len, steps, draft_vocab, seed, lr)  # a call with other settings trains its own
    if key in _EAGLE3_HEADS:
        return _EAGLE3_HEADS[key][1]
    V = model.cfg.vocab_size
    data = greedy_windows(model, windows, seq_len, seed)
    aux = Eagle3Config.for_target(model.cfg, 1).aux_layers
    feats, finals, argmax = teacher_pass(model, data, aux)
    vocab = choose_draft_vocab(argmax, draft_vocab or V, V, [t for t in model.cfg.eos_token_ids if t < V])
    head = init_head(model, vocab, seed)
    train(head, feats, finals, data, TrainConfig(seq_len=seq_len, batch_size=8, steps=steps, minutes=5, lr=lr,
                                                warmup=5, draft_vocab=int(vocab.numel()), seed=seed), log=lambda *_: None)
    head.requires_grad_(False)
    folder = Path(tempfile.mkdtemp(prefix="eagle3-head-"))
    head.save(folder / "head")
    _EAGLE3_HEADS[key] = (model, str(folder / "head"))
    return _EAGLE3_HEADS[key][1]


def own_options(method: str, options: dict) -> dict:
    """The entries of ``options`` that ``method`` takes (its drafter's options dataclass): one
    dict of shared test settings for every method; ``{}`` for ``ar``."""
    from sparsespec import options_class

    names = set(options_class(method).option_names())
    return {k: v for k, v in options.items() if k in names}


def hf_logits_and_greedy(folder, prompt_ids: list[int], new_tokens: int, check=None):
    """transformers' (eager attention, fp32) logits ``[T, V]`` at every prompt position and its greedy
    continuation of ``new_tokens`` tokens, the independent oracle of the real-model tests; the model
    is freed before returning (so ours can load next). ``check(hf_model)`` runs on the loaded model."""
    import gc

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                              local_files_only=True).eval()
    if check is not None:
        check(hf)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0].clone()  # [T, V]
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                          pad_token_id=hf.generation_config.pad_token_id)[0, ids.shape[1]:].tolist()
    del hf
    gc.collect()
    return logits, gen
