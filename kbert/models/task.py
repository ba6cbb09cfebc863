"""What every task model shares: a backbone, an optional preprocessor, and
preset loading/saving of backbone + head."""

import contextlib
import logging

import keras

from kbert.models.preset_mixin import PresetMixin

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
)


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

    def set_backbone_training(self, freeze_backbone):
        """False: fine-tune everything; True: train the head only (frozen
        features); "adapters": train adapters, LayerNorms and the head
        (the backbone must have `adapter_size`)."""
        from kbert.layers.adapters import train_only_adapters

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
        from kbert.presets.io import save_backbone, save_weights_file, write_json

        files = save_backbone(directory, self.backbone)
        write_json(
            directory,
            TASK_CONFIG_FILE,
            {
                "format": "kbert-task",
                "class_name": type(self).__name__,
                "config": self.task_config(),
            },
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

        backbone_overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in BACKBONE_OVERRIDES}
        backbone = load_backbone(directory, load_weights=load_weights, **backbone_overrides)
        task_path = os.path.join(directory, TASK_CONFIG_FILE)
        task_config, head_weights = {}, None
        if os.path.isfile(task_path):
            saved = read_json(directory, TASK_CONFIG_FILE)
            if saved.get("class_name") == cls.__name__:
                task_config = saved.get("config", {})
                head_weights = (
                    load_weights_file(directory, TASK_WEIGHTS_FILE) if load_weights else None
                )
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
                    directory,
                    cls.__name__,
                )
        return model

    # --- raw text in fit / evaluate / predict -------------------------------

    def preprocess_samples(self, x):
        """Raw strings (a list, an array, or a (texts, pairs) tuple) -> model
        inputs; model-input dicts pass through."""
        if self.preprocessor is None or isinstance(x, dict) or x is None:
            return x
        if isinstance(x, tuple) and len(x) == 2 and _is_text(x[0]) and _is_text(x[1]):
            return self.preprocessor(x[0], x[1])
        if _is_text(x):
            return self.preprocessor(x)
        return x

    def check_targets(self, y):
        """Raises a clear error for targets the task cannot learn from."""

    def _dataset(self, data, with_targets):
        """Maps a tf.data dataset of raw strings through the in-graph
        preprocessor. Elements are `x` (predict) or `(x, y[, w])`, where `x`
        is a string batch or a `(texts, pairs)` tuple."""
        import tensorflow as tf

        def convert_x(x):
            if isinstance(x, tuple) and len(x) == 2:
                return self.preprocessor(x[0], x[1])
            if isinstance(x, tf.Tensor) and x.dtype == tf.string:
                return self.preprocessor(x)
            return x

        if with_targets:
            return data.map(
                lambda x, *rest: (convert_x(x),) + rest, num_parallel_calls=tf.data.AUTOTUNE
            )
        return data.map(
            lambda *x: convert_x(x if len(x) > 1 else x[0]), num_parallel_calls=tf.data.AUTOTUNE
        )

    def _convert(self, x, y, with_targets=True):
        if _is_tf_dataset(x):
            return (self._dataset(x, with_targets) if self.preprocessor is not None else x), y
        if y is not None:
            checked = self.check_targets(y)
            y = y if checked is None else checked
        return self.preprocess_samples(x), y

    def fit(self, x=None, y=None, *args, validation_data=None, **kwargs):
        x, y = self._convert(x, y)
        if isinstance(validation_data, tuple) and len(validation_data) >= 2:
            vx, vy = self._convert(validation_data[0], validation_data[1])
            validation_data = (vx, vy) + tuple(validation_data[2:])
        elif _is_tf_dataset(validation_data):
            validation_data = self._convert(validation_data, None, with_targets=True)[0]
        batches = contextlib.nullcontext()
        if self._sync_free_torch_step():
            # Batches made on the host, copied without blocking by our step,
            # which a GPU replays as a CUDA graph where it can.
            from kbert.training.torch_step import (
                GraphedTrainStep,
                cuda_graph_supported,
                host_batches,
            )

            batches = host_batches()
            graph = getattr(self, "cuda_graph", "auto")
            if graph and cuda_graph_supported(self, force=graph is True):
                self._graphed_step = GraphedTrainStep(self)
        try:
            with batches:
                return super().fit(x, y, *args, validation_data=validation_data, **kwargs)
        finally:
            graphed = getattr(self, "_graphed_step", None)
            if graphed is not None:  # the graph lives for one fit; its counts stay
                self.cuda_graph_stats = graphed.stats()
                self._graphed_step = None

    def evaluate(self, x=None, y=None, *args, **kwargs):
        x, y = self._convert(x, y)
        return super().evaluate(x, y, *args, **kwargs)

    # Tasks whose outputs have no token axis predict raw text in length
    # buckets (see `_predict_in_buckets`); per-token outputs keep one length.
    bucket_raw_text = False
    BUCKET = 16

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Keras `predict`; raw text is tokenized first.

        On raw text, tasks with one output per example (classifier,
        embedder, multiple choice) run each batch cut to its longest
        sequence rounded up to a multiple of 16, instead of
        `preprocessor.sequence_length`: the same numbers (padding is
        masked), several times faster on short texts, and a compiled
        backend compiles once per bucket, not once per length.
        """
        raw = self.preprocessor is not None and not isinstance(x, dict) and not _is_tf_dataset(x)
        x, _ = self._convert(x, None, with_targets=False)
        if (
            raw
            and self.bucket_raw_text
            and isinstance(x, dict)
            and steps is None
            and callbacks is None
        ):
            return self._predict_in_buckets(x, batch_size or 32)
        return super().predict(
            x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks
        )

    def _predict_in_buckets(self, x, batch_size):
        import numpy as np

        full = x["padding_mask"].shape[-1]
        outputs = []
        for start in range(0, len(x["padding_mask"]), batch_size):
            batch = {name: value[start : start + batch_size] for name, value in x.items()}
            # Preprocessor output is right-padded: the columns past the
            # longest sequence are padding in every row.
            longest = int(np.max(np.sum(batch["padding_mask"], axis=-1), initial=1))
            length = min(full, -(-longest // self.BUCKET) * self.BUCKET)
            outputs.append(
                self.predict_on_batch({name: value[..., :length] for name, value in batch.items()})
            )
        if not outputs:
            return super().predict(x, batch_size=batch_size, verbose=0)
        return keras.tree.map_structure(lambda *parts: np.concatenate(parts, axis=0), *outputs)

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
        (`kbert.training.torch_step.GraphedTrainStep`). "auto": only when
        the step runs no code of yours (losses and metrics given as strings
        or Keras/kbert objects, no overridden `compute_loss`, `train_step`,
        `compute_metrics` or `call`), since a replay does not rerun Python:
        code that reads Python state changing between steps would see it
        frozen at capture. True: also with your code (it must compute from
        its tensors only). False: every step eager. No effect elsewhere."""
        if cuda_graph not in ("auto", True, False):
            raise ValueError(f'cuda_graph must be "auto", True or False; got {cuda_graph!r}')
        self.cuda_graph = cuda_graph
        from kbert.training.optimizer import create_optimizer, exclude_from_weight_decay

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

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras' TensorFlow trainer builds the model from a sample batch that
        # it reduces with `strategy.reduce` on the nested structure, which
        # MultiWorkerMirroredStrategy rejects ("Attempt to convert a value
        # ({'token_ids': PerReplica..."). A kbert task is built when it is
        # constructed; when only the optimizer is left, build it directly.
        strategy = getattr(self, "_distribute_strategy", None)
        built = (
            all(layer.built for layer in self._flatten_layers())
            and (self._compile_metrics is None or self._compile_metrics.built)
            and (self._compile_loss is None or self._compile_loss.built)
        )
        if strategy is not None and built:
            if self.optimizer is not None and not self.optimizer.built:
                with strategy.scope():
                    self.optimizer.build(self.trainable_variables)
            return
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _sync_free_torch_step(self):
        """Whether fit runs kbert.training.torch_step's step: torch, eager
        (with jit_compile, torch.compile traces Keras' own step)."""
        return keras.backend.backend() == "torch" and not self.jit_compile

    def train_step(self, *args, **kwargs):
        if self._sync_free_torch_step():
            # Keras' torch step synchronises the GPU stream several times;
            # ours does not.
            from kbert.training.torch_step import train_step

            graphed = getattr(self, "_graphed_step", None)
            if graphed is not None:
                return graphed(*args, **kwargs)
            return train_step(self, *args, **kwargs)
        return _multi_worker_logs(self, super().train_step(*args, **kwargs))

    def test_step(self, *args, **kwargs):
        if keras.backend.backend() == "torch":
            # Validation inside fit gets host batches too (see fit), and
            # Keras' loss and metric constants are made on the device.
            from kbert.training.torch_step import constants_on_device, to_device

            with constants_on_device():
                return super().test_step(*to_device(args), **kwargs)
        return _multi_worker_logs(self, super().test_step(*args, **kwargs))

    def compile_from_config(self, config):
        # Our compile only adds defaults, so a saved compile config replays as is.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    @classmethod
    def default_preprocessor(cls, directory, backbone):
        from kbert.models.preprocessor import BertPreprocessor

        return BertPreprocessor.from_directory(directory, min(128, backbone.max_sequence_length))


def _multi_worker_logs(model, logs):
    """Keras' TensorFlow trainer averages logs across MultiWorkerMirrored
    workers with `strategy.reduce("MEAN", v, axis=0)`, which fails on scalar
    logs ("Invalid reduction dimension 0 for input with 0 dimensions"). Give
    them a length-1 axis there; the reduction makes them scalars again."""
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None or not isinstance(logs, dict):
        return logs
    import tensorflow as tf

    if (
        not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        or not strategy.extended._in_multi_worker_mode()
    ):
        return logs
    return {
        k: tf.reshape(v, (1,)) if tf.is_tensor(v) and v.shape.rank == 0 else v
        for k, v in logs.items()
    }


def _is_text(x):
    import numpy as np

    if isinstance(x, str):
        return True
    if isinstance(x, np.ndarray):
        return x.dtype.kind in ("U", "S", "O") and (
            x.size == 0 or isinstance(x.reshape(-1)[0], (str, bytes))
        )
    if isinstance(x, (list, tuple)):
        # any string: the preprocessor then names whatever is not one
        return any(isinstance(v, (str, bytes)) for v in x)
    return False


def _is_tf_dataset(x):
    import sys

    if "tensorflow" not in sys.modules:
        return False
    import tensorflow as tf

    return isinstance(x, tf.data.Dataset)
