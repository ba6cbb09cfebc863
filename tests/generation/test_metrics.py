import pytest

from kbert.generation.metrics import bleu, exact_match, rouge, sari, sari_sentence

SOURCE = "About 95 species are currently accepted ."
REFERENCES = [
    "About 95 species are currently known .",
    "About 95 species are now accepted .",
    "95 species are now accepted .",
]


@pytest.mark.parametrize(
    "output, expected",
    [  # the reference implementation's example and its published scores
        ("About 95 you now get in .", 0.2682782411698074),
        ("About 95 species are now agreed .", 0.5889995423074248),
        ("About 95 species are currently agreed .", 0.5071608864657479),
    ],
)
def test_sari_matches_the_reference_implementation(output, expected):
    assert sari_sentence(SOURCE, output, REFERENCES) == pytest.approx(expected, abs=1e-12)


def test_corpus_metrics():
    outputs = ["About 95 you now get in .", "About 95 species are now agreed ."]
    assert sari([SOURCE] * 2, outputs, [REFERENCES] * 2) == pytest.approx(
        100 * (0.2682782411698074 + 0.5889995423074248) / 2
    )
    assert exact_match(["a  b", "c"], ["a b", "d"]) == 50.0
    pytest.importorskip("sacrebleu")
    assert bleu(["the cat sat on the mat"], ["the cat sat on the mat"]) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="as many"):
        sari([SOURCE], outputs, [REFERENCES])


def test_rouge_counts_overlapping_ngrams_and_the_longest_common_subsequence():
    pytest.importorskip("rouge_score")
    # 5 of 6 words shared; bigrams the-cat, on-the, the-mat of 5; LCS "the cat on the mat"
    scores = rouge(["the cat is on the mat", "a dog"], ["the cat sat on the mat", "a dog"])
    assert scores["rouge1"] == pytest.approx((100 * 5 / 6 + 100) / 2)
    assert scores["rouge2"] == pytest.approx((60.0 + 100) / 2)
    assert scores["rougeL"] == pytest.approx((100 * 5 / 6 + 100) / 2)
    assert rouge(["completely different"], ["the cat"], types=("rouge1",)) == {"rouge1": 0.0}
    with pytest.raises(ValueError, match="as many"):
        rouge(["a"], ["a", "b"])
