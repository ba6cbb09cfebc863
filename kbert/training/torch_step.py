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

On an H100, with the other torch changes of the same session (multi-tensor
clipping, `kbert.layers.fused.sublayer_call`, the MLM loss on 2-D rows), a
BERT-base 128 x 256 step went from 2,037 to 2,787 sequences/s (transformers
eager: 2,493 on the same machine) and a 512 x 32 step from 204 to 465-482
(`benchmarks/results/gpu_pretrain_h100_s5.json`).
"""

import contextlib
import warnings

import keras


def _device_copy(value, device):
    """A CPU tensor onto `device` from pinned memory, without blocking the
    host (torch's caching host allocator keeps the pinned buffer alive until
    the copy has run)."""
    import numpy as np
    import torch

    if device.type == "cpu":
        return value
    # float64 is left to Keras, which converts it to floatx.
    if isinstance(value, np.ndarray) and (value.dtype.kind in "biu" or value.dtype == np.float32):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        if device.type == "cuda":
            return value.pin_memory().to(device, non_blocking=True)
        return value.to(device)
    return value


def to_device(data):
    """Every host array or tensor in `data` on Keras' current torch device
    (non-blocking copies from pinned memory to a GPU)."""
    import torch

    from keras.src.backend.torch.core import get_device

    device = torch.device(get_device())
    return keras.tree.map_structure(lambda v: _device_copy(v, device), data)


def train_step(model, data):
    """Keras' torch `train_step` (same order, same losses and metrics),
    with no host-device synchronisation of its own."""
    import torch

    data = to_device(data)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
    model.zero_grad()
    loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    first = next(i for i in keras.tree.flatten(x) if i is not None)
    # The loss tracker weights by batch size: a tensor made on the device,
    # where Keras passes a Python int (a synchronising copy).
    model._loss_tracker.update_state(loss, sample_weight=torch.full((), first.shape[0], dtype=torch.float32,
                                                                   device=loss.device))
    if model.optimizer is not None:
        loss = model.optimizer.scale_loss(loss)
    trainable_weights = model.trainable_weights  # a walk over every layer: once per step
    if trainable_weights:
        loss.backward()
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            model.optimizer.apply(gradients, trainable_weights)
    else:
        warnings.warn("The model does not have any trainable weights.")
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


class InPlaceCounter:
    """Mixed into an optimizer's `iterations` variable: `assign_add` of a
    Python int adds in place on the device (Keras turns the int into a
    tensor first, a synchronising copy)."""

    def assign_add(self, value):
        import torch

        if isinstance(value, int) and not isinstance(value, bool):
            with torch.no_grad():
                self.value.add_(value)
            return self
        return super().assign_add(value)


_IN_PLACE_CLASSES = {}


def count_in_place(variable):
    """Make `variable.assign_add(int)` an in-place device add (see
    `InPlaceCounter`); the variable, its value and its saving are unchanged."""
    base = type(variable)
    if not isinstance(variable, InPlaceCounter):
        if base not in _IN_PLACE_CLASSES:  # one class per variable class, not per optimizer
            _IN_PLACE_CLASSES[base] = type(f"InPlace{base.__name__}", (InPlaceCounter, base), {})
        variable.__class__ = _IN_PLACE_CLASSES[base]
    return variable


def adam_update(optimizer, grads, variables, learning_rate):
    """Keras' multi-tensor torch Adam update (`torch._foreach_*`) with the
    step count and bias corrections computed on the device."""
    import torch

    # `_value` is the torch parameter itself: `.value` would add an autocast
    # and symbolic-scope check per read (600 reads per BERT-base step), and
    # no autocast scope is active in `apply`.
    keras_variables = variables
    variables = [v._value for v in variables]
    dtype = variables[0].dtype
    lr = keras.ops.cast(learning_rate, dtype)
    # Tensor-with-number arithmetic passes the number as a kernel argument:
    # no host-to-device copy, unlike ops.cast(python_float).
    local_step = optimizer.iterations.value.to(dtype) + 1
    beta_1_power = torch.pow(optimizer.beta_1, local_step)
    beta_2_power = torch.pow(optimizer.beta_2, local_step)
    alpha = lr * torch.sqrt(1 - beta_2_power) / (1 - beta_1_power)

    index = optimizer._get_variable_index
    m_list = [optimizer._momentums[index(v)]._value for v in keras_variables]
    v_list = [optimizer._velocities[index(v)]._value for v in keras_variables]
    torch._foreach_mul_(m_list, optimizer.beta_1)
    torch._foreach_add_(m_list, grads, alpha=1 - optimizer.beta_1)
    torch._foreach_mul_(v_list, optimizer.beta_2)
    torch._foreach_add_(v_list, torch._foreach_mul(grads, grads), alpha=1 - optimizer.beta_2)
    if optimizer.amsgrad:
        v_hat_list = [optimizer._velocity_hats[index(v)]._value for v in keras_variables]
        torch._foreach_maximum_(v_hat_list, v_list)
        v_list = v_hat_list
    torch._foreach_add_(
        variables,
        torch._foreach_div(torch._foreach_mul(m_list, alpha), torch._foreach_add(torch._foreach_sqrt(v_list), optimizer.epsilon)),
        alpha=-1,
    )


_END = object()


def _host_iterator_class(base):
    class HostBatchIterator(base):
        """Keras' torch epoch iterator, with each batch made on the host."""

        def _get_iterator(self):
            loader = super()._get_iterator()

            def batches():
                with keras.device("cpu"):
                    iterator = iter(loader)
                while True:
                    with keras.device("cpu"):
                        batch = next(iterator, _END)
                    if batch is _END:
                        return
                    yield batch

            return batches()

    return HostBatchIterator


@contextlib.contextmanager
def host_batches(force=False):
    """Within the block, Keras' torch `fit`/`evaluate` make their batches on
    the host (see the module docstring): only where the default device is a
    GPU, or with `force`."""
    from keras.src.backend.torch import trainer
    from keras.src.backend.torch.core import get_device

    if not force and not str(get_device()).startswith("cuda"):
        yield
        return
    original = trainer.TorchEpochIterator
    trainer.TorchEpochIterator = _host_iterator_class(original)
    try:
        yield
    finally:
        trainer.TorchEpochIterator = original
