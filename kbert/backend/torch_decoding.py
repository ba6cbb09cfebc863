"""Decode loops on torch: one step with static shapes, replayed as a CUDA
graph per input shapes on a GPU.

A decode loop (`kbert.backend.decoding.decode_loop`) is `cond(*state)` and
`body(constants, *state) -> state`, the state's last element the decoder's
cache. Here the loop runs a guarded step: `keep = cond(state)`, the body,
and every state tensor but the cache set back to its old value where
`keep` is false, so a step run after the loop's end changes nothing the
outputs read (the cache is written at the frozen position with what it
already holds, or left for dead). The host therefore reads `cond` only
every few steps and may queue steps past the end.

- On a GPU (`LoopGraphs`, made per decode program by `compile_decoding`):
  per signature (shapes, dtypes and Python values of the state and the
  constants, and the model's weight tensors) the first step runs eagerly on
  a side stream (lazy CUDA state is made outside a graph), then the step is
  captured as a `torch.cuda.CUDAGraph` on static copies of the state and
  constants; the graph writes the new state back into those buffers (the
  cache in place) and `cond` of it into a flag. Each token is one replay;
  the flag of the step `CHECK_EVERY` replays back is read from pinned
  memory (an event wait that leaves that many steps queued on the GPU).
  Later calls with that signature copy their inputs into the buffers and
  replay from the first step. A capture that fails warns once and the
  program runs eagerly from then on.
- Elsewhere (a CPU, or after a failed capture): the same guarded step,
  eagerly, `cond` read on the host every `check_every` steps.

`cache_write(cache, index, values)` writes the newest keys and values into
a cache at a position given as a device tensor, in place (`index_copy_`):
Keras' `slice_update` clones the cache and takes a tensor position through
index grids.
"""

import contextlib
import threading
import warnings

import keras
import torch

from kbert.backend import keras_internals
from kbert.backend.torch_ops import shared_mask, shared_masks
from kbert.backend.torch_step import (
    _GraphsPerShape,
    constants_on_device,
    random_state_kept_on_failure,
)

CHECK_EVERY = 4  # GPU: steps queued past the one whose `cond` the host reads
_ACTIVE = threading.local()


def cache_write(cache, index, values):
    """`values` (B, T, ...) written into `cache` (B, S, ...) at positions
    [index, index + T) of axis 1, `index` a 0-d integer tensor; in place
    (into a contiguous copy if `cache` is not contiguous). Returns the
    cache written."""
    if not cache.is_contiguous():  # e.g. a repeated (expanded) view: written to a copy
        cache = cache.contiguous()
    positions = shared_mask("positions", index, lambda: index.reshape(1).to(torch.long))
    if values.shape[1] != 1:
        positions = positions + torch.arange(values.shape[1], device=cache.device)
    return cache.index_copy_(1, positions, values.to(cache.dtype))


class WeightCasts:
    """A model's float weights in the dtypes its mixed-precision layers
    compute in, each cast once and kept, for decoding: Keras casts a
    weight on every read, so a decode step captured as a CUDA graph would
    cast the whole decoder again for every token (on BERT-base, about a
    seventh of a greedy step).

    `lookup(value, dtype)` (for `keras_internals.autocast_lookup`) returns
    the kept copy of a weight tensor in `dtype`, made on the first read;
    None for anything else, or where gradients are recorded. `refresh()`,
    at the start of each decoding call, recasts in place the copies whose
    weight changed since (a `fit` in between): a graph captured on the
    copies reads the new values. The values are Keras' own casts, so the
    outputs are unchanged; the copies take the weights' size in the
    compute dtype."""

    def __init__(self, variables):
        self.variables = list(variables)
        self.sources = {}
        self.copies = {}  # (id of the weight tensor, dtype) -> [weight version, copy]

    def refresh(self):
        self.sources = {}
        for variable in self.variables:
            value = keras_internals.torch_value(variable)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                self.sources[id(value)] = value
        for key, entry in list(self.copies.items()):
            value = self.sources.get(key[0])
            if value is None:
                del self.copies[key]
            elif value._version != entry[0]:
                with torch.no_grad():
                    entry[1].copy_(value)
                entry[0] = value._version

    def lookup(self, value, dtype):
        if torch.is_grad_enabled() or self.sources.get(id(value)) is not value:
            return None
        dtype = getattr(torch, keras.backend.standardize_dtype(dtype), None)
        if not isinstance(dtype, torch.dtype) or dtype == value.dtype:
            return None
        entry = self.copies.get((id(value), dtype))
        if entry is None:
            if is_capturing():  # a copy made in a capture would live in the graph's pool
                return None
            entry = self.copies[(id(value), dtype)] = [value._version, value.detach().to(dtype)]
        elif entry[0] != value._version:  # changed within the call: Keras' own cast
            return None
        return entry[1]

    @contextlib.contextmanager
    def active(self):
        """Within the block, weights read under autocast come from the
        kept copies (refreshed on entry)."""
        self.refresh()
        with keras_internals.autocast_lookup(self.lookup):
            yield


def is_capturing():
    """Whether a decoding step is being captured (or, emulated, recorded)."""
    return getattr(_ACTIVE, "capturing", False)


def _tensor(value):
    return value if isinstance(value, torch.Tensor) else keras.ops.convert_to_tensor(value)


def _guarded(cond, body):
    """step(constants, state) -> (state', cond(state')): `body` where
    `cond(state)` holds; elsewhere the old state (the cache, `state[-1]`,
    as the body left it)."""

    def step(constants, state):
        keep = cond(*state)
        with shared_masks():  # every block of the step reads the same masks
            new = tuple(body(constants, *state))
        control = [
            torch.where(keep, n, o)
            for n, o in zip(keras.tree.flatten(new[:-1]), keras.tree.flatten(state[:-1]))
        ]
        state = (*keras.tree.pack_sequence_as(state[:-1], control), new[-1])
        return state, cond(*state)

    return step


def _eager_loop(step, state, constants, flag, done, max_iterations, check_every):
    """Steps until `max_iterations` have run or a checked flag is false;
    the flag read every `check_every` steps (1: before each, Keras'
    `while_loop`)."""
    count = 0
    while done < max_iterations:
        if count % check_every == 0 and not bool(flag):
            break
        state, flag = step(constants, state)
        done += 1
        count += 1
    return state


def decode_loop(cond, body, state, constants, max_iterations, check_every=1):
    """The loop `kbert.backend.decoding.decode_loop` runs on torch: replayed
    as CUDA graphs inside a program of `compile_decoding` on a GPU, else
    eagerly (module docstring). Returns the final state."""
    state = tuple(keras.tree.map_structure(_tensor, tuple(state)))
    step = _guarded(cond, body)
    graphs = getattr(_ACTIVE, "graphs", None)
    with torch.no_grad(), constants_on_device():
        if graphs is not None and graphs.usable():
            return graphs.run(cond, body, step, state, constants, max_iterations)
        if graphs is not None:  # a GPU whose capture failed: keep it fed all the same
            check_every = CHECK_EVERY
        return _eager_loop(step, state, constants, cond(*state), 0, max_iterations, check_every)


@contextlib.contextmanager
def active(graphs):
    """Within the block, `decode_loop` uses `graphs` (a `LoopGraphs`, or
    None: eager)."""
    previous = getattr(_ACTIVE, "graphs", None)
    _ACTIVE.graphs = graphs
    try:
        yield
    finally:
        _ACTIVE.graphs = previous


def _signature(tree):
    leaves = keras.tree.flatten(tree)
    return repr(keras.tree.map_structure(lambda v: 0, tree)), tuple(
        (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else ("value", v)
        for v in leaves
    )


def _clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _copy_into(static, value):
    if isinstance(static, torch.Tensor) and static is not value:
        static.copy_(value)


class _Captured:
    """One captured step: its graph (or, emulated, the step itself), the
    static constants and state it reads and writes, its flag, and the
    `cond`/`body` whose shape-derived closure tensors it read (kept alive)."""

    def __init__(self, graph, constants, state, flag, keep_alive):
        self.graph, self.constants, self.state = graph, constants, state
        self.flag, self.keep_alive = flag, keep_alive


class LoopGraphs(_GraphsPerShape):
    """The CUDA graphs of one decode program, one per signature (module
    docstring). `path` names how the program's loops run.

    Args:
        variables: the model's variables (their tensors are part of a
            signature: a graph reads weights where they were at capture).
        emulate: bool. run the capture-and-replay logic without CUDA (the
            "graph" is the step on the static buffers), for tests on a CPU.
    """

    def __init__(self, variables, emulate=False):
        self.emulate = emulate
        self.variables = list(variables)
        if emulate:
            self.graphs, self.seen, self.failed, self.replays, self.pool = {}, set(), None, 0, None
        else:
            super().__init__(None)
        self.eager_steps = 0

    @property
    def path(self):
        if self.failed:
            return "eager"
        return "torch-cuda-graph (emulated)" if self.emulate else "torch-cuda-graph"

    def usable(self):
        return not self.failed and (
            self.emulate or str(keras_internals.torch_device()).startswith("cuda")
        )

    def stats(self):
        return {
            "replays": self.replays,
            "eager_steps": self.eager_steps,
            "graphs": len(self.graphs),
            "capture_failed": self.failed,
        }

    def _weights(self):
        return tuple(
            (v.value.data_ptr(), v.value.dtype) if isinstance(v.value, torch.Tensor) else None
            for v in self.variables
        )

    def run(self, cond, body, step, state, constants, max_iterations):
        signature = (_signature((state, constants)), self._weights())
        done = 0
        entry = self.graphs.get(signature)
        if entry is None:
            if len(self.graphs) >= self.MAX_GRAPHS:
                return _eager_loop(
                    step, state, constants, cond(*state), 0, max_iterations, CHECK_EVERY
                )
            if max_iterations < 1:
                return state
            # the first step eagerly, on the capture stream: lazy CUDA state
            # (cuBLAS workspaces, ...) is made outside a graph
            state, flag = self._warm_up(step, constants, state)
            self.eager_steps += 1
            done = 1
            if done >= max_iterations or not bool(flag):
                return state
            entry = self._capture(signature, step, state, constants, (cond, body))
            if entry is None:
                return _eager_loop(step, state, constants, flag, done, max_iterations, CHECK_EVERY)
        keras.tree.map_structure(_copy_into, entry.constants, constants)
        keras.tree.map_structure(_copy_into, entry.state, state)
        self._replay(entry, max_iterations - done)
        control = keras.tree.map_structure(_clone, entry.state[:-1])
        return (*control, entry.state[-1])

    def _warm_up(self, step, constants, state):
        if self.emulate:
            return step(constants, state)
        return self._on_capture_stream(step, constants, state)

    def _capture(self, signature, step, state, constants, keep_alive):
        static_constants = keras.tree.map_structure(_clone, constants)
        static_state = keras.tree.map_structure(_clone, state)
        flag = torch.ones((), dtype=torch.bool, device=state[0].device)

        def captured():
            new, keep = step(static_constants, static_state)
            keras.tree.map_structure(_copy_into, static_state, new)
            flag.copy_(keep)

        graph = captured if self.emulate else torch.cuda.CUDAGraph()
        previous = None if self.emulate else torch.cuda.current_stream()
        _ACTIVE.capturing = True
        try:
            if self.emulate:
                captured()  # what a capture records; the buffers are refilled before replays
            else:
                with (
                    random_state_kept_on_failure(),
                    torch.cuda.graph(
                        graph,
                        pool=self.pool,
                        stream=self.stream,
                        capture_error_mode="thread_local",
                    ),
                ):
                    captured()
        except Exception as error:  # a step that cannot be captured runs eagerly
            if not self.emulate:
                torch.cuda.set_stream(previous)
                torch.cuda.synchronize()
            self.failed = f"{type(error).__name__}: {str(error)[:300]}"
            warnings.warn(
                f"kbert: the decoding step could not be captured as a CUDA graph "
                f"({self.failed}); generate goes on eagerly",
                stacklevel=2,
            )
            return None
        finally:
            _ACTIVE.capturing = False
        if not self.emulate:
            if self.pool is None:
                self.pool = graph.pool()
            graph = graph.replay
        entry = _Captured(graph, static_constants, static_state, flag, keep_alive)
        self.graphs[signature] = entry
        return entry

    def _replay(self, entry, steps):
        """Up to `steps` replays, until the flag read `CHECK_EVERY` replays
        later is false."""
        lag = CHECK_EVERY
        if self.emulate:
            flags = [None] * lag
        else:
            flags = torch.ones(lag, dtype=torch.bool, pin_memory=True)
            events = [None] * lag
        for n in range(steps):
            slot = n % lag
            if n >= lag:
                if self.emulate:
                    if not bool(flags[slot]):
                        return
                else:
                    events[slot].synchronize()
                    if not bool(flags[slot]):
                        return
            entry.graph()
            self.replays += 1
            if self.emulate:
                flags[slot] = entry.flag.clone()
            else:
                flags[slot].copy_(entry.flag, non_blocking=True)
                events[slot] = torch.cuda.Event()
                events[slot].record()
