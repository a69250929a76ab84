"""sparsespec: lossless sparse self-speculative decoding (SparseSpec-L) and baselines in one engine.

    from sparsespec import Engine
    engine = Engine.from_pretrained("smollm2-135m", dtype="float32")
    outs = engine.generate(["prompt"], method="sparsespec-l", max_new_tokens=64)

    core = engine.core(method="sparsespec-l", max_num_seqs=8)       # continuous batching
    core.add_request("r1", "prompt", SamplingParams(max_new_tokens=64))
    while core.has_unfinished_requests():
        for out in core.step(): ...
"""
from sparsespec.config import SamplingParams
from sparsespec.engine import (Engine, EngineCore, GenerationOutput, RequestOutput, StreamEvent, methods,
                               options_class, parse_method_options, resolve_method_options)
from sparsespec.provision import PRESETS, ModelNotAvailableError, load_tokenizer, model_max_context, resolve_model
from sparsespec.registry import MethodUnavailable

METHODS = tuple(methods())

__all__ = [
    "Engine",
    "EngineCore",
    "RequestOutput",
    "SamplingParams",
    "GenerationOutput",
    "METHODS",
    "PRESETS",
    "MethodUnavailable",
    "ModelNotAvailableError",
    "load_tokenizer",
    "model_max_context",
    "options_class",
    "parse_method_options",
    "resolve_method_options",
    "resolve_model",
    "StreamEvent",
]
