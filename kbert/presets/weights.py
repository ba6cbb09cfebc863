"""Named weights: read a model's variables into a flat {path: array} dict and
assign them back, checking every name and shape (no silent partial load)."""

import re

import numpy as np


def weights_dict(layer):
    """{variable path: numpy array} for every weight of `layer`."""
    out = {}
    for variable in layer.weights:
        if variable.path in out:
            raise ValueError(f"two weights share the path {variable.path!r}")
        out[variable.path] = np.asarray(variable.numpy())
    return out


def assign_weights(layer, weights, source="weights", allow_missing=(), paths=None):
    """Assigns `weights` ({path: array}) to `layer`'s variables.

    Every variable must be present with the same shape and every entry must be
    used; paths starting with a prefix in `allow_missing` may be absent (or
    contain "/<prefix>", e.g. adapters inside blocks; they keep their fresh
    initialisation). With `paths`, only those variables are
    concerned. Raises ValueError naming each offender.
    """
    variables = {v.path: v for v in layer.weights}
    if paths is not None:
        variables = {p: variables[p] for p in paths}
    missing = [
        p
        for p in variables
        if p not in weights and not any(p.startswith(a) or f"/{a}" in p for a in allow_missing)
    ]
    unexpected = [p for p in weights if p not in variables]
    mismatched = [
        f"{p}: expected {tuple(variables[p].shape)}, got {tuple(np.shape(weights[p]))}"
        for p in variables
        if p in weights and tuple(variables[p].shape) != tuple(np.shape(weights[p]))
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {missing[:8]}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {unexpected[:8]}")
    if mismatched:
        problems.append(f"shape mismatch {len(mismatched)}: {mismatched[:8]}")
    if problems:
        raise ValueError(f"{source} do not match the model {layer.name!r}; " + "; ".join(problems))
    for path, variable in variables.items():
        if path in weights:
            value = np.asarray(weights[path])
            if not np.all(np.isfinite(value)):
                raise ValueError(f"{source}: weight {path!r} holds NaN or inf")
            variable.assign(value.astype(variable.dtype, copy=False))


_LAYER = re.compile(r"transformer_layer_(\d+)/")
SHARED_LAYER = "shared_transformer_layer/"  # kbert.models.backbone.SHARED_LAYER_NAME
PROJECTION = "embeddings/projection/kernel"


def held_sizes(shapes):
    """The backbone sizes a set of weights holds, from their shapes alone.

    Args:
        shapes: dict. {kbert variable path: shape}; only the embedding
            tables, the block paths and block 0's intermediate kernel matter.

    Returns {size name: int, or None where the tensor holding it is absent}.
    Layers count from block 0 up to the first one missing. ALBERT-style
    weights add `embedding_dim` (the table width, when an
    `embeddings/projection` maps it to `hidden_dim`; None without one) and
    `share_layers` (one shared block, which holds no layer count: its
    `num_layers` is absent).
    """

    def dim(path, axis):
        shape = shapes.get(path)
        return int(shape[axis]) if shape is not None and len(shape) == 2 else None

    blocks = {int(m.group(1)) for path in shapes if (m := _LAYER.match(path))}
    layers = 0
    while layers in blocks:
        layers += 1
    shared = any(path.startswith(SHARED_LAYER) for path in shapes)
    factorized = PROJECTION in shapes
    first_block = SHARED_LAYER if shared else "transformer_layer_0/"
    held = {
        "vocabulary_size": dim("embeddings/token_embedding/embeddings", 0),
        "hidden_dim": dim(PROJECTION if factorized else "embeddings/token_embedding/embeddings", 1),
        "max_sequence_length": dim("embeddings/position_embeddings", 0),
        "type_vocab_size": dim("embeddings/segment_embedding/embeddings", 0),
        "num_layers": layers or None,
        "intermediate_dim": dim(first_block + "intermediate_dense/kernel", 1),
        "embedding_dim": dim("embeddings/token_embedding/embeddings", 1) if factorized else None,
        "share_layers": shared,
    }
    if shared:
        del held["num_layers"]
    return held


_QKV = re.compile(r"(.*self_attention/)qkv/(kernel|bias)$")


def with_global_projections(weights):
    """`weights` with each block's global projections (`global_query`,
    `global_key_value`) set from its shared `qkv` where the weights lack
    them: Longformer's conversion, which starts the global projections as
    copies of the local ones. The `qkv` kernel's columns are the query's,
    the key's and the value's, in that order."""
    out = dict(weights)
    for path, value in weights.items():
        m = _QKV.match(path)
        if m is None:
            continue
        attention, part = m.groups()
        if attention + "global_query/" + part in weights:
            continue
        value = np.asarray(value)
        width = value.shape[-1] // 3
        out[attention + "global_query/" + part] = value[..., :width].copy()
        out[attention + "global_key_value/" + part] = value[..., width:].copy()
    return out
