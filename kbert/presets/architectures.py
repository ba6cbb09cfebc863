"""The standard BERT sizes, as in the original release (Turc et al. 2019 for
the compact ones): L layers, H hidden, A heads = H / 64, intermediate 4 H."""

from kbert.utils.naming import closest

_SIZES = {
    "bert_tiny": (2, 128),
    "bert_mini": (4, 256),
    "bert_small": (4, 512),
    "bert_medium": (8, 512),
    "bert_base": (12, 768),
    "bert_large": (24, 1024),
}

ARCHITECTURES = {
    name: {
        "vocabulary_size": 30522,
        "num_layers": layers,
        "num_heads": hidden // 64,
        "hidden_dim": hidden,
        "intermediate_dim": 4 * hidden,
        "max_sequence_length": 512,
        "type_vocab_size": 2,
    }
    for name, (layers, hidden) in _SIZES.items()
}


def architecture_config(name):
    """The backbone config of a named architecture (a fresh copy)."""
    if name not in ARCHITECTURES:
        raise ValueError(
            f"unknown architecture {name!r}; choose one of {sorted(ARCHITECTURES)}"
            + closest(name, ARCHITECTURES)
        )
    return dict(ARCHITECTURES[name])
