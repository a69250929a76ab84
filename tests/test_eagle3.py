"""``eagle3`` on tiny random-weight models, each check against an independent oracle.

Oracles: greedy AR (losslessness); the training-time-test forward of ``sparsespec.train_eagle3``
(what drafting j tokens after a pair sees must equal the unrolled training step j); a fresh
dense forward of the target over the committed sequence (the head's cache after every rollback
and the features it keeps); the checkpoint written back in the published layouts (EAGLE's
``midlayer.*`` in ``pytorch_model.bin``, SpecForge's ``layers.0.*`` in safetensors).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sparsespec import METHODS, Engine, SamplingParams
from sparsespec.drafters.eagle3 import Eagle3Drafter, resolve_head
from sparsespec.eagle3_head import Eagle3Config, Eagle3Head, default_aux_layers
from sparsespec.kv.cache import KVCache
from sparsespec.model import Transformer
from sparsespec.train_eagle3 import TrainConfig, choose_draft_vocab, init_head, teacher_pass, ttt_forward
from tests.helpers import eagle3_head, greedy_windows, write_tiny_llama

V = 48
DRAFT_V = 40  # < V: the draft-to-target map is not the identity


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _model(folder, seed=0, scale=0.15):
    """Scale 0.15: a smooth target a head learns in seconds (its greedy output settles on
    repeating one token); scale 0.5: a chaotic one whose tokens vary (the head learns little)."""
    return Transformer.from_folder(write_tiny_llama(folder, vocab_size=V, hidden=32, intermediate=64, layers=4,
                                                    max_pos=1024, seed=seed, scale=scale, embed_scale=1.0,
                                                    eos_token_id=V + 7))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = _model(tmp_path_factory.mktemp("tiny") / "m")
    model.source_folder = None
    return Engine(model, _Tok(), "tiny")


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """(engine, head folder, head) of the scale-0.5 target: varied tokens, some acceptance."""
    model = _model(tmp_path_factory.mktemp("varied") / "m", seed=4, scale=0.5)
    model.source_folder = None
    folder = eagle3_head(model, draft_vocab=DRAFT_V)
    return Engine(model, _Tok(), "varied"), folder, Eagle3Head.load(folder, model.cfg, embed=model.embed)


@pytest.fixture(scope="module")
def head_dir(engine):
    return eagle3_head(engine.model, draft_vocab=DRAFT_V)


@pytest.fixture(scope="module")
def head(engine, head_dir):
    return Eagle3Head.load(head_dir, engine.model.cfg, embed=engine.model.embed)


def _prompt(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _opts(head_dir, **kw):
    return {"draft_model": head_dir, **kw}


# ------------------------------------------------------------------ registry and defaults
def test_eagle3_is_a_registered_method_with_the_published_feature_layers():
    assert "eagle3" in METHODS
    assert default_aux_layers(32) == (1, 15, 28)  # Llama-3.1-8B: the official low / middle / high layers
    assert default_aux_layers(30) == (1, 14, 26)  # SmolLM2-135M
    assert default_aux_layers(4) == (0, 1, 3)


def test_missing_head_names_the_trainer(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSESPEC_CACHE", str(tmp_path))
    m = engine.model
    m.source_folder = tmp_path / "smollm2-135m"
    try:
        with pytest.raises(ValueError, match="train_eagle3 --model smollm2-135m"):
            resolve_head(m, None)
    finally:
        m.source_folder = None
    with pytest.raises(ValueError, match="built in memory"):
        resolve_head(m, None)
    with pytest.raises(ValueError, match="no such folder"):
        resolve_head(m, str(tmp_path / "nope"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not be fetched"):
        resolve_head(m, "someone/not-a-local-folder")


# ------------------------------------------------------------------ checkpoint format
def _same_head(a: Eagle3Head, b: Eagle3Head):
    assert a.cfg == b.cfg
    ta, tb = a.state_tensors(), b.state_tensors()
    assert ta.keys() == tb.keys()
    for n in ta:
        assert torch.equal(ta[n], tb[n]), n


def test_save_load_round_trip(engine, head, tmp_path):
    head.save(tmp_path / "copy", {"note": "x"})
    again = Eagle3Head.load(tmp_path / "copy", engine.model.cfg, embed=engine.model.embed)
    _same_head(head, again)
    cfg = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == DRAFT_V
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3] and cfg["sparsespec"] == {"note": "x"}
    assert again.embed is engine.model.embed  # the target's embedding, shared, not copied


def _forward(h: Eagle3Head, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 5), generator=g)
    feats = torch.randn(2, 5, 3 * h.cfg.target_hidden_size, generator=g)
    cache = KVCache(h.lcfg, 2, 16, h.dtype, "cpu")
    return h.target_logits(h.draft_logits(h.forward_cached(ids, h.fuse(feats), cache)))


@pytest.mark.parametrize("layout", ["eagle-bin", "specforge-safetensors"])
def test_official_checkpoint_layouts_load_to_the_same_head(engine, head, tmp_path, layout):
    tensors = head.state_tensors()
    raw = head.cfg.to_hf_config()
    folder = tmp_path / layout
    folder.mkdir()
    if layout == "eagle-bin":  # EAGLE's release: midlayer.* in pytorch_model.bin, no aux-layer ids in the config
        raw.pop("eagle_config")
        raw["architectures"] = ["LlamaForCausalLMEagle3"]
        torch.save(tensors, folder / "pytorch_model.bin")
    else:  # SpecForge: layers.0.*, its own embed_tokens copy, t2d left out (derived from d2t)
        tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items() if k != "t2d"}
        tensors["embed_tokens.weight"] = engine.model.embed.detach().clone()
        save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    loaded = Eagle3Head.load(folder, engine.model.cfg, embed=engine.model.embed)
    _same_head(head, loaded)
    torch.testing.assert_close(_forward(loaded), _forward(head), rtol=0, atol=0)


def test_bad_checkpoints_are_named(engine, head, tmp_path):
    cfg = engine.model.cfg

    def write(name, tensors=None, raw=None):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(raw if raw is not None else head.cfg.to_hf_config()))
        if tensors is not None:
            save_file(tensors, str(folder / "model.safetensors"))
        return folder

    t = head.state_tensors()
    with pytest.raises(ValueError, match="no .*safetensors or pytorch_model.bin"):
        Eagle3Head.load(write("noweights"), cfg, embed=engine.model.embed)
    with pytest.raises(ValueError, match="'midlayer.mlp.down_proj.weight' missing"):
        Eagle3Head.load(write("missing", {k: v for k, v in t.items() if "down_proj" not in k}), cfg,
                        embed=engine.model.embed)
    with pytest.raises(ValueError, match=r"fc.weight has shape \(32, 95\)"):
        Eagle3Head.load(write("shape", {**t, "fc.weight": t["fc.weight"][:, :95].contiguous()}), cfg,
                        embed=engine.model.embed)
    bad_map = t["d2t"].clone()
    bad_map[1] = bad_map[0] - 1  # draft ids 0 and 1 -> the same target id
    with pytest.raises(ValueError, match="d2t does not map"):
        Eagle3Head.load(write("map", {**t, "d2t": bad_map}), cfg, embed=engine.model.embed)
    raw = head.cfg.to_hf_config() | {"vocab_size": V + 1}
    with pytest.raises(ValueError, match="vocab_size 49 != the target's 48"):
        Eagle3Head.load(write("vocab", t, raw), cfg, embed=engine.model.embed)
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        Eagle3Head.load(write("arch", t, head.cfg.to_hf_config() | {"architectures": ["LlamaForCausalLM"]}), cfg,
                        embed=engine.model.embed)
    with pytest.raises(ValueError, match="no config.json"):
        Eagle3Head.load(tmp_path, cfg, embed=engine.model.embed)


# ------------------------------------------------------------------ the draft-to-target map
def test_draft_to_target_map(head):
    d2t_ids = head.draft_to_target
    assert d2t_ids.tolist() == sorted(d2t_ids.tolist()) and d2t_ids.numel() == DRAFT_V
    assert head.t2d.sum() == DRAFT_V and head.t2d[d2t_ids].all()
    draft_logits = torch.randn(3, DRAFT_V)
    full = head.target_logits(draft_logits)  # [3, V]
    assert torch.equal(full[:, d2t_ids], draft_logits)
    assert (full[:, ~head.t2d] == -1e30).all()
    assert torch.equal(full.argmax(-1), d2t_ids[draft_logits.argmax(-1)])
    # choose_draft_vocab: the most frequent predictions, ties to the lower id, forced ids kept
    am = torch.tensor([5, 5, 5, 7, 7, 9, 2])
    assert choose_draft_vocab(am, 3, 12, always=[11]).tolist() == [5, 7, 11]
    assert choose_draft_vocab(am, 4, 12).tolist() == [2, 5, 7, 9]


def test_drafted_tokens_stay_in_the_draft_vocabulary(engine, head_dir, head):
    prompts = [_prompt(90, 3), _prompt(60, 4)]
    outs = engine.generate(prompts, method="eagle3", method_options=_opts(head_dir, k=3), max_new_tokens=12,
                           temperature=1.0, seed=3, ignore_eos=True)
    core = engine.core("eagle3", _opts(head_dir, k=3), max_num_seqs=1, max_model_len=200)
    core.add_request("r", prompts[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    drafted = []
    real_propose = core.drafter.propose

    def spy(*a, **kw):
        d = real_propose(*a, **kw)
        drafted.extend(d.token_ids[0, : d.num_draft[0]].tolist())
        return d

    core.drafter.propose = spy
    while core.has_unfinished_requests():
        core.step()
    assert drafted and all(bool(head.t2d[t]) for t in drafted)
    assert all(len(o.token_ids) == 12 for o in outs)


# ------------------------------------------------------------------ inference == training-time test
def test_drafting_j_tokens_equals_the_unrolled_training_step_j(engine, head):
    """Prefill pairs 0..t, then draft with the head's own hidden: step j's logits must equal
    ``ttt_forward``'s step j at position t (the training mask, positions and feedback)."""
    model = engine.model
    ids = torch.tensor([_prompt(20, 9)])
    feats, _, _ = teacher_pass(model, ids, head.cfg.aux_layers)
    with torch.no_grad():
        want = ttt_forward(head, feats, ids, steps=3)  # 3 x [1, 19, V_d]
    for t in (0, 4, 11, 15):
        cache = KVCache(head.lcfg, 1, 32, head.dtype, "cpu")
        out = head.forward_cached(ids[:, 1 : t + 2], head.fuse(feats[:, : t + 1]), cache)  # pairs 0..t
        h = out[:, -1:]
        for j in range(3):
            if j:
                h = head.forward_cached(ids[:, t + j + 1 : t + j + 2], h, cache)
            torch.testing.assert_close(head.draft_logits(h[:, 0]), want[j][:, t], rtol=1e-4, atol=1e-4)


def test_training_raises_agreement_over_the_untrained_head(engine, head):
    model = engine.model
    ids = greedy_windows(model, 8, 64, seed=100)  # held out: other random prompts than the head's
    feats, finals, argmax = teacher_pass(model, ids, head.cfg.aux_layers)
    from sparsespec.train_eagle3 import held_out_agreement

    fresh = init_head(model, head.draft_to_target.clone())
    before = held_out_agreement(fresh, feats, finals, ids, 2)
    after = held_out_agreement(head, feats, finals, ids, 2)
    assert after[0] > before[0] + 0.1 and after[1] > before[1] + 0.1, (before, after)


def test_a_bf16_teacher_is_the_fp32_teacher_rounded_and_trains_the_same_loss(engine, head):
    """``teacher_pass(store_dtype=bfloat16)`` (the trainer's ``--feature-dtype``) holds exactly the
    fp32 teacher rounded to bf16, the same greedy tokens; ``ttt_loss`` on it equals the loss on the
    rounded values computed in fp32 (not a bf16 forward); other dtypes are refused."""
    from sparsespec.train_eagle3 import ttt_loss

    model = engine.model
    ids = greedy_windows(model, 4, 32, seed=7)
    f32, fin32, am32 = teacher_pass(model, ids, head.cfg.aux_layers)
    f16, fin16, am16 = teacher_pass(model, ids, head.cfg.aux_layers, store_dtype=torch.bfloat16)
    assert f16.dtype == fin16.dtype == torch.bfloat16 and f32.dtype == torch.float32
    assert torch.equal(f16, f32.to(torch.bfloat16)) and torch.equal(fin16, fin32.to(torch.bfloat16))
    assert torch.equal(am16, am32)
    assert not torch.equal(f16.float(), f32)  # the rounding is real: the check below can tell them apart
    with torch.no_grad():
        got, agree, _ = ttt_loss(head, f16, fin16, ids, 2, head.lm_head)
        want, agree_w, _ = ttt_loss(head, f16.float(), fin16.float(), ids, 2, head.lm_head)
        exact, _, _ = ttt_loss(head, f32, fin32, ids, 2, head.lm_head)
    assert got.dtype == torch.float32 and torch.equal(got, want) and agree == agree_w
    assert abs(float(got) - float(exact)) < 0.05 * float(exact)
    with pytest.raises(ValueError, match="store_dtype"):
        teacher_pass(model, ids, head.cfg.aux_layers, store_dtype=torch.float16)


# ------------------------------------------------------------------ losslessness and rollback
@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_is_token_identical_to_ar(engine, head_dir, k):
    prompts = [_prompt(150, 1), _prompt(97, 2), _prompt(40, 3)]
    refs = [engine.generate([p], method="ar", max_new_tokens=20, ignore_eos=True)[0].token_ids for p in prompts]
    one = engine.generate(prompts[:1], method="eagle3", method_options=_opts(head_dir, k=k), max_new_tokens=20,
                          ignore_eos=True)[0]
    assert one.token_ids == refs[0]
    ragged = engine.generate(prompts, method="eagle3", method_options=_opts(head_dir, k=k), max_new_tokens=20,
                             ignore_eos=True)
    assert [o.token_ids for o in ragged] == refs
    drafted = one.stats["num_drafted"] + sum(o.stats["num_drafted"] for o in ragged)
    accepted = one.stats["num_accepted"] + sum(o.stats["num_accepted"] for o in ragged)
    assert 0 < accepted < drafted, "both the accepted and the rejected path must run"
    assert one.stats["draft_weight_bytes"] == 0  # no int8 copy of the target: the report's label stays plain
    import hashlib

    weights = sorted(Path(head_dir).glob("*.safetensors"))[0]
    assert one.stats["drafter"]["eagle3_head"] == {  # a head given by folder: its file's own sha256
        "path": str(Path(head_dir).resolve()), "source": "given",
        "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    from cluster.results.aggregate import run_draft_weights

    assert run_draft_weights({"method": "eagle3", "stats": one.stats}) == "target"


def test_head_cache_after_each_rollback_equals_a_fresh_forward(varied):
    engine, head_dir, head = varied
    core = engine.core("eagle3", _opts(head_dir, k=4), max_num_seqs=2, max_model_len=300)
    prompts = {"a": _prompt(120, 5), "b": _prompt(70, 6), "c": _prompt(30, 7)}
    n_new = {"a": 18, "b": 7, "c": 12}
    for r in ("a", "b", "c"):  # c waits for a slot, then takes b's (compaction moves the drafter state)
        core.add_request(r, prompts[r], SamplingParams(max_new_tokens=n_new[r], ignore_eos=True))
    d: Eagle3Drafter = core.drafter
    model = engine.model
    checked = accepted = 0  # (tolerance 1e-3: this target's activations are large; a wrong pair is O(1) off)
    outs = []
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                accepted += out.output.stats["num_accepted"]
                outs.append(out.output.token_ids)
        for req in core.running:
            committed = req.prompt + req.out[:-1]
            n, b = len(committed), req.slot
            valid = d.valid[b]
            assert valid + d._npending(b) == n == core.cache.lengths[b]
            cache = KVCache(model.cfg, 1, n, model.dtype, "cpu")
            _, _, feats = model.prefill_features(torch.tensor([committed]), cache, hidden_layers=head.cfg.aux_layers)
            torch.testing.assert_close(torch.cat(d.pending[b]), feats[0, valid:n], rtol=1e-3, atol=1e-3)
            if valid:
                fresh = KVCache(head.lcfg, 1, n, head.dtype, "cpu")
                head.forward_cached(torch.tensor([committed[1 : valid + 1]]), head.fuse(feats[:, :valid]), fresh)
                torch.testing.assert_close(d.hcache.k[0, b, :, :valid], fresh.k[0, 0, :, :valid], rtol=1e-3, atol=1e-3)
                torch.testing.assert_close(d.hcache.v[0, b, :, :valid], fresh.v[0, 0, :, :valid], rtol=1e-3, atol=1e-3)
                checked += 1
    assert checked > 10 and accepted > 0
    assert all(len(set(o)) > len(o) // 3 for o in outs), outs  # varied tokens: the check is conclusive


def test_steps_without_a_draft_keep_the_features(engine, head_dir):
    """Rows whose budget leaves no draft (max_new_tokens 2: the last step drafts nothing) and a
    k=1 row that never drafts past its budget still commit features, so a later step is exact."""
    prompts = [_prompt(50, 11), _prompt(80, 12)]
    refs = [engine.generate([p], method="ar", max_new_tokens=n, ignore_eos=True)[0].token_ids
            for p, n in zip(prompts, (2, 15))]
    core = engine.core("eagle3", _opts(head_dir, k=1), max_num_seqs=2, max_model_len=200)
    core.add_request("short", prompts[0], SamplingParams(max_new_tokens=2, ignore_eos=True))
    core.add_request("long", prompts[1], SamplingParams(max_new_tokens=15, ignore_eos=True))
    got = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                got[out.request_id] = out.output.token_ids
    assert [got["short"], got["long"]] == refs


def test_unseen_shapes_are_refused(engine, tmp_path):
    other = _model(tmp_path / "wide", seed=1)
    bigger = Transformer.from_folder(write_tiny_llama(tmp_path / "w2", vocab_size=V, hidden=48, intermediate=64,
                                                      layers=4, heads=4, max_pos=1024))
    h = init_head(other, torch.arange(V))
    h.requires_grad_(False)
    h.save(tmp_path / "h")
    with pytest.raises(ValueError, match="target_hidden_size 32 != the target's hidden_size 48"):
        Eagle3Head.load(tmp_path / "h", bigger.cfg, embed=bigger.embed)
    shutil.rmtree(tmp_path / "h")


def test_trainer_cli_refuses_bad_arguments(capsys):
    from sparsespec.train_eagle3 import main

    with pytest.raises(SystemExit) as e:
        main(["--steps", "0"])
    assert e.value.code == 2 and "steps must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--chats", "0"])
    assert "--chats must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--eval-tokens", "0"])
    assert "--eval-tokens must be >= 1" in capsys.readouterr().err
    assert main(["--model", "no-such-model-anywhere"]) == 2
    assert "cannot load the target 'no-such-model-anywhere'" in capsys.readouterr().err


def test_chat_prompts_tokenise_each_book_once_and_keep_their_ids():
    """The trainer reads each book for its chat prompts and again for its windows: one tokenisation
    per text (``_token_ids``), and the prompts the same as from a fresh tokenisation."""
    from sparsespec.train_eagle3 import _token_ids, chat_prompts

    class Enc:
        def __init__(self, ids):
            self.input_ids = ids

    class CharTokenizer:  # one id per character; counts the texts it tokenises
        def __init__(self):
            self.seen = []

        def __call__(self, text, add_special_tokens=False):
            self.seen.append(text)
            return Enc([ord(c) for c in text])

        def decode(self, ids):
            return "".join(map(chr, ids))

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return f"<user>{messages[0]['content']}<assistant>"

    books = ["The first book. " * 40, "A second, different book. " * 30]
    tok = CharTokenizer()
    first = chat_prompts(tok, books, 3, seed=5, passage_tokens=20)
    again = chat_prompts(tok, books, 3, seed=5, passage_tokens=20)
    assert list(_token_ids(tok, books[1])) == [ord(c) for c in books[1]]
    assert sorted(t for t in tok.seen if t in books) == sorted(books)  # each book once, for all three calls
    assert first == again and len(first) == 3
    for p in first:  # a template around a 20-token passage of one of the books
        text = tok.decode(p)
        assert text.startswith("<user>") and text.endswith("<assistant>") and len(p) > 20


def test_train_config_is_validated():
    with pytest.raises(ValueError, match="seq_len must be at least"):
        TrainConfig(seq_len=3, ttt_steps=3)
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="three feature layers"):
        Eagle3Config(hidden_size=8, intermediate_size=8, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=8,
                     draft_vocab_size=8, target_hidden_size=8, aux_layers=(0, 1))


def test_features_are_the_layer_outputs_transformers_reports(tmp_path):
    """``forward_dense_features`` / ``prefill_features`` against transformers'
    ``output_hidden_states`` (``hidden_states[i + 1]`` is layer i's output, but the last), in the requested
    order, repeats allowed, over a chunked prefill and a ragged verify-shaped batch."""
    from transformers import AutoModelForCausalLM

    folder = write_tiny_llama(tmp_path / "m", vocab_size=V, hidden=32, intermediate=64, layers=4, max_pos=1024,
                              seed=3, scale=0.3, embed_scale=1.0)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = Transformer.from_folder(folder)
    ids = torch.tensor([_prompt(40, 21)])
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    layers = (2, 0, 1, 1)  # (transformers' last entry is after the final norm: layer 3 is not comparable)
    cache = KVCache(model.cfg, 1, 48, model.dtype, "cpu")
    _, _, got = model.prefill_features(ids, cache, chunk_size=16, hidden_layers=layers)
    torch.testing.assert_close(got[0, :, :96], torch.cat([hs[3], hs[1], hs[2]], dim=-1)[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0, :, 96:], hs[2][0], rtol=1e-4, atol=1e-4)
    # ragged: row 0 continues the prompt by 3 tokens, row 1 is the prompt's first 30 + 3
    cache = KVCache(model.cfg, 2, 48, model.dtype, "cpu")
    model.prefill(ids[:, :37], cache.row(0))
    model.prefill(ids[:, :27], cache.row(1))
    cache.lengths = [37, 27]
    _, _, f = model.forward_dense_features(torch.stack([ids[0, 37:40], ids[0, 27:30]]), cache, (1,))
    torch.testing.assert_close(f[0], hs[2][0, 37:40], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(f[1], hs[2][0, 27:30], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"hidden layer ids must be in \[0, 4\)"):
        model.forward_dense_features(ids, KVCache(model.cfg, 1, 48, model.dtype, "cpu"), (4,))


@pytest.mark.slow
def test_the_trainer_cli_saves_a_head_the_drafter_loads(tmp_path):
    """``python -m sparsespec.train_eagle3`` end to end on the real model at a tiny size: chat
    answers, teacher pass, a few steps, the held-out figures, and a head ``eagle3`` then runs."""
    from sparsespec.train_eagle3 import main
    from tests.helpers import real_engine

    out = tmp_path / "head"
    assert main(["--out", str(out), "--book-tokens", "1000", "--chats", "2", "--chat-tokens", "8", "--steps", "2",
                 "--seq-len", "64", "--batch-size", "4", "--draft-vocab", "512", "--eval-chats", "1",
                 "--eval-tokens", "16", "--threads", "2"]) == 0
    meta = json.loads((out / "config.json").read_text())["sparsespec"]
    assert meta["steps"] == 2 and len(meta["held_out_top1_per_step"]) == 3 and 0 <= meta["held_out_alpha_k4"] <= 1
    assert (meta["held_out_chats"], meta["held_out_chat_tokens"]) == (1, 16)
    assert 0 < meta["held_out_counts_k4"]["rounds"] <= 16  # 16 tokens generated, >= 1 per round
    engine = real_engine()
    prompt = engine.tokenizer("The capital of France is Paris. The capital of Italy is").input_ids
    ar = engine.generate([prompt], method="ar", max_new_tokens=12, ignore_eos=True)[0]
    got = engine.generate([prompt], method="eagle3", method_options={"draft_model": str(out), "k": 3},
                          max_new_tokens=12, ignore_eos=True)[0]
    assert got.token_ids == ar.token_ids and got.stats["num_drafted"] > 0
    # --export: the shipped form of that head, measured again, with a manifest the loader accepts
    from sparsespec.drafters.eagle3 import verify_shipped

    shipped = tmp_path / "shipped"
    assert main(["--export", str(out), "--out", str(shipped), "--eval-chats", "1", "--eval-tokens", "16",
                 "--seq-len", "64", "--threads", "2"]) == 0
    manifest = verify_shipped(shipped)
    assert manifest["dtype"] == "bfloat16" and manifest["target"]["preset"] == "smollm2-135m"
    figures = json.loads((shipped / "config.json").read_text())["sparsespec"]["exported_figures"]
    assert len(figures["held_out_top1_per_step"]) == 3
    assert (figures["held_out_chats"], figures["held_out_chat_tokens"]) == (1, 16)
    assert 0 < figures["held_out_counts_k4"]["rounds"] <= 16
    assert "out" not in json.loads((shipped / "config.json").read_text())["sparsespec"]["train"]
    with pytest.raises(SystemExit):  # --export needs --out: an argparse error, nothing written
        main(["--export", str(out), "--threads", "2"])


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_one_pair_forward_matches_the_published_layer_written_out(head, norm_before_residual):
    """A single pair attends only to itself (attention output = its v), so the layer reduces to
    the published formula, written here from the checkpoint tensors: residual = hidden (or
    hidden_norm(hidden) with ``norm_before_residual``), + o_proj(v of [input_layernorm(embed),
    hidden_norm(hidden)]), + down(silu(gate) * up) of post_attention_layernorm; logits =
    lm_head(norm(.))."""
    import dataclasses

    h = Eagle3Head(dataclasses.replace(head.cfg, norm_before_residual=norm_before_residual), embed=head.embed)
    with torch.no_grad():
        for name in ("fc", "ln_input", "hidden_norm", "wqkv", "wo", "ln_post", "w_gate_up", "w_down", "norm", "lm_head"):
            getattr(h, name).copy_(getattr(head, name))
        h.hidden_norm.mul_(1.7)  # so the residual choice matters
    t = h.state_tensors()
    c = h.cfg

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, 1), generator=g)
    hidden = torch.randn(3, 1, c.hidden_size, generator=g) * 3
    x = torch.cat([rms(head.embed[ids], t["midlayer.input_layernorm.weight"]),
                   rms(hidden, t["midlayer.hidden_norm.weight"])], dim=-1)
    v = x @ t["midlayer.self_attn.v_proj.weight"].T  # [3, 1, H_kv * D]
    G = c.num_heads // c.num_kv_heads
    attn = v.view(3, 1, c.num_kv_heads, 1, c.head_dim).expand(3, 1, c.num_kv_heads, G, c.head_dim).reshape(3, 1, -1)
    res = rms(hidden, t["midlayer.hidden_norm.weight"]) if norm_before_residual else hidden
    y = res + attn @ t["midlayer.self_attn.o_proj.weight"].T
    z = rms(y, t["midlayer.post_attention_layernorm.weight"])
    y = y + (torch.nn.functional.silu(z @ t["midlayer.mlp.gate_proj.weight"].T) * (z @ t["midlayer.mlp.up_proj.weight"].T)) \
        @ t["midlayer.mlp.down_proj.weight"].T
    want = rms(y, t["norm.weight"]) @ t["lm_head.weight"].T
    got = h.draft_logits(h.forward_cached(ids, hidden, KVCache(h.lcfg, 3, 4, h.dtype, "cpu")))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ the shipped head (bf16 + manifest)
def _provisioned(folder, preset="tiny-preset", sha="ab" * 32):
    """Write the provisioning record a preset's folder carries (``sparsespec.provision``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sparsespec_provenance.json").write_text(json.dumps({"preset": preset, "sha256": sha}))
    return folder


def test_an_exported_head_ships_in_bf16_and_its_manifest_catches_corruption(engine, head_dir, tmp_path):
    """``export_head``: every floating tensor is the bf16 rounding of the trained one, the maps
    are unchanged, the manifest's sha256 is the file's (an independent hashlib pass) and names the
    target; ``shipped_head`` applies it only to that preset's exact weights and refuses a file
    whose size or bytes changed."""
    import hashlib
    from pathlib import Path

    from safetensors.torch import load_file

    from sparsespec.drafters.eagle3 import shipped_head
    from sparsespec.train_eagle3 import export_head

    target = _provisioned(tmp_path / "target")
    with pytest.raises(ValueError, match="no provisioning record"):
        export_head(head_dir, tmp_path / "x", tmp_path / "nowhere")
    with pytest.raises(ValueError, match="not an EAGLE-3 head folder"):
        export_head(tmp_path, tmp_path / "x", target)
    root = tmp_path / "heads"
    manifest = export_head(head_dir, root / "tiny-preset", target)
    f = root / "tiny-preset" / "model.safetensors"
    assert manifest["target"] == {"preset": "tiny-preset", "hf_id": None, "sha256": "ab" * 32}
    assert manifest["weights_sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
    assert manifest["weights_bytes"] == f.stat().st_size
    src, dst = load_file(str(Path(head_dir) / "model.safetensors")), load_file(str(f))
    assert set(src) == set(dst)
    for name, t in src.items():
        if t.is_floating_point():
            assert dst[name].dtype == torch.bfloat16 and torch.equal(dst[name], t.to(torch.bfloat16)), name
        else:
            assert dst[name].dtype == t.dtype and torch.equal(dst[name], t), name
    m = engine.model
    m.source_folder = target
    try:
        assert shipped_head(m, root) == root / "tiny-preset"
        _provisioned(target, sha="cd" * 32)  # other weights under the same preset name
        assert shipped_head(m, root) is None
        _provisioned(target, preset="other-preset")
        assert shipped_head(m, root) is None
        shutil.copytree(root / "tiny-preset", root / "other-preset")  # a manifest made for another preset
        _provisioned(target, preset="other-preset", sha="ab" * 32)
        assert shipped_head(m, root) is None
        _provisioned(target)
        (target / "sparsespec_provenance.json").unlink()  # a plain local folder, not a preset
        assert shipped_head(m, root) is None
        _provisioned(target)
        good = f.read_bytes()
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 1
        f.write_bytes(bytes(bad))
        with pytest.raises(ValueError, match="sha256 .* corrupt or was modified; restore it"):
            shipped_head(m, root)
        f.write_bytes(good[:-8])
        with pytest.raises(ValueError, match="bytes, the manifest says"):
            shipped_head(m, root)
        f.unlink()
        with pytest.raises(ValueError, match="weights are missing"):
            shipped_head(m, root)
        f.write_bytes(good)
        (root / "tiny-preset" / "manifest.json").write_text("{")
        with pytest.raises(ValueError, match="unreadable EAGLE-3 head manifest"):
            shipped_head(m, root)
    finally:
        m.source_folder = None


def test_the_default_head_is_this_machines_trained_one_else_the_shipped_one(engine, head_dir, tmp_path, monkeypatch):
    """``resolve_head(model, None)``: the head trained here (``$SPARSESPEC_CACHE/eagle3/<name>``)
    first, else the shipped head of the model's preset; the bf16 head drafts losslessly."""
    import sparsespec.drafters.eagle3 as e3
    from sparsespec.train_eagle3 import export_head

    target = _provisioned(tmp_path / "tiny-preset")
    root = tmp_path / "heads"
    export_head(head_dir, root / "tiny-preset", target)
    monkeypatch.setattr(e3, "SHIPPED_HEADS", root)
    monkeypatch.setenv("SPARSESPEC_CACHE", str(tmp_path / "cache"))
    m = engine.model
    m.source_folder = target
    try:
        assert resolve_head(m, None) == root / "tiny-preset"
        trained = tmp_path / "cache" / "eagle3" / "tiny-preset"
        shutil.copytree(head_dir, trained)
        assert resolve_head(m, None) == trained
        # the provenance each row records: which of the three kinds of head, and its weights
        import hashlib

        shipped = e3.head_provenance(root / "tiny-preset")
        manifest = json.loads((root / "tiny-preset" / "manifest.json").read_text())
        assert shipped == {"path": str((root / "tiny-preset").resolve()), "source": "shipped",
                           "weights_sha256": manifest["weights_sha256"]}
        mine = e3.head_provenance(trained)
        assert mine["source"] == "trained" and mine["path"] == str(trained.resolve())
        assert mine["weights_sha256"] == hashlib.sha256(
            sorted(trained.glob("*.safetensors"))[0].read_bytes()).hexdigest()
        assert e3.head_provenance(head_dir)["source"] == "given"
    finally:
        m.source_folder = None
    prompts = [_prompt(30, 5), _prompt(21, 6)]
    ar = engine.generate(prompts, method="ar", max_new_tokens=16, ignore_eos=True)
    got = engine.generate(prompts, method="eagle3", method_options=_opts(str(root / "tiny-preset"), k=4),
                          max_new_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in ar]
    assert sum(o.stats["num_accepted"] for o in got) > 0  # drafted and accepted: not inconclusive


def test_the_shipped_smollm2_head_is_intact_and_drafts_losslessly_on_a_fresh_cache(tmp_path, monkeypatch):
    """The head in ``sparsespec/heads/smollm2-135m`` (a fresh clone has it): at most 20 MB, its
    manifest's sha256 is the file's, it is the default for the provisioned preset when nothing was
    trained on the machine, and the real target's greedy output with it is AR's, with drafts
    accepted (the independent oracle: ``ar`` on the same engine)."""
    import hashlib

    from sparsespec.drafters.eagle3 import SHIPPED_HEADS, verify_shipped
    from tests.helpers import chat_prompt, real_engine

    folder = SHIPPED_HEADS / "smollm2-135m"
    manifest = verify_shipped(folder)
    weights = folder / manifest["weights_file"]
    assert weights.stat().st_size <= 20 * 2**20
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == manifest["weights_sha256"]
    engine = real_engine()
    monkeypatch.setenv("SPARSESPEC_CACHE", str(tmp_path))  # nothing trained on this machine
    assert resolve_head(engine.model, None) == folder
    prompt = chat_prompt(engine.tokenizer, "Write two sentences about the sea.")
    ar = engine.generate([prompt], method="ar", max_new_tokens=24, ignore_eos=True)[0]
    got = engine.generate([prompt], method="eagle3", method_options={"k": 3}, max_new_tokens=24, ignore_eos=True)[0]
    assert got.token_ids == ar.token_ids
    assert got.stats["num_accepted"] > 0
    # every request records which head drafted it (the row's provenance in a store)
    assert got.stats["drafter"] == {"eagle3_head": {"path": str(folder.resolve()), "source": "shipped",
                                                    "weights_sha256": manifest["weights_sha256"]}}
    assert "drafter" not in ar.stats
