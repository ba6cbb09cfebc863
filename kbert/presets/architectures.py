"""The standard BERT sizes, as in the original release (Turc et al. 2019 for
the compact ones): L layers, H hidden, A heads = H / 64, intermediate 4 H;
and the checks a backbone config read from a file must pass."""

from kbert.utils.files import PresetError
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


# Bounds on a backbone config read from a file. Far above any published
# BERT (the largest vocabularies hold 250k tokens, the deepest 48 layers),
# far below sizes whose allocation would take minutes: a config that names
# more is malformed, and is refused before anything is built.
SIZE_LIMITS = {
    "vocabulary_size": 1 << 21,
    "num_layers": 256,
    "num_heads": 1024,
    "hidden_dim": 1 << 14,
    "intermediate_dim": 1 << 16,
    "max_sequence_length": 1 << 17,
    "type_vocab_size": 1 << 16,
    "embedding_dim": 1 << 14,
}
# A config without weights (load_weights=False) builds a random model: at
# most this many parameters (4 GiB in float32; BERT-large has 0.34 billion).
MAX_CONFIG_ONLY_PARAMETERS = 1 << 30
REQUIRED_SIZES = ("vocabulary_size", "num_layers", "num_heads", "hidden_dim", "intermediate_dim")
DEFAULT_SIZES = {"max_sequence_length": 512, "type_vocab_size": 2}


def parameter_count(config):
    """Number of weights of a backbone of `config` (sizes only)."""
    v, h, i, layers = (
        config["vocabulary_size"],
        config["hidden_dim"],
        config["intermediate_dim"],
        config["num_layers"],
    )
    p = config.get("max_sequence_length", DEFAULT_SIZES["max_sequence_length"])
    t = config.get("type_vocab_size", DEFAULT_SIZES["type_vocab_size"])
    e = config.get("embedding_dim")
    block = 4 * h * h + 2 * h * i + i + 9 * h  # qkv, output, feed-forward, 2 LayerNorms
    blocks = block if config.get("share_layers") else layers * block
    embeddings = (v + p + t + 2) * h if e is None else (v + p + t + 2) * e + e * h + h
    return embeddings + blocks + h * h + h


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_backbone_config(config, source, held=None, load_weights=True):
    """Refuses a backbone config whose sizes are malformed, absurd, or larger
    than the weights beside it hold, before anything is built.

    Args:
        config: dict. kbert backbone config (as read from a file).
        source: str. the file it came from, named in every error.
        held: dict or None. {size name: what the weights hold, or None
            when the tensor holding it is absent}, from weight shapes.
        load_weights: bool. False: no weights will be assigned, so the
            parameter count is bounded instead.

    Raises `kbert.presets.PresetError` naming the setting and the fix.
    """
    if not isinstance(config, dict):
        raise PresetError(
            f"{source}: the backbone config is a {type(config).__name__}, not an object"
        )
    absent = [k for k in REQUIRED_SIZES if k not in config]
    if absent:
        raise PresetError(f"{source} lacks the backbone setting(s) {absent}")
    sizes = {**DEFAULT_SIZES, **{k: config[k] for k in SIZE_LIMITS if k in config}}
    if sizes.get("embedding_dim", 0) is None:
        del sizes["embedding_dim"]  # null: no factorized embeddings
    share_layers = config.get("share_layers", False)
    if not isinstance(share_layers, bool):
        raise PresetError(f"{source}: share_layers must be true or false, got {share_layers!r:.60}")
    for name, value in sizes.items():
        if not _is_int(value) or value < 1:
            raise PresetError(f"{source}: {name} must be a positive integer, got {value!r:.60}")
        if value > SIZE_LIMITS[name]:
            raise PresetError(
                f"{source}: {name}={value} is beyond any BERT (at most {SIZE_LIMITS[name]}); "
                "the config is malformed"
            )
    if sizes["hidden_dim"] % sizes["num_heads"]:
        raise PresetError(
            f"{source}: hidden_dim={sizes['hidden_dim']} is not divisible by "
            f"num_heads={sizes['num_heads']}"
        )
    for name in ("dropout", "attention_dropout"):
        if name in config and not (_is_number(config[name]) and 0 <= config[name] < 1):
            raise PresetError(
                f"{source}: {name} must be a number in [0, 1), got {config[name]!r:.60}"
            )
    for name in ("layer_norm_epsilon", "initializer_range"):
        if name in config and not (_is_number(config[name]) and 0 <= config[name] < 1e3):
            raise PresetError(
                f"{source}: {name} must be a small non-negative number, got {config[name]!r:.60}"
            )
    if "activation" in config and not isinstance(config["activation"], str):
        raise PresetError(
            f"{source}: activation must be a name such as 'gelu', got {config['activation']!r:.60}"
        )
    adapter = config.get("adapter_size")
    if adapter is not None and not (_is_int(adapter) and 1 <= adapter <= sizes["hidden_dim"]):
        raise PresetError(
            f"{source}: adapter_size must be null or an integer in [1, hidden_dim], "
            f"got {adapter!r:.60}"
        )
    if held is None:
        count = parameter_count({**sizes, "share_layers": share_layers})
        if not load_weights and count > MAX_CONFIG_ONLY_PARAMETERS:
            raise PresetError(
                f"{source} describes a backbone of {count:,} parameters, more "
                f"than the {MAX_CONFIG_ONLY_PARAMETERS:,} a config without weights may build; "
                "construct BertBackbone(...) directly if you mean it"
            )
        return
    held = dict(held)
    if held.pop("share_layers", False) != share_layers:
        raise PresetError(
            f"{source}: share_layers={str(share_layers).lower()} but the weights hold "
            + ("one shared block" if not share_layers else "a block per layer")
            + "; the config does not describe these weights (fix the config or use its own "
            "weights)"
        )
    held_embedding = held.pop("embedding_dim", None)
    if held_embedding != sizes.get("embedding_dim"):
        raise PresetError(
            f"{source}: embedding_dim={sizes.get('embedding_dim')} but the weights hold "
            + (
                f"factorized embeddings of width {held_embedding}"
                if held_embedding
                else "no embedding projection"
            )
            + "; the config does not describe these weights (fix the config or use its own "
            "weights)"
        )
    for name, value in held.items():
        if value is None:
            raise PresetError(
                f"{source}: the weights lack the tensor that holds {name}, so the config "
                "cannot be checked against them; the checkpoint is incomplete"
            )
        asked = sizes[name]
        if name == "num_layers" and asked < value:
            continue  # a shallower model from the first layers (the rest stays unused)
        if asked != value:
            raise PresetError(
                f"{source}: {name}={asked} but the weights hold {value}; "
                "the config does not describe these weights (fix the config or use its own "
                "weights)"
            )
