"""Llama-family decoder (Llama 2/3.x with llama3 RoPE scaling, Mistral, Qwen2/2.5) for decoding.

Weights are loaded from a Hugging Face safetensors folder. The forward has three paths that
share the same layers:

* ``dense``: T new tokens attend causally to the whole dense cache (prefill chunks, AR decode and
  verification). Optionally returns, for the last ``rows`` query positions, the attention
  probabilities every key received, summed over the query heads of its KV group
  (``[L, B, H_kv, rows, S]``), which SparseSpec-L recycles as importance.
* ``draft``: one new token attends only to the sparse index of the dense cache plus the draft's
  own earlier tokens of this step (``DraftKV``): on the PyTorch path through a compact buffer the
  drafter gathered the index into; on the Triton path the kernel gathers the indexed positions
  itself (``DraftKV.index``), so the draft never copies KV.

GQA is computed by grouping query heads under their KV head (``[B, H_kv, G*T, D] @ [B, H_kv, D, S]``),
so repeated KV heads are never materialised.

Attention backends (``sparsespec.kernels``): on CUDA with triton importable, decode/verify
attention (T <= 32 new tokens, with the importance rows) and draft attention run Triton kernels;
on the CPU our kernels (``sparsespec.kernels.cpu``) where the kernel plan chose them, else the
PyTorch code below. Prefill chunks (T > 32) run our flash kernel where the plan measured it faster
(``KernelPlan.prefill_attention``), else SDPA (on CPU with equal starts, as two
unmasked flash calls merged by log-sum-exp: ``chunk_attention_cpu``; on the Triton path their
importance rows come from the verify kernel run on the last W queries).
``SPARSESPEC_ATTENTION=torch|triton`` overrides the choice.

Not done (yet): CUDA graphs / ``torch.compile`` of the step functions. The step functions take
host-side ragged lengths (Python ints that change every step and set slice bounds, mask shapes
and kernel grids: ``S = max(lengths) + T``, the index width N, the draft tail slot) and mutate
Python state (``cache.lengths``, ``DraftKV.length``), so a safe capture first needs device-side
lengths and fixed-size launches (grid over the capacity with early exit, N padded to the drafter's
``n_max`` with ``n_valid`` masking, which the draft kernel already supports). Expect eager
execution at batch 1 on a large GPU to be CPU-bound (about 40 small launches per layer), so steps
of an 8B model sit well above their memory roofline until that is done.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from sparsespec import kernels
from sparsespec.config import ModelConfig
from sparsespec.kernels import cpu
from sparsespec.kernels.plan import KernelPlan, apply_tiles, choose, ours_plan, pack_weights, torch_plan
from sparsespec.kernels.reference import _FLASH_CPU, chunk_attention_cpu
from sparsespec.kv.cache import KVCache
from sparsespec.kv.index import RowsTarget
from sparsespec.quant import DRAFT_WEIGHTS, DraftWeights, linear_weights, prepack_, quantize_int8, quantize_target_


def prefill_chunks(length: int, chunk_size: int, min_last: int = 0) -> list[tuple[int, int]]:
    """``[start, end)`` chunks covering ``length`` tokens, each at most ``chunk_size`` long, the
    last one at least ``min(min_last, length)`` long (so its queries include the prompt's last
    ``min_last`` positions, whose attention rows the drafters recycle)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    min_last = min(max(0, min_last), length)
    bounds = [(s, min(s + chunk_size, length)) for s in range(0, length, chunk_size)]
    s, e = bounds[-1]
    if e - s < min_last:  # move the boundary back: the previous chunk gives up its tail
        cut = length - min_last
        if min_last > chunk_size:
            raise ValueError(f"min_last={min_last} exceeds chunk_size={chunk_size}")
        bounds = [(a, min(b, cut)) for a, b in bounds[:-1] if a < cut] + [(cut, length)]
    return bounds


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies ``[D/2]`` float32, with Llama-3.x scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling
    if sc and sc.get("rope_type", sc.get("type")) == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_medium, smoothed, scaled)
    return inv.float()


@dataclass
class DraftKV:
    """KV of one draft phase, in one of two layouts.

    Compact (``index`` is None): ``k``, ``v`` ``[L, B, H_kv, N_max + K_max, D]``; slots
    ``[0, n_index)`` hold the gathered sparse index (row ``b`` uses its first ``n_valid[b]`` of
    them; None = all rows use all ``n_index``); the draft tokens of the current step append after
    it. ``length`` counts filled slots.

    Gather-in-kernel (``index`` set: Triton, and our CPU kernels): ``index`` ``[L, B, H_kv, N]`` int
    positions into ``source`` (the dense cache read in place, or a ``CompactDraftKV`` whose slots
    ``0 .. N_b - 1`` hold row ``b``'s indexed rows; anything with ``k``, ``v`` ``[L, B, H_kv, *, D]``;
    row ``b`` uses its first ``n_valid[b]``);
    ``k``, ``v`` ``[L, B, H_kv, K_max + 1, D]`` hold only the draft tokens (logical slot
    ``s >= n_index`` lives at ``s - n_index``). ``length`` counts logical slots as above.
    """

    k: torch.Tensor
    v: torch.Tensor
    length: int
    n_index: int = 0
    n_valid: torch.Tensor | None = None  # [B] int64
    index: torch.Tensor | None = None  # [L, B, H_kv, N] int32, positions into source.k / source.v
    source: KVCache | None = None  # or a CompactDraftKV (sparsespec.drafters.sparse_self)


class Transformer(torch.nn.Module):
    """Llama-family causal LM; see the module docstring."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        H, Hkv, D, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        kw = dict(dtype=dtype, device=self.device)
        self.embed = torch.nn.Parameter(torch.empty(cfg.vocab_size, E, **kw), requires_grad=False)
        self.lm_head = self.embed if cfg.tie_word_embeddings else torch.nn.Parameter(
            torch.empty(cfg.vocab_size, E, **kw), requires_grad=False
        )
        self.norm = torch.nn.Parameter(torch.empty(E, **kw), requires_grad=False)
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg.num_layers):
            layer = torch.nn.Module()
            layer.ln_attn = torch.nn.Parameter(torch.empty(E, **kw), requires_grad=False)
            layer.ln_mlp = torch.nn.Parameter(torch.empty(E, **kw), requires_grad=False)
            layer.wqkv = torch.nn.Parameter(torch.empty((H + 2 * Hkv) * D, E, **kw), requires_grad=False)
            layer.bqkv = (
                torch.nn.Parameter(torch.empty((H + 2 * Hkv) * D, **kw), requires_grad=False)
                if cfg.attention_bias else None
            )
            layer.wo = torch.nn.Parameter(torch.empty(E, H * D, **kw), requires_grad=False)
            layer.w_gate_up = torch.nn.Parameter(torch.empty(2 * cfg.intermediate_size, E, **kw), requires_grad=False)
            layer.w_down = torch.nn.Parameter(torch.empty(E, cfg.intermediate_size, **kw), requires_grad=False)
            self.layers.append(layer)
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(self.device), persistent=False)
        self.scale = 1.0 / math.sqrt(D)
        self.source_folder: Path | None = None  # the HF folder the weights came from
        self.quantize = "none"  # a sparsespec.quant.QUANTIZE value: what the target's own linear weights are
        self.prepacked_bytes = 0  # bytes of the oneDNN copies of the linear weights (``prepack_``)
        # which kernel runs each op (sparsespec.kernels.plan); ``use_kernels`` measures the best
        # one on this machine, which ``from_folder`` does at load
        self.kernel_plan: KernelPlan = choose(self, tune=False)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_folder(cls, folder: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> Transformer:
        """Load config and safetensors weights from a Hugging Face folder.

        Raises:
            ValueError: missing or mis-shaped tensors, naming the tensor.
        """
        folder = Path(folder)
        cfg = ModelConfig.from_folder(folder)
        model = cls(cfg, dtype=dtype, device=device)
        model.source_folder = folder
        tensors: dict[str, torch.Tensor] = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder}: no *.safetensors files")
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    tensors[name] = sf.get_tensor(name)

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"{folder}: tensor {name!r} missing from the checkpoint")
            return tensors.pop(name)

        def put(param: torch.nn.Parameter, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(f"{folder}: {name} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
            param.data.copy_(value.to(dtype))

        put(model.embed, take("model.embed_tokens.weight"), "embed_tokens")
        put(model.norm, take("model.norm.weight"), "model.norm")
        if not cfg.tie_word_embeddings:
            put(model.lm_head, take("lm_head.weight"), "lm_head")
        else:
            tensors.pop("lm_head.weight", None)
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            put(layer.ln_attn, take(p + "input_layernorm.weight"), p + "input_layernorm")
            put(layer.ln_mlp, take(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm")
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            put(layer.wqkv, qkv, p + "qkv")
            if cfg.attention_bias:
                put(layer.bqkv, torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]), p + "qkv bias")
            put(layer.wo, take(p + "self_attn.o_proj.weight"), p + "o_proj")
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0)
            put(layer.w_gate_up, gate_up, p + "gate_up")
            put(layer.w_down, take(p + "mlp.down_proj.weight"), p + "down_proj")
        return model.use_kernels("auto")

    # ------------------------------------------------------------------ pieces
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.kernel_plan.fused and cpu.supports(x):
            return cpu.rms_norm(x, w, self.cfg.rms_norm_eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return w * xf.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, 1, T, D]`` for int positions ``[B, T]`` (broadcast over heads)."""
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, layer, h: torch.Tensor, cos, sin):
        """Project and rotate: q ``[B, H, T, D]``, k, v ``[B, H_kv, T, D]``. ``layer``: the
        module or a ``sparsespec.quant.LayerWeights`` (anything with the linear weights)."""
        cfg = self.cfg
        B, T, _ = h.shape
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self._linear(h, layer.wqkv, layer.bqkv)  # [B, T, (H + 2 H_kv) D]
        if self.kernel_plan.fused and cpu.supports(qkv):  # split + RoPE in one pass
            return cpu.rope_split(qkv, cos.view(B, T, D), sin.view(B, T, D), H, Hkv, D)
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)
        k = k.view(B, T, Hkv, D).transpose(1, 2)
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        return self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin), v

    def _mlp(self, layer, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The gated MLP of ``h``; with ``residual``, added into it in place (and returned)."""
        gu = self._linear(h, layer.w_gate_up)  # [B, T, 2 I]
        if self.kernel_plan.fused and cpu.supports(gu):
            act = cpu.silu_mul(gu)
        else:
            gate, up = gu.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self._linear(act, layer.w_down, residual=residual)

    def _linear(self, x: torch.Tensor, w, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T (+ bias)`` through the kernel plan (``KernelPlan.apply_linear``); with
        ``residual``, ``residual += that`` in place (returned)."""
        return self.kernel_plan.apply_linear(x, w, bias, residual)

    def _grouped_attention(self, q, k, v, mask: torch.Tensor | None, want_rows: int):
        """Attention with query heads grouped by KV head.

        q ``[B, H, T, D]``; k, v ``[B, H_kv, S, D]``; ``mask`` ``[B, T, S]`` bool (True = visible)
        or None (every key visible). Returns out ``[B, H, T, D]`` and, if ``want_rows``, rows
        ``[B, H_kv, want_rows, S]`` float32: the attention probabilities of the last
        ``want_rows`` queries summed over the query heads of each KV group.
        """
        return kernels.grouped_attention(q, k, v, mask, want_rows, self.scale)

    # ------------------------------------------------------------------ forwards
    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, attend, logits_for: str,
             weights: DraftWeights | None = None, hidden_layers: tuple[int, ...] = (),
             features: list[torch.Tensor] | None = None):
        """Shared layer loop; ``attend(i, q, k, v)`` returns ``[B, H, T, D]``. ``weights``: the
        linear weights to read instead of the model's own (a quantised draft copy); the
        embedding and the norms are always the model's. ``hidden_layers``: layer ids whose
        output hidden states ``[B, T, E]`` are appended to ``features`` (in that order)."""
        B, T = input_ids.shape
        h = F.embedding(input_ids, self.embed)  # [B, T, E]
        cos, sin = self._rope(positions)  # [B, 1, T, D]
        for i, layer in enumerate(self.layers):
            lw = layer if weights is None else weights.layers[i]
            x = self._rms(h, layer.ln_attn)
            q, k, v = self._qkv(lw, x, cos, sin)
            a = attend(i, q, k, v)  # [B, H, T, D] or, from our kernels, already [B, T, H D]
            if a.dim() == 4:
                a = a.transpose(1, 2).reshape(B, T, -1)
            h = self._linear(a, lw.wo, residual=h)  # h += attention output @ wo.T, in place
            h = self._mlp(lw, self._rms(h, layer.ln_mlp), residual=h)
            if i in hidden_layers:
                features.append(h.clone())  # h is updated in place by the next layers
        if hidden_layers:  # reorder to the requested order
            order = sorted(set(hidden_layers))
            features[:] = [features[order.index(j)] for j in hidden_layers]
        return self._head(h, logits_for, weights)

    def _fused_layers(self, rows: int, weights: DraftWeights | None):
        """The per-layer pointers of ``cpu.forward_layers`` when a forward of ``rows`` tokens can run
        every layer in one call of our kernels (our attention and linear for that width, panels for
        every projection, no int8 weights; hidden-state features are copied out by the same call),
        else None."""
        plan = self.kernel_plan
        if (weights is not None or not plan.fused or plan.linear_backend(rows) != "ss"
                or self.attention_backend() != "ss" or self.quantize != "none"):
            return None
        ptrs = self.__dict__.get("_layer_ptrs")
        if ptrs is None:
            try:
                ptrs = cpu.LayerPointers(self)
            except ValueError:  # a projection without panels (weights changed without prepack_)
                return None
            self.__dict__["_layer_ptrs"] = ptrs
        return ptrs

    def _head(self, h: torch.Tensor, logits_for: str, weights: DraftWeights | None = None) -> torch.Tensor:
        """Final norm and LM head of the last layer's output ``h`` ``[B, T, E]``: logits float32."""
        if logits_for == "last":
            h = h[:, -1:]
        h = self._rms(h, self.norm)
        return self._linear(h, self.lm_head if weights is None else weights.lm_head).float()  # [B, T or 1, V]

    def _embed_rope(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Embeddings ``[B, T, E]`` (a new tensor: the layers update it in place) and cos, sin
        ``[B*T, D]`` contiguous for the fused layers."""
        B, T = input_ids.shape
        cos, sin = self._rope(positions)  # [B, 1, T, D]
        D = self.cfg.head_dim
        return F.embedding(input_ids, self.embed), cos.reshape(B * T, D), sin.reshape(B * T, D)

    def check_hidden_layers(self, hidden_layers) -> tuple[int, ...]:
        """``hidden_layers`` as a tuple of layer ids in ``[0, L)`` (``ValueError`` otherwise; a
        layer may repeat: a shallow model's low and middle feature layers can coincide)."""
        ids = tuple(int(i) for i in hidden_layers)
        L = self.cfg.num_layers
        if any(not 0 <= i < L for i in ids):
            raise ValueError(f"hidden layer ids must be in [0, {L}), got {list(hidden_layers)}")
        return ids

    def quantize_(self, kind: str) -> Transformer:
        """Quantise this model's linear weights in place (``sparsespec.quant.quantize_target_``):
        a new target, not a draft. Returns self."""
        quantize_target_(self, kind)
        if kind != "none":
            self.prepacked_bytes = 0  # the int8 weights replaced the dense ones and their copies
            self.__dict__.pop("_layer_ptrs", None)
        return self

    def prepack_(self, enable: bool | None = None) -> Transformer:
        """Give the dense CPU linear weights the packed copies the kernel plan reads
        (``sparsespec.kernels.plan.pack_weights``: our panels for ``"ss"``, oneDNN's for
        ``"onednn"``; the dense weights stay) and drop the others; ``enable`` True/False forces
        oneDNN copies on/off (``sparsespec.quant.prepack_``). No-op elsewhere and for int8 weights.
        Call it again after changing a weight in place. Returns self."""
        self.__dict__.pop("_layer_ptrs", None)  # the fused layers' pointers into the old copies
        if enable is None:
            self.prepacked_bytes = pack_weights(linear_weights(self), self.kernel_plan)
        else:
            self.prepacked_bytes = prepack_(linear_weights(self), enable)
        return self

    def use_kernels(self, plan: KernelPlan | str = "auto") -> Transformer:
        """Choose which kernel runs each op (``sparsespec.kernels.plan``).

        ``plan``: ``"auto"`` (the environment's override, else this machine's measured choice,
        measured now if not cached: a few seconds), ``"ss"`` (our CPU kernels wherever they run),
        ``"torch"`` (PyTorch's ops: the eager reference) or a ``KernelPlan``. Keeps the oneDNN
        copies the plan needs (and only those). Returns self.

        Raises:
            ValueError: an unknown name, or our kernels asked for where they cannot run.
        """
        if isinstance(plan, KernelPlan):
            self.kernel_plan = plan
        elif plan == "auto":
            self.kernel_plan = choose(self, tune=True)  # (choose applies the plan's tiles itself)
        elif plan == "torch":
            self.kernel_plan = torch_plan("requested", "user", self.device)
        elif plan == "ss":
            from sparsespec.kernels.plan import _eligible

            why = _eligible(self)
            if why is not None:
                raise ValueError(f"our CPU kernels cannot run this model: {why}")
            self.kernel_plan = ours_plan("user", "requested")
        else:
            raise ValueError(f"kernels must be 'auto', 'ss', 'torch' or a KernelPlan, got {plan!r}")
        if plan != "auto":
            self.kernel_plan = apply_tiles(self.kernel_plan)  # our kernels' AVX-512 or AVX2 tiles
        return self.prepack_()

    def attention_backend(self) -> str:
        """``"triton"``, ``"ss"`` (our CPU kernel) or ``"torch"``: ``SPARSESPEC_ATTENTION=torch|triton``
        when set (``sparsespec.kernels.backend``), else Triton on CUDA, else the kernel plan's choice
        where our kernel runs (fp32 CPU tensors, head_dim a multiple of 16)."""
        if kernels.use_triton(self.device):
            return "triton"
        if kernels.forced_backend() == "torch":
            return "torch"
        if self.kernel_plan.attention == "ss" and cpu.supports(self.embed) and cpu.attention_supported(self.cfg.head_dim):
            return "ss"
        return "torch"

    @property
    def attention_in_kernel(self) -> bool:
        """True when attention runs in a kernel that reads the dense cache in place (ours on the
        CPU, Triton on CUDA): the sparse drafters then hand it the index instead of a gathered copy."""
        return self.attention_backend() != "torch"

    def draft_weights(self, kind: str) -> DraftWeights | None:
        """The weights a draft forward reads for ``draft_weights=kind`` (``sparsespec.quant``):
        None for ``"target"`` (the model's own), an int8 copy for ``"int8"``, made on first use
        and shared by every drafter of this model.

        Raises:
            ValueError: an unknown kind.
        """
        if kind not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights must be one of {DRAFT_WEIGHTS}, got {kind!r}")
        if kind == "target" or kind == self.quantize:  # an int8 target's draft reads its own int8 weights
            return None
        cache = self.__dict__.setdefault("_draft_weights", {})
        if kind not in cache:
            cache[kind] = quantize_int8(self)
        return cache[kind]

    @torch.inference_mode()
    def forward_dense(self, input_ids: torch.Tensor, cache: KVCache, want_rows: int = 0, logits_for: str = "all"):
        """``forward_dense_features`` without features: returns ``(logits, rows)``."""
        logits, rows, _ = self.forward_dense_features(input_ids, cache, (), want_rows, logits_for)
        return logits, rows

    @torch.inference_mode()
    def forward_dense_features(self, input_ids: torch.Tensor, cache: KVCache, hidden_layers: tuple[int, ...] = (),
                               want_rows: int = 0, logits_for: str = "all", rows_into: RowsTarget | None = None):
        """Append ``input_ids`` ``[B, T]`` at each row's length with full causal attention.

        Rows may have different lengths (ragged batch): row ``b``'s tokens take positions
        ``lengths[b] .. lengths[b] + T - 1`` and see only its own valid keys.
        Returns logits ``[B, T, V]`` (``[B, 1, V]`` with ``logits_for="last"``) float32 and, if
        ``want_rows``, importance rows ``[L, B, H_kv, want_rows, S]`` float32 for the last
        ``want_rows`` queries of each row (S = the longest new row length). Advances every
        row's length by T.

        ``rows_into``: write those rows into an importance window's ring instead
        (``sparsespec.kv.index.RowsTarget``: query w of row b to slot ``slots[b, w]``, columns
        ``[0, S)``; ``want_rows`` is then the slots' width); our CPU attention kernel writes them
        there directly (no buffer, no copy), the other paths copy them. Returns None for the rows.

        Also returns ``features`` ``[B, T, len(hidden_layers) * E]`` (the model's dtype): the output
        hidden states of the layers ``hidden_layers`` at every new position, concatenated in that
        order (what an EAGLE-3 head reads), or None when ``hidden_layers`` is empty.
        """
        B, T = input_ids.shape
        hidden_layers = self.check_hidden_layers(hidden_layers)
        if rows_into is not None:
            want_rows = rows_into.slots.shape[1]
            if tuple(rows_into.slots.shape) != (B, want_rows) or want_rows > T:
                raise ValueError(f"rows_into.slots {tuple(rows_into.slots.shape)} does not fit a [{B}, <= {T}] step")
        feats: list[torch.Tensor] = []
        starts = list(cache.lengths)
        cache.reserve(T)
        S = max(starts) + T
        dev = self.device
        uniform = min(starts) == max(starts)
        start_t = torch.tensor(starts, device=dev)[:, None]  # [B, 1]
        positions = start_t + torch.arange(T, device=dev)  # [B, T]
        key_pos = torch.arange(S, device=dev)
        backend = self.attention_backend()
        fused = backend == "triton"  # Triton decode/verify attention (reads the cache in place)
        ours = backend == "ss"  # our CPU attention kernel (reads the cache in place)
        # Causal + ragged visibility. Every key before min(starts) is visible to every query, so
        # the torch path masks only the tail columns from there (``[B, T, S - m0]``, a few columns
        # for a decode/verify step), never a dense [B, T, S] mask; the kernels mask themselves.
        m0 = min(starts)
        mask = None
        if (T > 1 or not uniform) and (T > 32 or not (fused or ours)):
            mask = key_pos[None, None, m0:] <= positions[:, :, None]  # [B, T, S - m0]
        rows_mask = mask[:, T - want_rows :] if (mask is not None and want_rows) else None
        batch_idx = torch.arange(B, device=dev)[:, None].expand(B, T)  # [B, T]
        # each layer's importance rows are written in place: into the caller's ring (our kernel),
        # else into one buffer (no stack copy afterwards)
        direct = rows_into is not None and ours
        rows_buf = torch.empty(self.cfg.num_layers, B, self.cfg.num_kv_heads, want_rows, S,
                               dtype=torch.float32, device=dev) if want_rows and not direct else None  # [L, B, H_kv, W, S]
        if fused:
            starts_i32 = torch.tensor(starts, dtype=torch.int32, device=dev)  # [B]
        if ours:
            starts_i64 = torch.tensor(starts, dtype=torch.int64)  # [B]

        def rows_arg(i):  # where our kernel writes layer i's importance rows
            if not want_rows:
                return {}
            if direct:
                return {"rows_out": rows_into.ring[i], "slots": rows_into.slots}
            return {"rows_out": rows_buf[i]}

        def attend(i, q, k, v):
            if uniform:
                s0 = starts[0]
                cache.k[i, :, :, s0 : s0 + T] = k
                cache.v[i, :, :, s0 : s0 + T] = v
            else:  # scatter each row's new KV at its own offset
                cache.k[i][batch_idx, :, positions] = k.transpose(1, 2)
                cache.v[i][batch_idx, :, positions] = v.transpose(1, 2)
            keys, vals = cache.k[i, :, :, :S], cache.v[i, :, :, :S]  # [B, H_kv, S, D]
            if T > 32:  # prefill chunk: flash attention, then (cheap) rows for the last queries only
                if ours and self.kernel_plan.prefill_attention == "ss" and cpu.prefill_attention_supported(q.shape[-1]):
                    out = cpu.prefill_attention(q, cache.k[i], cache.v[i], starts_i64, self.scale)  # [B, T, H D]
                elif uniform and _FLASH_CPU is not None and q.device.type == "cpu":
                    out = chunk_attention_cpu(q, keys, vals, m0, self.scale)
                else:
                    dense = torch.ones(B, T, S, dtype=torch.bool, device=dev)
                    dense[:, :, m0:] = mask
                    out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=dense[:, None], enable_gqa=True,
                                                         scale=self.scale)
                if want_rows and fused:  # the last W queries as a W-token "verify" over the same keys
                    kernels.verify_attention(q[:, :, T - want_rows :], cache.k[i], cache.v[i],
                                             starts_i32 + (T - want_rows), want_rows, self.scale,
                                             max(starts) + T - want_rows, use=True, rows_out=rows_buf[i])
                elif want_rows and ours:
                    cpu.attention(q[:, :, T - want_rows :], cache.k[i], cache.v[i], starts_i64 + (T - want_rows),
                                  max(starts) + T - want_rows, self.scale, **rows_arg(i))
                elif want_rows:
                    kernels.grouped_attention(q[:, :, T - want_rows :], keys, vals, rows_mask, want_rows, self.scale,
                                              mask_from=m0, rows_out=rows_buf[i])
                return out
            if fused:
                out, _ = kernels.verify_attention(q, cache.k[i], cache.v[i], starts_i32, want_rows, self.scale,
                                                  max(starts), use=True,
                                                  rows_out=rows_buf[i] if want_rows else None)
                return out
            if ours:  # [B, T, H D]
                return cpu.attention(q, cache.k[i], cache.v[i], starts_i64, max(starts), self.scale, **rows_arg(i))
            out, _ = kernels.grouped_attention(q, keys, vals, mask, want_rows, self.scale, mask_from=m0,
                                               rows_out=rows_buf[i] if want_rows else None)
            return out

        ptrs = self._fused_layers(B * T, None) if (ours and T <= 32) else None
        if ptrs is not None:  # every layer in one call of our kernels (the same kernels, the same bits)
            h, cos, sin = self._embed_rope(input_ids, positions)
            rows_arg = None
            if want_rows:
                rows_arg = (rows_into.ring, rows_into.slots) if direct else (rows_buf, None)
            if hidden_layers:  # [B, T, n E], filled by the same call
                feats = [torch.empty(B, T, len(hidden_layers) * self.cfg.hidden_size, dtype=h.dtype)]
            cpu.forward_layers(self, ptrs, h, cos, sin, k=cache.k, v=cache.v, starts=starts, rows=rows_arg,
                               features=(feats[0], hidden_layers) if hidden_layers else None)
            logits = self._head(h, logits_for)
        else:
            logits = self._run(input_ids, positions, attend, logits_for, hidden_layers=hidden_layers, features=feats)
        cache.lengths = [s + T for s in starts]
        if rows_into is not None:
            if rows_buf is not None:  # the other attention paths: copy into the ring's slots
                for b in range(B):
                    rows_into.ring[:, b, :, rows_into.slots[b], :S] = rows_buf[:, b]
            rows_buf = None
        features = (feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1)) if hidden_layers else None  # [B, T, n E]
        return logits, rows_buf, features

    def prefill(self, input_ids: torch.Tensor, cache: KVCache, chunk_size: int = 512, want_rows: int = 0):
        """``prefill_features`` without features: returns ``(logits, rows)``."""
        logits, rows, _ = self.prefill_features(input_ids, cache, chunk_size, want_rows)
        return logits, rows

    def prefill_features(self, input_ids: torch.Tensor, cache: KVCache, chunk_size: int = 512, want_rows: int = 0,
                         hidden_layers: tuple[int, ...] = ()):
        """Chunked prefill of ``input_ids`` ``[B, P]``: attention memory is O(chunk * P).

        Returns last-position logits ``[B, V]`` and rows ``[L, B, H_kv, min(want_rows, P), S]`` of
        the last ``want_rows`` prompt queries, whatever the chunk boundaries (the last chunk is
        made at least that long, see ``prefill_chunks``), and the features ``[B, P, n * E]`` of
        ``hidden_layers`` at every prompt position (None when empty; ``forward_dense_features``).
        """
        P = input_ids.shape[1]
        if P == 0:
            raise ValueError("prefill needs at least one token")
        want = min(want_rows, P)
        bounds = prefill_chunks(P, chunk_size, want)
        logits = rows = None
        feats = []
        for i, (s, e) in enumerate(bounds):
            last = i == len(bounds) - 1
            logits, rows, f = self.forward_dense_features(input_ids[:, s:e], cache, hidden_layers,
                                                          want_rows=want if last else 0, logits_for="last")
            feats.append(f)
        return logits[:, -1], rows, (torch.cat(feats, dim=1) if hidden_layers else None)

    @torch.inference_mode()
    def forward_draft(self, input_ids: torch.Tensor, positions: torch.Tensor, dkv: DraftKV,
                      weights: DraftWeights | None = None) -> torch.Tensor:
        """One draft token per row, ``input_ids`` ``[B, 1]`` at ``positions`` ``[B]``, over the compact KV.

        Appends its KV to ``dkv`` and returns logits ``[B, V]`` float32. Padded index slots of rows
        with a smaller index (``dkv.n_valid``) are masked out. ``weights``: read these linear
        weights instead of the model's (``draft_weights``); the draft's own KV then comes from
        them too (it lives only in ``dkv`` and is discarded after the step).
        """
        slot = dkv.length
        B = input_ids.shape[0]
        if dkv.index is not None:  # gather-in-kernel layout: index into the dense cache + draft tail
            src, e = dkv.source, slot - dkv.n_index
            backend = self.attention_backend()
            use, ours = backend == "triton", backend == "ss"
            n_valid = dkv.n_valid
            if ours and n_valid is None:
                n_valid = torch.full((B,), dkv.index.shape[-1], dtype=torch.int64)

            def attend_indexed(i, q, k, v):
                dkv.k[i, :, :, e] = k[:, :, 0]
                dkv.v[i, :, :, e] = v[:, :, 0]
                if ours:  # [B, 1, H D]
                    return cpu.sparse_attention(q, src.k[i], src.v[i], dkv.index[i], n_valid, dkv.k[i, :, :, : e + 1],
                                                dkv.v[i, :, :, : e + 1], self.scale)
                return kernels.sparse_attention(q, src.k[i], src.v[i], dkv.index[i], dkv.n_valid,
                                                dkv.k[i, :, :, : e + 1], dkv.v[i, :, :, : e + 1], self.scale, use=use)

            ptrs = self._fused_layers(B, weights) if ours else None
            if ptrs is not None:  # every layer in one call: k, v of the new token to tail slot e
                h, cos, sin = self._embed_rope(input_ids, positions.view(B, 1))
                cpu.forward_layers(self, ptrs, h, cos, sin, k=src.k, v=src.v,
                                   draft=(dkv.index, n_valid, e, dkv.k, dkv.v))
                logits = self._head(h, "all")
            else:
                logits = self._run(input_ids, positions.view(B, 1), attend_indexed, "all", weights)
            dkv.length = slot + 1
            return logits[:, -1]
        mask = None
        if dkv.n_valid is not None:
            j = torch.arange(slot + 1, device=self.device)
            mask = ((j[None, :] < dkv.n_valid[:, None]) | (j[None, :] >= dkv.n_index))[:, None, :]  # [B, 1, S']

        def attend(i, q, k, v):
            dkv.k[i, :, :, slot] = k[:, :, 0]
            dkv.v[i, :, :, slot] = v[:, :, 0]
            out, _ = self._grouped_attention(q, dkv.k[i, :, :, : slot + 1], dkv.v[i, :, :, : slot + 1], mask, 0)
            return out

        logits = self._run(input_ids, positions.view(B, 1), attend, "all", weights)
        dkv.length = slot + 1
        return logits[:, -1]
