"""Checkpoints that let a killed run continue exactly where it stopped."""

import json
import math
import os
import shutil

import keras
import numpy as np

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
    """Writes `<directory>/ckpt-<step>/` atomically; keeps the newest `keep`."""
    os.makedirs(directory, exist_ok=True)
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
    if keras.backend.backend() != "torch":
        return {}
    import torch

    state = {"rng_torch_cpu": torch.get_rng_state().numpy()}
    if torch.cuda.is_available():
        for i, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"rng_torch_cuda_{i}"] = cuda_state.numpy()
    return state


def restore_backend_rng_state(arrays):
    if keras.backend.backend() != "torch" or "rng_torch_cpu" not in arrays:
        return
    import torch

    torch.set_rng_state(torch.from_numpy(arrays["rng_torch_cpu"].copy()))
    cuda = sorted(k for k in arrays if k.startswith("rng_torch_cuda_"))
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.from_numpy(arrays[k].copy()) for k in cuda])


class ResumableCheckpoint(keras.callbacks.Callback):
    """Saves weights, optimizer state (step, moments, loss scale) and RNG
    state at the end of every fit "epoch" (one checkpoint interval), stops at
    the first non-finite loss without saving it, and on a termination request
    (`request_stop`, e.g. from a SIGTERM handler) saves at the current step
    and stops.

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
        pending = getattr(self.model, "_kbert_pending_rng", None)
        if pending:
            restore_backend_rng_state(pending)
            self.model._kbert_pending_rng = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self.step

    def on_train_batch_end(self, batch, logs=None):
        self.step = self._epoch_start + batch + 1
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            self.failed_step = self.step
            self.model.stop_training = True
            return
        if self._stop_requested and self.stopped_at is None:
            save_checkpoint(self.model, self.directory, self.step, self.keep)
            self.stopped_at = self.step
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self.failed_step is not None or self.stopped_at is not None:
            return
        save_checkpoint(self.model, self.directory, self.step, self.keep)
