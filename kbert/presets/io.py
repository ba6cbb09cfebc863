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

import json
import logging
import os

import keras
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file

from kbert import backend
from kbert.layers.adapters import ADAPTER_LAYER_NAMES
from kbert.presets.registry import PRESETS, download_preset, is_hub_handle
from kbert.presets.weights import weights_dict
from kbert.tokenizers.vocabulary import load_vocabulary
from kbert.utils.files import (
    MAX_VOCABULARY_BYTES,
    PresetError,
    load_json,
    preset_file,
    save_safetensors,
    sha256,
    verify_checksums,
)
from kbert.version import __version__

logger = logging.getLogger("kbert")

__all__ = [
    "PresetError",
    "preset_file",
    "read_json",
    "write_json",
    "save_weights_file",
    "load_weights_file",
    "safetensors_shapes",
    "check_vocabulary_file",
    "verify_metadata",
    "write_metadata",
    "save_backbone",
    "save_model_to_preset",
    "is_kbert_preset",
    "read_backbone_config",
    "new_adapters",
    "load_model_from_preset",
    "resolve_preset",
]

FORMAT = "kbert-preset"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
METADATA_FILE = "metadata.json"


def resolve_preset(preset, allow_pickle=False):
    """A directory, a registered name or a Hub handle (`hf://org/name[@revision]`)
    -> a local directory; names and handles are downloaded once into the
    Hugging Face cache (see `kbert.presets.registry`). `allow_pickle` also
    fetches a Hub repository's pickled `pytorch_model.bin`."""
    preset = os.fspath(preset)
    if os.path.isdir(preset):
        return preset
    if is_hub_handle(preset) or preset in PRESETS:
        return download_preset(preset, allow_pickle=allow_pickle)
    if os.path.exists(preset):
        if preset.endswith((".keras", ".h5")):
            raise PresetError(
                f"{preset!r} is a saved Keras model, not a preset directory: load it with "
                "keras.saving.load_model(path) after `import kbert` (or save the model with "
                "save_to_preset to make a preset)"
            )
        raise PresetError(f"preset {preset!r} is a file; pass the directory that holds it")
    if os.sep in preset or preset.startswith("."):
        raise PresetError(f"preset directory {preset!r} does not exist")
    return download_preset(preset)  # raises the unknown-name error


def read_json(directory, name):
    """The JSON object in file `name` of `directory`; a PresetError naming
    the file when it is missing, not a regular file inside the directory, or
    not a well-formed JSON object."""
    path = preset_file(directory, name)
    if not os.path.exists(path):
        raise PresetError(f"{directory!r} has no {name}")
    return load_json(path)


def write_json(directory, name, obj):
    with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def save_weights_file(directory, name, layer, exclude=(), exact=False):
    """Saves `layer`'s weights, leaving out paths in `exclude` (prefixes, or
    exact paths when `exact`)."""
    excluded = set(exclude) if exact else None
    weights = {
        k: v
        for k, v in weights_dict(layer).items()
        if (k not in excluded if exact else not any(k.startswith(e) for e in exclude))
    }
    for path, value in weights.items():
        if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
            raise ValueError(
                f"weight {path!r} holds NaN or inf (a diverged training?): not saved, since "
                "loading would refuse it"
            )
    save_safetensors(weights, os.path.join(directory, name))


def load_weights_file(directory, name):
    path = preset_file(directory, name)
    if not os.path.exists(path):
        raise PresetError(f"{directory!r} has no weights file {name}")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise PresetError(f"weights file {path} is corrupt or truncated: {e}") from e


def safetensors_shapes(directory, name):
    """{tensor name: shape} from a safetensors file's header, reading no
    tensor data (the header is checked against the file's size)."""
    path = preset_file(directory, name)
    if not os.path.exists(path):
        raise PresetError(f"{directory!r} has no weights file {name}")
    try:
        with safe_open(path, framework="numpy") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise PresetError(f"weights file {path} is corrupt or truncated: {e}") from e


def check_vocabulary_file(directory, name, vocabulary_size):
    """Compares the vocabulary file `name` (if present; "/" separates
    subfolders) with the embedding table's `vocabulary_size` rows: more
    tokens than rows is a PresetError (raw text would give ids past the
    table), fewer a warning naming both. Returns the number of tokens, or
    None when there is no such file."""
    path = preset_file(directory, name, subfolders=True)
    if not os.path.exists(path):
        return None
    size = os.path.getsize(path)
    if size > MAX_VOCABULARY_BYTES:
        raise PresetError(
            f"{path} is {size} bytes, more than the {MAX_VOCABULARY_BYTES} a vocabulary may hold"
        )
    try:
        count = len(load_vocabulary(path))
    except ValueError as e:
        raise PresetError(f"{path} is not a usable vocabulary: {e}") from e
    if count > vocabulary_size:
        raise PresetError(
            f"{path} holds {count} tokens but the embedding table has {vocabulary_size} rows: "
            "raw text would give ids past the table; use the vocabulary the checkpoint was "
            "trained with"
        )
    if count < vocabulary_size:
        logger.warning(
            "%s holds %d tokens, fewer than the embedding table's %d rows; the rows past "
            "the vocabulary are unused",
            path,
            count,
            vocabulary_size,
        )
    return count


def verify_metadata(directory):
    """Checks every checksum in metadata.json; returns the metadata."""
    metadata = read_json(directory, METADATA_FILE)
    files = metadata.get("files")
    if not isinstance(files, dict) or not files:
        raise PresetError(f"{directory}/{METADATA_FILE} lists no files")
    verify_checksums(
        directory,
        files,
        missing=lambda name: f"preset file {name!r} listed in metadata.json is missing",
        changed=lambda name: (
            f"preset file {name!r} does not match its checksum in metadata.json "
            "(corrupt, truncated or modified); re-download or re-save the preset"
        ),
        locate=preset_file,
    )
    return metadata


def write_metadata(directory, model, files):
    write_json(
        directory,
        METADATA_FILE,
        {
            "kbert_version": __version__,
            "keras_version": keras.__version__,
            "saved_with_backend": backend.name(),
            "class_name": type(model).__name__,
            "files": {name: sha256(os.path.join(directory, name)) for name in sorted(files)},
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


def save_model_to_preset(model, directory, preprocessor=None):
    """Writes `model`'s preset files (and `preprocessor`'s tokenizer files,
    when given) and the metadata that checksums them."""
    os.makedirs(directory, exist_ok=True)
    files = model.write_preset_files(directory)
    if preprocessor is not None:
        files = list(files) + [
            f for f in preprocessor.save_to_directory(directory) if f not in files
        ]
    write_metadata(directory, model, files)


def is_kbert_preset(directory):
    return os.path.isfile(os.path.join(directory, METADATA_FILE))


def read_backbone_config(directory):
    """The backbone config of a kbert preset directory, after checking every
    file against its checksum (sizes are checked by the loader)."""
    verify_metadata(directory)
    config = read_json(directory, CONFIG_FILE)
    if config.get("format") != FORMAT or config.get("class_name") != "BertBackbone":
        raise PresetError(
            f"{directory}/{CONFIG_FILE} describes {str(config.get('class_name'))[:80]!r} "
            f"(format {str(config.get('format'))[:80]!r}), not a kbert BertBackbone"
        )
    if not isinstance(config.get("config"), dict):
        raise PresetError(f"{directory}/{CONFIG_FILE} has no 'config' object")
    version = config.get("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
        raise PresetError(
            f"{directory}/{CONFIG_FILE} is format_version {version!r:.40}; this kbert "
            f"reads presets up to format_version {FORMAT_VERSION}: upgrade kbert"
        )
    return config["config"]


def new_adapters(saved_config, overrides):
    """Adapter weights may be absent when adapters are added on load."""
    if overrides.get("adapter_size") and not saved_config.get("adapter_size"):
        return tuple(f"{name}/" for name in ADAPTER_LAYER_NAMES)
    return ()


def load_model_from_preset(cls, preset, load_weights=True, **kwargs):
    directory = resolve_preset(preset, allow_pickle=kwargs.get("allow_pickle", False))
    return cls.load_from_preset_dir(directory, load_weights=load_weights, **kwargs)
