"""sparsespec: lossless sparse self-speculative decoding (SparseSpec-L) and baselines in one engine.

    from sparsespec import Engine
    engine = Engine.from_pretrained("smollm2-135m", dtype="float32")
    outs = engine.generate(["prompt"], method="sparsespec-l", max_new_tokens=64)

    core = engine.core(method="sparsespec-l", max_num_seqs=8)       # continuous batching
    core.add_request("r1", "prompt", SamplingParams(max_new_tokens=64))
    while core.has_unfinished_requests():
        for out in core.step(): ...
"""
import importlib

# Loaded on first use (PEP 562), so that ``import sparsespec.registry`` and the CLIs' ``--help``
# do not import torch and the engine (3 s): name -> the module that defines it.
_EXPORTS = {
    "SamplingParams": "sparsespec.config",
    **dict.fromkeys(("Engine", "EngineCore", "GenerationOutput", "RequestOutput", "StreamEvent", "methods",
                     "options_class", "parse_method_options", "resolve_method_options"), "sparsespec.engine"),
    **dict.fromkeys(("PRESETS", "ModelNotAvailableError", "load_tokenizer", "model_max_context", "resolve_model"),
                    "sparsespec.provision"),
    "MethodUnavailable": "sparsespec.registry",
}


def __getattr__(name: str):
    """``METHODS`` (the registered decoding methods), the names of ``__all__`` and the submodules,
    imported when first read."""
    if name == "METHODS":
        value = tuple(importlib.import_module("sparsespec.engine").methods())
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
