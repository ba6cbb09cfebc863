"""The fit pipeline: what a model's `fit`, `evaluate` and `predict` do
before Keras' loop sees the data, and the training defaults of `compile`.

`PipelineModel` (a `keras.Model` base, like keras-hub's `PipelineModel`)
takes model inputs, raw text (through the model's preprocessor) or
`tf.data`; checks them on the host (ids, segment ids, masks, lengths,
targets) with errors that name the problem; cuts host batches to length
buckets (`kbert.training.batching`), packs rows where that pays; stops a
`fit` whose loss turns non-finite; and hands each backend's step set-up to
`kbert.backend.trainer`.

A model using it says what the pipeline must know (`PipelineModel`'s
attributes below); `kbert.models.Task` does so for every task model.
"""

import contextlib
import inspect
import numbers

import keras
import numpy as np

from kbert import backend
from kbert.backend import keras_internals, trainer
from kbert.training import batching, distribution, raw_text
from kbert.training.callbacks import NonFiniteLossError, ResumableCheckpoint
from kbert.training.optimizer import EPSILON, create_optimizer, exclude_from_weight_decay
from kbert.utils import checks


class PipelineModel(trainer.BackendTrainer, keras.Model):
    """`fit`, `evaluate`, `predict` (and the `*_on_batch` calls) on model
    inputs, raw text or `tf.data`, with host checks and length buckets;
    `compile` with BERT's fine-tuning defaults.

    What a subclass declares:
    - `preprocessor` (an attribute the subclass sets): raw text -> model
      inputs, or None (model inputs only).
    - `input_limits()`: {"vocabulary_size", "type_vocab_size",
      "max_sequence_length"}, the ranges inputs are checked against.
    - `token_inputs()`: the inputs with a token axis, cut by length buckets.
    - `compile_defaults(given)`: the loss and metrics `compile` fills in
      where `given` (the caller's compile arguments) has none.
    - `training_dtype_policy()`: the policy the model computes in.
    - `check_targets(y)`: raises for targets the model cannot learn from;
      may return them converted.
    - `token_targets`: targets and weights have a token axis (per-token
      labels), cut with the inputs when batches are bucketed.
    - `token_outputs`, `token_output_fill`: outputs have a token axis
      (axis 1); bucketed predictions are padded back to the input length
      with the fill value.
    - `targets_required`, `targets_hint`: `fit` / `evaluate` on host
      inputs need targets (`y`), described thus in the error.
    - `bucket_datasets`: batched tf.data inputs are cut to bucket lengths too.
    - `packs_rows`: `fit` may pack several examples per row
      (`batching.PackedBatches`; per-example outputs only).
    - `adam_epsilon`: the epsilon of `compile`'s "adamw" and "lamb".

    A setting users change on a model:
    - `trace_inference` ("auto", True or False): on torch on a CPU, small
      `predict_on_batch` batches replay TorchScript traces of the forward
      (`kbert.backend.torch_trace`); "auto" where `call` and
      `predict_step` are Keras' or kbert's, True for any, False never.
    """

    token_targets = False
    token_outputs = False
    token_output_fill = 0.0
    adam_epsilon = EPSILON  # `compile`'s default: the original BERT's
    targets_required = True
    targets_hint = "pass them as `y` (labels for texts, or target arrays for model inputs)"
    bucket_datasets = True
    packs_rows = False
    trace_inference = "auto"

    def input_limits(self):
        raise NotImplementedError(f"{type(self).__name__} must define input_limits()")

    def compile_defaults(self, given):
        """{compile argument: default} for the arguments `given` lacks."""
        return {}

    def token_inputs(self):
        """The names of the model inputs with a token axis (their last),
        which length buckets cut; a BERT encoder's three by default."""
        return batching.TOKEN_INPUTS

    def training_dtype_policy(self):
        """The dtype policy training runs in (mixed_float16 gets loss scaling)."""
        return self.dtype_policy

    def preprocess_samples(self, x):
        """Raw strings (a list, an array, or a (texts, pairs) tuple) -> model
        inputs; model-input dicts pass through."""
        return raw_text.preprocess_samples(self.preprocessor, x)

    def check_targets(self, y):
        """Raises a clear error for targets the task cannot learn from."""

    def takes_class_ids(self):
        """Whether the compiled loss takes one class id per example (sparse
        categorical cross-entropy, the default of kbert's classifiers),
        rather than, say, one-hot or multi-hot rows of the user's loss."""
        loss = getattr(self, "loss", None)
        if loss is None or isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
            return True
        name = loss if isinstance(loss, str) else getattr(loss, "__name__", "")
        return "sparse_categorical" in name

    def _prepare_inputs(self, x, bucket):
        """Model inputs checked before a backend sees them: host arrays here
        (one numpy pass), tf.data datasets in their pipeline (and cut to
        bucket lengths when `bucket`, a multiple or 0)."""
        if raw_text.is_tf_dataset(x):
            bucket = bucket if self.bucket_datasets else 0
            return batching.map_dataset(
                x,
                self.input_limits(),
                self.token_targets,
                bool(bucket),
                bucket or 1,
                token_inputs=self.token_inputs(),
            )
        if isinstance(x, dict):
            self._check_input_names(x)
            checks.check_model_inputs(x, **self.input_limits())
        return x

    def _check_input_names(self, x):
        """A ValueError naming the inputs a model-input dict lacks."""
        try:
            names = [t.name for t in self.inputs]
        except (AttributeError, ValueError, TypeError):  # not a functional graph
            return
        missing = [name for name in names if name not in x]
        if missing:
            raise ValueError(
                f"{type(self).__name__} inputs lack {', '.join(missing)}: it takes a dict "
                f"with {', '.join(names)} (got {', '.join(map(str, x)) or 'no keys'})"
            )

    def _bucketed(
        self,
        x,
        y,
        sample_weight,
        batch_size,
        shuffle,
        multiple,
        group_by_length=False,
        pack=False,
        shape_cost=0.0,
    ):
        if pack is None and not batching.packs_by_default():
            pack = False
        if pack is not False and self._data_parallel():
            if pack:
                raise ValueError(
                    "pack_rows=True runs on one device: a packed batch's rows and "
                    "examples cannot be split between replicas"
                )
            pack = False
        if pack is not False and batching.can_pack(self, x, y, sample_weight):
            batches = batching.PackedBatches(
                x, y, sample_weight, batch_size or 32, bool(shuffle), group_by_length, multiple
            )
            if not (pack or batching.packing_pays(batches)):
                batches.unpack()  # the same batches (and random draws), each cut to its bucket
            return batches.as_dataset()
        if pack:
            raise ValueError(
                f"pack_rows=True needs a task with one output per example "
                f"({type(self).__name__} has not) and inputs as arrays "
                f"of token_ids, segment_ids and padding_mask (N, T), "
                f"each example with at least one real token"
            )
        return batching.BucketedBatches(
            x,
            y,
            sample_weight,
            batch_size=batch_size or 32,
            shuffle=bool(shuffle),
            group_by_length=group_by_length,
            token_targets=self.token_targets,
            token_inputs=self.token_inputs(),
            multiple=multiple,
            shape_cost=shape_cost,
        ).as_dataset()

    def fit(
        self,
        x=None,
        y=None,
        *args,
        bucket_lengths=True,
        group_by_length=False,
        pack_rows=None,
        **kwargs,
    ):
        """Keras `fit`, on model inputs, raw text or `tf.data`.

        Inputs are checked before any backend gathers (ids, segment ids,
        mask values, lengths). With `bucket_lengths` (the default), each
        batch of host arrays or of a batched `tf.data` dataset is cut to
        its longest sequence rounded up to a multiple of 16 (see
        `kbert.training.batching`): the same losses as padding to the full
        length, for a fraction of the work. On JAX with a GPU or TPU,
        host arrays are cut to one length instead, their longest sequence
        rounded up to 16 (one compilation of the step), and `tf.data`
        batches to multiples of 64; pass `bucket_lengths=16` for buckets
        of 16 there. Not with `validation_split`,
        `class_weight` or `steps_per_epoch` (Keras' own batching then).
        `group_by_length`: batch examples of similar length together (the
        batch order stays random), for less padding still.
        `pack_rows` (`BertClassifier`, inputs as host arrays): several
        examples per row, attention kept inside each example
        (`kbert.training.batching.PackedBatches`); the same batches, losses
        and gradients as length buckets, to float rounding (dropout draws
        differ). None (the default) packs on JAX on a CPU where that
        leaves at most 80% of the positions of length buckets; True
        always, False never.
        """
        a = _bind(keras.Model.fit, x, y, *args, **kwargs)
        _require_compiled(self, "fit")
        _require_data(self, "fit", a["x"], a["y"])
        if "shuffle" not in _given(keras.Model.fit, x, y, *args, **kwargs) and _batched_source(
            a["x"]
        ):
            a["shuffle"] = False  # Keras' default, which it warns a dataset ignores
        trainer.warm_up(self)  # on torch the Adam kernel compiles while the text is tokenized
        a["x"], a["y"] = raw_text.convert(self, a["x"], a["y"])
        bucket_lengths = _multiple(bucket_lengths, self, a["x"])
        a["x"] = self._prepare_inputs(a["x"], bucket_lengths)
        if (
            bucket_lengths
            and not a["validation_split"]
            and a["class_weight"] is None
            and a["steps_per_epoch"] is None
            and batching.can_bucket(a["x"], a["y"], a["sample_weight"])
        ):
            a["x"] = self._bucketed(
                a["x"],
                a["y"],
                a["sample_weight"],
                a["batch_size"],
                a["shuffle"],
                bucket_lengths,
                group_by_length,
                pack=pack_rows,
                shape_cost=batching.training_shape_cost(
                    self, a["batch_size"] or 32, a["epochs"] - a["initial_epoch"]
                ),
            )
            a.update(y=None, sample_weight=None, batch_size=None, shuffle=False)
        elif pack_rows:
            raise ValueError(
                "pack_rows=True needs length buckets (bucket_lengths not False) and "
                "inputs as host arrays, without validation_split, class_weight or "
                "steps_per_epoch"
            )
        validation = a["validation_data"]
        if isinstance(validation, tuple) and len(validation) >= 2:
            vx, vy = raw_text.convert(self, validation[0], validation[1])
            vx = self._prepare_inputs(vx, bucket_lengths)
            vw = validation[2] if len(validation) > 2 else None
            if bucket_lengths and a["validation_steps"] is None and batching.can_bucket(vx, vy, vw):
                size = a["validation_batch_size"] or a["batch_size"] or 32
                validation = self._bucketed(vx, vy, vw, size, False, bucket_lengths)
                a["validation_batch_size"] = None
            else:
                validation = (vx, vy) + tuple(validation[2:])
        elif raw_text.is_tf_dataset(validation):
            validation = raw_text.convert(self, validation, None)[0]
            validation = self._prepare_inputs(validation, bucket_lengths)
        a["validation_data"] = validation
        steps = _steps(a["x"], a["batch_size"], a["steps_per_epoch"])
        epochs = max(a["epochs"] - a["initial_epoch"], 1)
        trainer.plan_steps(self, None if steps is None else steps * epochs, ("train", "test"))
        stack = contextlib.ExitStack()
        if isinstance(a["x"], batching.BucketedBatches):
            # the shapes to come compiled in the background (JAX)
            held_out = validation if isinstance(validation, batching.BucketedBatches) else None
            ahead = trainer.ahead_compiler(self, a["x"], held_out, epochs, a["callbacks"])
            if ahead is not None:
                a["callbacks"], close = ahead
                stack.callback(close)  # also when fit raises
        if distribution.torch_ddp_active():
            if self.jit_compile:
                raise ValueError(
                    "torch-ddp runs kbert's torch training step, not torch.compile: "
                    "compile the model with jit_compile=False"
                )
            a["x"] = distribution.shard_for_process(a["x"])
        context = trainer.fit_context(self)
        # a non-finite training loss ends fit with an error, unless a callback
        # of the caller's deals with it (or the caller built the CallbackList)
        given = a["callbacks"]
        handled = isinstance(given, keras.callbacks.CallbackList) or any(
            isinstance(c, _HANDLE_NON_FINITE) for c in keras.tree.flatten(given or [])
        )
        if not handled:
            a["callbacks"] = trainer.with_callback(given, _StopOnNonFiniteLoss())
        with stack, context, _input_errors(), checks.inputs_checked_on_host():
            with trainer.variables_kept_on_error(self):
                history = super().fit(**a)
        if not handled:
            _raise_on_non_finite_loss(history)
        return history

    def _data_parallel(self):
        """Whether batches are split between replicas: torch DDP, a
        `keras.distribution`, a TensorFlow strategy of several replicas."""
        if distribution.torch_ddp_active() or keras.distribution.distribution() is not None:
            return True
        return backend.is_tensorflow() and self.distribute_strategy.num_replicas_in_sync > 1

    def evaluate(self, x=None, y=None, *args, bucket_lengths=True, **kwargs):
        """Keras `evaluate`, with `fit`'s input checks and length buckets
        (the batches of fixed-length padding, each cut to its bucket)."""
        a = _bind(keras.Model.evaluate, x, y, *args, **kwargs)
        _require_compiled(self, "evaluate")
        _require_data(self, "evaluate", a["x"], a["y"])
        a["x"], a["y"] = raw_text.convert(self, a["x"], a["y"])
        bucket_lengths = _multiple(bucket_lengths, self, a["x"])
        a["x"] = self._prepare_inputs(a["x"], bucket_lengths)
        if (
            bucket_lengths
            and a["steps"] is None
            and batching.can_bucket(a["x"], a["y"], a["sample_weight"])
        ):
            a["x"] = self._bucketed(
                a["x"], a["y"], a["sample_weight"], a["batch_size"], False, bucket_lengths
            )
            a.update(y=None, sample_weight=None, batch_size=None)
        if not a.get("_use_cached_eval_dataset"):  # not fit's validation: fit planned that
            trainer.plan_steps(self, _steps(a["x"], a["batch_size"], a["steps"]), ("test",))
        with _input_errors(), checks.inputs_checked_on_host():
            with trainer.variables_kept_on_error(self):
                return super().evaluate(**a)

    def predict(
        self, x, batch_size=None, verbose="auto", steps=None, callbacks=None, bucket_lengths=True
    ):
        """Keras `predict`, on model inputs, raw text or `tf.data`.

        Inputs are checked first. With `bucket_lengths`, host inputs run in
        length order, each batch cut to its longest sequence rounded up to
        a multiple of 16 (on JAX with a GPU or TPU 32; on a GPU each
        bucket's program compiles ahead, side by side, its batches running
        on a loop program until then; `tf.data` batches 64), and
        come back in input order (per-token outputs padded back to the
        input length): the same numbers as full-length
        padding (padding is masked), several times faster on short texts,
        and a compiled backend compiles once per bucket, not once per length.
        No examples (an empty list, or model inputs with no rows) give
        outputs with no rows.
        """
        if x is None:
            raise ValueError(
                f"{type(self).__name__}.predict needs inputs: texts, or model inputs "
                "(a dict with token_ids, segment_ids, padding_mask)"
            )
        if no_examples(x):
            return self._empty_outputs(x)
        bucket_lengths = _multiple(bucket_lengths, self, predicting=not raw_text.is_tf_dataset(x))
        x, _ = raw_text.convert(self, x, None, with_targets=False)
        x = self._prepare_inputs(x, 0 if self.token_outputs else bucket_lengths)
        trainer.plan_steps(self, _steps(x, batch_size, steps), ("predict",))
        with trainer.predict_context(self), _input_errors(), checks.inputs_checked_on_host():
            with trainer.variables_kept_on_error(self):
                return self._predict(x, batch_size, verbose, steps, callbacks, bucket_lengths)

    def _predict(self, x, batch_size, verbose, steps, callbacks, bucket_lengths):
        if bucket_lengths and steps is None and callbacks is None and batching.can_bucket(x):
            return self._predict_bucketed(x, batch_size or 32, bucket_lengths)
        return super().predict(
            x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks
        )

    def _predict_bucketed(self, x, batch_size, multiple):
        batches = batching.BucketedBatches(
            x, batch_size=batch_size, sort=True, multiple=multiple, token_inputs=self.token_inputs()
        )
        trainer.compile_predict_ahead(self, batches)
        full = batches.full
        # consecutive batches of one bucket length run as one Keras predict
        groups, rows = [], []
        for index, length in enumerate(batches.batch_lengths):
            if groups and groups[-1][0] == length:
                groups[-1][1].append(batches[index])
                rows[-1].append(batches.batches[index])
            else:
                groups.append((length, [batches[index]]))
                rows.append([batches.batches[index]])
        parts = []
        for _, group in groups:
            out = super().predict(batching.BatchList(group).as_dataset(), verbose=0)
            if self.token_outputs:
                out = keras.tree.map_structure(
                    lambda v: batching.pad_token_axis(v, full, self.token_output_fill), out
                )
            parts.append(out)
        return batching.unsort(parts, [np.concatenate(r) for r in rows], len(batches.lengths))

    def predict_on_batch(self, x):
        """Keras `predict_on_batch`; model inputs of any length are checked,
        padded to their bucket length (so a compiled backend compiles once
        per bucket) and per-token outputs brought back to the input length.
        On JAX and TensorFlow on a CPU a batch of rows of mixed length runs
        as groups of rows of similar length, each cut to its own bucket
        (`kbert.training.batching.length_groups`)."""
        if no_examples(x):
            return self._empty_outputs(x)
        x = self.preprocess_samples(x)
        if not isinstance(x, dict) or not batching.can_bucket(x):
            return super().predict_on_batch(x)
        checks.check_model_inputs(x, **self.input_limits())
        groups = batching.length_groups(
            x,
            batching.batch_multiple(self),
            self.input_limits()["max_sequence_length"],
            split=batching.splits_batches(self),
            cut=trainer.traces_inference(self),
        )

        def restore(out, full):
            if not self.token_outputs:
                return out
            return keras.tree.map_structure(
                lambda v: batching.fit_token_axis(np.asarray(v), full, fill=self.token_output_fill),
                out,
            )

        with checks.inputs_checked_on_host():
            return batching.predict_in_groups(
                x, groups, super().predict_on_batch, restore, self.token_inputs()
            )

    def _empty_outputs(self, x):
        """What `predict` returns for no examples: the outputs the model
        computes for inputs with no rows (model inputs are checked first),
        raw text taken at the preprocessor's `sequence_length`."""
        if isinstance(x, dict):
            self._prepare_inputs(x, 0)
            shapes = {t.name: np.shape(x[t.name]) for t in self.inputs}
        else:
            limit = self.input_limits()["max_sequence_length"]
            length = min(getattr(self.preprocessor, "sequence_length", None) or limit, limit)
            shapes = {
                t.name: (0, *(length if d is None else d for d in t.shape[1:])) for t in self.inputs
            }
        inputs = {name: keras.KerasTensor(shape, "int32") for name, shape in shapes.items()}
        spec = self.compute_output_spec(inputs)
        return keras.tree.map_structure(lambda t: np.zeros(t.shape, t.dtype), spec)

    def __call__(self, inputs, *args, **kwargs):
        if isinstance(inputs, dict) and not checks.host_checked():
            # eager calls on concrete values; traced ones were checked on the host
            checks.check_model_inputs(inputs, **self.input_limits())
        return super().__call__(inputs, *args, **kwargs)

    def train_on_batch(self, x, y=None, *args, **kwargs):
        x, y = raw_text.convert(self, x, y)
        x = self._prepare_inputs(x, False)
        with checks.inputs_checked_on_host():
            return super().train_on_batch(x, y, *args, **kwargs)

    def test_on_batch(self, x, y=None, *args, **kwargs):
        x, y = raw_text.convert(self, x, y)
        x = self._prepare_inputs(x, False)
        with checks.inputs_checked_on_host():
            return super().test_on_batch(x, y, *args, **kwargs)

    def compile(
        self,
        optimizer="adamw",
        learning_rate=5e-5,
        num_train_steps=None,
        num_warmup_steps=None,
        cuda_graph="auto",
        autotune="auto",
        epsilon=None,
        **kwargs,
    ):
        """Fine-tuning defaults: AdamW (weight decay 0.01, none on LayerNorm
        and biases, global-norm clipping 1.0) at `learning_rate`, with 10%
        linear warm-up and linear decay when `num_train_steps` is given.

        `epsilon`: Adam's epsilon for "adamw" and "lamb"; None: the task's
        `adam_epsilon` (the original BERT's 1e-6; 1e-8 where new weights
        get tiny gradients: `BertSeq2SeqLM`'s new cross-attention,
        progressive transfer's feature-map losses).

        `cuda_graph`: on the torch backend with a GPU and kbert's AdamW,
        `fit` captures its training step as a CUDA graph and replays it
        (`model.cuda_graph_stats` reports replays). "auto": only when
        the step runs no code of yours (losses and metrics given as strings
        or Keras/kbert objects, no overridden `compute_loss`, `train_step`,
        `compute_metrics` or `call`), since a replay does not rerun Python:
        code that reads Python state changing between steps would see it
        frozen at capture. True: also with your code (it must compute from
        its tensors only). False: every step eager. No effect elsewhere.

        `autotune`: on JAX with a GPU, whether XLA autotunes the matrix
        products of each step program it compiles (seconds per program,
        repaid over about 10,000 steps; see `kbert.backend.jax_compile`).
        "auto": for training runs of at least
        `kbert.backend.trainer.AUTOTUNE_MIN_STEPS` steps, counted by the
        optimizer's schedule (`num_train_steps`, or the total steps of a
        given optimizer's schedule: a run fitted in pieces counts whole)
        or, without one, by the `fit`; for an `evaluate` or `predict` of
        that many batches; and for calls of unknown length (a `tf.data`
        dataset without a schedule); decided when the call first makes the
        step (after `compile`), which later calls reuse. True: always
        (XLA's default). False: never. No effect elsewhere."""
        if cuda_graph not in ("auto", True, False):
            raise ValueError(f'cuda_graph must be "auto", True or False; got {cuda_graph!r}')
        if not (autotune is True or autotune is False or autotune == "auto"):
            raise ValueError(f'autotune must be "auto", True or False; got {autotune!r}')
        named = isinstance(optimizer, str) and optimizer in ("adamw", "lamb")
        if epsilon is not None and not named:
            raise ValueError(
                f"epsilon={epsilon!r} sets kbert's 'adamw' or 'lamb'; got optimizer="
                f"{optimizer!r}: give your optimizer its own epsilon"
            )
        epsilon = self.adam_epsilon if epsilon is None else epsilon
        if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not epsilon > 0:
            raise ValueError(f"epsilon must be a positive number, got {epsilon!r}")
        self.cuda_graph = cuda_graph
        self.autotune = autotune if isinstance(autotune, bool) else "auto"
        trainer.clear_step_plan(self)  # Keras' compile makes new steps
        if named:
            # no decay when the length is unknown (nor a run length for the trainer)
            steps = num_train_steps or trainer.UNKNOWN_RUN_STEPS
            warmup = (
                num_warmup_steps
                if num_warmup_steps is not None
                else (steps // 10 if num_train_steps else 0)
            )
            optimizer = create_optimizer(
                learning_rate, steps, warmup, kind=optimizer, epsilon=epsilon
            )
        if not isinstance(optimizer, str):
            exclude_from_weight_decay(optimizer, self)
        if self.training_dtype_policy().name == "mixed_float16" and not isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer
        ):
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        for name, value in self.compile_defaults(kwargs).items():
            if kwargs.get(name) is None:
                kwargs[name] = value
        super().compile(optimizer=optimizer, **kwargs)

    def compile_from_config(self, config):
        # Our compile only adds defaults, so a saved compile config replays as is.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)


def _multiple(bucket_lengths, model=None, training_inputs=None, predicting=False):
    """`bucket_lengths` (True, False or a multiple) -> the multiple, 0 for off.
    With `training_inputs` (`fit`, `evaluate`), True is
    `batching.training_multiple` of them; `predicting`,
    `batching.predict_multiple`."""
    if bucket_lengths is True:
        if training_inputs is not None:
            return batching.training_multiple(model, training_inputs)
        if predicting:
            return batching.predict_multiple(model)
        return batching.default_multiple(model)
    if bucket_lengths is False or bucket_lengths is None:
        return 0
    if isinstance(bucket_lengths, int) and bucket_lengths > 0:
        return bucket_lengths
    raise ValueError(
        f"bucket_lengths must be True, False or a positive int (a multiple), got {bucket_lengths!r}"
    )


def no_examples(x):
    """Whether `x` holds no examples: an empty list, tuple or array (of
    texts, or of word lists), a (texts, pairs) tuple of two empty ones, or
    a dict of model inputs whose arrays have no rows."""

    def empty(value):
        if isinstance(value, (list, tuple)):
            return len(value) == 0
        return np.ndim(value) > 0 and np.shape(value)[0] == 0

    if isinstance(x, dict):
        return bool(x) and all(empty(v) for v in x.values())
    if isinstance(x, tuple) and len(x) == 2 and not any(isinstance(v, str) for v in x):
        if all(isinstance(v, (list, tuple, np.ndarray)) for v in x):
            return empty(x[0]) and empty(x[1])
    if isinstance(x, (list, tuple, np.ndarray)):
        return empty(x)
    return False


def _require_data(task, method, x, y):
    """`fit` / `evaluate`: a ValueError naming the problem, not a backend's,
    for no examples, and for host inputs (texts, word lists, model-input
    dicts) without targets where the task trains on them
    (`Task.targets_required`)."""
    if no_examples(x):
        raise ValueError(
            f"{type(task).__name__}.{method} got no examples (an empty "
            f"{type(x).__name__}); pass at least one"
        )
    host = isinstance(x, (dict, list, tuple)) or raw_text.is_text(x)
    if y is None and task.targets_required and host:
        raise ValueError(f"{type(task).__name__}.{method} needs targets: {task.targets_hint}")


def _require_compiled(task, method):
    """`fit` / `evaluate`: the same ValueError on every backend for a model
    not compiled, or compiled without a loss where it computes none itself
    (JAX would otherwise train on a loss of 0)."""
    name = type(task).__name__
    if not task.compiled:
        raise ValueError(f"{name}.{method}: call `compile()` before `{method}`")
    if getattr(task, "loss", None) is None and not _computes_own_loss(task) and not task.losses:
        raise ValueError(
            f"{name}.{method}: no loss to compute; pass one to `compile(loss=...)` "
            "(for example keras.losses.MeanSquaredError() for target embeddings)"
        )


def _computes_own_loss(task):
    """Whether `task`'s class computes a loss of its own: kbert's models
    that override `compute_loss`, and any user subclass that overrides it,
    the steps or `call` (which may `add_loss`)."""
    for cls in type(task).__mro__:
        module = cls.__module__ or ""
        if module.startswith("keras."):
            return False
        names = ("compute_loss",)
        if not module.startswith("kbert."):
            names += ("train_step", "test_step", "call")
        if any(name in vars(cls) for name in names):
            return True
    return False


def _given(method, *args, **kwargs):
    """The names of the arguments a call of Keras `Model` method passed."""
    arguments = dict(inspect.signature(method).bind(None, *args, **kwargs).arguments)
    return set(arguments) | set(arguments.pop("kwargs", {}))


def _batched_source(x):
    """Data that batches and orders itself, whose order Keras leaves as it
    is (with a warning where `shuffle=True`): a tf.data dataset, a
    generator, a torch `DataLoader`."""
    if raw_text.is_tf_dataset(x) or inspect.isgenerator(x):
        return True
    return type(x).__name__ == "DataLoader" and type(x).__module__.startswith("torch.")


def _steps(x, batch_size, steps=None):
    """How many batches a call on `x` runs, where known: `steps` if given,
    the batches of a `keras.utils.PyDataset` (kbert's length buckets
    among them), arrays or tensors in batches of `batch_size` (32 by
    default); None for a dataset or generator."""
    if steps is not None:
        return steps
    if isinstance(x, keras.utils.PyDataset):
        try:
            return x.num_batches  # None: infinite
        except NotImplementedError:  # neither num_batches nor __len__
            return None
    leaves = keras.tree.flatten(x) if isinstance(x, (dict, list, tuple)) else [x]
    first = leaves[0] if leaves else None
    shape = getattr(first, "shape", None)
    if shape is not None and len(shape) and isinstance(shape[0], int):
        return -(-shape[0] // (batch_size or 32))
    return None


class _StopOnNonFiniteLoss(keras.callbacks.Callback):
    """Ends `fit` after an epoch whose training loss is NaN or inf (read
    from the epoch's logs: no per-step synchronisation)."""

    def on_epoch_end(self, epoch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not np.isfinite(float(loss)):
            keras_internals.callback_model(self).stop_training = True


# callbacks that deal with a non-finite loss themselves
_HANDLE_NON_FINITE = (keras.callbacks.TerminateOnNaN, ResumableCheckpoint)


def _raise_on_non_finite_loss(history):
    """A NonFiniteLossError naming the first epoch whose training loss was
    NaN or inf (the error's `history` is the fit's)."""
    losses = history.history.get("loss", []) if history is not None else []
    for epoch, loss in zip(history.epoch if history is not None else (), losses):
        if not np.isfinite(loss):
            error = NonFiniteLossError(
                f"the training loss was {loss} in epoch {epoch + 1}, and training stopped "
                "there; the weights now hold NaN or inf (reload or rebuild the model). "
                "Lower the learning rate, check targets and sample weights for huge or "
                "non-finite values, or train in float32"
            )
            error.history = history
            raise error


def _bind(method, *args, **kwargs):
    """Every argument of a Keras `Model` method by name, defaults filled."""
    bound = inspect.signature(method).bind(None, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("self")
    arguments.update(arguments.pop("kwargs", {}))
    return arguments


@contextlib.contextmanager
def _input_errors():
    """An input check that failed inside a tf.data pipeline (see
    `batching.map_dataset`) surfaces as a ValueError naming the input."""
    try:
        yield
    except ValueError:
        raise
    except Exception as error:
        text = str(error)
        if batching.CHECK_MARK not in text:
            raise
        detail = text[text.index(batching.CHECK_MARK) + len(batching.CHECK_MARK) :]
        raise ValueError(detail.split("\n\t [[")[0].strip()) from None
