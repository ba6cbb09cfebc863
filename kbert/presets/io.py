"""The kbert preset directory: reading and writing.

A preset is a directory holding
- `config.json`: {"format": "kbert-preset", "class_name": "BertBackbone", "config": {...}}
- `model.safetensors`: the backbone's weights by variable path
- `task.json` + `task.safetensors`: a task model's head (task presets only)
- tokenizer files (`vocab.txt`, `tokenizer.json`) when a preprocessor is attached
- `metadata.json`: kbert/keras versions and the sha256 of every file above.

Loading reads JSON and safetensors only: nothing in a preset is executed.
Every file named by a preset must be a plain file inside its directory.
"""

import hashlib
import json
import os

import keras

from kbert.presets.registry import PRESETS, download_preset
from kbert.presets.weights import assign_weights, weights_dict

FORMAT = "kbert-preset"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
METADATA_FILE = "metadata.json"


class PresetError(ValueError):
    """A preset directory that is missing, malformed, corrupt or of another model."""


def resolve_preset(preset):
    """A registered name or a directory -> a local directory."""
    preset = os.fspath(preset)
    if os.path.isdir(preset):
        return preset
    if preset in PRESETS:
        return download_preset(preset)
    if os.path.exists(preset):
        raise PresetError(f"preset {preset!r} is a file; pass the directory that holds it")
    if os.sep in preset or preset.startswith("."):
        raise PresetError(f"preset directory {preset!r} does not exist")
    return download_preset(preset)  # raises the unknown-name error


def preset_file(directory, name):
    """Path of file `name` in `directory`, refusing anything that leaves it."""
    if (
        not isinstance(name, str)
        or not name
        or os.path.basename(name) != name
        or name in (".", "..")
    ):
        raise PresetError(
            f"preset names an unsafe file {name!r}: only plain file names are allowed"
        )
    path = os.path.join(directory, name)
    real_dir = os.path.realpath(directory)
    if os.path.islink(path) or os.path.dirname(os.path.realpath(path)) != real_dir:
        raise PresetError(f"preset file {name!r} is a link or leaves the preset directory")
    return path


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_json(directory, name):
    path = preset_file(directory, name)
    if not os.path.isfile(path):
        raise PresetError(f"{directory!r} has no {name}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise PresetError(f"{path} is not valid JSON: {e}") from e


def write_json(directory, name, obj):
    with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def save_weights_file(directory, name, layer, exclude=(), exact=False):
    """Saves `layer`'s weights, leaving out paths in `exclude` (prefixes, or
    exact paths when `exact`)."""
    from safetensors.numpy import save_file

    excluded = set(exclude) if exact else None
    weights = {
        k: v
        for k, v in weights_dict(layer).items()
        if (k not in excluded if exact else not any(k.startswith(e) for e in exclude))
    }
    save_file(weights, os.path.join(directory, name))


def load_weights_file(directory, name):
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = preset_file(directory, name)
    if not os.path.isfile(path):
        raise PresetError(f"{directory!r} has no weights file {name}")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise PresetError(f"weights file {path} is corrupt or truncated: {e}") from e


def verify_metadata(directory):
    """Checks every checksum in metadata.json; returns the metadata."""
    metadata = read_json(directory, METADATA_FILE)
    files = metadata.get("files")
    if not isinstance(files, dict) or not files:
        raise PresetError(f"{directory}/{METADATA_FILE} lists no files")
    for name, expected in files.items():
        path = preset_file(directory, name)
        if not os.path.isfile(path):
            raise PresetError(f"preset file {name!r} listed in metadata.json is missing")
        if _sha256(path) != expected:
            raise PresetError(
                f"preset file {name!r} does not match its checksum in metadata.json "
                "(corrupt, truncated or modified); re-download or re-save the preset"
            )
    return metadata


def write_metadata(directory, model, files):
    from kbert.version import __version__

    write_json(
        directory,
        METADATA_FILE,
        {
            "kbert_version": __version__,
            "keras_version": keras.__version__,
            "saved_with_backend": keras.backend.backend(),
            "class_name": type(model).__name__,
            "files": {name: _sha256(os.path.join(directory, name)) for name in sorted(files)},
        },
    )


def save_backbone(directory, backbone):
    write_json(
        directory,
        CONFIG_FILE,
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "class_name": "BertBackbone",
            "config": backbone.get_config(),
        },
    )
    save_weights_file(directory, WEIGHTS_FILE, backbone)
    return [CONFIG_FILE, WEIGHTS_FILE]


def save_model_to_preset(model, directory):
    os.makedirs(directory, exist_ok=True)
    files = model.write_preset_files(directory)
    write_metadata(directory, model, files)


def is_kbert_preset(directory):
    return os.path.isfile(os.path.join(directory, METADATA_FILE))


def load_backbone(directory, load_weights=True, **overrides):
    """BertBackbone from a kbert preset, a Hugging Face BERT directory, an
    original TF checkpoint directory or a keras-hub BERT preset."""
    from kbert.convert import huggingface, keras_hub
    from kbert.models.backbone import BertBackbone

    if keras_hub.is_keras_hub_dir(directory):
        return keras_hub.load_backbone(directory, load_weights=load_weights, **overrides)
    if huggingface.is_huggingface_dir(directory):
        return huggingface.load_backbone(directory, load_weights=load_weights, **overrides)
    if not is_kbert_preset(directory):
        raise PresetError(
            f"{directory!r} is not a preset: it has neither a kbert {METADATA_FILE} nor "
            "a Hugging Face config.json with model_type 'bert'"
        )
    verify_metadata(directory)
    config = read_json(directory, CONFIG_FILE)
    if config.get("format") != FORMAT or config.get("class_name") != "BertBackbone":
        raise PresetError(
            f"{directory}/{CONFIG_FILE} describes {config.get('class_name')!r} "
            f"(format {config.get('format')!r}), not a kbert BertBackbone"
        )
    if not isinstance(config.get("config"), dict):
        raise PresetError(f"{directory}/{CONFIG_FILE} has no 'config' object")
    backbone_config = {**config["config"], **overrides}
    try:
        backbone = BertBackbone.from_config(backbone_config)
    except TypeError as e:
        raise PresetError(f"{directory}/{CONFIG_FILE} has an invalid backbone config: {e}") from e
    if load_weights:
        assign_weights(
            backbone,
            load_weights_file(directory, WEIGHTS_FILE),
            source=f"weights in {directory}/{WEIGHTS_FILE}",
            allow_missing=new_adapters(config["config"], overrides),
        )
    return backbone


def new_adapters(saved_config, overrides):
    """Adapter weights may be absent when adapters are added on load."""
    from kbert.layers.adapters import ADAPTER_LAYER_NAMES

    if overrides.get("adapter_size") and not saved_config.get("adapter_size"):
        return tuple(f"{name}/" for name in ADAPTER_LAYER_NAMES)
    return ()


def load_model_from_preset(cls, preset, load_weights=True, **kwargs):
    directory = resolve_preset(preset)
    return cls.load_from_preset_dir(directory, load_weights=load_weights, **kwargs)
