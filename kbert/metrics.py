"""Evaluation metrics of the BERT fine-tuning tasks, in NumPy.

GLUE: accuracy, F1 (MRPC), Matthews correlation (CoLA), Pearson and
Spearman correlation (STS-B). CoNLL-2003: entity-level micro F1 with the
conlleval / seqeval chunk rules (IOB1, IOB2 and IOBES tags). SQuAD: exact
match and F1 with the official answer normalisation (v1.1 and v2.0 scripts).

These are plain functions over whole prediction sets (corpus-level metrics
such as F1 and MCC are not averages of batch values), used by the examples
and the results benchmark.
"""

import collections
import re
import string

import numpy as np


def _labels(y_true, y_pred):
    y_true, y_pred = np.asarray(y_true).reshape(-1), np.asarray(y_pred).reshape(-1)
    if y_true.shape != y_pred.shape:
        raise ValueError(f"got {y_true.size} true values but {y_pred.size} predictions")
    if y_true.size == 0:
        raise ValueError("no examples to score")
    return y_true, y_pred


def accuracy(y_true, y_pred):
    y_true, y_pred = _labels(y_true, y_pred)
    return float(np.mean(y_true == y_pred))


def f1_score(y_true, y_pred, positive=1):
    """Binary F1 of the `positive` class (GLUE MRPC / QQP); 0 when undefined."""
    y_true, y_pred = _labels(y_true, y_pred)
    tp = np.sum((y_pred == positive) & (y_true == positive))
    predicted, actual = np.sum(y_pred == positive), np.sum(y_true == positive)
    if tp == 0:
        return 0.0
    precision, recall = tp / predicted, tp / actual
    return float(2 * precision * recall / (precision + recall))


def matthews_corrcoef(y_true, y_pred):
    """Matthews correlation (multi-class form, Gorodkin 2004); 0 when undefined."""
    y_true, y_pred = _labels(y_true, y_pred)
    classes = np.unique(np.concatenate([y_true, y_pred]))
    index = {c: i for i, c in enumerate(classes)}
    confusion = np.zeros((len(classes), len(classes)), "float64")
    for t, p in zip(y_true, y_pred):
        confusion[index[t], index[p]] += 1
    t_sum, p_sum = confusion.sum(axis=1), confusion.sum(axis=0)
    n, correct = confusion.sum(), np.trace(confusion)
    cov_ytyp = correct * n - np.dot(t_sum, p_sum)
    cov_ypyp = n * n - np.dot(p_sum, p_sum)
    cov_ytyt = n * n - np.dot(t_sum, t_sum)
    if cov_ypyp * cov_ytyt == 0:
        return 0.0
    return float(cov_ytyp / np.sqrt(cov_ytyt * cov_ypyp))


def pearson(x, y):
    x, y = _labels(x, y)
    x, y = x.astype("float64") - np.mean(x), y.astype("float64") - np.mean(y)
    denominator = np.sqrt(np.sum(x * x) * np.sum(y * y))
    if denominator == 0:
        return 0.0
    return float(np.sum(x * y) / denominator)


def _average_ranks(values):
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values), "float64")
    sorted_values = values[order]
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or sorted_values[end] != sorted_values[start]:
            ranks[order[start:end]] = (start + end + 1) / 2.0  # 1-based mean rank of the tie group
            start = end
    return ranks


def spearman(x, y):
    """Spearman rank correlation (ties get their average rank)."""
    x, y = _labels(x, y)
    return pearson(_average_ranks(x.astype("float64")), _average_ranks(y.astype("float64")))


# --- entity-level F1 (CoNLL-2003) ----------------------------------------------


def _split_tag(tag):
    if tag in ("O", "", None):
        return "O", ""
    if "-" in tag:
        prefix, kind = tag.split("-", 1)
        return prefix, kind
    return tag, ""


def _end_of_chunk(prev_prefix, prefix, prev_type, kind):
    if prev_prefix in ("E", "S"):
        return True
    if prev_prefix in ("B", "I") and prefix in ("B", "S", "O"):
        return True
    return prev_prefix != "O" and prev_type != kind


def _start_of_chunk(prev_prefix, prefix, prev_type, kind):
    if prefix in ("B", "S"):
        return True
    if prev_prefix in ("E", "S", "O") and prefix in ("E", "I"):
        return True
    return prefix != "O" and prev_type != kind


def entities(tags):
    """Chunks (type, first, last) of a tag sequence (or list of sentences),
    by the conlleval rules: an I- after O or after another type starts a
    chunk, so IOB1 and IOB2 both work."""
    if tags and isinstance(tags[0], (list, tuple)):
        tags = [t for sentence in tags for t in list(sentence) + ["O"]]
    chunks, start, prev_prefix, prev_type = [], None, "O", ""
    for i, tag in enumerate(list(tags) + ["O"]):
        prefix, kind = _split_tag(tag)
        if _end_of_chunk(prev_prefix, prefix, prev_type, kind) and start is not None:
            chunks.append((prev_type, start, i - 1))
            start = None
        if _start_of_chunk(prev_prefix, prefix, prev_type, kind):
            start = i
        prev_prefix, prev_type = prefix, kind
    return chunks


def entity_f1(true_tags, pred_tags):
    """Micro-averaged entity F1 over sentences of tag strings (seqeval default)."""
    if len(true_tags) != len(pred_tags):
        raise ValueError(f"got {len(true_tags)} true sentences but {len(pred_tags)} predicted")
    for row, (t, p) in enumerate(zip(true_tags, pred_tags)):
        if len(t) != len(p):
            raise ValueError(f"sentence {row}: {len(t)} true tags but {len(p)} predicted")
    gold, guess = set(entities(true_tags)), set(entities(pred_tags))
    correct = len(gold & guess)
    if correct == 0:
        return 0.0
    precision, recall = correct / len(guess), correct / len(gold)
    return 2 * precision * recall / (precision + recall)


# --- SQuAD ----------------------------------------------------------------------


def normalize_answer(text):
    """The official SQuAD normalisation: lower case, no punctuation, no
    articles (a, an, the), single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def squad_exact_match(prediction, gold):
    return float(normalize_answer(prediction) == normalize_answer(gold))


def squad_f1(prediction, gold):
    pred_tokens, gold_tokens = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:  # SQuAD v2: no-answer scores 1 only against no-answer
        return float(pred_tokens == gold_tokens)
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions, golds):
    """Mean EM and F1 in percent; `golds[i]` is the list of reference answer
    texts of question i (an empty list or [""] = no answer, SQuAD v2); each
    question scores its best match over the references."""
    if len(predictions) != len(golds):
        raise ValueError(f"got {len(predictions)} predictions for {len(golds)} questions")
    if not golds:
        raise ValueError("no questions to score")
    em = f1 = 0.0
    for prediction, answers in zip(predictions, golds):
        answers = [a for a in answers if normalize_answer(a)] or [""]
        em += max(squad_exact_match(prediction, a) for a in answers)
        f1 += max(squad_f1(prediction, a) for a in answers)
    return {"exact_match": 100.0 * em / len(golds), "f1": 100.0 * f1 / len(golds)}
