import numpy as np

from kbert.training.seq2seq_batches import Seq2SeqBatches


def test_each_side_is_cut_to_its_own_bucket_and_rows_stay_whole():
    rows = 6
    x = {
        "encoder_token_ids": np.arange(rows * 40).reshape(rows, 40).astype("int32"),
        "encoder_padding_mask": np.zeros((rows, 40), "int32"),
        "decoder_token_ids": np.arange(rows * 24).reshape(rows, 24).astype("int32"),
        "decoder_padding_mask": np.zeros((rows, 24), "int32"),
    }
    for r in range(rows):
        x["encoder_padding_mask"][r, : 3 + 6 * r] = 1  # 3 .. 33 real source tokens
        x["decoder_padding_mask"][r, : 2 + r] = 1  # 2 .. 7 real target tokens
    y = x["decoder_token_ids"] + 1
    batches = Seq2SeqBatches(x, y, batch_size=2, shuffle=True, multiple=16, seed=1)
    seen = []
    for i in range(len(batches)):
        bx, by = batches[i]
        real = bx["encoder_padding_mask"].sum(1)
        assert bx["encoder_token_ids"].shape[1] == min(-(-real.max() // 16) * 16, 40)
        assert bx["decoder_token_ids"].shape == by.shape == (2, 16)
        np.testing.assert_array_equal(by, bx["decoder_token_ids"] + 1)  # labels stay with rows
        seen += (bx["decoder_token_ids"][:, 0] // 24).tolist()
    assert sorted(seen) == list(range(rows))
    first = list(batches.order)
    batches.on_epoch_end()
    assert sorted(batches.order) == sorted(first)
