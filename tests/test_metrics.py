import numpy as np
import pytest

from kbert import metrics

stats = pytest.importorskip("scipy.stats")


def test_classification_metrics_by_hand():
    y, p = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]
    assert metrics.accuracy(y, p) == pytest.approx(0.6)
    # tp=2, fp=1, fn=1 -> precision 2/3, recall 2/3
    assert metrics.f1_score(y, p) == pytest.approx(2 / 3)
    # tp=2 tn=1 fp=1 fn=1: (2*1 - 1*1) / sqrt(3*3*2*2) = 1/6
    assert metrics.matthews_corrcoef(y, p) == pytest.approx(1 / 6)
    assert metrics.matthews_corrcoef([0, 0, 1], [0, 0, 0]) == 0.0  # undefined -> 0
    assert metrics.matthews_corrcoef([0, 1, 2, 2], [0, 1, 2, 2]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="3 true values but 2"):
        metrics.accuracy([1, 2, 3], [1, 2])


def test_correlations_match_scipy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=50)
    y = x + rng.normal(size=50)
    y[:10] = y[10]  # ties
    assert metrics.pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)
    assert metrics.spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)


def test_entity_f1_follows_conlleval_chunking():
    # IOB1 (CoNLL-2003 files): an I- after O starts a chunk; B- only splits same-type neighbours
    assert metrics.entities(["I-PER", "I-PER", "O", "I-LOC", "B-LOC", "I-ORG"]) == [
        ("PER", 0, 1),
        ("LOC", 3, 3),
        ("LOC", 4, 4),
        ("ORG", 5, 5),
    ]
    true = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG"]]
    # gold 3 entities, predicted 3, 2 correct
    assert metrics.entity_f1(true, pred) == pytest.approx(2 / 3)
    # a truncated entity is wrong, not partly right
    assert metrics.entity_f1([["B-PER", "I-PER"]], [["B-PER", "O"]]) == 0.0
    # sentences do not join: an entity at the end of one and the start of the next are two
    assert len(metrics.entities([["I-PER"], ["I-PER"]])) == 2


def test_squad_scores_use_official_normalisation():
    assert metrics.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    scores = metrics.squad_scores(
        ["the Eiffel Tower", "in Paris France", ""], [["Eiffel Tower"], ["Paris"], [""]]
    )
    assert scores["exact_match"] == pytest.approx(200 / 3)
    # second: precision 1/3, recall 1 -> F1 0.5; third: no-answer matched
    assert scores["f1"] == pytest.approx(100 * (1 + 0.5 + 1) / 3)
    assert metrics.squad_scores(["x"], [["y", "x"]])["exact_match"] == 100.0  # best over references
    assert metrics.squad_scores([""], [["Paris"]])["f1"] == 0.0
