"""`fit_resumable`: model.fit in checkpoint-sized epochs that a restarted
process continues from the last checkpoint (weights, optimizer state, schedule
step, RNG state and data position)."""

import contextlib
import json
import os
import signal
import threading

import numpy as np

from kbert.backend import trainer
from kbert.training.callbacks import (
    ARRAYS_FILE,
    STATE_FILE,
    NonFiniteLossError,
    ResumableCheckpoint,
    _backend_rng_state,
    _variables,
)
from kbert.training.distribution import same_on_all_processes


def latest_checkpoint(directory):
    """Path of the newest complete checkpoint in `directory`, or None."""
    if not directory or not os.path.isdir(directory):
        return None
    names = sorted(
        d
        for d in os.listdir(directory)
        if d.startswith("ckpt-")
        and not d.endswith(".tmp")
        and os.path.isfile(os.path.join(directory, d, STATE_FILE))
    )
    return os.path.join(directory, names[-1]) if names else None


def restore_checkpoint(model, path):
    """Loads a checkpoint into a compiled model; returns its step.

    Backend RNG state outside Keras variables (torch's generator) is set when
    the next `fit` reaches its first batch (`ResumableCheckpoint`), after
    Keras' own set-up, which may draw from it."""
    with open(os.path.join(path, STATE_FILE)) as f:
        state = json.load(f)
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    model_vars, opt_vars = _variables(model)
    if len(model_vars) != len(state["model_variables"]) or len(opt_vars) != len(
        state["optimizer_variables"]
    ):
        raise ValueError(
            f"checkpoint {path} was written by a different model or optimizer "
            f"({len(state['model_variables'])}/{len(state['optimizer_variables'])} variables, "
            f"this one has {len(model_vars)}/{len(opt_vars)}); use a new checkpoint directory"
        )
    with np.load(os.path.join(path, ARRAYS_FILE), allow_pickle=False) as arrays:
        for prefix, variables in (("model", model_vars), ("optimizer", opt_vars)):
            for i, variable in enumerate(variables):
                value = arrays[f"{prefix}_{i:05d}"]
                if tuple(value.shape) != tuple(variable.shape):
                    raise ValueError(
                        f"checkpoint {path}: {variable.path} has shape {value.shape}, "
                        f"expected {variable.shape}"
                    )
                variable.assign(value)
        trainer.state_of(model).pending_rng = {
            k: arrays[k] for k in arrays.files if k.startswith("rng_")
        }
    return int(state["step"])


def fit_resumable(
    model,
    make_dataset,
    total_steps,
    checkpoint_dir,
    steps_per_checkpoint=100,
    callbacks=(),
    verbose="auto",
    keep=2,
):
    """Trains a compiled model for `total_steps`, checkpointing as it goes.

    Args:
        model: compiled keras.Model.
        make_dataset: callable(skip_batches) -> an endless deterministic
            dataset of batches that starts `skip_batches` batches in. With
            several processes, each returns the same global batches (a
            `tf.data.Dataset`); Keras gives each process its share.
        total_steps: int. a multiple of `steps_per_checkpoint`.
        checkpoint_dir: str. where checkpoints live; an existing checkpoint
            there is resumed from. With several processes, a directory they
            all share: process 0 writes, every process reads.
        steps_per_checkpoint: int.
        callbacks: more Keras callbacks (CSVLogger, TensorBoard, ...).

    Returns:
        (history or None, first step of this run).

    Raises:
        NonFiniteLossError: naming the step; the last good checkpoint stays.
    """
    if total_steps % steps_per_checkpoint:
        raise ValueError(
            f"total_steps={total_steps} must be a multiple of "
            f"steps_per_checkpoint={steps_per_checkpoint}"
        )
    start = 0
    checkpoint = latest_checkpoint(checkpoint_dir)
    if checkpoint is not None:
        start = restore_checkpoint(model, checkpoint)
    # Several processes (one per host) must resume from one checkpoint.
    start = same_on_all_processes(start, f"the step to resume from in {checkpoint_dir}")
    if start >= total_steps:
        return None, start
    saver = ResumableCheckpoint(checkpoint_dir, steps_per_checkpoint, keep, start_step=start)
    history = None
    with _stop_on_sigterm(saver):
        partial = (-start) % steps_per_checkpoint
        if partial:  # a SIGTERM checkpoint mid-interval: finish that interval first
            history = model.fit(
                make_dataset(start),
                epochs=1,
                steps_per_epoch=partial,
                callbacks=[saver, *callbacks],
                verbose=verbose,
            )
        if saver.failed_step is None and saver.stopped_at is None and saver.step < total_steps:
            if (
                partial
            ):  # this fit's set-up must not move torch's generator (one fit would not have)
                trainer.state_of(model).pending_rng = _backend_rng_state()
            history = model.fit(
                make_dataset(saver.step),
                initial_epoch=saver.step // steps_per_checkpoint,
                epochs=total_steps // steps_per_checkpoint,
                steps_per_epoch=steps_per_checkpoint,
                callbacks=[saver, *callbacks],
                verbose=verbose,
            )
    if saver.failed_step is not None:
        last = latest_checkpoint(checkpoint_dir)
        kept = (
            f"The last good checkpoint is {last}" if last else "No checkpoint was saved before it"
        )
        raise NonFiniteLossError(
            f"loss became NaN/inf at step {saver.failed_step}; training stopped. {kept} "
            "(lower the learning rate, check the data, or use float32 / loss scaling)"
        )
    if saver.stopped_at is not None:
        print(
            f"SIGTERM: saved a checkpoint at step {saver.stopped_at} in {checkpoint_dir}; "
            "run the same command again to continue",
            flush=True,
        )
        raise SystemExit(128 + signal.SIGTERM)
    return history, start


@contextlib.contextmanager
def _stop_on_sigterm(saver):
    """While training, SIGTERM (preemption) checkpoints after the current step
    and exits; the previous handler comes back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: saver.request_stop())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
