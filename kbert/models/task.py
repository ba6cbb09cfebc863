"""What every task model shares: a backbone, an optional preprocessor,
compile defaults and the config. Raw-text handling lives in
`kbert.models.raw_text`, preset I/O in `kbert.models.preset_io`, the
backends' training-step set-up in `kbert.backend`."""

import contextlib

import keras

from kbert import backend
from kbert.backend import keras_internals
from kbert.backend import tensorflow as tf_backend
from kbert.layers.adapters import train_only_adapters
from kbert.models import preset_io, raw_text
from kbert.models.backbone import BertBackbone
from kbert.models.preprocessor import BertPreprocessor
from kbert.training.optimizer import create_optimizer, exclude_from_weight_decay

if backend.is_torch():
    from kbert.backend import torch_step


class Task(keras_internals.TrainerShims, preset_io.PresetMixin, keras.Model):
    """Base class of task models (functional subclasses around a `BertBackbone`).

    Subclasses build their graph in `__init__` and list their own constructor
    arguments in `task_config()`. The backbone is serialized in `get_config`,
    so `.keras` artifacts and presets rebuild the whole model.
    """

    backbone_cls = BertBackbone

    @property
    def backbone(self):
        return self._backbone

    def _set_backbone(self, backbone, preprocessor=None):
        self._backbone = backbone
        self.preprocessor = preprocessor

    def task_config(self):
        return {}

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
            self.backbone.trainable = not freeze_backbone
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
            kernel_initializer=keras.initializers.TruncatedNormal(
                stddev=backbone.initializer_range
            ),
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
        return preset_io.write_task_files(self, directory)

    @classmethod
    def load_from_preset_dir(cls, directory, load_weights=True, **kwargs):
        return preset_io.load_task(cls, directory, load_weights=load_weights, **kwargs)

    @classmethod
    def default_preprocessor(cls, directory, backbone):
        return BertPreprocessor.from_directory(directory, min(128, backbone.max_sequence_length))

    # --- raw text in fit / evaluate / predict -------------------------------

    def preprocess_samples(self, x):
        """Raw strings (a list, an array, or a (texts, pairs) tuple) -> model
        inputs; model-input dicts pass through."""
        return raw_text.preprocess_samples(self.preprocessor, x)

    def check_targets(self, y):
        """Raises a clear error for targets the task cannot learn from."""

    def fit(self, x=None, y=None, *args, validation_data=None, **kwargs):
        x, y = raw_text.convert(self, x, y)
        if isinstance(validation_data, tuple) and len(validation_data) >= 2:
            vx, vy = raw_text.convert(self, validation_data[0], validation_data[1])
            validation_data = (vx, vy) + tuple(validation_data[2:])
        elif raw_text.is_tf_dataset(validation_data):
            validation_data = raw_text.convert(self, validation_data, None)[0]
        # On torch: batches made on the host, copied without blocking by
        # kbert's step, which a GPU replays as a CUDA graph where it can.
        context = torch_step.fit_context(self) if backend.is_torch() else contextlib.nullcontext()
        with context:
            return super().fit(x, y, *args, validation_data=validation_data, **kwargs)

    def evaluate(self, x=None, y=None, *args, **kwargs):
        x, y = raw_text.convert(self, x, y)
        return super().evaluate(x, y, *args, **kwargs)

    # Tasks whose outputs have no token axis predict raw text in length
    # buckets (see `raw_text.predict_in_buckets`); per-token outputs keep one length.
    bucket_raw_text = False

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Keras `predict`; raw text is tokenized first.

        On raw text, tasks with one output per example (classifier,
        embedder, multiple choice) run each batch cut to its longest
        sequence rounded up to a multiple of 16, instead of
        `preprocessor.sequence_length`: the same numbers (padding is
        masked), several times faster on short texts, and a compiled
        backend compiles once per bucket, not once per length.
        """
        raw = (
            self.preprocessor is not None
            and not isinstance(x, dict)
            and not raw_text.is_tf_dataset(x)
        )
        x, _ = raw_text.convert(self, x, None, with_targets=False)
        bucketed = raw and self.bucket_raw_text and isinstance(x, dict)
        if bucketed and steps is None and callbacks is None:
            outputs = raw_text.predict_in_buckets(self, x, batch_size or 32)
            if outputs is not None:
                return outputs
            return super().predict(x, batch_size=batch_size, verbose=0)
        return super().predict(
            x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks
        )

    def compile(
        self,
        optimizer="adamw",
        learning_rate=5e-5,
        num_train_steps=None,
        num_warmup_steps=None,
        cuda_graph="auto",
        **kwargs,
    ):
        """Fine-tuning defaults: AdamW (weight decay 0.01, none on LayerNorm
        and biases, global-norm clipping 1.0) at `learning_rate`, with 10%
        linear warm-up and linear decay when `num_train_steps` is given.

        `cuda_graph`: on the torch backend with a GPU and kbert's AdamW,
        `fit` captures its training step as a CUDA graph and replays it
        (`model.cuda_graph_stats` reports replays). "auto": only when
        the step runs no code of yours (losses and metrics given as strings
        or Keras/kbert objects, no overridden `compute_loss`, `train_step`,
        `compute_metrics` or `call`), since a replay does not rerun Python:
        code that reads Python state changing between steps would see it
        frozen at capture. True: also with your code (it must compute from
        its tensors only). False: every step eager. No effect elsewhere."""
        if cuda_graph not in ("auto", True, False):
            raise ValueError(f'cuda_graph must be "auto", True or False; got {cuda_graph!r}')
        self.cuda_graph = cuda_graph
        if isinstance(optimizer, str) and optimizer in ("adamw", "lamb"):
            steps = num_train_steps or 10**9  # no decay when the length is unknown
            warmup = (
                num_warmup_steps
                if num_warmup_steps is not None
                else (steps // 10 if num_train_steps else 0)
            )
            optimizer = create_optimizer(learning_rate, steps, warmup, kind=optimizer)
        if not isinstance(optimizer, str):
            exclude_from_weight_decay(optimizer, self)
        policy = self.backbone.get_layer("embeddings").dtype_policy
        if policy.name == "mixed_float16" and not isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer
        ):
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        super().compile(optimizer=optimizer, **kwargs)

    def train_step(self, *args, **kwargs):
        if backend.is_torch() and torch_step.runs_our_step(self):
            # Keras' torch step synchronises the GPU stream several times;
            # kbert's does not.
            return torch_step.task_train_step(self, *args, **kwargs)
        return tf_backend.multi_worker_logs(self, super().train_step(*args, **kwargs))

    def test_step(self, *args, **kwargs):
        if backend.is_torch():
            # Validation inside fit gets host batches too (see fit), and
            # Keras' loss and metric constants are made on the device.
            return torch_step.task_test_step(super().test_step, *args, **kwargs)
        return tf_backend.multi_worker_logs(self, super().test_step(*args, **kwargs))

    def compile_from_config(self, config):
        # Our compile only adds defaults, so a saved compile config replays as is.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)
