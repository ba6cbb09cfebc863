"""Checkpoints that let a killed run continue exactly where it stopped."""

import json
import math
import os
import shutil

import keras
import numpy as np

from kbert.backend import keras_internals, trainer
from kbert.backend import ops as backend_ops
from kbert.training.distribution import any_process, process_count, process_index

STATE_FILE = "state.json"
ARRAYS_FILE = "variables.npz"


class NonFiniteLossError(RuntimeError):
    """Training produced NaN/inf; the last good checkpoint is kept."""


def _variables(model):
    """Model variables (weights and RNG states) and optimizer variables, in order."""
    model_vars = list(model.variables)
    optimizer = model.optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        opt_vars = list(optimizer.variables)
    else:
        opt_vars = list(optimizer.variables) if optimizer is not None else []
    return model_vars, opt_vars


def save_checkpoint(model, directory, step, keep=2, extra=None):
    """Writes `<directory>/ckpt-<step>/` atomically; keeps the newest `keep`.

    With several processes (`jax-data-parallel` on several hosts) every
    process checks the values, which are replicated, and process 0 alone
    writes: `directory` must be one that all processes share."""
    model_vars, opt_vars = _variables(model)
    arrays = {
        f"model_{i:05d}": np.asarray(keras.ops.convert_to_numpy(v))
        for i, v in enumerate(model_vars)
    }
    arrays.update(
        {
            f"optimizer_{i:05d}": np.asarray(keras.ops.convert_to_numpy(v))
            for i, v in enumerate(opt_vars)
        }
    )
    arrays.update(_backend_rng_state())
    for name, value in arrays.items():
        if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
            raise NonFiniteLossError(f"refusing to checkpoint step {step}: {name} is not finite")
    final = os.path.join(directory, f"ckpt-{step:09d}")
    if process_index() != 0:
        return final
    os.makedirs(directory, exist_ok=True)
    staging = final + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    np.savez(os.path.join(staging, ARRAYS_FILE), **arrays)
    state = {
        "step": int(step),
        "model_variables": [v.path for v in model_vars],
        "optimizer_variables": [v.path for v in opt_vars],
        **(extra or {}),
    }
    with open(os.path.join(staging, STATE_FILE), "w") as f:
        json.dump(state, f, indent=1)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    checkpoints = sorted(
        d for d in os.listdir(directory) if d.startswith("ckpt-") and not d.endswith(".tmp")
    )
    for old in checkpoints[:-keep]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
    return final


def _backend_rng_state():
    """RNG state that lives outside Keras variables.

    Keras' torch backend draws unseeded dropout masks from torch's global
    generator, so resuming exactly needs that generator's state too.
    """
    return backend_ops.rng_state()


def restore_backend_rng_state(arrays):
    backend_ops.set_rng_state(arrays)


class ResumableCheckpoint(keras.callbacks.Callback):
    """Saves weights, optimizer state (step, moments, loss scale) and RNG
    state at the end of every fit "epoch" (one checkpoint interval), stops at
    the first non-finite loss without saving it, and on a termination request
    (`request_stop`, e.g. from a SIGTERM handler) saves at the current step
    and stops. With several processes, which must stop at the same step, a
    request on any of them stops all at the next regular checkpoint.

    Args:
        directory: str. checkpoint directory.
        steps_per_checkpoint: int. steps in one fit epoch.
        keep: int. checkpoints kept.
        start_step: int. the global step the next fit starts at.
    """

    def __init__(self, directory, steps_per_checkpoint, keep=2, start_step=0):
        super().__init__()
        self.directory = directory
        self.steps_per_checkpoint = steps_per_checkpoint
        self.keep = keep
        self.failed_step = None
        self.stopped_at = None  # step saved on a termination request
        self.step = start_step  # global step after the last finished batch
        self._stop_requested = False

    def request_stop(self):
        """Asks the run to checkpoint after the current step and stop (signal-safe)."""
        self._stop_requested = True

    def on_train_batch_begin(self, batch, logs=None):
        # At the first batch, after the data iterator exists: creating torch's
        # data-loader iterator draws from the global generator.
        model = keras_internals.callback_model(self)  # no state sync at each step
        pending = trainer.state_of(model).pending_rng
        if pending:
            restore_backend_rng_state(pending)
            trainer.state_of(model).pending_rng = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self.step

    def on_train_batch_end(self, batch, logs=None):
        self.step = self._epoch_start + batch + 1
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            self.failed_step = self.step
            self.model.stop_training = True
            return
        if self._stop_requested and self.stopped_at is None and process_count() == 1:
            save_checkpoint(self.model, self.directory, self.step, self.keep)
            self.stopped_at = self.step
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self.failed_step is not None or self.stopped_at is not None:
            return
        save_checkpoint(self.model, self.directory, self.step, self.keep)
        if process_count() > 1 and any_process(self._stop_requested):
            self.stopped_at = self.step
            self.model.stop_training = True


class CurveLogger(keras.callbacks.Callback):
    """Writes the points of the training curves as JSON lines: training
    metrics every `every` steps and, with `validation_data`, held-out metrics
    at the end of every fit epoch (with `fit_resumable`, every checkpoint).

    Each line is `{"step": optimizer step, "split": "train" | "held_out",
    "<metric>": value, ...}`. A training point is the mean over the steps
    since the previous point, recovered from Keras' running epoch means
    (exact for the loss at a fixed batch size; for metrics weighted per
    example, such as masked-LM accuracy, each batch counts once). The file is
    appended to; a run first drops the points beyond the step it starts at
    (written after the last checkpoint of a run that was stopped), so a
    resumed run continues the same curve.

    Held-out evaluation is `model.evaluate` with the backend RNG state put
    back afterwards (torch's global generator, which creating a data iterator
    draws from): unlike `fit(validation_data=...)`, evaluating leaves the
    training run, and exact resumption, unchanged.

    With several processes, every process evaluates (a collective step)
    and process 0 alone writes the file.

    Args:
        path: str. the JSON-lines file.
        every: int. steps between training points.
        validation_data: what `fit` takes as validation data (a dataset, or
            a tuple `(x, y)` / `(x, y, sample_weight)`), or None.
        validation_steps: int or None. batches of it to evaluate.

    Example:

    ```python
    curves = CurveLogger("run/curves.jsonl", every=10, validation_data=held_out)
    model.fit(train, epochs=3, steps_per_epoch=100, callbacks=[curves])
    points = read_curves("run/curves.jsonl")
    ```
    """

    def __init__(self, path, every=10, validation_data=None, validation_steps=None):
        super().__init__()
        if every < 1:
            raise ValueError(f"every={every}: steps between points must be at least 1")
        self.path = path
        self.every = every
        self.validation_data = validation_data
        self.validation_steps = validation_steps
        self.step = 0

    def on_train_begin(self, logs=None):
        if self.model.optimizer is None:
            raise ValueError("CurveLogger needs a compiled model (it counts optimizer steps)")
        self.step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        if process_index() != 0:
            return
        kept = [p for p in read_curves(self.path) if p["step"] <= self.step]
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        with open(self.path, "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in kept)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self.step
        self._batches = 0  # batches in this epoch at the last point
        self._sums = {}  # running mean x batches at the last point
        self._last = None

    def on_train_batch_end(self, batch, logs=None):
        # With steps_per_execution > 1, `batch` is the last step of the execution.
        previous, self.step = self.step, self._epoch_start + batch + 1
        self._last = (batch + 1, logs or {})
        if self.step // self.every > previous // self.every:
            self._write_window()

    def on_epoch_end(self, epoch, logs=None):
        if self._last is not None and self._last[0] > self._batches:
            self._write_window()  # the steps after the last point (metrics reset each epoch)
        if self.validation_data is None or self.model.stop_training:
            return  # stopped early (non-finite loss, termination request): no evaluation
        data = self.validation_data
        if isinstance(data, (tuple, list)):  # (x, y) or (x, y, sample_weight), as in `fit`
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(tuple(data))
        else:
            x, y, sample_weight = data, None, None
        rng = _backend_rng_state()
        results = self.model.evaluate(
            x,
            y,
            sample_weight=sample_weight,
            steps=self.validation_steps,
            verbose=0,
            return_dict=True,
        )
        restore_backend_rng_state(rng)
        self._write({"step": self.step, "split": "held_out", **_floats(results)})

    def _write_window(self):
        batches, logs = self._last
        point = {"step": self.step, "split": "train"}
        for name, mean in _floats(logs).items():
            total = mean * batches
            point[name] = (total - self._sums.get(name, 0.0)) / (batches - self._batches)
            self._sums[name] = total
        self._batches = batches
        self._write(point)

    def _write(self, point):
        if process_index() != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(point) + "\n")


def _floats(logs):
    out = {}
    for name, value in logs.items():
        try:
            out[name] = float(value)
        except (TypeError, ValueError):
            pass
    return out


def read_curves(path):
    """The points a `CurveLogger` wrote (a list of dicts), [] if there is no file."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
