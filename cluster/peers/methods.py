"""What a ``vllm:<method>`` sweep method is: its name and its options (vLLM's ``speculative_config`` keys)
with our defaults. Naming and validation only (a spec is checked with these before any engine
starts); :mod:`cluster.peers.engine` configures (``speculative_config``) and runs the engines.

Imports only the standard library (the main venv has no vLLM).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

#: a sweep method of this backend is ``VLLM_PREFIX + name``
VLLM_PREFIX = "vllm:"
#: our name -> vLLM's ``speculative_config`` method (None: plain decoding)
VLLM_METHODS: dict[str, str | None] = {"ar": None, "ngram": "ngram", "suffix": "suffix",
                                       "draft-model": "draft_model", "eagle3": "eagle3"}
#: options each method starts from (ngram as our ``ngram``'s defaults: k = 4, a 1-4 token match).
#: suffix: no global tree of past responses (``suffix_decoding_max_cached_requests: 0``; the
#: request's own prompt tree stays): a sweep decodes every sample again in each cell and in
#: each repetition, and a cache of earlier answers would draft this sample's own greedy answer
#: (measured: 1.62x our ar at batch 4 x 1K with the cache, after the batch-1 cell had decoded the
#: same samples). Set it for a workload whose requests really repeat.
VLLM_DEFAULTS: dict[str, dict[str, Any]] = {
    "ar": {},
    "ngram": {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
    "suffix": {"num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": 0},
    "draft-model": {"num_speculative_tokens": 4},
    "eagle3": {"num_speculative_tokens": 4},
}
#: the ``speculative_config`` keys a sweep may set (vLLM 0.32's ``SpeculativeConfig`` fields that
#: choose the method's behaviour; ``method`` comes from the name)
VLLM_SPEC_KEYS = frozenset({
    "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "quantization",
    "draft_tensor_parallel_size", "disable_by_batch_size", "max_model_len", "revision",
    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob", "num_speculative_tokens_per_batch_size", "speculative_token_tree",
})


def is_vllm_method(method: str) -> bool:
    return isinstance(method, str) and method.startswith(VLLM_PREFIX)


def resolve_vllm_options(method: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A ``vllm:<name>`` method's options: its defaults overlaid with ``options`` (vLLM's
    ``speculative_config`` keys). Raises ValueError for an unknown name, an unknown key, a
    non-JSON value or options on ``vllm:ar``."""
    name = method[len(VLLM_PREFIX):] if is_vllm_method(method) else method
    if name not in VLLM_METHODS:
        raise ValueError(f"unknown vLLM method {method!r} (available: "
                         f"{', '.join(VLLM_PREFIX + m for m in VLLM_METHODS)})")
    options = dict(options or {})
    if name == "ar" and options:
        raise ValueError("method 'vllm:ar' takes no options")
    unknown = sorted(set(options) - VLLM_SPEC_KEYS)
    if unknown:
        raise ValueError(f"{method}: unknown speculative_config key(s) {unknown} "
                         f"(allowed: {', '.join(sorted(VLLM_SPEC_KEYS))})")
    try:
        json.dumps(options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{method}: options must be plain JSON values: {e}") from None
    k = options.get("num_speculative_tokens", VLLM_DEFAULTS[name].get("num_speculative_tokens"))
    if name != "ar" and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ValueError(f"{method}: num_speculative_tokens must be an integer >= 1, got {k!r}")
    if name in ("draft-model", "eagle3") and "model" not in options:
        raise ValueError(f"{method}: needs `model` (the draft model or EAGLE-3 head: a preset or a local folder)")
    return {**VLLM_DEFAULTS[name], **options}



__all__ = ["VLLM_DEFAULTS", "VLLM_METHODS", "VLLM_PREFIX", "VLLM_SPEC_KEYS", "is_vllm_method",
           "resolve_vllm_options"]
