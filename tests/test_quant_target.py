"""A quantised *target* (``quantize="int8"``): a new model, not a draft. Its forward against a
model holding the dequantised weights (an independent oracle), greedy losslessness of every
method against the int8 ``ar`` (batch 1 and ragged, drafted > 0), sampling from the int8 model's
own processed distribution, the roofline's bytes, and the sweep axis (plan, worker, run ids)."""
import dataclasses

import pytest
import torch

from helpers import eagle3_head, own_options, tiny_model_like, write_tiny_llama
from sparsespec import METHODS, Engine
from sparsespec.model import Transformer
from sparsespec.kv.cache import KVCache
from sparsespec.quant import Int8Weight, linear_weights
from tests.test_engine_core import SPARSE, ByteTok, V, _model, _prompt, assert_follows_marginals


def _int8_engine(folder, **kw):
    model = _model(folder, **kw)
    model.source_folder = None
    return Engine(model, ByteTok(), "tiny").quantize("int8")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return _int8_engine(tmp_path_factory.mktemp("q8t") / "m")


def _dense(model, ids):
    cache = KVCache(model.cfg, 1, len(ids) + 1, model.dtype, "cpu")
    logits, _ = model.forward_dense(torch.tensor([ids]), cache)
    return logits[0]  # [T, V]


def test_quantising_in_place_swaps_every_linear_weight(tmp_path):
    from sparsespec.roofline import step_flops, weight_bytes

    fp = _model(tmp_path / "a")
    model = Transformer.from_folder(tmp_path / "a")
    wb_fp, fl_fp = weight_bytes(model), step_flops(model, 2, 3, 50)
    assert model.quantize == "none"
    assert model.quantize_("int8") is model and model.quantize == "int8"
    ws = linear_weights(model)
    assert len(ws) == 1 + 4 * model.cfg.num_layers and all(isinstance(w, Int8Weight) for w in ws)
    # what is left as parameters: the embedding (a gather) and the 1-D norms / biases
    assert all(p.dim() == 1 for n, p in model.named_parameters() if n != "embed")
    small = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 1)
    lin = [fp.lm_head] + [getattr(layer, n) for layer in fp.layers for n in ("wqkv", "wo", "w_gate_up", "w_down")]
    assert weight_bytes(model) == sum(w.numel() + 4 * w.shape[0] for w in lin) + small < wb_fp
    assert step_flops(model, 2, 3, 50) == fl_fp  # the same multiply-accumulates, fewer bytes
    # a draft "over int8 weights" of an int8 target is the target's own forward: no extra copy
    assert model.draft_weights("int8") is None and model.draft_weights("target") is None
    model.quantize_("int8")  # idempotent
    with pytest.raises(ValueError, match="quantize must be one of"):
        model.quantize_("int4")


def test_a_quantised_model_cannot_be_requantised_to_another_kind(monkeypatch, tmp_path):
    import sparsespec.quant as q

    model = _model(tmp_path / "b").quantize_("int8")
    monkeypatch.setattr(q, "QUANTIZE", ("none", "int8", "int4"))
    with pytest.raises(ValueError, match="quantised already"):
        q.quantize_target_(model, "int4")


def test_the_int8_matmul_is_batch_invariant_bitwise():
    """A row's output must not depend on what shares the call (the batch, a verify's k + 1
    tokens): else a quantised target's speculation could not reproduce its own AR."""
    g = torch.Generator().manual_seed(0)
    q = Int8Weight.quantize(torch.randn(48, 40, generator=g))
    x = torch.randn(12, 40, generator=g) * torch.rand(12, 1, generator=g) * 6  # rows of very different scale
    full = q.linear(x)
    assert all(torch.equal(q.linear(x[i:i + 1])[0], full[i]) for i in range(12))
    assert torch.equal(q.linear(x[3:9]), full[3:9]) and torch.equal(q.linear(x.view(3, 4, 40)), full.view(3, 4, 48))
    ref = x @ q.dequantize().T
    assert (full - ref).abs().mean() < 0.02 * ref.abs().mean()  # per-token 7-bit activations


def test_the_int8_target_forward_is_the_dequantised_model(tmp_path):
    """Oracle: the same dense forward on a model whose weights ARE the dequantised int8 ones."""
    fp = _model(tmp_path / "c")
    model = Transformer.from_folder(tmp_path / "c").quantize_("int8")
    ref = Transformer.from_folder(tmp_path / "c")
    for layer, ql in zip(ref.layers, model.layers):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            getattr(layer, name).data.copy_(getattr(ql, name).dequantize())
    if ref.cfg.tie_word_embeddings:
        ref.lm_head = torch.nn.Parameter(model.lm_head.dequantize(), requires_grad=False)
    else:
        ref.lm_head.data.copy_(model.lm_head.dequantize())
    ref.prepack_()  # the weights changed in place: refresh their prepacked copies
    exact = Transformer.from_folder(tmp_path / "c").quantize_("int8")  # the fp32-activation int8 kernel: exactly the dequantised weights
    for layer in exact.layers:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            object.__setattr__(layer, name, dataclasses.replace(getattr(layer, name), packed=None))
    exact.__dict__["lm_head"] = dataclasses.replace(exact.lm_head, packed=None)
    ids = _prompt(40, 3)
    want = _dense(ref, ids)
    torch.testing.assert_close(_dense(exact, ids), want, rtol=1e-4, atol=1e-4)
    # fbgemm (what runs on this CPU) also rounds each token's activations to 7 bits (about 1 % per
    # linear, test_quant_draft); through this random 32-wide model that compounds to ~10 % of the logits
    assert (_dense(model, ids) - want).abs().mean() < 0.25 * want.abs().mean()
    assert (_dense(fp, ids) - want).abs().max() > 1e-4, "the int8 target must differ from the full-precision one"


@pytest.mark.parametrize("method", [m for m in METHODS if m != "ar"])
def test_greedy_speculation_on_an_int8_target_equals_its_own_ar(engine, method, tmp_path):
    """On the tiny model (top-2 margins far above the int8 rounding) every method reproduces the
    int8 ar exactly: a verify on the wrong weights, a draft judged against the fp32 model or an
    accounting fault turns this red. (On a real model near-ties can flip, see quant.py.)"""
    opts = own_options(method, SPARSE)
    if method == "draft-model":
        opts = {"draft_model": str(write_tiny_llama(tmp_path / "d", vocab_size=V, hidden=32, intermediate=64,
                                                    max_pos=1024, seed=0, scale=0.5, embed_scale=1.0)), "k": 3}
    elif method == "ngram":
        opts = {"k": 3}
    elif method == "eagle3":  # a head trained on the int8 target itself
        opts["draft_model"] = eagle3_head(engine.model)
    prompts = [_prompt(190, 20), _prompt(130, 21), _prompt(75, 22)]
    if method == "ngram":  # repeated text, so the lookup finds something to propose
        prompts = [(p[:30] * 7)[:n] for p, n in zip(prompts, (190, 130, 75))]
    refs = [engine.generate([p], method="ar", max_new_tokens=14, ignore_eos=True)[0].token_ids for p in prompts]
    one = engine.generate(prompts[:1], method=method, method_options=opts, max_new_tokens=14, ignore_eos=True)[0]
    assert one.token_ids == refs[0]
    ragged = engine.generate(prompts, method=method, method_options=opts, max_new_tokens=14, ignore_eos=True)
    assert [o.token_ids for o in ragged] == refs
    assert one.stats["num_drafted"] + sum(o.stats["num_drafted"] for o in ragged) > 0, "drafted nothing: inconclusive"
    if method in ("sparsespec-l", "magicdec-streaming", "magicdec-snapkv"):
        both = engine.generate(prompts[:1], method=method, method_options={**opts, "draft_weights": "int8"},
                               max_new_tokens=14, ignore_eos=True)[0]
        assert both.token_ids == refs[0] and both.stats["draft_weight_bytes"] == 0  # the target's own int8 weights


def test_the_int8_ar_is_the_int8_models_greedy_argmax(engine):
    """An independent check of the reference itself: each ar token is the argmax of a fresh dense
    forward of the int8 model over the prompt and the tokens before it."""
    prompt = _prompt(60, 30)
    out = engine.generate([prompt], method="ar", max_new_tokens=6, ignore_eos=True)[0].token_ids
    ids = list(prompt)
    for t in out:
        assert int(_dense(engine.model, ids)[-1].argmax()) == t
        ids.append(t)


def test_sampling_on_an_int8_target_follows_its_processed_distribution(tmp_path):
    small = _int8_engine(tmp_path / "s", seed=1, vocab=12, scale=0.6)
    # (with the int8 weights, the prompt of the full-precision test has a one-token nucleus at
    # the first drafted position, where every draft is accepted: this prompt rejects some, accepts some)
    t, top_k, top_p, rows = 0.7, 6, 1.0, 3000
    prompt = torch.randint(0, 12, (120,), generator=torch.Generator().manual_seed(7)).tolist()
    opts = {"k": 3, "min_budget": 30, "max_budget": 30, "n_sink": 2, "n_recent": 4, "window": 4}
    outs = small.generate([prompt] * rows, method="sparsespec-l", method_options=opts, max_new_tokens=3,
                          temperature=t, top_k=top_k, top_p=top_p, seed=3, ignore_eos=True)
    drafted = sum(o.stats["num_drafted"] for o in outs)
    assert 0 < sum(o.stats["num_accepted"] for o in outs) < drafted, "both the accept and the recovery path"
    assert_follows_marginals(outs, small.model, prompt, t, top_k, top_p)  # the int8 model's own p


# --------------------------------------------------------------------------- the sweep axis
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(tiny_model_like(tmp_path_factory.mktemp("m") / "tiny-llama"))


def _spec(tiny, db, **kw):
    from cluster.sweep.schema import parse_spec

    data = {"name": "q", "models": [tiny], "methods": {"sparsespec-l": {"k": 3}}, "batch_sizes": [2],
            "benchmarks": [{"name": "ruler", "tasks": ["niah_single_1"], "num_samples": 2, "context_lengths": [512]}],
            "sampling": {"max_new_tokens": 6}, "db": db, **kw}
    return parse_spec(data)


def test_quantize_is_a_sweep_axis_with_its_own_runs(tiny, tmp_path):
    from cluster.sweep import run as sweep
    from cluster.sweep.schema import SpecError

    db = f"sqlite:///{tmp_path}/x.db"
    plain_cells, _ = sweep.plan(_spec(tiny, db))
    cells, shards = sweep.plan(_spec(tiny, db, quantize=["none", "int8"]))
    assert [c.quantize for c in cells] == ["none", "int8"]
    # the full-precision run keeps the id it had before the axis existed; the int8 run is new
    assert cells[0].run_id == plain_cells[0].run_id != cells[1].run_id
    assert "quantize" not in cells[0].config and cells[1].config["quantize"] == "int8"
    assert [s.quantize for s in shards] == ["none", "int8"]
    assert sweep.plan(_spec(tiny, db, quantize="int8"))[0][0].run_id == cells[1].run_id
    for bad, needle in ((["int4"], "quantize"), (["int8", "int8"], "duplicate quantize"), ([], "at least one")):
        with pytest.raises(SpecError, match=needle):
            _spec(tiny, db, quantize=bad)
    import argparse

    p = argparse.ArgumentParser()
    sweep.add_override_flags(p)
    assert sweep.overrides_from(p.parse_args(["--quantize", "none,int8"]))["quantize"] == ["none", "int8"]


def test_a_worker_on_an_int8_target_pairs_every_method_with_its_own_ar(tiny, tmp_path):
    from cluster.sweep import run as sweep
    from cluster.sweep.coordinator import result_rows
    from cluster.sweep.plan import plan_shards
    from cluster.sweep.worker import EngineWorker

    cells, _ = sweep.plan(_spec(tiny, f"sqlite:///{tmp_path}/x.db", quantize=["none", "int8"]))
    w8 = EngineWorker(tiny, "float32", "cpu", threads=1, quantize="int8")
    assert w8.engine.model.quantize == "int8" and w8.ping()["quantize"] == "int8"
    (shard,) = plan_shards(cells[1])
    out = w8.run_shard(shard)["rows"]
    rows = result_rows(shard, out, lambda s, p: 0.5)
    assert sum(r["stats"]["num_drafted"] for r in rows if r["method"] != "ar") > 0
    assert all(r["lossless"] is True for r in rows if r["method"] != "ar")  # against the int8 ar
    # the int8 ar is the int8 model's output, not the full-precision one's: its logits differ
    wfp = EngineWorker(tiny, "float32", "cpu", threads=1)
    ids = list(shard.samples[0].prompt_ids[-64:])
    assert (_dense(w8.engine.model, ids) - _dense(wfp.engine.model, ids)).abs().max() > 1e-4
