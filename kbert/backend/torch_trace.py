"""Inference on a CPU with the torch backend as TorchScript traces.

An eager Keras forward pays Python for every layer call and every
operation: on a CPU that is most of a thin model's time at small batches
(MobileBERT's 24 blocks of 4 feed-forward networks: about two thirds of a
batch-1 call). `TracedForward` records `model(x, training=False)` once per
input signature with `torch.jit.trace` and replays the recorded operations
from C++ (TorchScript's interpreter, graph optimisations off: the gain is
the Python, and a signature's first replay costs no optimisation pass).

What a trace keeps and what it does not:
- The weights are read from the model's own tensors (the trace holds
  references, not copies): `fit`, `assign` and `set_weights` change them in
  place and the next replay sees the change. A trace is dropped when the
  model's variables are other tensors than when it was recorded
  (`quantize`, LoRA, a rebuilt layer: checked whenever torch has
  registered new parameters anywhere) or its dtype policy changed.
- Python decisions taken while recording are frozen: shapes (part of the
  signature) and nothing else may decide them. A new trace is checked once
  against the eager forward on the same shapes with another padding mask;
  a model whose forward decides from values on the host (kbert's windowed
  attention counts global tokens that way, and is never traced) fails that
  check, warns, and runs eagerly from then on.

Traces serve `predict_on_batch` (a batch of at most `MAX_TRACED_TOKENS`
positions), the latency path: a signature runs eagerly the first time it
is seen and is traced the second time, so a one-off shape costs no
recording (about a second for MobileBERT, 0.2 s for MiniLM on one core).
Traces are kept across calls, the most recently used `MAX_TRACES`. A whole
`predict` runs eagerly (`eager_during`): its batches, in length order, are
too few per shape to pay for recordings. `model.trace_inference = False`
turns the whole thing off. Figures: `benchmarks/RESULTS.md`.
"""

import collections
import contextlib
import types
import warnings

import keras
import numpy as np
import torch

from kbert.backend import keras_internals, torch_ops

# Batches of at most this many token positions (rows x length) are traced:
# there the Python of an eager forward is a large share of the time. Larger
# ones run eagerly, where padding is dropped inside each block
# (`kbert.backend.ops.token_packing`) and the Python is a few percent.
MAX_TRACED_TOKENS = 256
# A perturbed padding mask must give the trace's outputs to this tolerance
# (the same operations in the same order: equal up to float rounding).
CHECK_TOLERANCE = 1e-4


# Parameters registered with any torch module so far. Keras registers every
# variable a built layer tracks (a layer built, quantized or given LoRA
# weights registers new ones), so an unchanged count means unchanged
# variables and the full check of a model's variables can be skipped.
_REGISTRATIONS = [0]


def _count_registration(module, name, parameter):
    _REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)


def batch_signature(data):
    """The structure, shapes and dtypes of a batch, hashable: a captured
    graph or a trace replays only batches with the same signature."""
    structure = keras.tree.map_structure(lambda v: None, data)
    leaves = tuple(
        (tuple(v.shape), str(v.dtype)) if hasattr(v, "shape") else repr(v)
        for v in keras.tree.flatten(data)
    )
    return repr(structure), leaves


def defined_by_keras_or_kbert(obj):
    """A loss/metric spec made only of strings and of functions or objects
    whose class Keras or kbert defines: pure functions of their tensors, so
    a replay computes what a fresh call would."""
    if obj is None or isinstance(obj, str):
        return True
    if isinstance(obj, dict):
        return all(defined_by_keras_or_kbert(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(defined_by_keras_or_kbert(v) for v in obj)
    module = obj.__module__ if isinstance(obj, types.FunctionType) else type(obj).__module__
    return (module or "").startswith(("keras.", "kbert."))


def enabled(model):
    """Whether `model`'s predict runs through `TracedForward`: torch on a
    CPU, `model.trace_inference` not False, no torch.compile, no windowed
    attention, a forward not given up on (see `TracedForward`), and (for
    "auto", the default) a `call` and `predict_step` that Keras or kbert
    define."""
    setting = getattr(model, "trace_inference", "auto")
    if not setting or getattr(model, "jit_compile", False) is True:
        return False
    traced = model.__dict__.get("_traced_forward")
    if traced is not None and traced.failed:
        return False  # given up: eager, with eager's buckets
    if str(keras_internals.torch_device()) != "cpu":
        return False
    backbone = getattr(model, "backbone", None)
    if getattr(backbone, "attention_window", None):
        return False
    return setting != "auto" or defined_by_keras_or_kbert(
        [type(model).call, type(model).predict_step]
    )


@contextlib.contextmanager
def eager_during(model):
    """No traces for `model` inside the block: what a whole `predict` runs
    in. Its batches come in length order, many lengths a few batches
    each, so recording them (about a second each for MobileBERT) would
    cost more than their Python; traces serve repeated `predict_on_batch`
    calls, the latency path."""
    before = model.__dict__.get("_traces_paused", False)
    object.__setattr__(model, "_traces_paused", True)
    try:
        yield
    finally:
        object.__setattr__(model, "_traces_paused", before)


def forward_of(model):
    """The model's `TracedForward` (made on first use), or None where
    `enabled(model)` says no or traces are paused (`eager_during`)."""
    if model.__dict__.get("_traces_paused") or not enabled(model):
        return None
    traced = getattr(model, "_traced_forward", None)
    if traced is None or traced.model is not model:
        traced = TracedForward(model)
        # not a Keras-tracked attribute: set on the instance's dict
        object.__setattr__(model, "_traced_forward", traced)
    return traced


def _small(x):
    """Whether a batch has at most `MAX_TRACED_TOKENS` token positions (its
    padding mask's size; batches without one count as small)."""
    mask = x.get("padding_mask") if isinstance(x, dict) else None
    return mask is None or int(np.prod(mask.shape)) <= MAX_TRACED_TOKENS


@contextlib.contextmanager
def _constant_weights(tensors):
    """Weights marked as not requiring gradients while recording: the trace
    then holds them as constants (references to the same tensors)."""
    flags = [t.requires_grad for t in tensors]
    try:
        for t in tensors:
            t.requires_grad_(False)
        yield
    finally:
        for t, flag in zip(tensors, flags):
            t.requires_grad_(flag)


def _other_padding(x):
    """`x` with every padding mask's rows keeping the first half of their
    tokens (at least one), or None when `x` has no padding mask."""
    if not isinstance(x, dict) or not any("padding_mask" in k for k in x):
        return None
    out = dict(x)
    for key, mask in x.items():
        if "padding_mask" not in key or not isinstance(mask, torch.Tensor) or mask.ndim != 2:
            continue
        lengths = (mask != 0).sum(-1, keepdim=True)
        keep = torch.arange(mask.shape[1])[None] < torch.clamp((lengths + 1) // 2, min=1)
        out[key] = (keep & (mask != 0)).to(mask.dtype)
    return out


class TracedForward:
    """`model(x, training=False)` on a CPU as one TorchScript trace per
    input signature (see the module's docstring)."""

    MAX_TRACES = 32

    def __init__(self, model):
        self.model = model
        self.traces = collections.OrderedDict()  # signature -> traced function
        self.seen = set()
        self.state = None
        self.checked = None  # (dtype policy, registrations) when `state` was last checked
        self.failed = None  # why tracing was given up, if it was
        self.recorded = self.replays = self.eager_calls = 0

    def __deepcopy__(self, memo):
        """A copied model starts without traces: its copies of the weights
        are other tensors."""
        import copy

        return TracedForward(copy.deepcopy(self.model, memo))

    def _state(self):
        """What a trace depends on besides the input signature."""
        tensors = tuple(v.value for v in self.model.weights)
        return self.model.dtype_policy.name, tuple(map(id, tensors)), tensors

    def _eager(self, x, small=True):
        """The eager forward; for a batch that is traced, with the products
        its trace records (the same bits: `torch_ops.plain_dense`)."""
        self.eager_calls += 1
        with torch.no_grad(), torch_ops.plain_dense() if small else contextlib.nullcontext():
            return self.model(x, training=False)

    def _record(self, x, tensors):
        leaves = keras.tree.flatten(x)

        def forward(*values):
            return self.model(keras.tree.pack_sequence_as(x, list(values)), training=False)

        with (
            torch.no_grad(),
            warnings.catch_warnings(),
            _constant_weights([t for t in tensors if isinstance(t, torch.Tensor)]),
        ):
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            trace = torch.jit.trace(forward, tuple(leaves), check_trace=False, strict=False)
        self.recorded += 1
        return trace

    def _run(self, trace, x):
        self.replays += 1
        with torch.no_grad(), torch.jit.optimized_execution(False):
            return trace(*keras.tree.flatten(x))

    def _agrees(self, trace, x):
        """The trace against the eager forward on the same shapes with
        other padding: the same outputs, or the reason they differ."""
        other = _other_padding(x)
        if other is None:
            return None
        expected = keras.tree.flatten(self._eager(other))
        got = keras.tree.flatten(self._run(trace, other))
        for a, b in zip(expected, got):
            a, b = np.asarray(a.float()), np.asarray(b.float())
            if a.shape != b.shape or not np.allclose(a, b, atol=CHECK_TOLERANCE, rtol=0):
                return "its outputs depend on input values in ways a trace cannot replay"
        return None

    def _give_up(self, why):
        self.failed = why
        self.traces.clear()
        warnings.warn(
            f"kbert: {type(self.model).__name__}'s CPU inference forward could not be traced "
            f"({why}); predict goes on eagerly",
            stacklevel=3,
        )

    def __call__(self, x):
        if not _small(x):
            return self._eager(x, small=False)
        x = keras.tree.map_structure(
            lambda v: keras.ops.convert_to_tensor(v) if isinstance(v, np.ndarray) else v, x
        )
        checked = (self.model.dtype_policy.name, _REGISTRATIONS[0])
        if checked != self.checked:
            name, ids, _ = self._state()
            if self.state != (name, ids):
                self.traces.clear()
                self.seen.clear()
                self.state = (name, ids)
            self.checked = checked
        signature = batch_signature(x)
        trace = self.traces.get(signature)
        if trace is not None:
            self.traces.move_to_end(signature)
            return self._run(trace, x)
        if signature not in self.seen:
            self.seen.add(signature)
            return self._eager(x)
        try:
            trace = self._record(x, self._state()[2])
            why = self._agrees(trace, x)
        except Exception as error:  # a forward that cannot be traced runs eagerly
            why = f"{type(error).__name__}: {str(error)[:300]}"
        if why:
            self._give_up(why)
            return self._eager(x)
        self.traces[signature] = trace
        while len(self.traces) > self.MAX_TRACES:
            self.traces.popitem(last=False)
        return self._run(trace, x)

    def stats(self):
        return {
            "traces": len(self.traces),
            "recorded": self.recorded,
            "replays": self.replays,
            "eager_calls": self.eager_calls,
            "failed": self.failed,
        }
