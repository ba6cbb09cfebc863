"""Data parallelism on the torch backend: torch.distributed, one process per
device, gradients all-reduced by `DistributedDataParallel` (bucketed and
overlapped with the backward pass).

Launched with `torchrun --nproc_per_node N` (or any launcher that sets
`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`):
`initialize()` joins the process group (NCCL on GPUs, gloo on CPUs) and
puts this process on GPU `LOCAL_RANK`.

What makes N processes train as one device on the same global batch:
- every process builds the same model from the same seed, and DDP
  broadcasts process 0's weights when it wraps the model;
- each process takes its rows of every global batch (`rows`);
- the loss a process differentiates is its share of the global loss, so
  that the shares sum to the single-device loss: either the model
  normalises by global totals itself (`replica_sum`, as `BertPreTrainer`
  does for the masked-LM weights) or the step scales Keras' per-process
  mean by the process's fraction of the global batch;
- DDP's communication hook sums the gradients (DDP's own hook averages
  them), so every process holds the single-device gradient; global-norm
  clipping of it is then exact, and every process applies the same update;
- metrics are reduced across processes when read (`global_metrics_result`): the
  metric variables (totals and counts) are summed, the results computed,
  and each process's own totals put back.
Dropout masks differ between processes (torch's generator is offset by the
rank when the model is wrapped), so a run with dropout is not the
single-device run mask for mask, only in distribution.

When kbert replays its training step as a CUDA graph (on GPUs, the
default), DDP's hooks cannot run inside the graph: the step then runs the
model itself and sums the gradients with `all_reduce_gradients` after the
backward pass, in buckets of `BUCKET_BYTES`, captured in the graph with
everything else. The reduction no longer overlaps the backward pass, but
the replay removes the host's launch overhead, which costs more: BERT-base
on two GPUs trains faster this way than eagerly through DDP
(benchmarks/RESULTS.md). `sync_after_backward()` tells which way this fit
runs.
"""

import contextlib
import datetime
import os

import keras
import torch
import torch.distributed as dist

from kbert.backend.state import state_of

_STATE = {"on": False, "normalised": False, "after_backward": False}
BUCKET_BYTES = 64 * 2**20


def initialize(timeout_s=None):
    """Joins the process group the launcher describes (once); returns
    (rank, world size). NCCL where CUDA is available, else gloo."""
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed")
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing and not dist.is_initialized():
        raise ValueError(
            f"torch-ddp needs the variables a launcher sets ({', '.join(missing)} missing): "
            "run the script with `torchrun --nproc_per_node N script.py ...`"
        )
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        seconds = timeout_s or int(os.environ.get("KBERT_DDP_TIMEOUT", "1800"))
        dist.init_process_group(
            backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=seconds)
        )
    _STATE["on"] = True
    return dist.get_rank(), dist.get_world_size()


def active():
    """Whether kbert trains with torch-ddp in this process."""
    return _STATE["on"] and dist.is_initialized()


def rank():
    return dist.get_rank() if active() else 0


def world_size():
    return dist.get_world_size() if active() else 1


def rows(batch_size):
    """This process's rows of a global batch of `batch_size`: contiguous
    and as equal as they can be (sizes differ by at most one)."""
    count, index = world_size(), rank()
    base, extra = divmod(int(batch_size), count)
    start = index * base + min(index, extra)
    return slice(start, start + base + (1 if index < extra else 0))


def _reduce_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def all_reduce_sum(value):
    """The sum of tensor `value` over the processes (no gradient flows)."""
    tensor = torch.as_tensor(value).detach().clone()
    device = _reduce_device()
    if device is not None and tensor.device != device:
        tensor = tensor.to(device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def replica_sum(value):
    """(sum of `value` over the processes, number of processes); records
    that the step's loss is normalised by global totals (see module doc)."""
    _STATE["normalised"] = True
    return all_reduce_sum(value).to(torch.as_tensor(value).device), world_size()


def gather_ints(value):
    """The int `value` of every process, process 0 first (a collective)."""
    tensor = all_reduce_sum(
        torch.nn.functional.one_hot(torch.tensor(rank()), world_size()) * int(value)
    )
    return [int(v) for v in tensor.cpu().tolist()]


def barrier():
    if active():
        dist.barrier()


def _sum_hook(state, bucket):
    """DDP communication hook: gradients summed over processes (DDP's
    default divides the sum by the process count)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def prepare_for_graphs(model):
    """Readies `model` for steps replayed as CUDA graphs, which run without
    the DDP wrapper: process 0's weights broadcast and the dropout
    generator offset by the rank (what wrapping does), once per model.
    False when the model was already wrapped: DDP's reducer keeps the
    autograd nodes of the stream it was made on, and a capture on another
    stream fails, so such a model keeps training eagerly through DDP."""
    state = state_of(model)
    if state.ddp is not None:
        return False
    if not state.ddp_synced:
        with torch.no_grad():
            for variable in model.weights:
                dist.broadcast(variable.value, src=0)
        torch.manual_seed(torch.initial_seed() + rank())
        state.ddp_synced = True
    return True


@contextlib.contextmanager
def gradients_after_backward(on=True):
    """Within the block, kbert's step runs the model itself (no DDP
    wrapper) and sums the gradients after the backward pass
    (`all_reduce_gradients`): what a CUDA-graph replay needs. Call
    `prepare_for_graphs` (or `wrapped`) first, so that every process starts
    from process 0's weights."""
    previous = _STATE["after_backward"]
    _STATE["after_backward"] = bool(on)
    try:
        yield
    finally:
        _STATE["after_backward"] = previous


def sync_after_backward():
    """Whether this step sums gradients after the backward pass."""
    return active() and _STATE["after_backward"]


def all_reduce_gradients(gradients):
    """Sums `gradients` (tensors, in place) over the processes: flattened
    into buckets of about `BUCKET_BYTES` per dtype, one all-reduce each."""
    buckets, size = [[]], 0
    for grad in gradients:
        if grad is None:
            continue
        nbytes = grad.numel() * grad.element_size()
        last = buckets[-1]
        if last and (size + nbytes > BUCKET_BYTES or last[0].dtype != grad.dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    for bucket in buckets:
        if not bucket:
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for grad in bucket:
            n = grad.numel()
            grad.copy_(flat[offset : offset + n].view_as(grad))
            offset += n


def wrapped(model):
    """`model` wrapped in DistributedDataParallel (made once per model;
    broadcasts process 0's weights when made)."""
    state = state_of(model)
    ddp = state.ddp
    if ddp is None:
        device = _reduce_device()
        ddp = torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=[device.index] if device is not None else None,
            gradient_as_bucket_view=True,
            # The set of used weights is the same every step (a token
            # classifier never uses the pooler): no per-step search for
            # unused ones.
            static_graph=True,
        )
        ddp.register_comm_hook(None, _sum_hook)
        # Dropout draws from torch's generator, seeded alike in every
        # process: offset it so that each process's rows get their own masks.
        if not state.ddp_synced:
            torch.manual_seed(torch.initial_seed() + rank())
            state.ddp_synced = True
        state.ddp = ddp  # not a registered module: it holds the model itself
    return ddp


@contextlib.contextmanager
def loss_normalisation():
    """Around a step's forward and loss: yields `share(loss, local_rows)`,
    which returns (the loss this process differentiates, the loss it
    reports)."""
    _STATE["normalised"] = False

    def share(loss, local_rows):
        if _STATE["normalised"]:
            # the model's shares already sum to the global loss
            return loss, reported_loss(loss)
        # Keras' mean over this process's rows, weighted by its fraction of
        # the global batch (a fill kernel, not a host-to-device copy)
        local = torch.full((), float(local_rows), dtype=torch.float32, device=loss.device)
        return loss * (local / all_reduce_sum(local).to(loss.device)), loss

    yield share


def reported_loss(loss):
    """The loss a step logs, from the `loss` its model computed (call it
    within `loss_normalisation`): a model that normalised by global totals
    (`replica_sum`) returned this process's share of the global loss, which
    times the process count is what the processes' logs average to the
    global loss (`global_metrics_result`); any other loss is logged as is."""
    return loss * world_size() if _STATE["normalised"] else loss


def global_metrics_result(model, local_result):
    """The model's metric results over all processes: each metric's
    variables summed across processes, `local_result()` (Keras'
    `get_metrics_result`) computed on the sums, local values put back. A
    collective: every process calls it at the same point."""
    variables = [v for metric in model.metrics for v in metric.variables]
    values = [v.value for v in variables]
    if not values:
        return local_result()
    saved = [value.detach().clone() for value in values]
    flat = torch.cat([value.detach().reshape(-1).to(torch.float64) for value in values])
    flat = all_reduce_sum(flat).to(values[0].device)
    with torch.no_grad():
        offset = 0
        for value in values:
            n = value.numel()
            value.copy_(flat[offset : offset + n].reshape(value.shape).to(value.dtype))
            offset += n
    try:
        logs = local_result()
        logs = keras.tree.map_structure(
            lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, logs
        )
    finally:
        with torch.no_grad():
            for value, old in zip(values, saved):
                value.copy_(old)
    return logs
