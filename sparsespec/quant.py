"""Weight-only int8 copies of a model's linear layers, for the draft forward of self-speculation.

A quantised *draft* changes only the proposal ``q``: the draft tokens are sampled from the
quantised forward's own processed distribution and verified against the full-precision target,
so greedy output stays token-identical to AR and sampling stays exact (``sparsespec.rejection``).
What it buys is bytes: at batch 1 on a small model the weights are most of what a draft step
reads, and int8 halves (bf16) or quarters (fp32) them; the sparse index cuts the KV reads as before.

Scheme: symmetric per-output-channel int8, ``W ~ s[:, None] * Q`` with ``Q = round(W / s)`` in
[-127, 127] and ``s = max|W[n, :]| / 127`` (a zero row gets ``s = 1``). The matmul, on CPU where
PyTorch has the x86/fbgemm quantized engine: fbgemm's dynamic int8 linear (the activations are
quantised per token to 7-bit uint8, ``_fbgemm_per_token``: each row alone or in any batch gives
bitwise the same output; int32 accumulation, fp32 out), measured here
7-10x faster than the fp32 GEMV at SmolLM2's LM head (``benchmarks/RESULTS.md``); without that
engine ``torch._weight_int8pack_mm`` (int8 weights, fp32 activations: slower than fp32 on this
CPU); elsewhere the weight is dequantised per call (correct, not faster).

Two uses: a quantised *draft* (``DraftWeights``, read only by the draft forward: its rounding
changes q, never the output) and a quantised *target* (``quantize_target_``: the model's own
weights replaced, a new model whose ar is the reference). The matmul is batch-invariant bit
for bit, so a row's linear layers do not depend on what shares the call; the attention of a
verify (k + 1 queries) and of an AR step still differ in the last float bits, and the int8
rounding of the next activations can turn that into a different token where the int8 model's
top two logits nearly tie (``benchmarks/RESULTS.md``: margins of 0.07-0.09 on SmolLM2), so on
an int8 target speculation reproduces its ar except at such near-ties, measured per sample.
"""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

#: ``draft_weights`` values (``SelfSpecOptions``, ``sparsespec.drafters.sparse_self``): the target's own weights, or an int8 copy.
DRAFT_WEIGHTS = ("target", "int8")
#: ``quantize`` values of a *target* (a model setting: every method, ``ar`` included, runs on it).
QUANTIZE = ("none", "int8")


@dataclass(frozen=True)
class Int8Weight:
    """``qweight`` ``[N, K]`` int8 and ``scales`` ``[N]`` (the model's dtype): ``W ~ scales[:, None] * qweight``."""

    qweight: torch.Tensor
    scales: torch.Tensor
    packed: Any = field(default=None, compare=False, repr=False)  # fbgemm's prepacked weight (CPU)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Int8Weight:
        """Symmetric per-output-channel int8 of ``w`` ``[N, K]`` (computed in fp32); on a CPU with
        the fbgemm engine also prepacked for its int8 linear."""
        if w.dim() != 2:
            raise ValueError(f"int8 quantisation needs a 2-D weight [N, K], got shape {tuple(w.shape)}")
        wf = w.detach().float()
        amax = wf.abs().amax(dim=1)  # [N]
        scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.clamp(torch.round(wf / scales[:, None]), -127, 127).to(torch.int8).contiguous()
        packed = None
        if w.device.type == "cpu" and fbgemm_available():
            with warnings.catch_warnings():  # quantized tensor creation is deprecated; fbgemm's kernel is what pays
                warnings.simplefilter("ignore")
                qw = torch._make_per_channel_quantized_tensor(q, scales.double(), torch.zeros_like(amax, dtype=torch.long), 0)
                packed = torch.ops.quantized.linear_prepack(qw, None)
        return cls(q, scales.to(w.dtype).contiguous(), packed)

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` in the scales' dtype (the reference the matmul must match)."""
        return self.qweight.to(self.scales.dtype) * self.scales[:, None]

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for ``x`` ``[..., K]`` -> ``[..., N]``."""
        lead, K = x.shape[:-1], x.shape[-1]
        if self.packed is not None and x.device.type == "cpu":
            y = _fbgemm_per_token(x.reshape(-1, K).float(), self.packed).view(*lead, -1).to(x.dtype)
        elif x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            y = torch._weight_int8pack_mm(x.reshape(-1, K).contiguous(), self.qweight, self.scales.to(x.dtype))
            y = y.view(*lead, -1)
        else:
            y = F.linear(x, self.dequantize().to(x.dtype))
        return y if bias is None else y + bias


def _fbgemm_per_token(x: torch.Tensor, packed: Any) -> torch.Tensor:
    """fbgemm's dynamic int8 linear with a per-token activation scale, ``x`` ``[M, K]`` fp32.

    ``quantized::linear_dynamic`` picks one uint8 grid for the whole input from its min and max,
    so a row's rounding would depend on the other rows of the call (the batch, the k + 1 tokens
    of a verify): a quantised target's verify would then not reproduce its own AR. Here each
    row is divided by its max |x| (every row then lies in [-1, 1]) and one calibration row
    holding 1 and -1 is appended, so the grid is always that of [-1, 1]: each row is quantised
    the same way whatever shares the call, the int32 accumulation is exact, and the output row
    (multiplied back by its max) is bitwise the same alone or in any batch.
    ``reduce_range=True``: fbgemm's setting on x86 (7-bit activations, no u8 x s8 saturation)."""
    m = x.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)  # [M, 1]
    calib = x.new_zeros(1, x.shape[-1])
    calib[0, 0], calib[0, min(1, x.shape[-1] - 1)] = 1.0, -1.0
    y = torch.ops.quantized.linear_dynamic(torch.cat([x / m, calib]).contiguous(), packed, True)
    return y[:-1] * m


def fbgemm_available() -> bool:
    """Whether this PyTorch has the x86 / fbgemm quantized engine (int8 dynamic linear on CPU)."""
    return bool({"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines))


def linear(x: torch.Tensor, w: torch.Tensor | Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a dense weight (through its oneDNN prepacked copy when ``prepack_``
    made one), the int8 matmul for an ``Int8Weight``. (The model's own forwards go through its
    kernel plan, ``sparsespec.kernels.plan.KernelPlan.apply_linear``.)"""
    if isinstance(w, Int8Weight):
        return w.linear(x, bias)
    packed = getattr(w, PACKED_ATTR, None)
    if packed is not None and x.dtype == w.dtype and x.device.type == "cpu":
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, w, bias)


#: attribute of a dense CPU weight holding its oneDNN (blocked-layout) copy, set by ``prepack_``
PACKED_ATTR = "_sparsespec_packed"
#: attribute of a dense fp32 CPU weight holding its copy packed in panels of 16 columns for our
#: linear kernel (``sparsespec.kernels.plan.pack_weights``)
PANELS_ATTR = "_sparsespec_panels"


def drop_packed_copies(weights) -> None:
    """Remove every packed copy (oneDNN's and our panels) from ``weights``."""
    for w in weights:
        for attr in (PACKED_ATTR, PANELS_ATTR):
            if w is not None and not isinstance(w, Int8Weight) and hasattr(w, attr):
                delattr(w, attr)


@functools.lru_cache(maxsize=None)
def prepack_available() -> bool:
    """True when oneDNN's prepacked linear runs here and matches ``F.linear`` (to fp32 rounding).

    oneDNN's blocked layout is one of the linear backends the kernel plan measures at load
    (``sparsespec.kernels.plan``); ``SPARSESPEC_PREPACK=0`` leaves it out.
    """
    if os.environ.get("SPARSESPEC_PREPACK", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        w, x = torch.randn(8, 4), torch.randn(3, 4)
        with torch.inference_mode():
            y = torch.ops.mkldnn._linear_pointwise(x, w.to_mkldnn(), None, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w), rtol=1e-4, atol=1e-5))
    except Exception:  # pragma: no cover - a build without the op
        return False


def prepack_(weights, enable: bool = True) -> int:
    """Give each dense fp32 / bf16 CPU weight of ``weights`` its oneDNN prepacked copy (read by
    ``linear``), or drop the copies (``enable=False``). Returns the bytes the copies hold (the
    dense weights stay: the embedding gather, int8 quantisation and the byte counts read them).

    The copy is a snapshot: whoever changes a packed weight in place must prepack again.
    """
    total = 0
    for w in weights:
        if isinstance(w, Int8Weight) or w is None:
            continue
        if enable and w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16) and w.dim() == 2 \
                and prepack_available():
            packed = w.detach().contiguous().to_mkldnn()
            setattr(w, PACKED_ATTR, packed)
            total += w.numel() * w.element_size()
        elif hasattr(w, PACKED_ATTR):
            delattr(w, PACKED_ATTR)
    return total


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's linear weights (the norms stay the target's: they are tiny)."""

    wqkv: torch.Tensor | Int8Weight
    bqkv: torch.Tensor | None
    wo: torch.Tensor | Int8Weight
    w_gate_up: torch.Tensor | Int8Weight
    w_down: torch.Tensor | Int8Weight


@dataclass(frozen=True)
class DraftWeights:
    """The linear weights a draft forward reads: every layer's projections and the LM head.

    ``kind`` is a ``DRAFT_WEIGHTS`` value; ``nbytes`` counts the extra copy only (the int8
    tensors and their scales), what the draft adds to memory.
    """

    kind: str
    layers: tuple[LayerWeights, ...]
    lm_head: torch.Tensor | Int8Weight

    @property
    def nbytes(self) -> int:
        ws = [self.lm_head] + [w for lw in self.layers for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
        return sum(w.nbytes for w in ws if isinstance(w, Int8Weight))


def linear_weights(model) -> list[torch.Tensor | Int8Weight]:
    """Every linear weight a full forward reads: each layer's four projections and the LM head
    (for a tied head, the embedding matrix or its int8 copy)."""
    return [model.lm_head] + [w for layer in model.layers
                              for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]


def nbytes(w: torch.Tensor | Int8Weight) -> int:
    """Bytes stored for a dense or int8 weight (scales included)."""
    return w.nbytes if isinstance(w, Int8Weight) else w.numel() * w.element_size()


def numel(w: torch.Tensor | Int8Weight) -> int:
    """Multiply-accumulates per token of a dense or int8 weight ``[N, K]``: N x K."""
    return (w.qweight if isinstance(w, Int8Weight) else w).numel()


def quantize_target_(model, kind: str) -> None:
    """Quantise ``model``'s own linear weights in place (a quantised *target*): every forward,
    draft and verify alike, then reads the int8 weights, so the model's greedy output is the
    quantised model's, and ``ar`` on it is the reference its speculation is lossless against.
    The embedding (a gather) and the norms stay in the model's dtype; a tied LM head gets its
    own int8 copy of the embedding matrix. ``kind="none"`` leaves the model as it is.

    Raises:
        ValueError: an unknown kind, or a model quantised already with another kind.
    """
    if kind not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {kind!r}")
    current = getattr(model, "quantize", "none")
    if kind == current:
        return
    if current != "none":
        raise ValueError(f"model is quantised already ({current}); cannot re-quantise it to {kind}")
    if kind == "none":
        return

    drop_packed_copies(linear_weights(model))  # the int8 weights replace them (and their copies)

    def swap(module, name: str) -> None:
        w = Int8Weight.quantize(getattr(module, name))
        if name in module._parameters:  # a Parameter slot cannot hold an Int8Weight
            del module._parameters[name]
        object.__setattr__(module, name, w)

    for layer in model.layers:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            swap(layer, name)
    model.__dict__["lm_head"] = Int8Weight.quantize(model.lm_head)
    model._parameters.pop("lm_head", None)
    model.__dict__.pop("_draft_weights", None)
    model.quantize = kind


def quantize_int8(model) -> DraftWeights:
    """An int8 copy of ``model``'s linear weights (``sparsespec.model.Transformer``), made once."""
    layers = tuple(
        LayerWeights(Int8Weight.quantize(layer.wqkv), layer.bqkv, Int8Weight.quantize(layer.wo),
                     Int8Weight.quantize(layer.w_gate_up), Int8Weight.quantize(layer.w_down))
        for layer in model.layers)
    return DraftWeights("int8", layers, Int8Weight.quantize(model.lm_head))
