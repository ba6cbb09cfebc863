"""Fine-tuning data sets through Hugging Face `datasets` or from local files.

Each loader returns what the matching reader in `kbert.data.finetuning`
returns, from one of two places:

- `dataset=`: anything `datasets.load_dataset` accepts: a Hub id (downloaded
  once into the `datasets` cache; with `HF_DATASETS_OFFLINE=1` only the cache
  is read) or a local directory laid out like the Hub repository.
- `data_dir=` / `data_file=`: the files as their authors distribute them
  (GLUE `.tsv`, CoNLL-2003 `eng.*`, SQuAD JSON).

Split names are the Hub's: "train", "validation", "test". `datasets` is
imported only when `dataset` is used.

    texts, pairs, labels = load_glue("stsb", "validation", data_dir="glue_data")
    sentences, tags = load_conll2003("train")  # eriktks/conll2003 through `datasets`
"""

import os

from kbert.data.finetuning import GLUE_DIRS, GLUE_TASKS, read_conll, read_glue, read_squad

GLUE_HUB = "nyu-mll/glue"
CONLL2003_HUB = "eriktks/conll2003"
SQUAD_HUB = "rajpurkar/squad"

# Hub columns of each GLUE configuration: (text, pair or None).
GLUE_COLUMNS = {
    "sst2": ("sentence", None),
    "cola": ("sentence", None),
    "mrpc": ("sentence1", "sentence2"),
    "stsb": ("sentence1", "sentence2"),
}
# Split -> file name in the original distributions (GLUE's test files have no labels).
GLUE_FILES = {"train": "train.tsv", "validation": "dev.tsv"}
CONLL2003_FILES = {"train": "eng.train", "validation": "eng.testa", "test": "eng.testb"}

# These repositories hold a loading script, which `datasets` 4 and later do
# not run; the Hub's Parquet conversion of them lives on this branch.
PARQUET_BRANCH = {
    "conll2003": "refs/convert/parquet",
    "eriktks/conll2003": "refs/convert/parquet",
}


def load_hub_split(dataset, split, name=None, **load_kwargs):
    """`datasets.load_dataset(dataset, name, split=split)`, with the Parquet
    branch for repositories that only hold a loading script.

    Args:
        dataset: str. Hub id or local directory.
        split: str. "train", "validation" or "test".
        name: str or None. the configuration (e.g. "sst2").
        **load_kwargs: passed on (`cache_dir`, `revision`, `data_files`, ...).
    """
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"loading {dataset!r} needs the `datasets` package: pip install datasets "
            "(or pass data_dir= with the original files)"
        ) from e
    if dataset in PARQUET_BRANCH:
        load_kwargs.setdefault("revision", PARQUET_BRANCH[dataset])
    return datasets.load_dataset(dataset, name, split=split, **load_kwargs)


def _local_file(directory, files, split, what):
    if split not in files:
        raise ValueError(f"{what} files have no {split!r} split; use one of {sorted(files)}")
    path = os.path.join(directory, files[split])
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: data_dir must hold the {what} files "
            f"({', '.join(files.values())}); or load the data set by name with dataset=..."
        )
    return path


def load_glue(task, split="train", data_dir=None, dataset=GLUE_HUB, **load_kwargs):
    """One split of a GLUE task -> (texts, pairs or None, labels).

    Args:
        task: str. "sst2", "cola", "mrpc" or "stsb".
        split: str. "train" or "validation" (GLUE's test labels are hidden).
        data_dir: str or None. a directory with the GLUE files,
            `<data_dir>/<TASK>/{train,dev}.tsv` (e.g. `glue_data/SST-2/dev.tsv`);
            read instead of `dataset` when given.
        dataset: str. `datasets` name whose configuration is `task`
            (default "nyu-mll/glue").
        **load_kwargs: passed to `datasets.load_dataset`.

    Labels are class ids (int) or, for STS-B, scores 0..5 (float).
    """
    if task not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {task!r}; known: {sorted(GLUE_TASKS)}")
    if data_dir is not None:
        files = {k: os.path.join(GLUE_DIRS[task], v) for k, v in GLUE_FILES.items()}
        return read_glue(task, _local_file(data_dir, files, split, f"GLUE {task}"))
    rows = load_hub_split(dataset, split, task, **load_kwargs)
    text, pair = GLUE_COLUMNS[task]
    labels = list(rows["label"])
    if any(label == -1 for label in labels):
        raise ValueError(
            f"{dataset} {task} {split!r} has no labels (GLUE hides its test labels); "
            "evaluate on 'validation'"
        )
    cast = float if GLUE_TASKS[task]["kind"] == "score" else int
    return (
        list(rows[text]),
        list(rows[pair]) if pair else None,
        [cast(label) for label in labels],
    )


def load_conll2003(split="train", data_dir=None, dataset=CONLL2003_HUB, **load_kwargs):
    """One split of CoNLL-2003 English NER -> (sentences as word lists, tag lists).

    Args:
        split: str. "train", "validation" (eng.testa) or "test" (eng.testb).
        data_dir: str or None. a directory with `eng.train`, `eng.testa`,
            `eng.testb` (columns `word POS chunk NER`); read instead of
            `dataset` when given.
        dataset: str. `datasets` name with `tokens` and `ner_tags` columns
            (default "eriktks/conll2003", read from its Parquet branch).
        **load_kwargs: passed to `datasets.load_dataset`.

    Tags are strings as the source writes them: the original files use IOB1
    (`I-PER` starts an entity), the Hub copy IOB2 (`B-PER`); entity F1 reads both.
    """
    if data_dir is not None:
        return read_conll(_local_file(data_dir, CONLL2003_FILES, split, "CoNLL-2003"))
    rows = load_hub_split(dataset, split, **load_kwargs)
    missing = {"tokens", "ner_tags"} - set(rows.column_names)
    if missing:
        raise ValueError(
            f"{dataset} has no {sorted(missing)} column(s) (it has {rows.column_names}); "
            "CoNLL-2003 on the Hub has `tokens` and `ner_tags`"
        )
    names = getattr(getattr(rows.features["ner_tags"], "feature", None), "names", None)
    tags = [[names[t] if names else str(t) for t in row] for row in rows["ner_tags"]]
    return [list(words) for words in rows["tokens"]], tags


def load_squad(split="train", data_file=None, dataset=SQUAD_HUB, **load_kwargs):
    """SQuAD-style questions -> a list of dicts with id, title, question,
    context and answers (a list of {"text", "answer_start"}; empty when the
    question has no answer, as in SQuAD v2.0).

    Args:
        split: str. "train" or "validation" (with `dataset`).
        data_file: str or None. a SQuAD v1.1/v2.0 JSON file, read whole
            instead of `dataset` when given.
        dataset: str. `datasets` name with SQuAD's columns (default
            "rajpurkar/squad"; "rajpurkar/squad_v2" for v2.0).
        **load_kwargs: passed to `datasets.load_dataset`.
    """
    if data_file is not None:
        return read_squad(data_file)
    rows = load_hub_split(dataset, split, **load_kwargs)
    return [
        {
            "id": row["id"],
            "title": row.get("title", ""),
            "question": row["question"],
            "context": row["context"],
            "answers": [
                {"text": text, "answer_start": int(start)}
                for text, start in zip(row["answers"]["text"], row["answers"]["answer_start"])
            ],
        }
        for row in rows
    ]
