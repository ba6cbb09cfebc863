"""Pre-train a BERT (masked LM + next sentence prediction) from raw text.

The program behind `kbert pretrain` and examples/pretrain.py (same flags).
With no arguments, examples/pretrain.py trains a WordPiece vocabulary on the
shipped corpus (WikiText-2 validation articles, The Adventures of Sherlock
Holmes, tiny-shakespeare; see examples/data/README.md), creates MLM/NSP
TFRecords, pre-trains a small BERT on the CPU for a few minutes, reports
held-out masked-LM and NSP accuracy, and saves a `.keras` file, a preset and
`curves.png` (training loss and accuracy every `--log-every` steps, held-out
figures at every checkpoint; the points are in `curves.jsonl`).

    KERAS_BACKEND=jax python examples/pretrain.py
    KERAS_BACKEND=jax kbert pretrain --architecture bert_base \\
        --corpus wiki/*.txt --format lines --batch-size 256 --steps 100000 \\
        --dtype mixed_bfloat16 --attention-dropout 0 --distribution jax-data-parallel

Re-running the same command resumes from the last checkpoint in
`--output-dir` (weights, optimizer state, schedule step, data position).

Several hosts (JAX): run the same command on each, with `--distribution
jax-data-parallel --coordinator-address HOST0:PORT --num-processes N
--process-id I` (I = 0 on HOST0) and an `--output-dir` they all share.
Process 0 writes the vocabulary, the examples, checkpoints and results;
every process reads the same global batches and trains on its share.

Several GPUs or hosts (torch): launch with torchrun, e.g. `KERAS_BACKEND=torch
torchrun --nproc_per_node 8 examples/pretrain.py --distribution torch-ddp ...`
(add `--nnodes N --node_rank I --rdzv-endpoint HOST0:PORT` for several
hosts, with a shared `--output-dir`).
Every size, path, step count, batch, precision and distribution choice is a flag.
"""

import argparse
import glob
import json
import os
import random
import time

import keras

import kbert
from kbert import backend as kbert_backend
from kbert.data import MaskingConfig, read_documents
from kbert.training import ENGINES, create_optimizer, distribution_scope, fit_resumable
from kbert.training.callbacks import CurveLogger, read_curves
from kbert.training.distribution import barrier, process_index

# The corpus in a source checkout's examples/data (sources and licences in its README).
SHIPPED_CORPUS = ("wikitext-2-valid.tokens.txt", "sherlock.txt", "tinyshakespeare.txt")


def shipped_corpus(directory):
    """The paths of the shipped corpus in `directory` (examples/data), or None
    when a file is missing (an installed package has no examples/)."""
    paths = [os.path.join(directory, name) for name in SHIPPED_CORPUS]
    return paths if all(os.path.isfile(path) for path in paths) else None


def parse_args(argv=None, prog=None, default_corpus=None):
    """The flags; `--corpus` is required unless `default_corpus` (a list of
    text files) is given."""
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    data = p.add_argument_group("data")
    data.add_argument(
        "--corpus",
        nargs="+",
        default=default_corpus,
        required=not default_corpus,
        help="text files (wikitext, prose, or a sentence per line)"
        + (" (default: the shipped corpus in examples/data)" if default_corpus else ""),
    )
    data.add_argument(
        "--format",
        default="auto",
        choices=["auto", "lines", "prose", "wikitext"],
        help="auto: wikitext if '= Title =' lines, else prose",
    )
    data.add_argument("--output-dir", default="runs/pretrain")
    data.add_argument("--vocab", default=None, help="existing vocab.txt (else one is trained)")
    data.add_argument("--vocab-size", type=int, default=6000)
    data.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=True)
    data.add_argument(
        "--data-mode",
        default="static",
        choices=["static", "dynamic"],
        help="static: TFRecords written once; dynamic: fresh pairs and masks every epoch",
    )
    data.add_argument("--dupe-factor", type=int, default=3)
    data.add_argument("--shards", type=int, default=2)
    data.add_argument("--max-seq-length", type=int, default=128)
    data.add_argument("--max-predictions-per-seq", type=int, default=20)
    data.add_argument("--masked-lm-prob", type=float, default=0.15)
    data.add_argument("--short-seq-prob", type=float, default=0.1)
    data.add_argument("--whole-word-mask", action="store_true")
    data.add_argument(
        "--sentence-task",
        default="nsp",
        choices=["nsp", "sop"],
        help="nsp: next sentence prediction (BERT); sop: sentence order prediction (ALBERT)",
    )
    data.add_argument(
        "--eval-fraction", type=float, default=0.15, help="share of documents held out"
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--architecture", default=None, help="bert_tiny ... bert_large (overrides sizes)"
    )
    model.add_argument("--num-layers", type=int, default=2)
    model.add_argument("--hidden-dim", type=int, default=128)
    model.add_argument("--num-heads", type=int, default=2)
    model.add_argument("--intermediate-dim", type=int, default=512)
    model.add_argument("--max-position", type=int, default=512)
    model.add_argument("--dropout", type=float, default=0.1)
    model.add_argument(
        "--attention-dropout",
        type=float,
        default=0.1,
        help="0 enables fused attention in training (the fast recipe)",
    )
    model.add_argument("--activation", default="gelu")
    train = p.add_argument_group("training")
    train.add_argument("--batch-size", type=int, default=64, help="global batch size")
    train.add_argument("--steps", type=int, default=600)
    train.add_argument("--steps-per-checkpoint", type=int, default=200)
    train.add_argument("--learning-rate", type=float, default=1e-3)
    train.add_argument("--warmup-steps", type=int, default=60)
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--optimizer", default="adamw", choices=["adamw", "lamb"])
    train.add_argument(
        "--dtype", default="float32", choices=["float32", "mixed_bfloat16", "mixed_float16"]
    )
    train.add_argument("--steps-per-execution", type=int, default=1)
    train.add_argument("--jit-compile", default="auto", choices=["auto", "true", "false"])
    train.add_argument("--distribution", default="none", choices=ENGINES)
    train.add_argument(
        "--coordinator-address",
        default=None,
        help="host:port of process 0, the same on every host (jax-data-parallel on several hosts)",
    )
    train.add_argument(
        "--num-processes", type=int, default=None, help="processes in the run, one per host"
    )
    train.add_argument(
        "--process-id", type=int, default=None, help="this process, 0 to --num-processes - 1"
    )
    train.add_argument(
        "--phase2-steps",
        type=int,
        default=0,
        help="then train this many steps at --phase2-seq-length",
    )
    train.add_argument("--phase2-seq-length", type=int, default=512)
    train.add_argument("--phase2-batch-size", type=int, default=None)
    train.add_argument("--seed", type=int, default=12345)
    train.add_argument("--eval-batches", type=int, default=50)
    train.add_argument(
        "--log-every", type=int, default=10, help="steps between points of the training curves"
    )
    train.add_argument("--verbose", default="auto")
    return p.parse_args(argv)


def prepare_vocabulary(args):
    path = args.vocab or os.path.join(args.output_dir, "vocab.txt")
    # With several processes, process 0 writes into the shared --output-dir.
    if not os.path.isfile(path) and process_index() == 0:
        print(f"training a {args.vocab_size}-token WordPiece vocabulary on {args.corpus}")
        kbert.tokenizers.train_wordpiece_vocabulary(
            args.corpus, args.vocab_size, output=path, lowercase=args.lowercase
        )
    barrier("vocabulary")
    return kbert.BertTokenizer(path, lowercase=args.lowercase)


def split_documents(args):
    """Documents -> (train, held-out), shuffled with the seed, as 'lines' files."""
    report = kbert.data.CorpusReport()
    documents = read_documents(args.corpus, format=args.format, report=report)
    print(report)
    random.Random(args.seed).shuffle(documents)
    held = max(2, int(len(documents) * args.eval_fraction))
    if len(documents) - held < 2:
        raise SystemExit(
            f"the corpus has {len(documents)} documents; pre-training needs at least {held + 2}"
        )
    return documents[held:], documents[:held]


def write_lines(documents, path):
    """The original BERT input format: a sentence per line, blank line between documents."""
    with open(path, "w", encoding="utf-8") as f:
        for document in documents:
            f.write("\n".join(document) + "\n\n")


def make_data(args, tokenizer, train_docs, eval_docs, seq_length):
    """TFRecord directories for training and held-out evaluation (made once)."""
    masking = MaskingConfig(
        max_seq_length=seq_length,
        max_predictions_per_seq=args.max_predictions_per_seq
        if seq_length == args.max_seq_length
        else max(args.max_predictions_per_seq, int(round(seq_length * args.masked_lm_prob))),
        masked_lm_prob=args.masked_lm_prob,
        short_seq_prob=args.short_seq_prob,
        whole_word_mask=args.whole_word_mask,
        sentence_task=args.sentence_task,
    )
    root = os.path.join(args.output_dir, f"data-{seq_length}")
    if process_index() == 0:  # the other processes read what it writes
        write_examples(args, tokenizer, train_docs, eval_docs, masking, root)
    barrier(f"data-{seq_length}")
    return root, masking


def write_examples(args, tokenizer, train_docs, eval_docs, masking, root):
    text_dir = os.path.join(root, "text")
    os.makedirs(text_dir, exist_ok=True)
    shards = []
    for i in range(args.shards):
        path = os.path.join(text_dir, f"train-{i}.txt")
        write_lines(train_docs[i :: args.shards], path)
        shards.append(path)
    write_lines(eval_docs, os.path.join(text_dir, "eval.txt"))
    for name, inputs, dupe in (
        ("train", shards, args.dupe_factor),
        ("eval", [os.path.join(text_dir, "eval.txt")], 1),
    ):
        out = os.path.join(root, name)
        if not os.path.isfile(os.path.join(out, "manifest.json")):
            kbert.data.create_pretraining_data(
                inputs, tokenizer, out, masking=masking, dupe_factor=dupe, seed=args.seed
            )


def datasets(args, tokenizer, root, masking, train_docs, batch_size, replicas=1):
    """(make_train(skip_batches), the held-out dataset, its number of batches).

    With several replicas every held-out batch is full (a batch splits
    evenly between devices and processes)."""
    t, p = masking.max_seq_length, masking.max_predictions_per_seq
    if args.data_mode == "dynamic":
        tokenized = kbert.data.tokenize_documents(train_docs, tokenizer)

        def make_train(skip):
            return kbert.data.dynamic_pretraining_dataset(
                tokenized,
                tokenizer,
                batch_size,
                masking,
                seed=args.seed,
                repeat=True,
                skip_batches=skip,
            )
    else:
        files = sorted(glob.glob(os.path.join(root, "train", "*.tfrecord")))

        def make_train(skip):
            return kbert.data.pretraining_dataset(
                files, batch_size, t, p, seed=args.seed, repeat=True, skip_batches=skip
            )

    evaluation = kbert.data.pretraining_dataset(
        os.path.join(root, "eval", "*.tfrecord"),
        batch_size,
        t,
        p,
        shuffle=False,
        drop_remainder=replicas > 1,
    )
    with open(os.path.join(root, "eval", "manifest.json")) as f:
        instances = json.load(f)["instances"]
    available = instances // batch_size if replicas > 1 else -(-instances // batch_size)
    eval_steps = min(args.eval_batches, available)  # a count Keras knows: no end-of-data warning
    return make_train, evaluation.take(eval_steps), eval_steps


def build_model(args, tokenizer, scope):
    sizes = dict(
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        hidden_dim=args.hidden_dim,
        intermediate_dim=args.intermediate_dim,
    )
    if args.architecture:
        sizes = {
            k: v
            for k, v in kbert.presets.architecture_config(args.architecture).items()
            if k in sizes
        }
    with scope:
        backbone = kbert.BertBackbone(
            vocabulary_size=tokenizer.vocabulary_size,
            max_sequence_length=max(
                args.max_position,
                args.max_seq_length,
                args.phase2_seq_length if args.phase2_steps else 0,
            ),
            dropout=args.dropout,
            attention_dropout=args.attention_dropout,
            activation=args.activation,
            dtype=args.dtype,
            **sizes,
        )
        preprocessor = kbert.BertPreprocessor(tokenizer, args.max_seq_length)
        model = kbert.BertPreTrainer(
            backbone, preprocessor=preprocessor, sentence_task=args.sentence_task
        )
    return model


def compile_model(model, args, scope, steps, warmup):
    optimizer = create_optimizer(
        args.learning_rate, steps, warmup, args.weight_decay, kind=args.optimizer
    )
    jit = {"auto": "auto", "true": True, "false": False}[args.jit_compile]
    with scope:
        model.compile(
            optimizer=optimizer, steps_per_execution=args.steps_per_execution, jit_compile=jit
        )


def callbacks(args, phase, evaluation, eval_steps):
    """Curve points (training every --log-every steps, held-out at each
    checkpoint), the per-checkpoint CSV log, and TensorBoard when installed
    (the logs from process 0 alone)."""
    logs = os.path.join(args.output_dir, "logs")
    curves = CurveLogger(
        os.path.join(args.output_dir, "curves.jsonl"),
        every=args.log_every,
        validation_data=evaluation,
        validation_steps=eval_steps,
    )
    if process_index() != 0:
        return [curves]  # it evaluates on every process and writes on process 0
    os.makedirs(logs, exist_ok=True)
    out = [curves, keras.callbacks.CSVLogger(os.path.join(logs, f"{phase}.csv"), append=True)]
    try:
        import tensorboard  # noqa: F401
        import tensorflow  # noqa: F401  (TensorBoard writes through tf.summary)

        out.append(
            keras.callbacks.TensorBoard(
                os.path.join(logs, "tensorboard", phase), update_freq=args.log_every
            )
        )
    except ImportError:
        print("TensorFlow/TensorBoard not installed: no TensorBoard logs (CSV log only)")
    return out


def plot(args):
    """curves.png from curves.jsonl: loss and accuracies, training as lines,
    held-out as points."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return None
    points = read_curves(os.path.join(args.output_dir, "curves.jsonl"))
    if not points:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = (
        (axes[0], "loss", ("loss", "mlm_loss", f"{args.sentence_task}_loss")),
        (axes[1], "accuracy", ("mlm_accuracy", f"{args.sentence_task}_accuracy")),
    )
    for ax, title, keys in panels:
        for key, color in zip(keys, ("C0", "C1", "C2")):
            for split, style in (("train", dict(lw=1.2)), ("held_out", dict(marker="o", ls="--"))):
                xy = [(p["step"], p[key]) for p in points if p["split"] == split and key in p]
                if xy:
                    label = key if split == "train" else f"{key} (held-out)"
                    ax.plot(*zip(*xy), color=color, label=label, **style)
        if args.phase2_steps:
            ax.axvline(args.steps, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"training: mean of every {args.log_every} steps; held-out: "
        f"{args.eval_batches} batches at each checkpoint",
        fontsize=10,
    )
    path = os.path.join(args.output_dir, "curves.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None, prog=None, default_corpus=None):
    """Pre-trains with the command-line arguments `argv` and returns the
    held-out results; `prog` names the command in usage and errors (the
    script's name by default), `default_corpus` is the text files used
    without `--corpus`."""
    args = parse_args(argv, prog, default_corpus)
    keras.utils.set_random_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    started = time.time()
    backend = kbert_backend.name()
    print(f"backend: {backend}, distribution: {args.distribution}, dtype: {args.dtype}")

    # First: jax.distributed starts before any JAX computation.
    scope, replicas = distribution_scope(
        args.distribution,
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    tokenizer = prepare_vocabulary(args)
    train_docs, eval_docs = split_documents(args)
    if args.batch_size % replicas:
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by {replicas} replicas")
    model = build_model(args, tokenizer, scope)
    print(f"model: {model.backbone.count_params():,} backbone parameters, {replicas} replica(s)")

    total = args.steps + args.phase2_steps
    phases = [("phase1", args.max_seq_length, args.batch_size, args.steps)]
    if args.phase2_steps:
        phases.append(
            (
                "phase2",
                args.phase2_seq_length,
                args.phase2_batch_size or args.batch_size,
                args.phase2_steps,
            )
        )
    compile_model(model, args, scope, total, args.warmup_steps)
    done = 0
    for phase, seq_length, batch_size, steps in phases:
        root, masking = make_data(args, tokenizer, train_docs, eval_docs, seq_length)
        make_train, evaluation, eval_steps = datasets(
            args, tokenizer, root, masking, train_docs, batch_size, replicas
        )
        fit_resumable(
            model,
            make_train,
            total_steps=steps,
            checkpoint_dir=os.path.join(args.output_dir, "checkpoints", phase),
            steps_per_checkpoint=min(args.steps_per_checkpoint, steps),
            callbacks=callbacks(args, phase, evaluation, eval_steps),
            verbose=int(args.verbose) if args.verbose.isdigit() else args.verbose,
        )
        done += steps
        results = model.evaluate(evaluation, steps=eval_steps, verbose=0, return_dict=True)
        print(
            f"[{phase}, seq {seq_length}] held-out masked-LM accuracy "
            f"{results['mlm_accuracy']:.3f} (chance {1 / tokenizer.vocabulary_size:.4f}), "
            f"{args.sentence_task.upper()} accuracy "
            f"{results[args.sentence_task + '_accuracy']:.3f} (chance 0.5)"
        )

    if process_index() != 0:
        print(f"process {process_index()}: done in {time.time() - started:.0f} s")
        return results
    keras_path = os.path.join(args.output_dir, "pretrainer.keras")
    preset_dir = os.path.join(args.output_dir, "preset")
    model.save(keras_path)
    model.save_to_preset(preset_dir)
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(
            {k: float(v) for k, v in results.items()}
            | {"seconds": time.time() - started, "backend": kbert_backend.name()},
            f,
            indent=2,
        )
    curves = plot(args)
    print(f"saved {keras_path}")
    print(f"saved preset {preset_dir} (load with kbert.BertBackbone.from_preset)")
    if curves:
        print(f"saved {curves}")
    print(f"done in {time.time() - started:.0f} s")
    return results
