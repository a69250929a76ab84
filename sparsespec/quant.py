"""Weight-only int8 copies of a model's linear layers, for the draft forward of self-speculation.

A quantised *draft* changes only the proposal ``q``: the draft tokens are sampled from the
quantised forward's own processed distribution and verified against the full-precision target,
so greedy output stays token-identical to AR and sampling stays exact (``sparsespec.rejection``).
What it buys is bytes: at batch 1 on a small model the weights are most of what a draft step
reads, and int8 halves (bf16) or quarters (fp32) them; the sparse index cuts the KV reads as before.

Scheme: symmetric per-output-channel int8, ``W ~ s[:, None] * Q`` with ``Q = round(W / s)`` in
[-127, 127] and ``s = max|W[n, :]| / 127`` (a zero row gets ``s = 1``). The matmul, on CPU where
PyTorch has the x86/fbgemm quantized engine: fbgemm's dynamic int8 linear (the activations are
quantised per call to uint8 with ``reduce_range``, int32 accumulation, fp32 out), measured here
7-10x faster than the fp32 GEMV at SmolLM2's LM head (``benchmarks/RESULTS.md``); without that
engine ``torch._weight_int8pack_mm`` (int8 weights, fp32 activations: slower than fp32 on this
CPU); elsewhere the weight is dequantised per call (correct, not faster). Only the draft reads
these, so their rounding changes q, never the output.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

#: ``draft_weights`` values (``SpecConfig``): the target's own weights, or an int8 copy.
DRAFT_WEIGHTS = ("target", "int8")


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
            y = torch.ops.quantized.linear_dynamic(x.reshape(-1, K).float().contiguous(), self.packed, True)
            y = y.view(*lead, -1).to(x.dtype)  # reduce_range=True: fbgemm's setting on x86 (no u8 x s8 saturation)
        elif x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            y = torch._weight_int8pack_mm(x.reshape(-1, K).contiguous(), self.qweight, self.scales.to(x.dtype))
            y = y.view(*lead, -1)
        else:
            y = F.linear(x, self.dequantize().to(x.dtype))
        return y if bias is None else y + bias


def fbgemm_available() -> bool:
    """Whether this PyTorch has the x86 / fbgemm quantized engine (int8 dynamic linear on CPU)."""
    return bool({"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines))


def linear(x: torch.Tensor, w: torch.Tensor | Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a dense weight, the int8 matmul for an ``Int8Weight``."""
    if isinstance(w, Int8Weight):
        return w.linear(x, bias)
    return F.linear(x, w, bias)


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


def quantize_int8(model) -> DraftWeights:
    """An int8 copy of ``model``'s linear weights (``sparsespec.model.Transformer``), made once."""
    layers = tuple(
        LayerWeights(Int8Weight.quantize(layer.wqkv), layer.bqkv, Int8Weight.quantize(layer.wo),
                     Int8Weight.quantize(layer.w_gate_up), Int8Weight.quantize(layer.w_down))
        for layer in model.layers)
    return DraftWeights("int8", layers, Int8Weight.quantize(model.lm_head))
