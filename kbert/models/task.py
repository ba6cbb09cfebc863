"""What every task model is: a backbone, an optional preprocessor, a head,
its config and presets. How a task trains and predicts (raw text, checks,
length buckets, compile defaults) is `kbert.training.pipeline`; the
backends' step set-up sits behind `kbert.backend.trainer`."""

import keras

from kbert.backend import keras_internals
from kbert.layers import initializers
from kbert.layers.adapters import train_only_adapters
from kbert.layers.quantization import apply_quantization, quantized_layers_config
from kbert.models import preset_io
from kbert.models.backbone import BertBackbone
from kbert.models.preprocessor import BertPreprocessor
from kbert.training.pipeline import PipelineModel


class Task(preset_io.PresetMixin, PipelineModel):
    """Base class of task models (functional subclasses around a `BertBackbone`).

    Subclasses build their graph in `__init__`, finish with `_init_task`,
    and name their own constructor arguments in `config_names` (read back
    by `task_config()`). The backbone is serialized in `get_config`, so
    `.keras` artifacts and presets rebuild the whole model. The fit
    pipeline's declarations (`kbert.training.pipeline.PipelineModel`) are
    answered from the backbone and preprocessor.
    """

    backbone_cls = BertBackbone
    # The constructor arguments `task_config()` returns, besides the backbone
    # and preprocessor.
    config_names = ("freeze_backbone",)
    # Task presets of these classes hold this task's head among theirs
    # (`from_preset` loads it from them).
    head_weights_from = ()
    # Layers of this task's head those presets do not hold (they start fresh).
    head_weights_fresh = ()

    @property
    def backbone(self):
        return self._backbone

    def _init_task(self, inputs, outputs, backbone, preprocessor, config, kwargs):
        """The end of every task's `__init__`: the functional model, its
        backbone and preprocessor, its `config` values (`config_names`;
        `freeze_backbone` sets what trains), Keras' `kwargs`."""
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self._set_backbone(backbone, preprocessor)
        config = dict(config)
        freeze_backbone = config.pop("freeze_backbone", False)
        for name, value in config.items():
            setattr(self, name, value)
        self.set_backbone_training(freeze_backbone)

    def _set_backbone(self, backbone, preprocessor=None):
        length = getattr(preprocessor, "sequence_length", None)
        if length is not None and length > backbone.max_sequence_length:
            raise ValueError(
                f"the preprocessor packs {length} tokens per row but the backbone takes at most "
                f"max_sequence_length={backbone.max_sequence_length}; build the preprocessor "
                f"with sequence_length <= {backbone.max_sequence_length}"
            )
        self._backbone = backbone
        self.preprocessor = preprocessor

    def task_config(self):
        return {name: getattr(self, name) for name in self.config_names}

    def set_backbone_training(self, freeze_backbone):
        """False: fine-tune everything; True: train the head only (frozen
        features); "adapters": train adapters, LayerNorms and the head
        (the backbone must have `adapter_size`)."""
        if freeze_backbone not in (False, True, "adapters"):
            raise ValueError(
                f"freeze_backbone must be False, True or 'adapters', got {freeze_backbone!r}"
            )
        if freeze_backbone == "adapters":
            train_only_adapters(self.backbone)
        else:
            keras_internals.set_trainable(self.backbone, not freeze_backbone)
        self.freeze_backbone = freeze_backbone

    @staticmethod
    def backbone_inputs(backbone):
        """The backbone's symbolic inputs, to build a task graph on."""
        return {name: backbone.input[name] for name in ("token_ids", "segment_ids", "padding_mask")}

    @staticmethod
    def logits_head(features, backbone, num_classes, dropout):
        """dropout -> Dense(num_classes) -> float32 logits (fixed layer names:
        converters and saved weights use them)."""
        policy = backbone.get_layer("embeddings").dtype_policy
        x = keras.layers.Dropout(dropout, dtype=policy, name="classifier_dropout")(features)
        logits = keras.layers.Dense(
            num_classes,
            kernel_initializer=initializers.truncated_normal(backbone.initializer_range),
            dtype=policy,
            name="logits",
        )(x)
        return keras.layers.Activation("linear", dtype="float32", name="float32_logits")(logits)

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
        config.update(quantized_layers_config(self, exclude=[self.backbone]))
        return config

    @classmethod
    @initializers.placeholders_when_loading
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        if config.get("preprocessor") is not None:
            config["preprocessor"] = keras.saving.deserialize_keras_object(config["preprocessor"])
        quantized = config.pop("quantized_layers", None)
        return apply_quantization(cls(**config), quantized, "the task config")

    def head_weight_paths(self):
        backbone_paths = {v.path for v in self.backbone.weights}
        return [v.path for v in self.weights if v.path not in backbone_paths]

    # --- presets ----------------------------------------------------------

    def write_preset_files(self, directory):
        return preset_io.write_task_files(self, directory)

    @classmethod
    def load_from_preset_dir(cls, directory, load_weights=True, **kwargs):
        return preset_io.load_task(cls, directory, load_weights=load_weights, **kwargs)

    @classmethod
    def window_defaults(cls, kwargs):
        """Backbone settings `from_preset(..., attention_window=W)` takes
        unless given (`kwargs`: the task's other arguments): the task's
        global tokens. The backbone's own default ([CLS]) here."""
        return {}

    @classmethod
    def default_preprocessor(cls, directory, backbone):
        return BertPreprocessor.from_directory(directory, min(128, backbone.max_sequence_length))

    # --- what the fit pipeline asks ---------------------------------------

    def input_limits(self):
        """The ranges model inputs are checked against."""
        backbone = self.backbone
        return {
            "vocabulary_size": backbone.vocabulary_size,
            "type_vocab_size": backbone.type_vocab_size,
            "max_sequence_length": backbone.max_sequence_length,
        }

    def token_inputs(self):
        return self.backbone.token_inputs

    def training_dtype_policy(self):
        return self.backbone.get_layer("embeddings").dtype_policy
