"""Readers of the fine-tuning data formats: GLUE .tsv, CoNLL-2003, SQuAD JSON.

Plain Python (no TensorFlow): each reader returns lists ready for the task
models' `fit` on raw strings.
"""

import csv
import json
import os

# task: (file columns of text a, text b or None, label; header line?; label kind)
GLUE_TASKS = {
    "sst2": dict(
        text=0, pair=None, label=1, header=True, kind="class", num_classes=2, metric="accuracy"
    ),
    "cola": dict(
        text=3, pair=None, label=1, header=False, kind="class", num_classes=2, metric="mcc"
    ),
    "mrpc": dict(text=3, pair=4, label=0, header=True, kind="class", num_classes=2, metric="f1"),
    "stsb": dict(
        text=7, pair=8, label=9, header=True, kind="score", num_classes=1, metric="pearson"
    ),
}
GLUE_DIRS = {"sst2": "SST-2", "cola": "CoLA", "mrpc": "MRPC", "stsb": "STS-B"}


def read_glue(task, path):
    """A GLUE .tsv file -> (texts, pairs or None, labels).

    Args:
        task: "sst2", "cola", "mrpc" or "stsb".
        path: the .tsv file (e.g. `glue/SST-2/dev.tsv`), parsed with
            QUOTE_NONE (MRPC has stray quotes).

    Labels are ints (class ids) or floats (STS-B scores 0..5).
    """
    if task not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {task!r}; known: {sorted(GLUE_TASKS)}")
    spec = GLUE_TASKS[task]
    texts, pairs, labels = [], [], []
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if spec["header"]:
        rows = rows[1:]
    for number, row in enumerate(rows, start=2 if spec["header"] else 1):
        if not row:
            continue
        needed = max(c for c in (spec["text"], spec["pair"], spec["label"]) if c is not None)
        if len(row) <= needed:
            raise ValueError(f"{path}:{number}: {len(row)} columns, {task} needs {needed + 1}")
        texts.append(row[spec["text"]])
        if spec["pair"] is not None:
            pairs.append(row[spec["pair"]])
        try:
            labels.append(
                float(row[spec["label"]]) if spec["kind"] == "score" else int(row[spec["label"]])
            )
        except ValueError as e:
            raise ValueError(f"{path}:{number}: bad label {row[spec['label']]!r}") from e
    if not texts:
        raise ValueError(f"{path} has no examples")
    return texts, (pairs if spec["pair"] is not None else None), labels


def glue_path(task, data_dir, split):
    return os.path.join(data_dir, GLUE_DIRS[task], f"{split}.tsv")


def read_conll(path):
    """CoNLL-2003 file -> (sentences as word lists, NER tag lists).

    The last column is the NER tag (original IOB1); `-DOCSTART-` lines and
    blank lines separate sentences.
    """
    sentences, tags, words, labels = [], [], [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("-DOCSTART-"):
                if words:
                    sentences.append(words)
                    tags.append(labels)
                    words, labels = [], []
                continue
            columns = line.split()
            if len(columns) < 2:
                raise ValueError(f"{path}:{number}: expected 'word ... tag', got {line!r}")
            words.append(columns[0])
            labels.append(columns[-1])
    if words:
        sentences.append(words)
        tags.append(labels)
    if not sentences:
        raise ValueError(f"{path} has no sentences")
    return sentences, tags


def read_squad(path):
    """SQuAD v1.1/v2.0 JSON -> list of dicts with id, title, question,
    context, answers (list of {"text", "answer_start"}; empty when the
    question is impossible)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "data" not in data:
        raise ValueError(f"{path} is not SQuAD JSON (no top-level 'data')")
    examples = []
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                answers = [] if qa.get("is_impossible") else qa.get("answers", [])
                examples.append(
                    {
                        "id": qa["id"],
                        "title": article.get("title", ""),
                        "question": qa["question"],
                        "context": paragraph["context"],
                        "answers": [
                            {"text": a["text"], "answer_start": int(a["answer_start"])}
                            for a in answers
                        ],
                    }
                )
    return examples
