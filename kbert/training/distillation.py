"""Knowledge-distillation losses (DistilBERT, TinyBERT, task distillation).

Shapes: B batch, T tokens (query), S tokens (key, = T), N heads, H hidden,
C classes (or vocabulary entries), `...` any leading axes.

Every loss is float32 and a weighted mean over the real items (tokens,
predictions or query-key pairs): padding counts nowhere, and a batch with
no real item gives 0, not NaN.
"""

from keras import ops

_TINY = 1e-5  # as the original BERT code's MLM normaliser: 0 items give 0


def _weighted_mean(values, weights):
    weights = ops.cast(weights, "float32")
    return ops.sum(values * weights) / (ops.sum(weights) + _TINY)


def soft_target_loss(teacher_logits, student_logits, temperature=2.0, weights=None):
    """KL(softmax(t / T) || softmax(s / T)) * T^2, a weighted mean over `...`.

    DistilBERT's `alpha_ce` term and the soft-label loss of task distillation
    (Hinton et al. 2015): the soft-target cross-entropy minus the teacher's
    entropy, which has the same gradient and is 0 when the student matches
    the teacher. The T^2 keeps gradient sizes independent of T.

    Args:
        teacher_logits: tensor (..., C).
        student_logits: tensor (..., C).
        temperature: float. T.
        weights: tensor (...) or None. e.g. `mask_weights` (0 for padded
            prediction slots); None weighs every row 1.
    """
    t = ops.cast(teacher_logits, "float32") / temperature
    s = ops.cast(student_logits, "float32") / temperature
    t_log = ops.log_softmax(t, axis=-1)
    s_log = ops.log_softmax(s, axis=-1)
    kl = ops.sum(ops.exp(t_log) * (t_log - s_log), axis=-1)  # (...)
    if weights is None:
        weights = ops.ones_like(kl)
    return _weighted_mean(kl, weights) * (temperature**2)


def cosine_loss(teacher_hidden, student_hidden, padding_mask):
    """Mean over real tokens of 1 - cos(teacher, student) (DistilBERT's `alpha_cos`).

    Args:
        teacher_hidden: tensor (B, T, H).
        student_hidden: tensor (B, T, H), same H (project first otherwise).
        padding_mask: tensor (B, T). 1 for real tokens.
    """
    t = ops.cast(teacher_hidden, "float32")
    s = ops.cast(student_hidden, "float32")
    dot = ops.sum(t * s, axis=-1)
    # max(|t| |s|, 1e-8) with the floor under the square root: a zero
    # vector (e.g. a token position filled with zeros) then has a zero
    # gradient, where sqrt(0) would give 0 * inf = NaN.
    norms = ops.sqrt(ops.maximum(ops.sum(t * t, axis=-1) * ops.sum(s * s, axis=-1), 1e-16))
    cos = dot / norms  # (B, T)
    return _weighted_mean(1.0 - cos, padding_mask)


def hidden_state_mse(teacher_hidden, student_hidden, padding_mask):
    """Mean squared difference over real tokens and the H features (TinyBERT's
    hidden-state and embedding losses).

    Args:
        teacher_hidden: tensor (B, T, H).
        student_hidden: tensor (B, T, H), projected to the teacher's width.
        padding_mask: tensor (B, T). 1 for real tokens.
    """
    diff = ops.cast(teacher_hidden, "float32") - ops.cast(student_hidden, "float32")
    per_token = ops.mean(diff * diff, axis=-1)  # (B, T)
    return _weighted_mean(per_token, padding_mask)


def attention_score_mse(teacher_scores, student_scores, padding_mask):
    """Mean squared difference of pre-softmax attention scores over the
    query-key pairs where both tokens are real (TinyBERT's attention loss).

    Args:
        teacher_scores: tensor (B, N, T, S). QK^T / sqrt(D), no mask added.
        student_scores: tensor (B, N, T, S), same N.
        padding_mask: tensor (B, T). 1 for real tokens.
    """
    diff = ops.cast(teacher_scores, "float32") - ops.cast(student_scores, "float32")
    mask = ops.cast(padding_mask, "float32")
    pairs = mask[:, None, :, None] * mask[:, None, None, :]  # (B, 1, T, S)
    pairs = ops.broadcast_to(pairs, ops.shape(diff))
    return _weighted_mean(diff * diff, pairs)


def attention_kl(teacher_scores, student_scores, padding_mask):
    """KL(teacher || student) of the attention distributions over the real
    keys, a mean over heads and real queries (MobileBERT's attention
    transfer, Sun et al. 2020). Where the head counts differ, each model's
    heads are averaged into one distribution per query first.

    Args:
        teacher_scores: tensor (B, Nt, T, S). pre-softmax scores, no mask added.
        student_scores: tensor (B, Ns, T, S).
        padding_mask: tensor (B, T). 1 for real tokens.
    """
    mask = ops.cast(padding_mask, "float32")
    # padded keys get -1e30 (exp underflows to 0), as the attention layer does
    bias = ((mask - 1.0) * 1e30)[:, None, None, :]  # (B, 1, 1, S)
    t_log = ops.log_softmax(ops.cast(teacher_scores, "float32") + bias, axis=-1)
    s_log = ops.log_softmax(ops.cast(student_scores, "float32") + bias, axis=-1)
    if teacher_scores.shape[1] != student_scores.shape[1]:
        t_log = ops.log(ops.mean(ops.exp(t_log), axis=1, keepdims=True) + 1e-30)
        s_log = ops.log(ops.mean(ops.exp(s_log), axis=1, keepdims=True) + 1e-30)
    key_mask = mask[:, None, None, :]
    kl = ops.sum(ops.exp(t_log) * (t_log - s_log) * key_mask, axis=-1)  # (B, N, T)
    weights = ops.broadcast_to(mask[:, None, :], ops.shape(kl))
    return _weighted_mean(kl, weights)


def default_layer_map(teacher_layers, student_layers):
    """TinyBERT's uniform mapping g(m) = m * L_t / L_s (rounded down) for the
    student's blocks m = 1 .. L_s, as 1-based teacher block numbers (0 is the
    embedding output). A student deeper than its teacher (MobileBERT's
    thin blocks) rounds up instead, so that every student block learns a
    teacher block: consecutive student blocks share one, the last learns
    the teacher's last.

    Example:
    >>> default_layer_map(6, 3)
    [2, 4, 6]
    >>> default_layer_map(2, 5)
    [1, 1, 2, 2, 2]
    """
    if student_layers > teacher_layers:
        return [-(-m * teacher_layers // student_layers) for m in range(1, student_layers + 1)]
    return [m * teacher_layers // student_layers for m in range(1, student_layers + 1)]
