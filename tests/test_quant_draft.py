"""A quantised draft (``draft_weights="int8"``): the int8 matmul against its dequantised weight,
the draft forward against a model holding the dequantised weights (an independent oracle), greedy
losslessness against AR for every self-speculative method (batch 1 and ragged, drafted > 0), and
sampling from the processed target with q the quantised draft's own distribution."""
import copy
import dataclasses

import pytest
import torch

from sparsespec import Engine, resolve_method_options
from sparsespec.drafters.sparse_self import SparseSpecLOptions
from sparsespec.model import DraftKV
from sparsespec.quant import DraftWeights, Int8Weight, LayerWeights, fbgemm_available, linear
from tests.test_engine_core import SPARSE, ByteTok, _model, _prompt, assert_follows_marginals
from tests.helpers import own_options

SELF = ("sparsespec-l", "magicdec-streaming", "magicdec-snapkv")
INT8 = {**SPARSE, "draft_weights": "int8"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = _model(tmp_path_factory.mktemp("q") / "m")
    model.source_folder = None
    return Engine(model, ByteTok(), "tiny")


def test_int8_weight_round_trip_and_matmul():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 32, generator=g)
    w[3] = 0.0  # a zero row keeps scale 1 and stays zero
    q = Int8Weight.quantize(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (24, 32) and q.scales.shape == (24,)
    assert int(q.qweight.abs().max()) == 127 and q.scales[3] == 1.0 and q.qweight[3].abs().sum() == 0
    # every element within half a quantisation step of the original
    assert bool(((q.dequantize() - w).abs() <= q.scales[:, None] / 2 + 1e-7).all())
    x = torch.randn(2, 5, 32, generator=g)
    b = torch.randn(24, generator=g)
    ref = x @ q.dequantize().T + b
    # int8 weights with fp32 activations (no fbgemm): the dequantised weight's product
    exact = dataclasses.replace(q, packed=None)
    torch.testing.assert_close(exact.linear(x, b), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(linear(x, exact), linear(x, q.dequantize()), rtol=1e-4, atol=1e-4)
    if fbgemm_available():  # fbgemm also quantises the activations (7 bits per call): ~1 % error
        assert q.packed is not None
        err = (q.linear(x, b) - ref).abs().max() / ref.abs().max()
        assert 0 < err < 0.05
    assert q.nbytes == 24 * 32 + 24 * 4
    with pytest.raises(ValueError, match="2-D"):
        Int8Weight.quantize(torch.zeros(2, 3, 4))


def test_options_are_validated_and_only_the_self_drafters_take_them(engine):
    with pytest.raises(ValueError, match="draft_weights must be one of"):
        SparseSpecLOptions(draft_weights="int4")
    with pytest.raises(ValueError, match="unknown method_options \\['draft_weights'\\] for method 'ngram'"):
        resolve_method_options("ngram", {"draft_weights": "int8"})
    with pytest.raises(ValueError, match="unknown method_options"):
        engine.core("ngram", {"draft_weights": "int8"})
    # an option of the self-speculative methods: resolved (and in their run ids) at its default too
    assert resolve_method_options("sparsespec-l", {})["draft_weights"] == "target"
    assert resolve_method_options("sparsespec-l", {"draft_weights": "int8"})["draft_weights"] == "int8"
    m = engine.model
    assert m.draft_weights("target") is None and m.draft_weights("int8") is m.draft_weights("int8")
    with pytest.raises(ValueError, match="draft_weights"):
        m.draft_weights("fp8")


def test_the_draft_forward_reads_the_int8_weights(engine):
    """Oracle: the same forward on a copy of the model whose weights ARE the dequantised ones."""
    m = engine.model
    saved = m.__dict__.pop("_draft_weights", None)
    ref = copy.deepcopy(m)  # (before the int8 copy exists: fbgemm's packed weights do not deep-copy)
    if saved is not None:
        m.__dict__["_draft_weights"] = saved
    dw8 = m.draft_weights("int8")

    def unpacked(w):
        return dataclasses.replace(w, packed=None)

    # the same int8 weights through the fp32-activation kernel: equal to the dequantised model
    dw = DraftWeights("int8", tuple(LayerWeights(unpacked(lw.wqkv), lw.bqkv, unpacked(lw.wo), unpacked(lw.w_gate_up),
                                                 unpacked(lw.w_down)) for lw in dw8.layers), unpacked(dw8.lm_head))
    for layer, lw in zip(ref.layers, dw.layers):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            getattr(layer, name).data.copy_(getattr(lw, name).dequantize())
    if not ref.cfg.tie_word_embeddings:
        ref.lm_head.data.copy_(dw.lm_head.dequantize())
    else:  # a tied head: the int8 copy is the head's; the embedding itself stays full precision
        ref.lm_head = torch.nn.Parameter(dw.lm_head.dequantize(), requires_grad=False)
    ref.prepack_()  # the weights changed in place: refresh their prepacked copies
    cfg = m.cfg
    g = torch.Generator().manual_seed(1)
    shape = (cfg.num_layers, 2, cfg.num_kv_heads, 20, cfg.head_dim)
    kv = (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    ids, pos = torch.tensor([[3], [7]]), torch.tensor([30, 41])

    def run(model, weights):
        dkv = DraftKV(kv[0].clone(), kv[1].clone(), 12, n_index=12)
        return model.forward_draft(ids, pos, dkv, weights)

    got, want, dense = run(m, dw), run(ref, None), run(m, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - dense).abs().max() > 1e-4, "the int8 draft must differ from the full-precision one"
    fast = run(m, dw8)  # what the engine runs (fbgemm on this CPU): close to the same forward
    assert (fast - want).abs().max() < 0.15 * want.abs().max()  # 7-bit activations through 2 random layers


@pytest.mark.parametrize("method", SELF)
def test_greedy_int8_draft_is_token_identical_to_ar(engine, method):
    prompts = [_prompt(190, 20), _prompt(130, 21), _prompt(75, 22)]
    refs = [engine.generate([p], method="ar", max_new_tokens=14, ignore_eos=True)[0].token_ids for p in prompts]
    one = engine.generate(prompts[:1], method=method, method_options=own_options(method, INT8), max_new_tokens=14, ignore_eos=True)[0]
    assert one.token_ids == refs[0]
    ragged = engine.generate(prompts, method=method, method_options=own_options(method, INT8), max_new_tokens=14, ignore_eos=True)
    assert [o.token_ids for o in ragged] == refs
    drafted = one.stats["num_drafted"] + sum(o.stats["num_drafted"] for o in ragged)
    assert drafted > 0, "drafted nothing: inconclusive"
    assert one.stats["draft_weight_bytes"] == engine.model.draft_weights("int8").nbytes > 0
    plain = engine.generate(prompts[:1], method=method, method_options=own_options(method, SPARSE), max_new_tokens=4, ignore_eos=True)[0]
    assert plain.stats["draft_weight_bytes"] == 0


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    model = _model(tmp_path_factory.mktemp("qs") / "m", seed=1, vocab=12, scale=0.6)
    model.source_folder = None
    return Engine(model, ByteTok(), "small")


def test_sampling_with_an_int8_draft_follows_the_processed_target(small):
    t, top_k, top_p, rows = 0.7, 6, 0.85, 3000
    prompt = torch.randint(0, 12, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    opts = {"k": 3, "min_budget": 30, "max_budget": 30, "n_sink": 2, "n_recent": 4, "window": 4,
            "draft_weights": "int8"}
    outs = small.generate([prompt] * rows, method="sparsespec-l", method_options=opts, max_new_tokens=3,
                          temperature=t, top_k=top_k, top_p=top_p, seed=3, ignore_eos=True)
    drafted = sum(o.stats["num_drafted"] for o in outs)
    accepted = sum(o.stats["num_accepted"] for o in outs)
    assert drafted > 0 and accepted < drafted, "rejections must happen for the recovery path to be tested"
    assert_follows_marginals(outs, small.model, prompt, t, top_k, top_p)


def test_full_index_int8_draft_is_judged_by_its_own_q(small):
    """With every position indexed, a full-precision draft has q == p (alpha 1, see
    test_engine_core); the int8 draft's q differs, so some drafts are rejected. If q were taken
    from the full-precision weights while the tokens came from the int8 forward (or the reverse),
    the acceptance test would be wrong; the distribution test above checks the outcome."""
    prompt = torch.randint(0, 12, (60,), generator=torch.Generator().manual_seed(6)).tolist()
    full = {"min_budget": 4096, "max_budget": 4096, "n_sink": 4, "n_recent": 8, "window": 8, "k": 4}
    fp = small.generate([prompt] * 40, method="sparsespec-l", method_options=full, max_new_tokens=9,
                        temperature=0.9, seed=4, ignore_eos=True)
    q8 = small.generate([prompt] * 40, method="sparsespec-l", method_options={**full, "draft_weights": "int8"},
                        max_new_tokens=9, temperature=0.9, seed=4, ignore_eos=True)
    assert sum(o.stats["num_accepted"] for o in fp) == sum(o.stats["num_drafted"] for o in fp)
    assert sum(o.stats["num_accepted"] for o in q8) < sum(o.stats["num_drafted"] for o in q8)


def test_the_roofline_counts_the_int8_copy_instead_of_the_weights(engine):
    from sparsespec.roofline import draft_weight_bytes, kv_bytes, roofline, weight_bytes

    m = engine.model
    dw = m.draft_weights("int8")
    small = sum(p.numel() * p.element_size() for p in m.parameters() if p.dim() == 1)
    assert draft_weight_bytes(m, None) == weight_bytes(m)
    assert draft_weight_bytes(m, dw) == dw.nbytes + small < weight_bytes(m)
    machine = {"read_bytes_per_s": 1e9, "gemm_flops_per_s": 1e12}
    r = roofline(m, machine, 2, 1, 100, weight_nbytes=draft_weight_bytes(m, dw))
    assert r["bytes"] == dw.nbytes + small + kv_bytes(m.cfg, 4, 2, 100)
    # int8 weights: one byte per linear weight plus one fp32 scale per output channel
    lin = [m.lm_head] + [getattr(layer, n) for layer in m.layers for n in ("wqkv", "wo", "w_gate_up", "w_down")]
    assert dw.nbytes == sum(w.numel() + 4 * w.shape[0] for w in lin)
