"""The preset loader: the one place that builds models from files.

Converters (`kbert.convert`) and the preset format (`kbert.presets`) turn a
directory into config and weight dictionaries; this module picks the reader
for a directory (kbert preset, Hugging Face or original TF checkpoint,
keras-hub preset), builds the model and assigns the weights, and writes task
presets (backbone files + the head's `task.json` and `task.safetensors`).
"""

import logging
import os

from kbert.convert import huggingface, keras_hub
from kbert.presets import io
from kbert.presets.weights import assign_weights

logger = logging.getLogger("kbert")

TASK_CONFIG_FILE = "task.json"
TASK_WEIGHTS_FILE = "task.safetensors"
# from_preset keyword arguments that go to the backbone
BACKBONE_OVERRIDES = (
    "dtype",
    "dropout",
    "attention_dropout",
    "output_hidden_states",
    "adapter_size",
    "allow_pickle",
)


class PresetMixin:
    """Adds `from_preset` and `save_to_preset`; see `kbert.presets`."""

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        """Builds the model from a registered name, a kbert preset directory
        or a Hugging Face BERT directory.

        Args:
            preset: str or path. registered name (`kbert.presets.list_presets()`)
                or local directory.
            load_weights: bool. False gives the architecture, randomly initialised.
            **kwargs: config overrides, e.g. `dtype="mixed_bfloat16"`.
        """
        return io.load_model_from_preset(cls, preset, load_weights=load_weights, **kwargs)

    def save_to_preset(self, preset_dir):
        """Writes config, safetensors weights and checksummed metadata to a directory."""
        io.save_model_to_preset(self, preset_dir)


def load_backbone(backbone_cls, directory, load_weights=True, **overrides):
    """A `backbone_cls` from a kbert preset, a Hugging Face BERT directory,
    an original TF checkpoint directory or a keras-hub BERT preset."""
    allow_pickle = overrides.pop("allow_pickle", False)
    if keras_hub.is_keras_hub_dir(directory):
        config, weights = keras_hub.read_backbone(directory, load_weights)
        source, allow_missing = f"keras-hub weights in {directory}", ()
    elif huggingface.is_huggingface_dir(directory):
        config, weights, allow_missing = huggingface.read_backbone(
            directory, load_weights, allow_pickle=allow_pickle
        )
        source = f"Hugging Face weights in {directory}"
    elif io.is_kbert_preset(directory):
        config, weights = io.read_backbone_preset(directory, load_weights)
        source, allow_missing = f"weights in {directory}/{io.WEIGHTS_FILE}", ()
    else:
        raise io.PresetError(
            f"{directory!r} is not a preset: it has neither a kbert {io.METADATA_FILE} nor "
            "a Hugging Face config.json with model_type 'bert'"
        )
    try:
        backbone = backbone_cls.from_config({**config, **overrides})
    except TypeError as e:
        raise io.PresetError(f"{directory} has an invalid backbone config: {e}") from e
    if weights is not None:
        assign_weights(
            backbone,
            weights,
            source=source,
            allow_missing=allow_missing + io.new_adapters(config, overrides),
        )
    return backbone


def write_task_files(task, directory):
    """Backbone files, the head's config and weights, and the tokenizer
    files when a preprocessor is attached; returns the file names."""
    files = io.save_backbone(directory, task.backbone)
    io.write_json(
        directory,
        TASK_CONFIG_FILE,
        {"format": "kbert-task", "class_name": type(task).__name__, "config": task.task_config()},
    )
    backbone_paths = tuple(v.path for v in task.backbone.weights)
    io.save_weights_file(directory, TASK_WEIGHTS_FILE, task, exclude=backbone_paths, exact=True)
    files += [TASK_CONFIG_FILE, TASK_WEIGHTS_FILE]
    if task.preprocessor is not None:
        files += task.preprocessor.save_to_directory(directory)
    return files


def load_task(cls, directory, load_weights=True, **kwargs):
    """A task model of class `cls` from a preset directory: its own head
    when the preset holds one of this class (kbert task preset or Hugging
    Face checkpoint), otherwise a fresh head on the preset's backbone."""
    backbone_overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in BACKBONE_OVERRIDES}
    allow_pickle = backbone_overrides.get("allow_pickle", False)
    backbone = load_backbone(
        cls.backbone_cls, directory, load_weights=load_weights, **backbone_overrides
    )
    task_config, head_weights = {}, None
    if os.path.isfile(os.path.join(directory, TASK_CONFIG_FILE)):
        saved = io.read_json(directory, TASK_CONFIG_FILE)
        if saved.get("class_name") == cls.__name__:
            task_config = saved.get("config", {})
            if load_weights:
                head_weights = io.load_weights_file(directory, TASK_WEIGHTS_FILE)
        else:
            logger.warning(
                "%s holds a %s head; building a fresh %s head on its backbone",
                directory,
                saved.get("class_name"),
                cls.__name__,
            )
    if "preprocessor" not in kwargs:
        kwargs["preprocessor"] = cls.default_preprocessor(directory, backbone)
    model = cls(backbone=backbone, **{**task_config, **kwargs})
    source = f"head weights in {directory}/{TASK_WEIGHTS_FILE}"
    if head_weights is None and load_weights:
        head_weights = huggingface.read_task_head(cls.__name__, directory, allow_pickle)
        source = f"Hugging Face head in {directory}"
        if head_weights is None:
            logger.warning(
                "%s: the %s head is initialised fresh (the preset has no matching head)",
                directory,
                cls.__name__,
            )
            return model
        paths = model.head_weight_paths()
        if set(head_weights) != set(paths):
            raise io.PresetError(
                f"the Hugging Face head in {directory} does not map onto {cls.__name__}: "
                f"expected {sorted(paths)}, got {sorted(head_weights)}"
            )
    if head_weights is not None:
        assign_weights(model, head_weights, source=source, paths=model.head_weight_paths())
    return model
