"""The EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"): its config, weights, forward, and the checkpoint format.

Architecture (as published for Llama-3.1-8B-Instruct and read by vLLM / SGLang):

* ``fc``: ``[E_d, 3 E_t]``, fuses the target's low / middle / high hidden states (the outputs of
  the layers ``aux_layers``, default ``(1, L/2 - 1, L - 4)``) into one ``E_d``-dim feature;
* one decoder layer (``midlayer``) whose attention reads ``[rms(embed(x)), rms(hidden)]``
  (``2 E_d`` wide: q/k/v are ``[*, 2 E_d]``), with the residual taken from ``hidden`` (before
  ``hidden_norm``, or after it when ``norm_before_residual``), then the usual MLP block;
* ``norm`` + ``lm_head`` ``[V_d, E_d]`` over a reduced draft vocabulary; draft id ``d`` is target
  id ``d + d2t[d]``; ``t2d`` ``[V]`` bool marks the target ids that are in the draft vocabulary;
* the token embedding is the target's (a checkpoint may carry its own ``embed_tokens.weight``).

Sequence convention: the head's position ``t`` holds the pair (feature of the target at ``t``,
token ``x_{t+1}``) and predicts ``x_{t+2}``. Drafting then feeds back the layer's own output
hidden state (before ``norm``) with the token it just drafted.

Checkpoint format (what ``save`` writes and ``load`` reads): a folder with ``config.json`` (a
Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``,
``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``) and
``model.safetensors`` (or ``pytorch_model.bin``) with ``fc.weight``, ``midlayer.*`` (also read as
``layers.0.*`` / ``model.layers.0.*``, the SpecForge layout), ``norm.weight``, ``lm_head.weight``,
``d2t`` and ``t2d``.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sparsespec.config import ModelConfig
from sparsespec.kv.cache import KVCache

#: ``config.json`` ``architectures`` entries accepted as EAGLE-3 heads
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle")
WEIGHTS_FILE = "model.safetensors"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high feature layers for a target of ``num_layers`` layers (the
    outputs of layers 1, L/2 - 1 and L - 4, 0-based; as the official code and SpecForge pick)."""
    if num_layers < 5:
        return (0, max(0, num_layers // 2 - 1), num_layers - 1)
    return (1, num_layers // 2 - 1, num_layers - 4)


@dataclass(frozen=True)
class Eagle3Config:
    """Shapes of an EAGLE-3 head (``E_d`` = ``hidden_size``, ``E_t`` = ``target_hidden_size``)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # V, the target's
    draft_vocab_size: int  # V_d
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 131072
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                     "draft_vocab_size", "target_hidden_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"EAGLE-3 config: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"EAGLE-3 config: draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("EAGLE-3 config: num_attention_heads must be a multiple of num_key_value_heads")
        if len(self.aux_layers) != 3:
            raise ValueError(f"EAGLE-3 config: need three feature layers, got {list(self.aux_layers)}")

    def layer_config(self) -> ModelConfig:
        """The one decoder layer as a ``ModelConfig`` (RoPE and the KV cache read it)."""
        return ModelConfig(model_type="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
                           rope_theta=self.rope_theta, rope_scaling=self.rope_scaling)

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int, aux_layers=None) -> Eagle3Config:
        """A head shaped like one layer of ``target`` (how EAGLE-3 heads are made)."""
        return cls(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                   num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                   vocab_size=target.vocab_size, draft_vocab_size=int(draft_vocab_size),
                   target_hidden_size=target.hidden_size,
                   aux_layers=tuple(aux_layers or default_aux_layers(target.num_layers)),
                   rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
                   max_position_embeddings=target.max_position_embeddings)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], target: ModelConfig | None = None) -> Eagle3Config:
        """From an EAGLE-3 ``config.json``; ``target`` supplies the default feature layers."""
        heads = cfg["num_attention_heads"]
        eagle = cfg.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            if target is None:
                raise ValueError("EAGLE-3 config has no eagle_aux_hidden_state_layer_ids and no target to infer them")
            aux = default_aux_layers(target.num_layers)
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope else None)
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        return cls(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"], num_heads=heads,
                   num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab_size=cfg["vocab_size"],
                   draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
                   target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
                   aux_layers=tuple(int(i) for i in aux), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                   rope_theta=theta, rope_scaling=dict(scaling) if scaling else None,
                   max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
                   norm_before_residual=bool(cfg.get("norm_before_residual", False)))

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of this head (the published EAGLE-3 layout)."""
        out = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "num_hidden_layers": 1, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": False,
            "norm_before_residual": self.norm_before_residual,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers), "use_aux_hidden_state": True},
        }
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Eagle3Head(torch.nn.Module):
    """An EAGLE-3 draft head (see the module docstring). Trainable parameters are
    ``torch.nn.Parameter``s (``sparsespec.train_eagle3`` trains them); the drafter runs it under
    ``torch.inference_mode``.

    Args:
        cfg: its shapes.
        embed: the target's token embedding ``[V, E_d]`` (shared, never trained), or None to own one.
    """

    def __init__(self, cfg: Eagle3Config, embed: torch.Tensor | None = None, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.cfg = cfg
        E, Et, H, Hkv, D, I = (cfg.hidden_size, cfg.target_hidden_size, cfg.num_heads, cfg.num_kv_heads,
                               cfg.head_dim, cfg.intermediate_size)
        kw = dict(dtype=dtype, device=device)
        P = torch.nn.Parameter
        if embed is not None and tuple(embed.shape) != (cfg.vocab_size, E):
            raise ValueError(f"EAGLE-3 head: the target embedding is {tuple(embed.shape)}, expected {(cfg.vocab_size, E)}")
        self.embed = embed if embed is not None else P(torch.zeros(cfg.vocab_size, E, **kw), requires_grad=False)
        self.fc = P(torch.zeros(E, 3 * Et, **kw))
        self.ln_input = P(torch.ones(E, **kw))
        self.hidden_norm = P(torch.ones(E, **kw))
        self.wqkv = P(torch.zeros((H + 2 * Hkv) * D, 2 * E, **kw))
        self.wo = P(torch.zeros(E, H * D, **kw))
        self.ln_post = P(torch.ones(E, **kw))
        self.w_gate_up = P(torch.zeros(2 * I, E, **kw))
        self.w_down = P(torch.zeros(E, I, **kw))
        self.norm = P(torch.ones(E, **kw))
        self.lm_head = P(torch.zeros(cfg.draft_vocab_size, E, **kw))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long, device=device))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool, device=device))
        self.lcfg = cfg.layer_config()
        from sparsespec.model import rope_inv_freq

        self.register_buffer("inv_freq", rope_inv_freq(self.lcfg).to(device), persistent=False)
        self.scale = 1.0 / math.sqrt(D)
        self.source: str | None = None  # the folder it was loaded from

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.device

    # ------------------------------------------------------------------ vocabulary map
    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """Set ``d2t`` / ``t2d`` from the sorted target ids ``[V_d]`` of the draft vocabulary."""
        ids = torch.as_tensor(draft_ids, dtype=torch.long, device=self.device)
        if ids.shape != (self.cfg.draft_vocab_size,) or ids.unique().numel() != ids.numel():
            raise ValueError(f"need {self.cfg.draft_vocab_size} distinct target ids, got shape {tuple(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"draft vocabulary ids must be in [0, {self.cfg.vocab_size})")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=self.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        """``[V_d]`` int64: the target id of each draft id (``d + d2t[d]``)."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.device) + self.d2t

    def check_vocab(self) -> None:
        """``ValueError`` unless ``d2t`` maps into the target vocabulary injectively and ``t2d``
        marks exactly the mapped ids."""
        tgt = self.draft_to_target
        V = self.cfg.vocab_size
        if int(tgt.min()) < 0 or int(tgt.max()) >= V or tgt.unique().numel() != tgt.numel():
            raise ValueError("EAGLE-3 head: d2t does not map the draft vocabulary one-to-one into the target's")
        marked = torch.zeros(V, dtype=torch.bool, device=self.device)
        marked[tgt] = True
        if not torch.equal(marked, self.t2d):
            raise ValueError("EAGLE-3 head: t2d does not mark exactly the target ids that d2t maps to")

    def target_logits(self, draft_logits: torch.Tensor, fill: float = -1e30) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., V_d]`` scattered into the target vocabulary ``[..., V]``;
        ids outside the draft vocabulary get ``fill`` (finite, so entropies stay defined; q is 0 there)."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.cfg.vocab_size), fill)
        out[..., self.draft_to_target] = draft_logits
        return out

    # ------------------------------------------------------------------ pieces
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., 3 E_t]`` target features -> ``[..., E_d]`` (the ``fc``)."""
        return F.linear(features.to(self.dtype), self.fc)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, 1, T, D]`` for positions ``[B, T]``."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def qkv(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Inputs of the layer's attention: q ``[B, H, T, D]``, k, v ``[B, H_kv, T, D]`` (RoPE
        applied at ``positions`` ``[B, T]``) and the residual ``[B, T, E_d]``; ``hidden`` ``[B, T, E_d]``."""
        c = self.cfg
        B, T = input_ids.shape
        eps = c.rms_norm_eps
        e = _rms(F.embedding(input_ids, self.embed).to(self.dtype), self.ln_input, eps)
        hn = _rms(hidden, self.hidden_norm, eps)
        residual = hn if c.norm_before_residual else hidden
        qkv = F.linear(torch.cat([e, hn], dim=-1), self.wqkv)
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        cos, sin = self.rope(positions)
        q = _apply_rope(q.view(B, T, H, D).transpose(1, 2), cos, sin)
        k = _apply_rope(k.view(B, T, Hkv, D).transpose(1, 2), cos, sin)
        return q, k, v.view(B, T, Hkv, D).transpose(1, 2), residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output ``[B, H, T, D]`` + residual -> the layer's output hidden ``[B, T, E_d]``
        (before ``norm``: what the next draft step reads)."""
        B, _, T, _ = attn.shape
        h = residual + F.linear(attn.transpose(1, 2).reshape(B, T, -1), self.wo)
        gate, up = F.linear(_rms(h, self.ln_post, self.cfg.rms_norm_eps), self.w_gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.w_down)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output hidden ``[..., E_d]`` -> draft-vocabulary logits ``[..., V_d]`` float32."""
        return F.linear(_rms(hidden, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()

    # ------------------------------------------------------------------ inference
    @torch.inference_mode()
    def forward_cached(self, input_ids: torch.Tensor, hidden: torch.Tensor, cache: KVCache,
                       lengths: list[int] | None = None) -> torch.Tensor:
        """Append ``T`` pairs per row to the head's ``cache`` (``[1, B, H_kv, S_max, D]``) with causal
        attention over each row's earlier pairs; returns the output hidden ``[B, T, E_d]``.

        ``input_ids`` ``[B, T]``, ``hidden`` ``[B, T, E_d]`` (already fused). Row ``b``'s pairs take
        positions ``cache.lengths[b] ..``; ``lengths[b]`` (default T): how many of its T pairs are
        real (the rest is padding written past the row's length: garbage, overwritten later).
        Advances ``cache.lengths[b]`` by ``lengths[b]``.
        """
        B, T = input_ids.shape
        starts = list(cache.lengths)
        real = list(lengths) if lengths is not None else [T] * B
        dev = self.device
        if max(starts) + T > cache.capacity:
            raise ValueError(f"EAGLE-3 head cache overflow: {max(starts) + T} > capacity {cache.capacity}")
        start_t = torch.tensor(starts, device=dev)[:, None]
        positions = start_t + torch.arange(T, device=dev)  # [B, T]
        q, k, v, residual = self.qkv(input_ids, hidden, positions)
        if min(starts) == max(starts):
            s0 = starts[0]
            cache.k[0, :, :, s0 : s0 + T] = k
            cache.v[0, :, :, s0 : s0 + T] = v
        else:
            bi = torch.arange(B, device=dev)[:, None].expand(B, T)
            cache.k[0][bi, :, positions] = k.transpose(1, 2)
            cache.v[0][bi, :, positions] = v.transpose(1, 2)
        S = max(starts) + T
        keys, vals = cache.k[0, :, :, :S], cache.v[0, :, :, :S]  # [B, H_kv, S, D]
        mask = None
        if T > 1 or min(starts) != max(starts):
            mask = (torch.arange(S, device=dev)[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, S]
        out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=self.scale, enable_gqa=True)
        cache.lengths = [s + n for s, n in zip(starts, real)]
        return self.finish(out, residual)

    # ------------------------------------------------------------------ checkpoint
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The published tensor names -> tensors (q/k/v and gate/up split as in the official files)."""
        c = self.cfg
        H, Hkv, D, I = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        q, k, v = self.wqkv.detach().split([H * D, Hkv * D, Hkv * D], dim=0)
        gate, up = self.w_gate_up.detach().split([I, I], dim=0)
        m = "midlayer."
        out = {
            "fc.weight": self.fc, m + "input_layernorm.weight": self.ln_input, m + "hidden_norm.weight": self.hidden_norm,
            m + "self_attn.q_proj.weight": q, m + "self_attn.k_proj.weight": k, m + "self_attn.v_proj.weight": v,
            m + "self_attn.o_proj.weight": self.wo, m + "post_attention_layernorm.weight": self.ln_post,
            m + "mlp.gate_proj.weight": gate, m + "mlp.up_proj.weight": up, m + "mlp.down_proj.weight": self.w_down,
            "norm.weight": self.norm, "lm_head.weight": self.lm_head, "d2t": self.d2t, "t2d": self.t2d,
        }
        return {n: t.detach().contiguous().cpu() for n, t in out.items()}

    def save(self, folder: str | Path, meta: dict[str, Any] | None = None) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (the format ``load`` reads); ``meta``:
        extra JSON-serialisable facts (training settings, held-out acceptance) kept in the config
        under ``sparsespec``. Written to a temporary folder and renamed. Returns the folder."""
        from safetensors.torch import save_file

        folder = Path(folder)
        tmp = folder.with_name(folder.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        cfg = self.cfg.to_hf_config()
        if meta:
            cfg["sparsespec"] = meta
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(self.state_tensors(), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if folder.exists():
            import shutil

            shutil.rmtree(folder)
        tmp.rename(folder)
        return folder

    @classmethod
    def load(cls, folder: str | Path, target_cfg: ModelConfig, embed: torch.Tensor | None = None,
             dtype=torch.float32, device="cpu") -> Eagle3Head:
        """Load a head from an EAGLE-3 folder (see the module docstring) for a target of config
        ``target_cfg`` whose embedding ``embed`` it shares (unless the checkpoint has its own).

        Raises:
            ValueError: missing files, not an EAGLE-3 config, a tensor missing or mis-shaped, a
                vocabulary or hidden size that does not match the target, an invalid token map.
        """
        folder = Path(folder)
        path = folder / "config.json"
        if not path.is_file():
            raise ValueError(f"{folder}: no config.json (not an EAGLE-3 head folder)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON ({e})") from None
        arch = raw.get("architectures") or []
        if arch and not any(a in ARCHITECTURES for a in arch):
            raise ValueError(f"{path}: architectures {arch} is not an EAGLE-3 head ({', '.join(ARCHITECTURES)})")
        try:
            cfg = Eagle3Config.from_hf_config(raw, target_cfg)
        except KeyError as e:
            raise ValueError(f"{path}: EAGLE-3 config lacks {e}") from None
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"{folder}: head vocab_size {cfg.vocab_size} != the target's {target_cfg.vocab_size}")
        if cfg.target_hidden_size != target_cfg.hidden_size:
            raise ValueError(f"{folder}: head target_hidden_size {cfg.target_hidden_size} != the target's "
                             f"hidden_size {target_cfg.hidden_size}")
        if any(not 0 <= i < target_cfg.num_layers for i in cfg.aux_layers):
            raise ValueError(f"{folder}: feature layers {list(cfg.aux_layers)} outside the target's "
                             f"{target_cfg.num_layers} layers")
        tensors = _read_tensors(folder)
        own_embed = _pop_any(tensors, ("embed_tokens.weight", "model.embed_tokens.weight"))
        if own_embed is None and (embed is None or embed.shape[1] != cfg.hidden_size):
            raise ValueError(f"{folder}: the head has no embed_tokens.weight and its hidden_size {cfg.hidden_size} "
                             f"differs from the target embedding's")
        head = cls(cfg, embed=None if own_embed is not None else embed, dtype=dtype, device=device)
        if own_embed is not None:
            head.embed = torch.nn.Parameter(_shaped(own_embed, (cfg.vocab_size, cfg.hidden_size), "embed_tokens",
                                                    folder).to(dtype=dtype, device=device), requires_grad=False)
        c = cfg
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim

        def take(name: str, shape) -> torch.Tensor:
            for prefix in ("", "model."):
                for mid in ("midlayer.", "layers.0.", "model.layers.0."):
                    key = prefix + name.replace("midlayer.", mid) if name.startswith("midlayer.") else prefix + name
                    if key in tensors:
                        return _shaped(tensors.pop(key), shape, name, folder)
            raise ValueError(f"{folder}: tensor {name!r} missing from the EAGLE-3 checkpoint")

        m = "midlayer."
        E, I = c.hidden_size, c.intermediate_size
        with torch.no_grad():
            head.fc.copy_(take("fc.weight", (E, 3 * c.target_hidden_size)))
            head.ln_input.copy_(take(m + "input_layernorm.weight", (E,)))
            head.hidden_norm.copy_(take(m + "hidden_norm.weight", (E,)))
            head.wqkv.copy_(torch.cat([take(m + "self_attn.q_proj.weight", (H * D, 2 * E)),
                                       take(m + "self_attn.k_proj.weight", (Hkv * D, 2 * E)),
                                       take(m + "self_attn.v_proj.weight", (Hkv * D, 2 * E))]))
            head.wo.copy_(take(m + "self_attn.o_proj.weight", (E, H * D)))
            head.ln_post.copy_(take(m + "post_attention_layernorm.weight", (E,)))
            head.w_gate_up.copy_(torch.cat([take(m + "mlp.gate_proj.weight", (I, E)),
                                            take(m + "mlp.up_proj.weight", (I, E))]))
            head.w_down.copy_(take(m + "mlp.down_proj.weight", (E, I)))
            head.norm.copy_(take("norm.weight", (E,)))
            head.lm_head.copy_(take("lm_head.weight", (c.draft_vocab_size, E)))
            d2t = _pop_any(tensors, ("d2t", "model.d2t"))
            t2d = _pop_any(tensors, ("t2d", "model.t2d"))
            if d2t is None:  # a head over the full vocabulary needs no map
                if c.draft_vocab_size != c.vocab_size:
                    raise ValueError(f"{folder}: draft_vocab_size {c.draft_vocab_size} < vocab_size but no d2t map")
                head.set_vocab(torch.arange(c.vocab_size))
            else:
                head.d2t.copy_(_shaped(d2t, (c.draft_vocab_size,), "d2t", folder).long())
                if t2d is None:
                    head.t2d.zero_()
                    head.t2d[head.draft_to_target.clamp(0, c.vocab_size - 1)] = True
                else:
                    head.t2d.copy_(_shaped(t2d, (c.vocab_size,), "t2d", folder).bool())
        head.check_vocab()
        head.requires_grad_(False)
        head.source = str(folder)
        return head


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    tensors[name] = sf.get_tensor(name)
        return tensors
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"{folder}: no *.safetensors or pytorch_model.bin weights")
    for f in bins:
        tensors.update(torch.load(f, map_location="cpu", weights_only=True))
    return tensors


def _pop_any(tensors: dict[str, torch.Tensor], names) -> torch.Tensor | None:
    for n in names:
        if n in tensors:
            return tensors.pop(n)
    return None


def _shaped(t: torch.Tensor, shape, name: str, folder: Path) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{folder}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def config_dict(cfg: Eagle3Config) -> dict[str, Any]:
    """``cfg`` as a plain dict (for logs and run metadata)."""
    return asdict(cfg)
