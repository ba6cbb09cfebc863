"""What every task model shares: a backbone, an optional preprocessor, and
preset loading/saving of backbone + head."""

import logging

import keras

from kbert.models.preset_mixin import PresetMixin

logger = logging.getLogger("kbert")

TASK_CONFIG_FILE = "task.json"
TASK_WEIGHTS_FILE = "task.safetensors"


class Task(PresetMixin, keras.Model):
    """Base class of task models (functional subclasses around a `BertBackbone`).

    Subclasses build their graph in `__init__` and list their own constructor
    arguments in `task_config()`. The backbone is serialized in `get_config`,
    so `.keras` artifacts and presets rebuild the whole model.
    """

    backbone_cls = None

    @property
    def backbone(self):
        return self._backbone

    def _set_backbone(self, backbone, preprocessor=None):
        self._backbone = backbone
        self.preprocessor = preprocessor

    def task_config(self):
        return {}

    def get_config(self):
        config = {
            "name": self.name,
            "trainable": self.trainable,
            "backbone": keras.saving.serialize_keras_object(self.backbone),
            "preprocessor": keras.saving.serialize_keras_object(self.preprocessor)
            if self.preprocessor is not None
            else None,
        }
        config.update(self.task_config())
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        if config.get("preprocessor") is not None:
            config["preprocessor"] = keras.saving.deserialize_keras_object(config["preprocessor"])
        return cls(**config)

    def head_weight_paths(self):
        backbone_paths = {v.path for v in self.backbone.weights}
        return [v.path for v in self.weights if v.path not in backbone_paths]

    # --- presets ----------------------------------------------------------

    def write_preset_files(self, directory):
        from kbert.presets.io import save_backbone, save_weights_file, write_json

        files = save_backbone(directory, self.backbone)
        write_json(
            directory,
            TASK_CONFIG_FILE,
            {"format": "kbert-task", "class_name": type(self).__name__, "config": self.task_config()},
        )
        backbone_paths = tuple(v.path for v in self.backbone.weights)
        save_weights_file(directory, TASK_WEIGHTS_FILE, self, exclude=backbone_paths, exact=True)
        files += [TASK_CONFIG_FILE, TASK_WEIGHTS_FILE]
        if self.preprocessor is not None:
            files += self.preprocessor.save_to_directory(directory)
        return files

    @classmethod
    def load_from_preset_dir(cls, directory, load_weights=True, **kwargs):
        import os

        from kbert.presets.io import load_backbone, load_weights_file, read_json
        from kbert.presets.weights import assign_weights

        backbone_overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in ("dtype", "dropout", "attention_dropout", "output_hidden_states")}
        backbone = load_backbone(directory, load_weights=load_weights, **backbone_overrides)
        task_path = os.path.join(directory, TASK_CONFIG_FILE)
        task_config, head_weights = {}, None
        if os.path.isfile(task_path):
            saved = read_json(directory, TASK_CONFIG_FILE)
            if saved.get("class_name") == cls.__name__:
                task_config = saved.get("config", {})
                head_weights = load_weights_file(directory, TASK_WEIGHTS_FILE) if load_weights else None
            else:
                logger.warning(
                    "%s holds a %s head; building a fresh %s head on its backbone",
                    directory, saved.get("class_name"), cls.__name__,
                )
        if "preprocessor" not in kwargs:
            kwargs["preprocessor"] = cls.default_preprocessor(directory, backbone)
        model = cls(backbone=backbone, **{**task_config, **kwargs})
        if head_weights is not None:
            assign_weights(
                model,
                head_weights,
                source=f"head weights in {directory}/{TASK_WEIGHTS_FILE}",
                paths=model.head_weight_paths(),
            )
        elif load_weights:
            from kbert.convert import huggingface

            if not huggingface.load_task_head(model, directory):
                logger.warning(
                    "%s: the %s head is initialised fresh (the preset has no matching head)",
                    directory, cls.__name__,
                )
        return model

    @classmethod
    def default_preprocessor(cls, directory, backbone):
        from kbert.models.preprocessor import BertPreprocessor

        return BertPreprocessor.from_directory(directory, min(128, backbone.max_sequence_length))
