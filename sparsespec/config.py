"""Frozen, validated configuration dataclasses.

``ModelConfig`` is read from a Hugging Face ``config.json`` (Llama 2/3.x, Mistral, Qwen2/2.5);
``MethodOptions`` is the base of every method's options (each drafter declares its own subclass
in its file; ``SpecOptions`` is the part the speculative methods share); ``SamplingParams`` the
decoding parameters. Invalid values raise ``ValueError`` naming the field.
"""
from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (the shape letters of the shape comments: L layers, H heads, H_kv KV heads, D head dim, E hidden)."""

    model_type: str
    vocab_size: int  # V
    hidden_size: int
    intermediate_size: int
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # H_kv
    head_dim: int  # D
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group, G = H / H_kv)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers 5.x writes "rope_parameters"; 4.x files have rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope else None)
        if scaling is not None:
            scaling = dict(scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type == "default":
                scaling = None
            elif rope_type != "llama3":
                raise ValueError(f"rope scaling type {rope_type!r} is not supported (default, llama3)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg["max_position_embeddings"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        try:
            return cls.from_hf_config(json.loads(path.read_text()))
        except (KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: malformed model config ({e!r})") from None


#: ``dataclasses.field`` metadata key of an option added to a method after its run ids were first
#: stored (``later_option``): left out of the resolved options while at its default.
LATER = "sparsespec_later_option"


def later_option(default: Any, **kwargs: Any) -> Any:
    """A field for an option added to an existing method: ``MethodOptions.resolved`` leaves it out
    while it is at ``default``, so the run ids of that method's configurations stored before it
    existed stay the same (and those runs resume); any other value enters the run id."""
    return field(default=default, metadata={LATER: True}, **kwargs)


@dataclass(frozen=True)
class MethodOptions:
    """The options of one method (``method_options``): a frozen, validated dataclass.

    Each drafter declares its own subclass as its ``options`` attribute, in its own file (``ar``,
    the null drafter, has this empty one: no options). Fields are the option names; defaults are
    the method's defaults. Subclasses validate in ``__post_init__`` (calling ``super()``'s) and
    raise ``ValueError`` naming the option. A run id hashes only ``resolved()`` of each method
    of the run, so an option of one method never moves another method's run ids.
    """

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The option names this method takes, in declaration order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_options(cls, method: str, options: Mapping[str, Any] | None) -> MethodOptions:
        """Validated options of ``method`` from a plain mapping (missing ones at their defaults).

        Raises:
            ValueError: an option this method does not take (the message lists the ones it
                does, with the closest name), or an invalid value (the message names the method
                and the option).
        """
        options = dict(options or {})
        known = cls.option_names()
        unknown = sorted(set(options) - set(known), key=str)
        if unknown:
            hints = [h[0] for h in (difflib.get_close_matches(str(u), known, n=1) for u in unknown) if h]
            hint = f" (did you mean {', '.join(map(repr, hints))}?)" if hints else ""
            takes = f"its options: {', '.join(known)}" if known else "it takes no options"
            raise ValueError(f"unknown method_options {unknown} for method {method!r}{hint}; {takes}")
        try:
            return cls(**options)
        except ValueError as e:
            raise ValueError(f"method {method!r}: {e}") from None

    def resolved(self) -> dict[str, Any]:
        """The options as a plain dict, every default filled in: what a run id hashes and a run
        stores. Left out: ``later_option`` fields at their default (see there)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get(LATER) and value == f.default:
                continue
            out[f.name] = value
        return out


@dataclass(frozen=True)
class SpecOptions(MethodOptions):
    """The part every speculative method shares: the draft length and how ``"auto"`` picks it.

    Attributes:
        k: draft length K (tokens proposed per step), an int >= 1, or ``"auto"``: the
            ``controller`` picks it every step, up to ``max_k`` (0 where speculation does not pay).
        max_k: the longest draft ``"auto"`` may choose (tokens, >= 1).
        controller: how ``k="auto"`` picks the draft length (ignored for an integer k, and left
            out of ``resolved()`` then, so it does not split run ids): ``"cost"``
            (``sparsespec.adaptive.CostAwareController``: once per step for the whole batch, 0
            included, from the rows' measured acceptance and the measured costs of a draft
            forward and of a verify as a function of batch, width and context, calibrated at load)
            or ``"entropy"`` (``EntropyAdaptive``: per row, stopping on each drafted token's
            entropy, one host sync per draft token).
    """

    k: int | str = "auto"
    max_k: int = 16
    controller: str = "cost"

    def __post_init__(self) -> None:
        from sparsespec.adaptive import CONTROLLERS

        if self.k != "auto" and (not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1):
            raise ValueError(f"k must be an integer >= 1 or 'auto', got {self.k!r}")
        if not isinstance(self.max_k, int) or isinstance(self.max_k, bool) or self.max_k < 1:
            raise ValueError(f"max_k must be an integer >= 1, got {self.max_k!r}")
        if self.controller not in CONTROLLERS:
            raise ValueError(f"controller must be one of {CONTROLLERS}, got {self.controller!r}")

    @property
    def k_limit(self) -> int:
        """The longest draft these options can produce (sizes the buffers)."""
        return self.max_k if self.k == "auto" else int(self.k)

    def resolved(self) -> dict[str, Any]:
        out = super().resolved()
        if self.k != "auto":  # the controller only chooses k="auto"'s lengths: not part of a fixed-k run
            out.pop("controller", None)
        return out


def check_int(name: str, value: Any, low: int) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is an int (not a bool) >= ``low``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters, applied identically to the target (p) and the draft (q).

    Attributes:
        max_new_tokens: generated-token cap per prompt (>= 1).
        temperature: 0 = greedy (one-hot p and q: exact-match verification).
        top_k: keep the k most likely tokens (0 = off).
        top_p: nucleus mass in (0, 1] (1 = off).
        seed: seeds the sampling generator (same seed, same output); None = nondeterministic.
        stop: strings that end generation; the text stops before them, tokens up to the one
            that completed them.
        eos_token_ids: token ids that end generation (kept as the last token); None = the
            model's EOS ids (resolved when the request is added).
        stop_token_ids: extra ids that end generation like EOS (vLLM's ``stop_token_ids``).
        ignore_eos: generate exactly ``max_new_tokens`` tokens (speed runs); stop strings too
            are ignored.
        min_new_tokens: the ``eos_token_ids`` cannot be generated before this many tokens (their
            target logits are masked, as vLLM's ``min_tokens`` and transformers' ``min_new_tokens``
            do); 0 = off. Must be < ``max_new_tokens``.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: ``eos_token_ids`` (resolved) plus ``stop_token_ids``."""
        eos = tuple(self.eos_token_ids or ())
        return eos + tuple(t for t in self.stop_token_ids if t not in eos)

    def __post_init__(self) -> None:
        from sparsespec.sampling import validate_sampling

        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        validate_sampling(self.temperature, self.top_k, self.top_p, self.seed)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids") + (("eos_token_ids",) if self.eos_token_ids is not None else ()):
            if not isinstance(getattr(self, name), tuple):
                try:
                    object.__setattr__(self, name, tuple(getattr(self, name)))
                except TypeError:
                    raise ValueError(f"{name} must be a list, got {getattr(self, name)!r}") from None
        for name in ("eos_token_ids", "stop_token_ids"):
            ids = getattr(self, name)
            if ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError(f"{name} must be non-negative ints, got {ids!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        m = self.min_new_tokens
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m < self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}), got {m!r}")
