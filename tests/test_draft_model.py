"""The ``draft-model`` baseline on the real model: greedy losslessness (batch 1 and ragged batch 3,
K in {1, 4, auto}) with the target as its own draft model (alpha = 1) and with a tiny random draft
model (mostly rejections: rollback), the short-window fallback, tokenizer checks, sampling."""
import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from sparsespec import resolve_model
from sparsespec.stats import derive
from tests.helpers import book_prompt, real_engine, write_tiny_llama

pytestmark = pytest.mark.slow

N_NEW = 12
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def _tiny_llama(folder, vocab_size=49152, max_pos=4096, seed=0, copy_tokenizer=True):
    """A random-weight 2-layer Llama on the SmolLM2 vocabulary (HF tensor names)."""
    write_tiny_llama(folder, vocab_size=vocab_size, max_pos=max_pos, seed=seed)
    if copy_tokenizer:
        src = resolve_model("smollm2-135m")
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, folder / name)
    return folder


def _sharp_tiny_model(folder):
    """The tiny Llama in ``folder`` with sharper attention (the drafts depend on the whole
    context), its packed copies refreshed after the in-place change."""
    from sparsespec.model import Transformer

    model = Transformer.from_folder(folder)
    for layer in model.layers:
        layer.wqkv.data *= 10
        layer.wo.data *= 10
    model.embed.data *= 10
    model.prepack_()  # the weights changed in place: refresh their prepacked copies
    return model


def _fresh_greedy(model, hist, k):
    """The oracle: ``k`` greedy tokens after ``hist`` from a fresh dense decode of ``model``."""
    from sparsespec.kv.cache import KVCache

    cache = KVCache(model.cfg, 1, len(hist) + k, model.dtype, "cpu")
    out, h = [], list(hist)
    for _ in range(k):
        logits, _ = model.forward_dense(torch.tensor([h[cache.length:]]), cache, logits_for="last")
        h.append(int(logits[0, -1].argmax()))
        out.append(h[-1])
    return out


def _self_draft_with_window(folder, max_pos):
    """The target's own weights (symlinked) with a shorter ``max_position_embeddings``."""
    src = resolve_model("smollm2-135m")
    folder.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json" and f.is_file():
            (folder / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = max_pos
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def engine():
    return real_engine()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_models")
    return {
        "tiny": str(_tiny_llama(root / "tiny")),
        "tiny_short": str(_tiny_llama(root / "tiny_short", max_pos=128)),
    }


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    return [  # ragged lengths, a few hundred tokens
        book_prompt(tok, 2000, 200, "Summarise what happened to Alice in the text above."),
        book_prompt(tok, 9000, 120, "Repeat the first sentence of the text above."),
        book_prompt(tok, 5000, 160, "Who is speaking in the last paragraph?"),
    ]


@pytest.fixture(scope="module")
def ar_rows(engine, prompts):
    outs = engine.generate(prompts, method="ar", max_new_tokens=N_NEW, ignore_eos=True)
    return [o.token_ids for o in outs]


def _check_lossless(outs, ar_rows):
    assert [o.token_ids for o in outs] == ar_rows[: len(outs)]
    for o in outs:
        s = o.stats
        assert s["num_emitted"] == N_NEW - 1 and s["num_accepted"] <= s["num_drafted"]


@pytest.mark.parametrize("k", [1, 4, "auto"])
@pytest.mark.parametrize("batch", [1, 3])
def test_self_as_draft_is_lossless_with_alpha_one(engine, prompts, ar_rows, k, batch):
    target = str(resolve_model("smollm2-135m"))
    outs = engine.generate(prompts[:batch], method="draft-model", method_options={"k": k, "draft_model": target},
                           max_new_tokens=N_NEW, ignore_eos=True)
    _check_lossless(outs, ar_rows)
    for o in outs:
        s = o.stats
        assert s["num_drafted"] > 0
        assert s["num_accepted"] == s["num_drafted"], "the target drafting for itself must have alpha == 1"
        assert derive(s)["budget_frac"] > 0.9  # the draft attends to (almost) the whole context
        prov = json.loads((Path(target) / "sparsespec_provenance.json").read_text())
        assert s["drafter"] == {"draft_model": {"path": str(Path(target).resolve()), "preset": prov["preset"],
                                                "sha256": prov["sha256"]}}  # which draft ran, in every row


@pytest.mark.parametrize("k", [1, 4])
def test_random_draft_rolls_back_and_stays_lossless(engine, prompts, ar_rows, folders, k):
    outs = engine.generate(prompts, method="draft-model", method_options={"k": k, "draft_model": folders["tiny"]},
                           max_new_tokens=N_NEW, ignore_eos=True)
    _check_lossless(outs, ar_rows)
    drafted = sum(o.stats["num_drafted"] for o in outs)
    accepted = sum(o.stats["num_accepted"] for o in outs)
    assert drafted > 0 and accepted < drafted  # rejections happened: the draft cache was rolled back
    assert outs[0].stats["drafter"] == {"draft_model": {"path": str(Path(folders["tiny"]).resolve())}}  # no record


def test_short_window_falls_back_to_target_only(engine, prompts, ar_rows, folders):
    # every prompt (150-250 tokens) is longer than the 128-token draft window: nothing is prefilled
    outs = engine.generate(prompts, method="draft-model", method_options={"k": 4, "draft_model": folders["tiny_short"]},
                           max_new_tokens=N_NEW, ignore_eos=True)
    _check_lossless(outs, ar_rows)
    assert all(o.stats["num_drafted"] == 0 for o in outs)


def test_short_window_drafts_only_where_it_fits(engine, prompts, ar_rows, tmp_path):
    # the target's weights with a window that the longest row outgrows while decoding: it drafts
    # until its context reaches the window, then falls back to target-only steps
    lens = sorted(len(p) for p in prompts)
    window = lens[-1] + N_NEW // 2
    assert lens[0] < window - N_NEW  # the shortest row fits throughout
    folder = _self_draft_with_window(tmp_path / "self_short", window)
    outs = engine.generate(prompts, method="draft-model", method_options={"k": 4, "draft_model": str(folder)},
                           max_new_tokens=N_NEW, ignore_eos=True)
    _check_lossless(outs, ar_rows)
    for p, o in zip(prompts, outs):
        s = o.stats
        # a draft token at position x is predicted from position x - 1 < window
        assert s["num_drafted"] <= window - len(p)
        assert 0 < s["num_drafted"] == s["num_accepted"]


def test_sampling_is_reproducible_and_drafts(engine, prompts):
    opts = {"k": 4, "draft_model": str(resolve_model("smollm2-135m"))}
    runs = [engine.generate(prompts[1:], method="draft-model", method_options=opts, max_new_tokens=N_NEW,
                            temperature=0.8, seed=123, ignore_eos=True) for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    for o in runs[0]:
        s = o.stats
        assert len(o.token_ids) == N_NEW and s["num_drafted"] > 0
        # q == p up to rounding (the target drafts for itself): min(1, p/q) accepts (almost) always
        assert s["num_accepted"] >= 0.8 * s["num_drafted"]


def test_missing_draft_model_option(engine):
    with pytest.raises(ValueError, match="draft-model needs method_options"):
        engine.generate(["Hello"], method="draft-model", method_options={"k": 2}, max_new_tokens=4)


def test_vocab_size_mismatch(engine, tmp_path):
    folder = _tiny_llama(tmp_path / "v", vocab_size=49153)
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        engine.generate(["Hello"], method="draft-model", method_options={"draft_model": str(folder)}, max_new_tokens=4)


def test_tokenizer_vocabulary_mismatch(engine, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = _tiny_llama(tmp_path / "w", copy_tokenizer=False)
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)
    with pytest.raises(ValueError, match="tokenizer mismatch") as err:
        engine.generate(["Hello"], method="draft-model", method_options={"draft_model": str(folder)}, max_new_tokens=4)
    assert str(folder) in str(err.value) and "smollm2" in str(err.value).lower()


def test_draft_cache_catch_up_and_rollback(tmp_path):
    """Driven directly (a tiny model drafting for itself): after rollbacks, full acceptance and
    steps without a propose, the drafts equal those of a fresh greedy decode of the history."""
    from sparsespec.adaptive import FixedK
    from sparsespec.config import SamplingParams
    from sparsespec.drafters.draft_model import DraftModelDrafter, DraftModelOptions
    from sparsespec.kv.cache import KVCache
    from sparsespec.sampling import BatchSampling

    folder = _tiny_llama(tmp_path / "t", seed=1)
    model = _sharp_tiny_model(folder)
    V = model.cfg.vocab_size
    fresh_greedy = functools.partial(_fresh_greedy, model)

    g = torch.Generator().manual_seed(0)
    hist = [torch.randint(0, V, (n,), generator=g).tolist() for n in (40, 25)]
    changed = [(hist[0][0] + 1) % V] + hist[0][1:]
    assert fresh_greedy(changed, 3) != fresh_greedy(hist[0], 3), "the check must see a stale cache"
    k, sp = 3, SamplingParams(max_new_tokens=64)
    drafter = DraftModelDrafter(model, DraftModelOptions(k=k, draft_model=str(folder)), capacity=100, batch_size=2, max_k=k)
    assert drafter.draft is model  # the target's own folder reuses its weights
    target = KVCache(model.cfg, 2, 100, model.dtype, "cpu")  # stands in for the engine's cache
    for b, h in enumerate(hist):
        drafter.prefill_row(b, target, None, h[:-1])
        target.lengths[b] = len(h) - 1

    def advance(new):  # the engine: commit tokens, roll the target back, then drafter.commit
        for h, n in zip(hist, new):
            h.extend(n)
        target.lengths = [len(h) - 1 for h in hist]
        drafter.commit(target, None, [len(n) for n in new])
        assert all(dl <= tl for dl, tl in zip(drafter.dcache.lengths, target.lengths))

    for step in range(3):
        pending = torch.tensor([[h[-1]] for h in hist])
        d = drafter.propose(target, pending, [k, k], [FixedK(k)] * 2, BatchSampling([sp] * 2, [None] * 2), hist)
        assert d.num_draft == [k, k] and d.q_probs is None and d.entropies.shape == (2, k)
        for b, h in enumerate(hist):
            assert d.token_ids[b].tolist() == fresh_greedy(h, k), (step, b)
        t = d.token_ids.tolist()
        if step == 0:  # row 0: all accepted + bonus; row 1: one accepted, then a recovered token
            advance([t[0] + [7], [t[1][0], (t[1][1] + 1) % V]])
        elif step == 1:  # both rejected at once, then 3 steps without a propose (AR steps)
            advance([[(t[0][0] + 1) % V], [(t[1][0] + 1) % V]])
            for tok in (5, 6, 8):
                advance([[tok], [tok]])
    drafter.move(1, 0)  # row 0 leaves the pool; row 1 takes its slot
    assert drafter.index_sizes()[0] == drafter.dcache.lengths[0] == drafter.dcache.lengths[1]
    assert torch.equal(drafter.dcache.k[:, 0, :, : drafter.dcache.lengths[0]],
                       drafter.dcache.k[:, 1, :, : drafter.dcache.lengths[1]])
    assert drafter.nbytes == drafter.dcache.nbytes > 0

