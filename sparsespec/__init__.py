"""sparsespec: lossless sparse self-speculative decoding (SparseSpec-L) and baselines in one engine.

    from sparsespec import Engine
    engine = Engine.from_pretrained("smollm2-135m", dtype="float32")
    outs = engine.generate(["prompt"], method="sparsespec-l", max_new_tokens=64)
"""
from sparsespec.engine import Engine, GenerationOutput, StreamEvent, methods, resolve_method_options
from sparsespec.provision import PRESETS, ModelNotAvailableError, load_tokenizer, model_max_context, resolve_model

METHODS = tuple(methods())

__all__ = [
    "Engine",
    "GenerationOutput",
    "METHODS",
    "PRESETS",
    "ModelNotAvailableError",
    "load_tokenizer",
    "model_max_context",
    "resolve_method_options",
    "resolve_model",
    "StreamEvent",
]
