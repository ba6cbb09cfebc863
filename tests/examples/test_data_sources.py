"""kbert.data.sources: the shipped samples, the real files in ../shared/data,
and the `datasets` path (local files laid out like the Hub repositories, and
Hub ids read from the `datasets` cache offline). Nothing reaches the network
(conftest.no_network)."""

import json
import os
import shutil

import pytest

from kbert.data.finetuning import read_squad
from kbert.data.sources import load_conll2003, load_glue, load_squad

from .helpers import SAMPLES, SHARED

needs_shared = pytest.mark.skipif(not os.path.isdir(SHARED), reason="../shared/data is not present")
CONLL_TAGS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]


# --- the shipped samples -------------------------------------------------------


def test_glue_sample_is_sts_b():
    glue = os.path.join(SAMPLES, "glue")
    texts, pairs, scores = load_glue("stsb", "train", data_dir=glue)
    dev = load_glue("stsb", "validation", data_dir=glue)
    assert len(texts) == len(pairs) == len(scores) == 300 and len(dev[0]) == 100
    assert all(isinstance(s, float) and 0.0 <= s <= 5.0 for s in scores + dev[2])
    assert len(set(texts) & set(dev[0])) == 0
    with pytest.raises(FileNotFoundError, match="SST-2"):
        load_glue("sst2", "train", data_dir=glue)
    with pytest.raises(ValueError, match="no 'test' split"):
        load_glue("stsb", "test", data_dir=glue)


def test_ner_sample_reads_as_conll_2003():
    ner = os.path.join(SAMPLES, "ner")
    splits = {s: load_conll2003(s, data_dir=ner) for s in ("train", "validation", "test")}
    assert [len(splits[s][0]) for s in splits] == [67, 12, 14]
    train_tags = {t for tags in splits["train"][1] for t in tags}
    assert {"I-PER", "I-ORG", "I-LOC", "I-MISC", "O"} <= train_tags
    for sentences, tags in splits.values():
        assert [len(s) for s in sentences] == [len(t) for t in tags]
        assert {t for row in tags for t in row} <= train_tags  # the recipe's label check
    assert splits["train"][0][0][:3] == ["The", "Panthers", "defense"]
    assert splits["train"][1][0][:3] == ["O", "I-ORG", "O"]


def test_squad_sample_splits_by_article():
    train = load_squad(data_file=os.path.join(SAMPLES, "squad", "train.json"))
    dev = load_squad(data_file=os.path.join(SAMPLES, "squad", "dev.json"))
    assert (len(train), len(dev)) == (147, 57)
    assert not {e["title"] for e in train} & {e["title"] for e in dev}
    for e in train + dev:
        answer = e["answers"][0]
        start = answer["answer_start"]
        assert e["context"][start : start + len(answer["text"])] == answer["text"]


# --- the full data sets in ../shared/data ----------------------------------------


@needs_shared
@pytest.mark.parametrize(
    "task, sizes", [("sst2", (67349, 872)), ("cola", (8551, 1043)), ("mrpc", (3667, 408)),
                    ("stsb", (5749, 1500))]
)  # fmt: skip
def test_glue_files(task, sizes):
    glue = os.path.join(SHARED, "glue")
    train = load_glue(task, "train", data_dir=glue)
    dev = load_glue(task, "validation", data_dir=glue)
    assert (len(train[0]), len(dev[0])) == sizes
    assert (train[1] is None) == (task in ("sst2", "cola"))


@needs_shared
def test_conll_2003_files():
    conll = os.path.join(SHARED, "conll2003")
    sizes = [len(load_conll2003(s, data_dir=conll)[0]) for s in ("train", "validation", "test")]
    assert sizes == [14041, 3250, 3453]


@needs_shared
def test_xquad_file():
    examples = load_squad(data_file=os.path.join(SHARED, "squad", "xquad.en.json"))
    assert len(examples) == 1190


# --- through `datasets` ------------------------------------------------------------


def hub_glue_dir(root, task="stsb"):
    """The shipped STS-B sample as nyu-mll/glue lays it out: Parquet per
    configuration and split, configurations declared in README.md."""
    datasets = pytest.importorskip("datasets")
    glue = os.path.join(SAMPLES, "glue")
    features = datasets.Features(
        {
            "sentence1": datasets.Value("string"),
            "sentence2": datasets.Value("string"),
            "label": datasets.Value("float32"),
            "idx": datasets.Value("int32"),
        }
    )
    for split, name in (("train", "train"), ("validation", "validation")):
        texts, pairs, labels = load_glue(task, split, data_dir=glue)
        rows = {"sentence1": texts, "sentence2": pairs, "label": labels}
        rows["idx"] = list(range(len(texts)))
        os.makedirs(os.path.join(root, task), exist_ok=True)
        datasets.Dataset.from_dict(rows, features=features).to_parquet(
            os.path.join(root, task, f"{name}-00000-of-00001.parquet")
        )
    with open(os.path.join(root, "README.md"), "w") as f:
        f.write(
            "---\nconfigs:\n- config_name: stsb\n  data_files:\n"
            "  - split: train\n    path: stsb/train-*\n"
            "  - split: validation\n    path: stsb/validation-*\n---\n"
        )
    return root


def hub_conll_dir(root):
    """The shipped NER sample, IOB2-tagged with ClassLabel ids, as Parquet per split."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "tokens": datasets.List(datasets.Value("string")),
            "ner_tags": datasets.List(datasets.ClassLabel(names=CONLL_TAGS)),
        }
    )
    expected = {}
    for split in ("train", "validation", "test"):
        sentences, tags = load_conll2003(split, data_dir=os.path.join(SAMPLES, "ner"))
        iob2 = [to_iob2(row) for row in tags]
        expected[split] = (sentences, iob2)
        rows = {
            "id": [str(i) for i in range(len(sentences))],
            "tokens": sentences,
            "ner_tags": [[CONLL_TAGS.index(t) for t in row] for row in iob2],
        }
        os.makedirs(os.path.join(root, split), exist_ok=True)
        datasets.Dataset.from_dict(rows, features=features).to_parquet(
            os.path.join(root, split, "0000.parquet")
        )
    return root, expected


def to_iob2(tags):
    out, previous = [], "O"
    for tag in tags:
        if tag.startswith("I-") and previous[2:] != tag[2:]:
            tag = "B-" + tag[2:]
        out.append(tag)
        previous = tag
    return out


def hub_squad_dir(root):
    """The shipped SQuAD sample as rajpurkar/squad's columns, one JSON-lines file per split."""
    expected = {}
    for split, name in (("train", "train"), ("validation", "dev")):
        examples = read_squad(os.path.join(SAMPLES, "squad", f"{name}.json"))
        expected[split] = examples
        os.makedirs(os.path.join(root, split), exist_ok=True)
        with open(os.path.join(root, split, "data.jsonl"), "w", encoding="utf-8") as f:
            for e in examples:
                row = {k: e[k] for k in ("id", "title", "context", "question")}
                row["answers"] = {
                    "text": [a["text"] for a in e["answers"]],
                    "answer_start": [a["answer_start"] for a in e["answers"]],
                }
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return root, expected


def test_glue_through_datasets_equals_the_files(tmp_path):
    repo = hub_glue_dir(str(tmp_path / "glue"))
    for split in ("train", "validation"):
        texts, pairs, labels = load_glue("stsb", split, dataset=repo, cache_dir=str(tmp_path / "c"))
        files = load_glue("stsb", split, data_dir=os.path.join(SAMPLES, "glue"))
        assert (texts, pairs) == files[:2]
        assert labels == pytest.approx(files[2], abs=1e-6)


def test_glue_test_split_without_labels_is_refused(tmp_path):
    datasets = pytest.importorskip("datasets")
    root = tmp_path / "glue"
    (root / "sst2").mkdir(parents=True)
    datasets.Dataset.from_dict(
        {"sentence": ["a fine film", "a dull film"], "label": [-1, -1], "idx": [0, 1]}
    ).to_parquet(str(root / "sst2" / "test-00000-of-00001.parquet"))
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: sst2\n  data_files:\n"
        "  - split: test\n    path: sst2/test-*\n---\n"
    )
    with pytest.raises(ValueError, match="no labels"):
        load_glue("sst2", "test", dataset=str(root), cache_dir=str(tmp_path / "c"))


def test_conll_through_datasets_names_the_class_labels(tmp_path):
    repo, expected = hub_conll_dir(str(tmp_path / "conll2003"))
    for split in ("train", "validation", "test"):
        got = load_conll2003(split, dataset=repo, cache_dir=str(tmp_path / "c"))
        assert got == expected[split]
    assert "B-PER" in {t for row in expected["train"][1] for t in row}  # IOB2 from the Hub


def test_squad_through_datasets_equals_the_files(tmp_path):
    pytest.importorskip("datasets")
    repo, expected = hub_squad_dir(str(tmp_path / "squad"))
    for split in ("train", "validation"):
        assert load_squad(split, dataset=repo, cache_dir=str(tmp_path / "c")) == expected[split]


def cache_as_hub_id(local_repo, hub_id, cache_dir, **load_kwargs):
    """Fills the `datasets` cache from a local repository and files it under
    `hub_id`, where a download of that Hub dataset would have put it."""
    import datasets

    datasets.load_dataset(local_repo, cache_dir=cache_dir, **load_kwargs)
    name = os.path.basename(local_repo)
    shutil.move(os.path.join(cache_dir, name), os.path.join(cache_dir, hub_id.replace("/", "___")))


def test_default_hub_ids_load_offline_from_the_cache(tmp_path, monkeypatch):
    """`nyu-mll/glue`, `eriktks/conll2003` (through its Parquet branch) and
    `rajpurkar/squad`, downloaded earlier, load with HF_DATASETS_OFFLINE=1."""
    datasets = pytest.importorskip("datasets")

    cache = str(tmp_path / "cache")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    cache_as_hub_id(hub_glue_dir(str(tmp_path / "glue")), "nyu-mll/glue", cache, name="stsb")
    conll, conll_expected = hub_conll_dir(str(tmp_path / "conll2003"))
    cache_as_hub_id(conll, "eriktks/conll2003", cache)
    squad, squad_expected = hub_squad_dir(str(tmp_path / "squad"))
    cache_as_hub_id(squad, "rajpurkar/squad", cache)

    texts, pairs, labels = load_glue("stsb", "validation")
    assert texts == load_glue("stsb", "validation", data_dir=os.path.join(SAMPLES, "glue"))[0]
    assert load_conll2003("test") == conll_expected["test"]
    assert load_squad("validation") == squad_expected["validation"]
