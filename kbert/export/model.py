"""`model.export(path, format=...)` for kbert models on every backend.

Keras' own exporters do the work where they can; this module gives them
what a BERT needs:
- an input signature in which batch size and sequence length are dynamic
  and shared by every input (Keras gives each unknown dimension of each
  input its own symbol);
- TensorFlow: ONNX through `tf2onnx`, with TensorFlow's `Erfc` (exact GELU)
  written as 1 - Erf, which ONNX has;
- torch: ONNX through `torch.export` (the TorchScript exporter Keras uses
  cannot take a dynamic hidden-size lookup in LayerNorm);
- JAX: the model is saved and exported by a TensorFlow-backend process
  (`in_tensorflow`). A jax2tf SavedModel fails at serving time: TensorFlow
  2.21's XlaCallModule cannot shape-refine the StableHLO composite that
  JAX 0.10 emits for erf (exact GELU) under dynamic shapes.

Shapes: B batch, T tokens, N choices, P predictions.
"""

import os

import keras
import numpy as np

from kbert import backend as kbert_backend
from kbert.backend.ops import portable_graph
from kbert.export.process import in_tensorflow
from kbert.layers.quantization import quantized_layers

FORMATS = ("tf_saved_model", "onnx")

# Names of the dynamic dimensions, shared by every input.
BATCH = "batch"
TOKENS = "tokens"
PREDICTIONS = "predictions"


def input_specs(model):
    """{input name: keras.InputSpec} with dynamic batch and length axes."""
    inputs = model.input
    if not isinstance(inputs, dict):
        raise ValueError(
            f"{type(model).__name__} takes {type(inputs).__name__} inputs; kbert export "
            "supports models whose inputs are a dict of named int tensors"
        )
    return {
        name: keras.InputSpec(
            shape=(None,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, name=name
        )
        for name, tensor in inputs.items()
    }


def dimension_names(name, shape):
    """Symbols for an input's axes: batch, fixed sizes, then the shared length."""
    names = []
    for axis, size in enumerate(shape):
        if axis == 0:
            names.append(BATCH)
        elif size is not None:
            names.append(int(size))
        else:
            names.append(PREDICTIONS if name == "mask_positions" else TOKENS)
    return names


def dummy_inputs(specs, batch=2, length=8):
    """Small concrete inputs matching `specs` (ids 0, every token real)."""
    out = {}
    for name, spec in specs.items():
        # Distinct sizes for distinct dimensions: torch.export would tie equal ones.
        dynamic = length // 2 if name == "mask_positions" else length
        shape = [
            batch if axis == 0 else (size if size is not None else dynamic)
            for axis, size in enumerate(spec.shape)
        ]
        value = np.ones(shape, "int32") if name == "padding_mask" else np.zeros(shape, "int32")
        out[name] = value
    return out


def export_model(model, filepath, format="tf_saved_model", verbose=None, **kwargs):
    """Exports a kbert model (backbone or task) for serving.

    `format="tf_saved_model"` (TensorFlow and JAX backends) writes a
    SavedModel whose `serve` signature takes the model's input dict;
    `format="onnx"` (every backend) writes an ONNX file with inputs named
    as the model's. Batch size and sequence length are dynamic in both.

    Args:
        model: `kbert.BertBackbone` or a kbert task model.
        filepath: str. output directory (SavedModel) or file (ONNX).
        format: str. "tf_saved_model" or "onnx".
        verbose: bool or None. Keras' export message.
        **kwargs: passed to Keras' exporter (e.g. `opset_version` for ONNX).

    Example:
    >>> backbone = kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=16)
    >>> export_model(backbone, "/tmp/backbone.onnx", format="onnx", verbose=False)
    """
    with portable_graph():  # a saved graph runs anywhere: no token packing, no oneDNN-only ops
        return _export_model(model, filepath, format, verbose, **kwargs)


def _export_model(model, filepath, format="tf_saved_model", verbose=None, **kwargs):
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: kbert exports {FORMATS}")
    filepath = os.fspath(filepath)
    if format == "onnx":
        os.makedirs(os.path.dirname(os.path.abspath(filepath)), exist_ok=True)
    backend = kbert_backend.name()
    specs = input_specs(model)
    embeddings = getattr(model, "backbone", model).get_layer("embeddings")
    dtype = keras.backend.standardize_dtype(embeddings.compute_dtype)
    if format == "onnx" and dtype != "float32":
        raise ValueError(
            f"ONNX export needs a float32 model, {model.name} computes in {dtype}; rebuild "
            "it with dtype='float32' (e.g. from_preset(..., dtype='float32'))"
        )
    # torch.export traces an int8 layer's on-the-fly input quantization into
    # a graph ONNX Runtime rejects (a squeeze of a non-unit axis): a
    # quantized model exports from a TensorFlow-backend process, as on JAX
    quantized = bool(quantized_layers(model))
    if backend != "tensorflow" and not (format == "onnx" and backend == "torch" and not quantized):
        # JAX: the SavedModel's XlaCallModule (TensorFlow 2.21) cannot
        # shape-refine the StableHLO composite JAX emits for erf (exact
        # GELU) under dynamic shapes, and jax2onnx cannot trace Keras'
        # functional models; the same model in a TensorFlow-backend process
        # exports both.
        return in_tensorflow(model, filepath, "model", format=format, **kwargs)
    if format == "onnx" and backend == "torch":
        return _onnx_torch(model, filepath, specs, kwargs.pop("opset_version", None))
    if format == "onnx":
        return _onnx_tensorflow(model, filepath, specs, kwargs.pop("opset_version", None))
    return keras.Model.export(
        model, filepath, format=format, verbose=verbose, input_signature=[specs], **kwargs
    )


def _output_names(model):
    outputs = model.output
    if isinstance(outputs, dict):
        return sorted(outputs)
    if isinstance(outputs, (list, tuple)):
        return [f"output_{i}" for i in range(len(outputs))]
    return ["output_0"]


def _onnx_torch(model, filepath, specs, opset_version):
    import torch

    names = list(specs)
    sample = dummy_inputs(specs)
    model(sample)  # Keras' tracking needs one call

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *flat):
            return self.model(dict(zip(names, flat)), training=False)

    batch = torch.export.Dim("batch")
    dims = {BATCH: batch, TOKENS: torch.export.Dim("tokens"), PREDICTIONS: torch.export.Dim("p")}
    dynamic_shapes = tuple(
        {
            axis: dims[d]
            for axis, d in enumerate(dimension_names(n, specs[n].shape))
            if isinstance(d, str)
        }
        for n in names
    )
    module = Flat().eval()
    # With autograd on, so that dense layers trace as `linear` (ONNX Gemm /
    # MatMul), not as the oneDNN packed-weight op of CPU inference.
    with torch.enable_grad():
        program = torch.onnx.export(
            module,
            tuple(torch.as_tensor(sample[n]) for n in names),
            input_names=names,
            output_names=_output_names(model),
            dynamic_shapes=(dynamic_shapes,),  # one entry: forward(*flat)
            opset_version=opset_version,
            dynamo=True,
            verbose=False,
        )
    program.save(filepath)
    _check_dynamic_axes(model, filepath, names, specs)


def _check_dynamic_axes(model, filepath, names, specs):
    """Raises if the exporter fixed a dynamic axis to the example's size."""
    import onnx

    graph = onnx.load(filepath, load_external_data=False).graph
    fixed = []
    for tensor in graph.input:
        dims = tensor.type.tensor_type.shape.dim
        wanted = dimension_names(tensor.name, specs[tensor.name].shape)
        fixed += [
            f"{tensor.name}[{axis}]"
            for axis, (dim, name) in enumerate(zip(dims, wanted))
            if isinstance(name, str) and not dim.dim_param
        ]
    if fixed:
        os.remove(filepath)
        raise ValueError(
            f"torch.export fixed {', '.join(fixed)} of {model.name} to the example's sizes; "
            "export this model to ONNX from the tensorflow backend (save it as a .keras "
            "file and run `KERAS_BACKEND=tensorflow kbert export model.keras out --format onnx`)"
        )


def _erfc_as_one_minus_erf(ctx, node, name, args):
    """tf2onnx handler: ONNX has Erf but no Erfc."""
    from tf2onnx import utils

    dtype = utils.map_onnx_to_numpy_type(ctx.get_dtype(node.input[0]))
    node.type = "Erf"
    one = ctx.make_const(utils.make_name(f"{node.name}_one"), np.array(1, dtype))
    sub = ctx.insert_new_node_on_output("Sub", node.output[0], name=utils.make_name(node.name))
    ctx.replace_inputs(sub, [one.output[0], node.output[0]])
    return node


def _onnx_tensorflow(model, filepath, specs, opset_version):
    import tensorflow as tf
    import tf2onnx

    signature = [
        {name: tf.TensorSpec(spec.shape, spec.dtype, name=name) for name, spec in specs.items()}
    ]

    @tf.function(input_signature=signature, autograph=False)
    def serve(inputs):
        outputs = model(inputs, training=False)
        if isinstance(outputs, dict):
            return {k: tf.identity(v, name=k) for k, v in outputs.items()}
        return {"output_0": tf.identity(outputs, name="output_0")}

    tf2onnx.convert.from_function(
        serve,
        input_signature=signature,
        opset=opset_version,
        custom_op_handlers={"Erfc": (_erfc_as_one_minus_erf, [])},
        output_path=filepath,
    )
