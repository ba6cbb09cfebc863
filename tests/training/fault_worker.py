"""A tiny resumable pre-training run that faults on request (used by test_faults.py).

    python -m tests.training.fault_worker CHECKPOINT_DIR OUT.npz \
        [--kill-at N] [--term-at N] [--kill-in-save N]

--kill-at N: SIGKILL itself after step N. --term-at N: SIGTERM itself after
step N (the run must checkpoint and exit 143). --kill-in-save N: SIGKILL in
the middle of writing the N-th checkpoint file. Finishing runs write the
final weights to OUT.npz.
"""

import argparse
import os
import signal

import keras
import numpy as np

import kbert
from kbert.training import callbacks as kbert_callbacks
from kbert.training import create_optimizer, fit_resumable
from tests.harness import TINY
from tests.models.test_pretrainer import batch

TOTAL, EVERY = 8, 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint_dir")
    p.add_argument("out")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--term-at", type=int)
    p.add_argument("--kill-in-save", type=int)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import tensorflow as tf

    items = [batch(seed=i) for i in range(8)]
    stacked = keras.tree.map_structure(lambda *a: np.stack(a), *items)

    def make(skip):
        return tf.data.Dataset.from_tensor_slices(stacked).repeat().skip(skip)

    keras.utils.set_random_seed(args.seed)  # a restarted process gets other initial weights
    model = kbert.BertPreTrainer(kbert.BertBackbone(**TINY))
    model.compile(optimizer=create_optimizer(1e-3, TOTAL, 2))

    losses = []

    class Fault(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step = None

        def on_train_begin(self, logs=None):
            self.step = int(keras.ops.convert_to_numpy(model.optimizer.iterations))

        def on_train_batch_end(self, batch_index, logs=None):
            self.step += 1
            losses.append(float(logs["loss"]))
            if self.step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.step == args.term_at:
                os.kill(os.getpid(), signal.SIGTERM)

    if args.kill_in_save:
        saves = {"n": 0}
        original = np.savez

        def dying_savez(path, **arrays):
            saves["n"] += 1
            if saves["n"] == args.kill_in_save:
                with open(path, "wb") as f:  # half a file, then death
                    f.write(b"PK\x03\x04" + os.urandom(100))
                os.kill(os.getpid(), signal.SIGKILL)
            return original(path, **arrays)

        kbert_callbacks.np.savez = dying_savez
    fit_resumable(
        model,
        make,
        TOTAL,
        args.checkpoint_dir,
        steps_per_checkpoint=EVERY,
        callbacks=[Fault()],
        verbose=0,
    )
    np.savez(
        args.out, *[keras.ops.convert_to_numpy(v) for v in model.weights], losses=np.asarray(losses)
    )


if __name__ == "__main__":
    main()
