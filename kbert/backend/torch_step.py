"""The torch backend's training step without host-device synchronisation.

Keras' torch trainer synchronises the CUDA stream several times per step: a
Python number that becomes a tensor is a pageable host-to-device copy, and
torch waits for the stream before such a copy (the loss tracker's batch
size, `iterations + 1`, `beta_1`, `beta_2`, `iterations.assign_add(1)`), and
each input batch arrives as CPU tensors copied the same way. Every sync
drains the GPU queue, so the host's Python work for the next layers (Keras
layer calls are costly) can no longer run ahead of the GPU: the step time
becomes host time plus GPU time instead of their maximum.

Keras' torch data adapters (arrays, tf.data, PyDataset) convert each batch
with `convert_to_tensor`, which puts it on the GPU with such a blocking
copy. During `Task.fit` (`host_batches`) the batches are made on the host
instead (Keras' device scope set to "cpu" around each `next()` of the
loader), and the step copies them from pinned memory without blocking. The
batch size for the loss tracker is made on the device, and AdamW's update
keeps its step count and bias corrections on the device. Same arithmetic
as Keras (a test compares against a NumPy AdamW; another records every
constant conversion in a step: none). Used by `Task.train_step`/`fit` and
`kbert.training.AdamW` only when the backend is torch.

Python numbers that Keras' own loss reduction and `Mean` metrics convert
inside the step are made on the GPU by fill kernels (`constants_on_device`).

On a GPU, `Task.fit` replays this step as a CUDA graph (`GraphedTrainStep`):
possible only because the step has no synchronisation and updates its state
in place. Figures: `benchmarks/RESULTS.md`.
"""

import contextlib
import threading
import warnings

import keras
import numpy as np
import torch

from kbert.backend import keras_internals, torch_ddp, torch_ops, torch_trace, torch_triton
from kbert.backend.state import state_of


def _host_tensor(value):
    """A host array as a CPU tensor (integer and float32 arrays; float64 is
    left to Keras, which converts it to floatx), or None if it is not one."""
    if isinstance(value, np.ndarray) and (value.dtype.kind in "biu" or value.dtype == np.float32):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        return value
    return None


def _host_array(value):
    """A host array or CPU tensor as a NumPy array (any dtype), or None."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        return value.numpy()
    return value if isinstance(value, np.ndarray) else None


def _device_copy(value, device):
    """A CPU tensor onto `device` from pinned memory, without blocking the
    host (torch's caching host allocator keeps the pinned buffer alive until
    the copy has run)."""
    host = _host_tensor(value) if device.type != "cpu" else None
    if host is None:
        return value
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def to_device(data):
    """Every host array or tensor in `data` on Keras' current torch device
    (non-blocking copies from pinned memory to a GPU)."""
    device = torch.device(keras_internals.torch_device())
    return keras.tree.map_structure(lambda v: _device_copy(v, device), data)


def device_constant(convert, value, dtype, device):
    """`convert(value, dtype)` (Keras' torch `convert_to_tensor`) for a
    Python number or a short tuple of them, made on `device` by fill
    kernels (the number is a kernel argument) instead of a host-to-device
    copy: same values and dtype, no stream synchronisation, and capturable
    in a CUDA graph."""
    with keras.device("cpu"):
        host = convert(value, dtype=dtype)
    if host.ndim == 0:
        return torch.full((), host.item(), dtype=host.dtype, device=device)
    return torch.stack([torch.full((), v, dtype=host.dtype, device=device) for v in host.tolist()])


def _is_constant(value):
    number = (bool, int, float)
    if isinstance(value, number):
        return True
    return (
        isinstance(value, (tuple, list))
        and 0 < len(value) <= 8
        and all(isinstance(v, number) for v in value)
    )


@contextlib.contextmanager
def constants_on_device():
    """Within the block, Keras' torch backend makes the Python numbers it
    converts (Keras' loss reduction divides by the batch shape, `Mean`
    metrics count samples, ...) on the GPU with `device_constant` instead of
    copying them from pageable host memory, which waits for the stream."""
    device = torch.device(keras_internals.torch_device())
    if device.type != "cuda":
        yield
        return

    def factory(original):
        def convert_to_tensor(x, dtype=None, sparse=None, ragged=None):
            if _is_constant(x) and str(keras_internals.torch_device()).startswith("cuda"):
                return device_constant(original, x, dtype, device)
            return original(x, dtype=dtype, sparse=sparse, ragged=ragged)

        return convert_to_tensor

    with keras_internals.torch_convert_to_tensor(factory):
        yield


def train_step(model, data, segments=None):
    """Keras' torch `train_step` (same order, same losses and metrics),
    with no host-device synchronisation of its own. `segments`: run
    attention over segments (`torch_ops.segment_attention`); None: where
    the batch allows it (`segments_apply`)."""
    if segments is None:
        segments = segments_apply(data)
    with constants_on_device(), torch_ops.segment_attention(segments):
        return _train_step(model, data)


def segments_apply(data):
    """Whether the training step on this batch may run attention over
    segments (`torch_ops.segment_attention`): its padding mask, (..., T) on
    the host with T of at least `torch_ops.SEGMENT_MIN_LENGTH`, has in every
    row its real tokens first and its padding after them (as kbert's
    preprocessors and transformers' tokenizers make them), and no loss can
    read a padding position's output: targets with a value per token are
    weighted 0 at padding. Checked on the host, before the batch is copied
    (on the device it would synchronise the step). False for a mask or
    targets already on a device, without a mask, and under torch-ddp (each
    process would decide for its own rows, and their graphs must agree)."""
    if isinstance(data, (tuple, list)):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    else:
        x, y, sample_weight = data, None, None
    if not isinstance(x, dict) or torch_ddp.active():
        return False
    mask = _host_array(x.get("padding_mask"))
    if mask is None or mask.ndim < 2 or mask.shape[-1] < torch_ops.SEGMENT_MIN_LENGTH:
        return False
    if not torch.cuda.is_available():
        return False
    mask = mask != 0
    rows = mask.reshape(-1, mask.shape[-1])
    # real tokens first: no row turns from padding back to a real token
    if (rows[:, 1:] & ~rows[:, :-1]).any():
        return False
    targets = keras.tree.flatten(y)
    per_token = [v for v in targets if tuple(getattr(v, "shape", ())[: mask.ndim]) == mask.shape]
    if not per_token:
        return True
    weights = [v for v in keras.tree.flatten(sample_weight) if v is not None]
    if not weights:
        return False
    for weight in weights:
        weight = _host_array(weight)
        if weight is None or weight.shape[: mask.ndim] != mask.shape:
            return False
        if (weight.reshape(mask.shape + (-1,))[~mask] != 0).any():
            return False
    return True


def _train_step(model, data):
    data = to_device(data)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    distributed = torch_ddp.active()
    # Under torch-ddp the forward runs through DistributedDataParallel, whose
    # hooks all-reduce the gradients during the backward pass; a step
    # replayed as a CUDA graph sums them after the backward pass instead.
    after_backward = torch_ddp.sync_after_backward()
    forward = torch_ddp.wrapped(model) if distributed and not after_backward else model
    normalisation = torch_ddp.loss_normalisation() if distributed else contextlib.nullcontext()
    with normalisation as share:
        if keras_internals.call_has_training_arg(model):
            y_pred = forward(x, training=True)
        else:
            y_pred = forward(x)
        model.zero_grad()
        loss = keras_internals.compute_loss(model, x, y, y_pred, sample_weight, training=True)
        first = next(i for i in keras.tree.flatten(x) if i is not None)
        reported = loss
        if distributed:
            loss, reported = share(loss, first.shape[0])
    # The loss tracker weights by batch size: a tensor made on the device,
    # where Keras passes a Python int (a synchronising copy).
    keras_internals.loss_tracker(model).update_state(
        reported,
        sample_weight=torch.full((), first.shape[0], dtype=torch.float32, device=loss.device),
    )
    if model.optimizer is not None:
        loss = model.optimizer.scale_loss(loss)
    trainable_weights = model.trainable_weights  # a walk over every layer: once per step
    if trainable_weights:
        loss.backward()
        gradients = [v.value.grad for v in trainable_weights]
        if after_backward:
            torch_ddp.all_reduce_gradients(gradients)
        with torch.no_grad(), own_gradients():
            model.optimizer.apply(gradients, trainable_weights)
    else:
        warnings.warn("The model does not have any trainable weights.")
    # (reduced across processes under torch-ddp: see Task.get_metrics_result)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


_OWN_GRADIENTS = threading.local()


@contextlib.contextmanager
def own_gradients():
    """Within the block (in this thread) the gradients given to the
    optimizer are the step's own (`.grad` tensors set to None before each
    backward pass): its update may scale them in place (see `adam_update`)."""
    before = owns_gradients()
    _OWN_GRADIENTS.on = True
    try:
        yield
    finally:
        _OWN_GRADIENTS.on = before


def owns_gradients():
    return getattr(_OWN_GRADIENTS, "on", False)


class InPlaceCounter:
    """Mixed into an optimizer's `iterations` variable: `assign_add` of a
    Python int adds in place on the device (Keras turns the int into a
    tensor first, a synchronising copy)."""

    def assign_add(self, value):
        if isinstance(value, int) and not isinstance(value, bool):
            with torch.no_grad():
                self.value.add_(value)
            return self
        return super().assign_add(value)


def count_in_place(variable):
    """Make `variable.assign_add(int)` an in-place device add (see
    `InPlaceCounter`); the variable, its value and its saving are unchanged."""
    return keras_internals.add_variable_methods(variable, InPlaceCounter)


def adam_update(optimizer, grads, variables, learning_rate):
    """Keras' multi-tensor torch Adam update with the step count and bias
    corrections computed on the device: one Triton kernel per variable on a
    GPU (`kbert.backend.torch_triton`), `torch._foreach_*` passes elsewhere."""
    # Keras' decoupled weight decay and kbert's clipping scale, deferred to
    # here (`defers_weight_decay`, `defers_clipping`), taken first: nothing
    # of this step may reach a later one
    decay = [False] * len(variables)
    if getattr(optimizer, "defers_weight_decay", False):
        decay = optimizer.take_deferred_decay(variables)
    take_scale = getattr(optimizer, "take_deferred_clip_scale", None)
    clip_scale = take_scale() if take_scale is not None else None
    m_list, v_list, v_hat_list = keras_internals.adam_slots(optimizer, variables)
    keras_variables = variables
    variables = [keras_internals.torch_value(v) for v in variables]
    dtype = variables[0].dtype
    lr = keras.ops.cast(learning_rate, dtype)
    # Tensor-with-number arithmetic passes the number as a kernel argument:
    # no host-to-device copy, unlike ops.cast(python_float).
    count = optimizer.iterations  # a derived tensor under gradient accumulation
    local_step = getattr(count, "value", count).to(dtype) + 1
    beta_1_power = torch.pow(optimizer.beta_1, local_step)
    beta_2_power = torch.pow(optimizer.beta_2, local_step)
    alpha = lr * torch.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    betas = (optimizer.beta_1, optimizer.beta_2)
    corrected = getattr(optimizer, "corrected_epsilon", False)
    if v_hat_list is None and cpu_fused_adam(
        variables,
        grads,
        m_list,
        v_list,
        lr,
        local_step,
        *betas,
        optimizer.epsilon,
        weight_decay=(optimizer.weight_decay, decay) if any(decay) else None,
        clip_scale=clip_scale,
        corrected_epsilon=corrected,
    ):
        return  # one pass over each variable on a CPU, decay and clipping included
    if clip_scale is not None:
        grads = torch_ops.scale_all(grads, clip_scale)
    optimizer.apply_weight_decay_now([v for v, d in zip(keras_variables, decay) if d])
    epsilon = optimizer.epsilon
    if corrected:  # torch's epsilon (see kbert's AdamW): a device scalar
        epsilon = epsilon * torch.sqrt(1 - beta_2_power)
    if v_hat_list is None and torch_triton.adam_update(
        variables, grads, m_list, v_list, alpha, *betas, epsilon
    ):
        return  # one kernel per variable on a GPU, the same arithmetic
    torch._foreach_mul_(m_list, optimizer.beta_1)
    torch._foreach_add_(m_list, grads, alpha=1 - optimizer.beta_1)
    torch._foreach_mul_(v_list, optimizer.beta_2)
    torch._foreach_add_(v_list, torch._foreach_mul(grads, grads), alpha=1 - optimizer.beta_2)
    if v_hat_list is not None:
        torch._foreach_maximum_(v_hat_list, v_list)
        v_list = v_hat_list
    torch._foreach_add_(
        variables,
        torch._foreach_div(
            torch._foreach_mul(m_list, alpha),
            torch._foreach_add(torch._foreach_sqrt(v_list), epsilon),
        ),
        alpha=-1,
    )


def cpu_fused_adam(
    variables,
    grads,
    m_list,
    v_list,
    lr,
    step,
    beta_1,
    beta_2,
    epsilon,
    weight_decay=None,
    clip_scale=None,
    corrected_epsilon=False,
):
    """Keras' Adam update through torch's fused CPU kernel
    (`torch._fused_adam_`, torch 2.4-2.13 checked): one pass over each
    variable and its slots where the foreach update makes ten, several
    times faster on a CPU. Returns False, having
    changed nothing, where it does not apply: tensors not all contiguous
    float32 on the CPU, tensor hyperparameters, under torch.compile, or a
    torch without the kernel.

    torch's kernel divides the bias corrections in as
    (sqrt(v) / sqrt(c2) + eps) and lr / c1; with eps / sqrt(c2) for eps
    that is Keras' x - m lr sqrt(c2) / c1 / (sqrt(v) + eps), up to rounding
    (`corrected_epsilon`: the kernel's own arithmetic, eps as given).
    CPU tensors can be read without a device synchronisation, so the step
    and learning rate become Python numbers here.

    `weight_decay`: (rate, [bool per variable]) or None: Keras' decoupled
    decay x (1 - rate lr) of the marked variables before the update, in the
    same pass (`torch._fused_adamw_`, which scales by 1 - lr rate first);
    a separate pass over each decayed variable otherwise. `clip_scale`: a
    float32 scalar tensor that multiplies every gradient first (global-norm
    clipping), in the same pass as the kernel's `grad_scale` (a divisor:
    it also writes the scaled gradients back)."""
    if torch.compiler.is_compiling() or not hasattr(torch, "_fused_adam_"):
        return False
    if not all(isinstance(b, (int, float)) for b in (beta_1, beta_2, epsilon)):
        return False
    if not 0 <= beta_2 < 1:
        return False
    # The kernel walks each variable, gradient and slot as flat memory:
    # all must be contiguous (a variable made from a transposed array is not).
    tensors = (*variables, *grads, *m_list, *v_list)
    if not all(
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.dtype == torch.float32
        and t.is_contiguous()
        for t in tensors
    ):
        return False
    if weight_decay is not None and not (
        isinstance(weight_decay[0], (int, float)) and hasattr(torch, "_fused_adamw_")
    ):
        return False
    grad_scale = None
    if clip_scale is not None:
        if not (isinstance(clip_scale, torch.Tensor) and clip_scale.device.type == "cpu"):
            return False
        grad_scale = (1.0 / clip_scale.to(torch.float32)).reshape(())
    step = float(step)
    correction_2 = 1.0 - beta_2**step
    rate, marked = weight_decay if weight_decay is not None else (0.0, [False] * len(variables))
    for decays in (False, True):
        part = [i for i, m in enumerate(marked) if bool(m) == decays]
        if not part:
            continue
        kernel = torch._fused_adamw_ if decays else torch._fused_adam_
        kernel(
            [variables[i] for i in part],
            [grads[i] for i in part],
            [m_list[i] for i in part],
            [v_list[i] for i in part],
            [],
            [torch.tensor(step)] * len(part),
            lr=float(lr),
            beta1=beta_1,
            beta2=beta_2,
            weight_decay=float(rate) if decays else 0.0,
            eps=epsilon if corrected_epsilon else epsilon / correction_2**0.5,
            amsgrad=False,
            maximize=False,
            grad_scale=grad_scale,
        )
    # The kernels write in place without bumping the tensors' version
    # counters, which caches of derived weights (`torch_ops.PackedWeightCache`)
    # read to see a change.
    increment_versions(variables)
    return True


def increment_versions(tensors):
    """Marks `tensors` as changed in place (their `_version` advances)."""
    for tensor in tensors:
        torch.autograd.graph.increment_version(tensor)


@contextlib.contextmanager
def host_batches(force=False):
    """Within the block, Keras' torch `fit`/`evaluate` make their batches on
    the host (see the module docstring): only where the default device is a
    GPU, or with `force`."""
    if not force and not str(keras_internals.torch_device()).startswith("cuda"):
        yield
        return
    with keras_internals.torch_batches_on_host():
        yield


def _graph_safe_optimizer(optimizer):
    """Whether `optimizer`'s update is known to be capturable: kbert's AdamW
    (no host-device copies; step count and bias corrections on the device)
    with a learning rate that is a variable or a schedule of `iterations`
    (a plain callable would be evaluated once, at capture), no gradient
    accumulation or EMA (Keras branches on device values there), no loss
    scaling (the same)."""
    lr = keras_internals.learning_rate_object(optimizer)
    return (
        getattr(optimizer, "updates_on_device", False)
        and isinstance(lr, (keras.Variable, keras.optimizers.schedules.LearningRateSchedule))
        and not optimizer.gradient_accumulation_steps
        and not optimizer.use_ema
    )


def user_code_in_step(model):
    """Whether the training step runs code of the user's (a loss, a metric,
    an overridden `compute_loss`/`train_step`/`compute_metrics`): a graph
    would freeze whatever Python state such code reads at capture."""
    compiled = keras_internals.compiled_losses_and_metrics(model)
    methods = [
        getattr(type(model), name)
        for name in ("compute_loss", "train_step", "compute_metrics", "call")
    ]
    return not torch_trace.defined_by_keras_or_kbert(compiled + methods)


def cuda_graph_supported(model, force=False):
    """Whether `model.fit` can replay its training step as a CUDA graph: a
    GPU, kbert's AdamW, and (unless `force`) no user code in the step."""
    return (
        torch.cuda.is_available()
        and str(keras_internals.torch_device()).startswith("cuda")
        and model.optimizer is not None
        and _graph_safe_optimizer(model.optimizer)
        and (force or not user_code_in_step(model))
    )


@contextlib.contextmanager
def random_state_kept_on_failure():
    """A CUDA graph capture that fails leaves torch's default CUDA generator
    marked as capturing (its epilogue runs only when a capture ends well),
    and every eager dropout after it raises "Offset increment outside graph
    capture". On an exception inside the block, the generator gets back a
    copy of its state from before the block."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    saved = generator.clone_state()
    try:
        yield
    except BaseException:
        generator.graphsafe_set_state(saved)
        raise


class _GraphsPerShape:
    """What `GraphedTrainStep` and `GraphedForward` share: one CUDA graph per
    input signature (at most `MAX_GRAPHS`), all in one memory pool, captured
    on a side stream; a signature's first run warms up on that stream."""

    MAX_GRAPHS = 16

    def __init__(self, model):
        self.model = model
        self.stream = torch.cuda.Stream()
        self.graphs = {}  # signature -> (graph, static inputs, static outputs)
        self.seen = set()
        self.pool = None
        self.replays = 0
        self.failed = None  # why capture failed, if it did

    def _on_capture_stream(self, run, *args):
        """`run(*args)` eagerly on the capture stream: lazy CUDA state for its
        kernels is made there, outside any graph."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            outputs = run(*args)
        torch.cuda.current_stream().wait_stream(self.stream)
        return outputs


class GraphedTrainStep(_GraphsPerShape):
    """`train_step` captured as a CUDA graph per batch shape and replayed
    for every later batch of that shape, for the duration of one `fit`.

    The eager step issues ~2,000 kernels through Keras' Python layers; on a
    GPU the host cannot issue them as fast as the GPU runs them, so the step
    is host-bound. A replay issues the whole step (forward, backward,
    clipping, AdamW, metrics) in one call. It needs what `train_step`
    already guarantees: no host-device synchronisation and state updated in
    place (Keras' torch variables assign with `copy_`, the step counter adds
    in place). Dropout draws from torch's default CUDA generator, which a
    graph advances on every replay (fresh masks each step).

    Shapes: length-bucketed batches (`kbert.training.batching`) come in a
    handful of shapes; each gets its graph, all graphs share one memory
    pool. A shape runs eagerly on the capture stream the first time it is
    seen (lazy CUDA state for its kernels is made outside any graph) and
    is captured the next time; at most `MAX_GRAPHS` shapes are captured,
    later ones run eagerly.

    Lifetime: one `fit` (`Task.fit` makes it and drops it), so variables
    cannot be re-created under it. The first `WARMUP` steps of a fit run
    eagerly on the capture stream (optimizer slots, metric variables,
    gradients and the libraries' per-stream state are made there); the
    second step of the first batch's shape is captured. If capture fails,
    a warning says why and the fit goes on eagerly.
    """

    WARMUP = 1

    def __init__(self, model):
        super().__init__(model)
        self.eager_steps = 0

    def _capture(self, data, signature, segments):
        static_inputs = to_device(data)
        leaves = [v for v in keras.tree.flatten(static_inputs) if v is not None]
        if not all(isinstance(v, torch.Tensor) and v.is_cuda for v in leaves):
            # e.g. float64 arrays, which Keras converts inside the step
            return self._give_up(
                "a batch holds arrays that are not integer or float32", data, segments
            )
        # Grads made inside the capture live in the graphs' memory pool.
        self.model.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        previous = torch.cuda.current_stream()
        failed = None
        try:
            with (
                random_state_kept_on_failure(),
                torch.cuda.graph(
                    graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
                ),
            ):
                static_logs = train_step(self.model, static_inputs, segments)
        except Exception as error:  # a step that cannot be captured trains eagerly
            torch.cuda.set_stream(previous)  # a failed capture_end skips the stream's restore
            failed = f"{type(error).__name__}: {str(error)[:300]}"
        if torch_ddp.active():
            # A graph holds collectives: every process replays its graph or
            # none does (a capture records without running, so nothing was
            # exchanged yet).
            flag = torch.ones((), device="cuda") if failed else torch.zeros((), device="cuda")
            if float(torch_ddp.all_reduce_sum(flag)) > 0 and not failed:
                failed = "another process could not capture its step"
        if failed:
            self.model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            # graphs captured before draw dropout masks from the generator
            # state replaced above: the rest of the fit runs eagerly
            self.graphs.clear()
            return self._give_up(failed, data, segments)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[signature] = (graph, static_inputs, static_logs)
        graph.replay()  # capture records the step without running it
        self.replays += 1
        return static_logs

    def _give_up(self, why, data, segments):
        self.failed = why
        self.eager_steps += 1
        warnings.warn(
            f"kbert: the training step could not be captured as a CUDA graph ({why}); "
            "this fit goes on eagerly. compile(cuda_graph=False) skips the attempt."
        )
        return train_step(self.model, data, segments)

    def __call__(self, data):
        # a batch with segments and one without are two graphs
        segments = segments_apply(data)
        signature = (*torch_trace.batch_signature(data), segments)
        captured = self.graphs.get(signature)
        if captured is not None:
            graph, static_inputs, static_logs = captured
            keras.tree.map_structure(_copy_into, static_inputs, data)
            graph.replay()
            self.replays += 1
            return static_logs
        capturing = not self.failed and len(self.graphs) < self.MAX_GRAPHS
        if capturing and self.eager_steps >= self.WARMUP and signature in self.seen:
            return self._capture(data, signature, segments)  # counted as a replay
        self.seen.add(signature)
        self.eager_steps += 1
        if capturing:
            return self._on_capture_stream(train_step, self.model, data, segments)
        return train_step(self.model, data, segments)

    def stats(self):
        """Replayed and eager steps of this fit, graphs captured, and why
        capture failed (or None)."""
        return {
            "replays": self.replays,
            "eager_steps": self.eager_steps,
            "graphs": len(self.graphs),
            "capture_failed": self.failed,
        }


def _copy_into(static, value):
    """`value` into the graph's input buffer `static`, from pinned memory
    when it is on the host."""
    if static is not None:
        host = _host_tensor(value)
        static.copy_(value if host is None else host.pin_memory(), non_blocking=True)
    return static


def warm_up(model):
    """Before a `fit` prepares its inputs: where its step will run the
    Triton Adam kernel (kbert's AdamW, on a GPU), the kernel's first launch
    (its compilation) starts in the background (`torch_triton.warm_up`)."""
    optimizer = getattr(model, "optimizer", None)
    if not runs_our_step(model) or not getattr(optimizer, "updates_on_device", False):
        return None
    if getattr(optimizer, "amsgrad", False) or not torch.cuda.is_available():
        return None
    return torch_triton.warm_up(torch.device(keras_internals.torch_device()))


def runs_our_step(model):
    """Whether `fit` runs this module's step: eager torch (with jit_compile,
    torch.compile traces Keras' own step)."""
    return not model.jit_compile


def graphs_training(model):
    """Whether `fit` replays `model`'s training step as CUDA graphs, one per
    batch shape (`fit_context`, without its side effects: a model already
    wrapped by DDP trains eagerly)."""
    graph = getattr(model, "cuda_graph", "auto")
    if torch_ddp.active() and state_of(model).ddp is not None:
        return False
    return bool(runs_our_step(model) and graph and cuda_graph_supported(model, force=graph is True))


@contextlib.contextmanager
def fit_context(model):
    """What a task's `fit` runs inside on torch: batches made on the host,
    and on a GPU the step replayed as a CUDA graph where it can (the graph
    lives for one fit; `model.cuda_graph_stats` keeps its counts)."""
    if not runs_our_step(model):
        yield
        return
    graph = getattr(model, "cuda_graph", "auto")
    sync = contextlib.nullcontext()
    distributed = torch_ddp.active()
    if (
        graph
        and cuda_graph_supported(model, force=graph is True)
        and (not distributed or torch_ddp.prepare_for_graphs(model))
    ):
        model.graphed_step = GraphedTrainStep(model)
        if distributed:
            # DDP's backward hooks cannot be replayed: the graph holds the
            # gradient all-reduce after the backward pass (torch_ddp doc).
            sync = torch_ddp.gradients_after_backward()
    try:
        with host_batches(), sync:
            yield
    finally:
        graphed = getattr(model, "graphed_step", None)
        if graphed is not None:
            model.cuda_graph_stats = graphed.stats()
            model.graphed_step = None


def task_train_step(model, data):
    """A task's training step on torch: the graph's replay inside a graphed
    fit, else the sync-free eager step."""
    graphed = getattr(model, "graphed_step", None)
    if graphed is not None:
        return graphed(data)
    return train_step(model, data)


def task_test_step(model, keras_test_step, *args, **kwargs):
    """Keras' test step on host batches copied to the device, with its loss
    and metric constants made on the device; under torch-ddp, the step
    below."""
    with constants_on_device():
        if torch_ddp.active():
            return _ddp_test_step(model, *to_device(args), **kwargs)
        return keras_test_step(*to_device(args), **kwargs)


def _ddp_test_step(model, data):
    """Keras' torch test step, logging the loss as `_train_step` does: a
    model whose loss is normalised by global totals (`BertPreTrainer`)
    returns this process's share of it, not the loss."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with torch_ddp.loss_normalisation():
        if keras_internals.call_has_training_arg(model):
            y_pred = model(x, training=False)
        else:
            y_pred = model(x)
        loss = keras_internals.compute_loss(model, x, y, y_pred, sample_weight, training=False)
        reported = torch_ddp.reported_loss(loss)
    first = next(i for i in keras.tree.flatten(x) if i is not None)
    keras_internals.loss_tracker(model).update_state(
        reported,
        sample_weight=torch.full((), first.shape[0], dtype=torch.float32, device=loss.device),
    )
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


class GraphedForward(_GraphsPerShape):
    """The inference forward `model(x, training=False)` captured as a CUDA
    graph per input shape and replayed, for the duration of one `predict`.

    Keras' eager forward issues each kernel from Python; on short inputs the
    GPU waits for the host. Shapes come from length buckets (a handful);
    a shape runs eagerly the first time it is seen and is captured the
    next time (up to `MAX_GRAPHS` shapes, all in one memory pool). Replay
    outputs live in the graph's buffers, so they are cloned before Keras
    keeps them. If capture fails, a warning says why and the call goes on
    eagerly.
    """

    def __init__(self, model):
        super().__init__(model)
        self.eager_calls = 0

    def _eager(self, x):
        self.eager_calls += 1
        with torch.no_grad(), constants_on_device():
            return self.model(x, training=False)

    def _capture(self, x, signature):
        static_inputs = keras.tree.map_structure(
            lambda v: v.clone() if isinstance(v, torch.Tensor) else v, x
        )
        leaves = [v for v in keras.tree.flatten(static_inputs) if v is not None]
        if not all(isinstance(v, torch.Tensor) and v.is_cuda for v in leaves):
            self.failed = "inputs that are not CUDA tensors"
            return self._eager(x)
        graph = torch.cuda.CUDAGraph()
        previous = torch.cuda.current_stream()
        try:
            with (
                torch.no_grad(),
                constants_on_device(),  # a Python number made a tensor: no host copy
                random_state_kept_on_failure(),
                torch.cuda.graph(
                    graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
                ),
            ):
                static_outputs = self.model(static_inputs, training=False)
        except Exception as error:  # a forward that cannot be captured runs eagerly
            torch.cuda.set_stream(previous)
            torch.cuda.synchronize()
            self.failed = f"{type(error).__name__}: {str(error)[:300]}"
            warnings.warn(
                f"kbert: the inference forward could not be captured as a CUDA graph "
                f"({self.failed}); predict goes on eagerly"
            )
            return self._eager(x)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[signature] = (graph, static_inputs, static_outputs)
        return self._replay(signature, x)

    def _replay(self, signature, x):
        graph, static_inputs, static_outputs = self.graphs[signature]
        keras.tree.map_structure(_copy_into, static_inputs, x)
        graph.replay()
        self.replays += 1
        return keras.tree.map_structure(
            lambda v: v.clone() if isinstance(v, torch.Tensor) else v, static_outputs
        )

    def __call__(self, x):
        signature = torch_trace.batch_signature(x)
        if signature in self.graphs:
            return self._replay(signature, x)
        if self.failed or len(self.graphs) >= self.MAX_GRAPHS:
            return self._eager(x)
        if signature not in self.seen:
            # warm-up on the capture stream: lazy CUDA state made outside a graph
            self.seen.add(signature)
            return self._on_capture_stream(self._eager, x)
        return self._capture(x, signature)

    def stats(self):
        return {
            "replays": self.replays,
            "eager_calls": self.eager_calls,
            "graphs": len(self.graphs),
            "capture_failed": self.failed,
        }


@contextlib.contextmanager
def predict_context(model):
    """What a task's `predict` runs inside on torch with a GPU: the forward
    replayed as a CUDA graph per input shape (`model.cuda_graph_stats`
    keeps the counts), unless `compile(cuda_graph=False)`."""
    graph = getattr(model, "cuda_graph", "auto")
    if (
        not graph
        or not str(keras_internals.torch_device()).startswith("cuda")
        or getattr(model, "jit_compile", False) is True
        or (
            graph == "auto"
            and not torch_trace.defined_by_keras_or_kbert(
                [type(model).call, type(model).predict_step]
            )
        )
    ):
        with torch_trace.eager_during(model):
            yield
        return
    model.graphed_forward = GraphedForward(model)
    try:
        yield
    finally:
        model.cuda_graph_stats = model.graphed_forward.stats()
        model.graphed_forward = None


def task_predict_step(model, keras_predict_step, data):
    """A task's predict step on torch: the graphed forward inside a
    graphed predict, the traced forward on a CPU
    (`kbert.backend.torch_trace`), else Keras' step."""
    forward = getattr(model, "graphed_forward", None) or torch_trace.forward_of(model)
    if forward is None:
        return keras_predict_step(data)
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    return forward(x)
