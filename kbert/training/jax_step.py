"""The JAX backend's `steps_per_execution`: one XLA program for all of them.

Keras' JAX trainer runs `steps_per_execution` steps as that many calls of
the jitted step from a Python loop. XLA runs each call's step as one CUDA
graph (a command buffer), and a graph whose buffers moved (a new input
batch, every step) is updated before it is launched; the update waits for
the previous launch to finish. So the host runs in lockstep with the GPU
and the GPU waits, at every step, for the update, the launch and the next
batch's host-to-device copies: on an H100, BERT-large at 128 tokens lost
about 2 ms of a 77 ms step this way (`benchmarks/profile_step.py`, "idle"
and "host_top_ms_per_step": cuGraphLaunch and command_buffer::update).

Here the steps of one execution are a `jax.lax.scan` over their batches,
stacked on a leading axis: one program, one launch, one copy of the
batches. Same step function, same order, same seeds; the logs are the last
step's, as Keras returns them. An execution with fewer batches, or batches
of different shapes (the end of an epoch), runs them one at a time.
"""

import keras


def scanned_steps_supported(model):
    """Whether `model`'s train function can be a scan over its steps: JAX,
    compiled, more than one step per execution, no distribution (under one,
    Keras' trainer sets state shardings that this path does not)."""
    return (
        keras.backend.backend() == "jax"
        and model.steps_per_execution > 1
        and model.jit_compile
        and not model.run_eagerly
        and keras.distribution.distribution() is None
    )


def scanned_train_function(model):
    """A train function for Keras' JAX `fit`/`train_on_batch`:
    `(state, iterator) -> (logs, state)`, as `JAXTrainer._make_function`
    makes, with the steps of a full execution in one program."""
    import jax
    import jax.numpy as jnp

    def one_step(state, data):
        return model.train_step(state, data)

    def scanned(state, stacked):
        def body(state, data):
            logs, state = one_step(state, data)
            return state, logs

        state, logs = jax.lax.scan(body, state, stacked)
        return jax.tree.map(lambda value: value[-1], logs), state

    multi = jax.jit(scanned, donate_argnums=0)
    single = jax.jit(one_step, donate_argnums=0)
    stack = jax.jit(lambda batches: jax.tree.map(lambda *values: jnp.stack(values), *batches))

    def iterator_step(state, iterator):
        batches = [next(iterator)]  # StopIteration here ends the epoch, as in Keras
        for _ in range(model.steps_per_execution - 1):
            try:
                batches.append(next(iterator))
            except StopIteration:
                break
        shapes = [jax.tree.map(lambda value: (value.shape, value.dtype), data) for data in batches]
        if len(batches) == model.steps_per_execution and all(s == shapes[0] for s in shapes[1:]):
            return multi(state, stack(batches))
        for data in batches:
            logs, state = single(state, data)
        return logs, state

    return iterator_step
