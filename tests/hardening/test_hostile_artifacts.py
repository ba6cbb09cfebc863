"""Hostile artifacts are refused with a clear error and nothing runs."""

import hashlib
import json
import os
import zipfile

import keras
import numpy as np
import pytest

import kbert
from kbert.presets import PresetError
from tests.harness import TINY


@pytest.fixture
def preset(tmp_path):
    directory = tmp_path / "preset"
    kbert.BertBackbone(**TINY).save_to_preset(directory)
    return directory


def _rewrite_metadata(directory, files):
    metadata = json.loads((directory / "metadata.json").read_text())
    metadata["files"] = files
    (directory / "metadata.json").write_text(json.dumps(metadata))


def test_lambda_layer_in_keras_file_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    inputs = keras.Input((2,))
    outputs = keras.layers.Lambda(lambda x: x * 2)(inputs)
    path = str(tmp_path / "lambda.keras")
    keras.Model(inputs, outputs).save(path)
    with pytest.raises(ValueError, match="(?i)lambda|unsafe|safe_mode"):
        keras.saving.load_model(path)
    assert not marker.exists()


def test_unregistered_class_in_keras_file_is_refused(tmp_path):
    path = tmp_path / "model.keras"
    kbert.BertBackbone(**TINY).save(path)
    with zipfile.ZipFile(path) as z:
        files = {n: z.read(n) for n in z.namelist()}
    config = json.loads(files["config.json"])
    config.update(class_name="system", module="os", registered_name="system")
    files["config.json"] = json.dumps(config).encode()
    bad = tmp_path / "bad.keras"
    with zipfile.ZipFile(bad, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    with pytest.raises((TypeError, ValueError)):
        keras.saving.load_model(bad)


@pytest.mark.parametrize("name", ["../outside.json", "/etc/passwd", "sub/dir.json", ".."])
def test_metadata_naming_paths_outside_is_refused(preset, name):
    metadata = json.loads((preset / "metadata.json").read_text())
    _rewrite_metadata(preset, {**metadata["files"], name: "0" * 64})
    with pytest.raises(PresetError, match="unsafe file"):
        kbert.BertBackbone.from_preset(preset)


def test_symlinked_weights_are_refused(preset, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(preset / "model.safetensors", outside)
    os.symlink(outside, preset / "model.safetensors")
    with pytest.raises(PresetError, match="link"):
        kbert.BertBackbone.from_preset(preset)


def test_truncated_weights_with_matching_checksum_are_refused(preset):
    data = (preset / "model.safetensors").read_bytes()[:1000]
    (preset / "model.safetensors").write_bytes(data)
    metadata = json.loads((preset / "metadata.json").read_text())
    _rewrite_metadata(
        preset, {**metadata["files"], "model.safetensors": hashlib.sha256(data).hexdigest()}
    )
    with pytest.raises(PresetError, match="corrupt or truncated"):
        kbert.BertBackbone.from_preset(preset)


def test_nan_weights_are_refused(preset):
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(preset / "model.safetensors"))
    weights["pooler/dense/bias"] = np.full_like(weights["pooler/dense/bias"], np.nan)
    save_file(weights, str(preset / "model.safetensors"))
    metadata = json.loads((preset / "metadata.json").read_text())
    digest = hashlib.sha256((preset / "model.safetensors").read_bytes()).hexdigest()
    _rewrite_metadata(preset, {**metadata["files"], "model.safetensors": digest})
    with pytest.raises(ValueError, match="NaN or inf"):
        kbert.BertBackbone.from_preset(preset)
