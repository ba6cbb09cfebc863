"""One process of a tiny resumable pre-training run on CPU, alone or as one of
several JAX or torch processes (used by test_jax_multiprocess.py and
test_torch_ddp.py).

    python -m tests.training.multiprocess_worker CHECKPOINT_DIR OUT.npz \
        [--coordinator-address HOST:PORT --num-processes N --process-id I] \
        [--engine torch-ddp] [--clipnorm C] [--kill-at N] [--term-at N] [--seed S] \
        [--evaluate]

Without --num-processes or --engine: one process, one device, no
distribution. With --num-processes: `jax-data-parallel` over N processes
(one CPU device each: the caller sets JAX_PLATFORMS=cpu). With --engine
torch-ddp: one of the processes a launcher (torchrun, or the test setting
its variables) started, gloo on CPU. Every process feeds the same global
batches; each trains on its share. --kill-at N: SIGKILL itself after step N. --term-at
N: SIGTERM itself after step N (all processes then stop at the next
checkpoint and exit 143). A finished
run writes the final weights, the losses, the process count and (with
--evaluate) `evaluate`'s loss, mlm_loss and nsp_loss to OUT.npz (process 0
only). Progress goes to stderr, so a failing test shows where a
process stopped.
"""

import argparse
import contextlib
import os
import signal
import sys
import time

import keras
import numpy as np

import kbert
from kbert.training import create_optimizer, distribution_scope, fit_resumable
from kbert.training.distribution import process_count, process_index
from tests.harness import TINY
from tests.models.test_pretrainer import batch

TOTAL, EVERY, GLOBAL_BATCH = 6, 2, 4
STARTED = time.time()


def log(*what):
    print(f"[{time.time() - STARTED:6.1f} s]", *what, file=sys.stderr, flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint_dir")
    p.add_argument("out")
    p.add_argument("--coordinator-address")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--term-at", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default=None)
    p.add_argument("--clipnorm", type=float, default=1.0)
    # torch-ddp: each process draws its own dropout masks for its rows, so
    # only a run without dropout can equal one process on the global batch
    p.add_argument("--no-dropout", action="store_true")
    # torch-ddp: sum the gradients after the backward pass, as a step
    # replayed as a CUDA graph does, instead of through DDP's hooks
    p.add_argument("--sync-after-backward", action="store_true")
    # after training: evaluate on two global batches, every process on all
    # of their rows (as `evaluate` runs under torch-ddp)
    p.add_argument("--evaluate", action="store_true")
    args = p.parse_args()
    keras.utils.set_random_seed(args.seed)  # a restarted process gets other initial weights
    engine = args.engine or ("none" if args.num_processes is None else "jax-data-parallel")
    scope, replicas = distribution_scope(
        engine,
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    log(f"process {process_index()} of {process_count()}, {replicas} replica(s)")
    import tensorflow as tf

    # Global batches of 4 whose halves weigh different numbers of predictions
    # (one row has padding slots only): the loss must be normalised over the
    # global batch, not per process.
    items = [batch(seed=i, batch_size=GLOBAL_BATCH) for i in range(4)]
    examples = keras.tree.map_structure(lambda *a: np.concatenate(a), *items)

    def make(skip):
        data = tf.data.Dataset.from_tensor_slices(examples)
        # A static batch size: Keras splits each global batch between processes.
        data = data.batch(GLOBAL_BATCH, drop_remainder=True)
        return data.repeat().skip(skip)

    with scope:
        dropout = dict(dropout=0.0, attention_dropout=0.0) if args.no_dropout else {}
        model = kbert.BertPreTrainer(kbert.BertBackbone(**TINY, **dropout))
        clipnorm = args.clipnorm or None  # 0: no clipping
        model.compile(optimizer=create_optimizer(1e-3, TOTAL, 2, clipnorm=clipnorm))
    log("built and compiled")

    losses = []

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.step = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
            log(f"training from step {self.step}")

        def on_train_batch_end(self, batch_index, logs=None):
            self.step += 1
            losses.append(float(logs["loss"]))
            log(f"step {self.step}")
            if self.step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.step == args.term_at:
                os.kill(os.getpid(), signal.SIGTERM)

    sync = contextlib.nullcontext()
    if args.sync_after_backward:
        from kbert.backend import torch_ddp

        torch_ddp.prepare_for_graphs(model)  # process 0's weights, as a graphed fit does
        sync = torch_ddp.gradients_after_backward()
    try:
        with sync:
            fit_resumable(
                model,
                make,
                TOTAL,
                args.checkpoint_dir,
                steps_per_checkpoint=EVERY,
                callbacks=[Record()],
                verbose=0,
            )
    except SystemExit as stopped:  # stopped by SIGTERM after a checkpoint
        log(f"exit {stopped.code}")
        leave(args, stopped.code)
    evaluated = {}
    if args.evaluate:
        logs = model.evaluate(make(0).take(2), verbose=0, return_dict=True)
        evaluated["evaluated"] = np.asarray([logs[k] for k in ("loss", "mlm_loss", "nsp_loss")])
    if process_index() == 0:
        np.savez(
            args.out,
            *[keras.ops.convert_to_numpy(v) for v in model.weights],
            losses=np.asarray(losses),
            processes=process_count(),
            **evaluated,
        )
    log("done")
    leave(args, 0)


def leave(args, code):
    if args.engine == "torch-ddp":
        import torch.distributed as dist

        dist.barrier()  # no process leaves while another still works
    elif args.num_processes:
        import jax

        jax.distributed.shutdown()  # a barrier: no process leaves while another still works
    # Skip the interpreter's teardown (tens of seconds of TensorFlow and
    # thread-pool clean-up on a loaded machine), which is not under test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
