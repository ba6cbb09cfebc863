"""Metrics of generated text: SARI, BLEU (sacrebleu), ROUGE (rouge-score)
and exact match.

SARI (Xu et al., 2016) scores an output against its source and references
by the n-grams (n = 1..4) it keeps, deletes and adds: the mean of the keep
F1, the deletion precision and the addition F1. `sari` follows the
authors' reference implementation (cocoxu/simplification, SARI.py) term
for term, its counting included (lowercased, space-split tokens; n-gram
counts scaled by the number of references; additions counted as sets),
so that its scores are comparable with the published ones (WikiSplit
results are corpus means of sentence SARI). It is our own because the
packages that carry it either pull a large dependency tree or change
the reference's counting.
"""

from collections import Counter


def _ngrams(tokens, n):
    return [" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def _f1(precision, recall):
    return 2 * precision * recall / (precision + recall) if precision > 0 or recall > 0 else 0.0


def _sari_ngram(source, output, references):
    """(keep F1, deletion precision, addition F1) of one n-gram order."""
    count = len(references)
    reference_counts = Counter(g for grams in references for g in grams)
    source_counts = Counter({g: c * count for g, c in Counter(source).items()})
    output_counts = Counter({g: c * count for g, c in Counter(output).items()})

    kept = source_counts & output_counts
    kept_good = kept & reference_counts
    kept_all = source_counts & reference_counts
    keep_precision = sum(kept_good[g] / kept[g] for g in kept_good) / len(kept) if kept else 0.0
    keep_recall = (
        sum(kept_good[g] / kept_all[g] for g in kept_good) / len(kept_all) if kept_all else 0.0
    )

    deleted = source_counts - output_counts
    deleted_good = deleted - reference_counts
    delete_precision = (
        sum(deleted_good[g] / deleted[g] for g in deleted_good) / len(deleted) if deleted else 0.0
    )

    added = set(output_counts) - set(source_counts)
    added_good = added & set(reference_counts)
    added_all = set(reference_counts) - set(source_counts)
    add_precision = len(added_good) / len(added) if added else 0.0
    add_recall = len(added_good) / len(added_all) if added_all else 0.0
    return _f1(keep_precision, keep_recall), delete_precision, _f1(add_precision, add_recall)


def sari_sentence(source, output, references):
    """SARI of one output (0..1): its source, and a list of references.

    Example:
    >>> round(sari_sentence("a b c", "a b c", ["a b c"]), 3)
    0.25
    """
    tokenize = lambda text: text.lower().split(" ")  # noqa: E731  (the reference's rule)
    s, o, refs = tokenize(source), tokenize(output), [tokenize(r) for r in references]
    scores = [
        _sari_ngram(_ngrams(s, n), _ngrams(o, n), [_ngrams(r, n) for r in refs])
        for n in range(1, 5)
    ]
    keep, delete, add = (sum(part) / 4 for part in zip(*scores))
    return (keep + delete + add) / 3


def sari(sources, outputs, references):
    """Corpus SARI, 0..100: the mean sentence SARI. `references` holds one
    reference (str) or a list of them per output."""
    sources, outputs, references = list(sources), list(outputs), list(references)
    if not (len(sources) == len(outputs) == len(references)) or not outputs:
        raise ValueError(
            f"sari needs as many sources, outputs and references, at least one: got "
            f"{len(sources)}, {len(outputs)} and {len(references)}"
        )
    total = sum(
        sari_sentence(s, o, [r] if isinstance(r, str) else list(r))
        for s, o, r in zip(sources, outputs, references)
    )
    return 100.0 * total / len(outputs)


def bleu(outputs, references):
    """Corpus BLEU (sacrebleu's defaults: 13a tokenization, 0..100) of
    outputs against one reference each."""
    import sacrebleu  # the `metrics` extra

    return sacrebleu.corpus_bleu(list(outputs), [list(references)]).score


def rouge(outputs, references, types=("rouge1", "rouge2", "rougeL")):
    """{type: mean F-measure x 100} of outputs against one reference each,
    with Google's `rouge-score` package (Porter stemming, as the summarisation
    papers report it).

    Example:
    >>> rouge(["the cat sat"], ["the cat sat"])["rouge2"]
    100.0
    """
    from rouge_score import rouge_scorer  # the `metrics` extra

    outputs, references = list(outputs), list(references)
    if len(outputs) != len(references) or not outputs:
        raise ValueError(
            f"rouge needs as many outputs as references, at least one: got "
            f"{len(outputs)} and {len(references)}"
        )
    scorer = rouge_scorer.RougeScorer(list(types), use_stemmer=True)
    totals = dict.fromkeys(types, 0.0)
    for output, reference in zip(outputs, references):
        scores = scorer.score(reference, output)  # (target, prediction)
        for name in types:
            totals[name] += scores[name].fmeasure
    return {name: 100.0 * total / len(outputs) for name, total in totals.items()}


def exact_match(outputs, references):
    """Percentage of outputs equal to their reference (whitespace-normalised)."""
    outputs, references = list(outputs), list(references)
    if len(outputs) != len(references) or not outputs:
        raise ValueError(
            f"exact_match needs as many outputs as references, at least one: got "
            f"{len(outputs)} and {len(references)}"
        )
    same = sum(" ".join(o.split()) == " ".join(r.split()) for o, r in zip(outputs, references))
    return 100.0 * same / len(outputs)
