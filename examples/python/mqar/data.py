"""Multi-query associative recall (MQAR) batches, after Zoology's definition (Arora et al., 2023).

A sequence starts with `kv_pairs` key-value pairs (k1 v1 k2 v2 ...), keys drawn without replacement from the
lower half of the vocabulary (token 0 excluded) and values from the upper half. The rest of the sequence holds
each key once more as a query, at positions drawn without replacement from a power law (alpha = 0.01, so
most queries sit close to the pairs); the target after a query is its value. Every other position holds a
random token. Loss and accuracy count the query positions only (targets elsewhere are IGNORE).
"""
import torch

IGNORE = -100
VOCAB = 8192


def _sample_rows(n, pool_lo, pool_hi, size, gen):
    """`n` rows of `size` distinct integers from [pool_lo, pool_hi)."""
    scores = torch.rand(n, pool_hi - pool_lo, generator=gen)
    return scores.topk(size, dim=1).indices + pool_lo


def mqar_batch(n, seq_len, kv_pairs, vocab=VOCAB, power_a=0.01, gen=None):
    """(inputs [n, seq_len] int64, targets [n, seq_len] int64 with IGNORE outside the queries).

    targets[:, t] is the token that should follow inputs[:, t] (next-token prediction).
    """
    ctx = 2 * kv_pairs
    if seq_len % 2 or 4 * kv_pairs > seq_len:
        raise ValueError(f"mqar: need an even seq_len >= 4 * kv_pairs, got seq_len={seq_len}, kv_pairs={kv_pairs}")
    if vocab <= seq_len:
        raise ValueError(f"mqar: the vocabulary ({vocab}) must exceed seq_len ({seq_len})")
    half = vocab // 2
    keys = _sample_rows(n, 1, half, kv_pairs, gen)
    values = _sample_rows(n, half, vocab, kv_pairs, gen)

    # Query slots are even offsets after the context; slot s sits at ctx + 2 s, its answer one token later.
    space = (seq_len - ctx) // 2
    p = power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (power_a - 1)
    slots = torch.multinomial((p / p.sum()).expand(n, space), kv_pairs, replacement=False, generator=gen)

    full = torch.zeros(n, seq_len + 1, dtype=torch.int64)
    full[:, 0:ctx:2] = keys
    full[:, 1:ctx:2] = values
    full.scatter_(1, ctx + 2 * slots, keys)
    labels = torch.full((n, seq_len + 1), IGNORE, dtype=torch.int64)
    labels.scatter_(1, ctx + 2 * slots + 1, values)

    inputs, targets = full[:, :-1].clone(), labels[:, 1:].clone()
    filler = torch.randint(vocab, inputs.shape, generator=gen)
    empty = inputs == 0
    inputs[empty] = filler[empty]
    return inputs, targets


class MQARStream:
    """Training batches drawn fresh every step from a seeded generator, and one fixed test set."""

    def __init__(self, seq_len, kv_pairs, batch, test_size, seed=0, vocab=VOCAB):
        self.seq_len, self.kv_pairs, self.batch, self.vocab = seq_len, kv_pairs, batch, vocab
        self.gen = torch.Generator().manual_seed(seed)
        test_gen = torch.Generator().manual_seed(seed + 1_000_003)  # disjoint stream for the test set
        self.test = mqar_batch(test_size, seq_len, kv_pairs, vocab, gen=test_gen)

    def next(self):
        """The next training batch (inputs, targets)."""
        return mqar_batch(self.batch, self.seq_len, self.kv_pairs, self.vocab, gen=self.gen)
