"""The float64 reference itself, on tiny cases checked by hand."""

import math

import pytest
import torch

from tsdecode.reference import reference_decode


def _cache(k_rows, v_rows, page_size=2):
    """One KV head, D = len(row); rows laid out over pages 0..n in order."""
    d = len(k_rows[0])
    n_pages = math.ceil(len(k_rows) / page_size)
    cache = torch.zeros(n_pages, 2, 1, page_size, d, dtype=torch.float64)
    for i, (k, v) in enumerate(zip(k_rows, v_rows)):
        cache[i // page_size, 0, 0, i % page_size] = torch.tensor(k, dtype=torch.float64)
        cache[i // page_size, 1, 0, i % page_size] = torch.tensor(v, dtype=torch.float64)
    table = torch.arange(n_pages, dtype=torch.int32)[None]
    return cache, table


def test_single_key_returns_its_value_times_bmm2():
    cache, table = _cache([[1.0, 2.0]], [[3.0, -4.0]])
    q = torch.tensor([[[0.5, 0.5]]], dtype=torch.float64)
    out = reference_decode(q, cache, table, torch.tensor([1]), bmm2_scale=2.0)
    assert torch.allclose(out, torch.tensor([[[6.0, -8.0]]], dtype=torch.float64))


def test_two_keys_softmax_by_hand():
    # logits = scale * q.k = 1 * [0, ln 3] -> weights [1/4, 3/4]
    cache, table = _cache([[0.0, 0.0], [math.log(3.0), 0.0]], [[4.0, 0.0], [0.0, 8.0]])
    q = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
    out = reference_decode(q, cache, table, torch.tensor([2]), bmm1_scale=1.0)
    assert torch.allclose(out, torch.tensor([[[1.0, 6.0]]], dtype=torch.float64))


def test_default_scale_is_inverse_sqrt_head_dim():
    cache, table = _cache([[0.0] * 4, [2.0, 0, 0, 0]], [[1.0, 0, 0, 0], [0, 1.0, 0, 0]])
    q = torch.tensor([[[math.log(5.0), 0, 0, 0]]], dtype=torch.float64)
    # logits = [0, 2*ln5/2] = [0, ln 5] -> weights [1/6, 5/6]
    out = reference_decode(q, cache, table, torch.tensor([2]))
    assert torch.allclose(out[0, 0, :2], torch.tensor([1 / 6, 5 / 6], dtype=torch.float64))


def test_causal_rows_and_window():
    values = [[float(i), 0.0] for i in range(4)]
    cache, table = _cache([[0.0, 0.0]] * 4, values)  # equal logits: output = mean of visible V
    q = torch.zeros(1, 2, 1, 2, dtype=torch.float64)  # [B=1, SQ=2, Hq=1, D=2]
    lens = torch.tensor([4])
    causal = reference_decode(q, cache, table, lens, seq_len_q=2, mask_type="causal")
    # row 0 sees keys 0..2 (mean 1), row 1 sees 0..3 (mean 1.5)
    assert torch.allclose(causal[0, :, 0, 0], torch.tensor([1.0, 1.5], dtype=torch.float64))
    window = reference_decode(q, cache, table, lens, seq_len_q=2, mask_type="causal", window_left=1)
    # window 1: row 0 sees keys 1..2 (mean 1.5), row 1 sees 2..3 (mean 2.5)
    assert torch.allclose(window[0, :, 0, 0], torch.tensor([1.5, 2.5], dtype=torch.float64))


def test_gqa_head_mapping_and_packed_rows():
    # two KV heads with constant values 1 and 2; four query heads -> heads 0,1 use KV 0
    cache = torch.zeros(1, 2, 2, 2, 2, dtype=torch.float64)
    cache[0, 1, 0] = 1.0
    cache[0, 1, 1] = 2.0
    table = torch.zeros(2, 1, dtype=torch.int32)
    q = torch.randn(3, 4, 2, dtype=torch.float64)  # packed: request 0 has 1 token, request 1 has 2
    out = reference_decode(q, cache, table, torch.tensor([2, 2]), qo_indptr=torch.tensor([0, 1, 3]))
    assert torch.allclose(out[:, :2], torch.ones(3, 2, 2, dtype=torch.float64))
    assert torch.allclose(out[:, 2:], 2 * torch.ones(3, 2, 2, dtype=torch.float64))


def test_columns_past_the_live_pages_are_not_read():
    # a row padded with -1 (FlashInfer's padding) past its one live page: same answer as unpadded
    cache, table = _cache([[1.0, 0.0], [0.0, 1.0]], [[2.0, 0.0], [0.0, 4.0]])
    padded = torch.tensor([[0, -1, -1]], dtype=torch.int32)
    q = torch.tensor([[[1.0, 1.0]]], dtype=torch.float64)
    lens = torch.tensor([2])
    assert torch.equal(reference_decode(q, cache, padded, lens), reference_decode(q, cache, table, lens))


def test_seq_len_q_must_agree_with_q():
    """The layout comes from q's rank: a seq_len_q that says otherwise is refused, not ignored
    (a 3-D q with seq_len_q=2 was read as one query token)."""
    cache, table = _cache([[0.0, 0.0]] * 4, [[1.0, 0.0]] * 4)
    lens = torch.tensor([4])
    with pytest.raises(ValueError, match=r"seq_len_q=2 disagrees with q's shape \[1, 1, 2\]"):
        reference_decode(torch.zeros(1, 1, 2, dtype=torch.float64), cache, table, lens, seq_len_q=2)
    with pytest.raises(ValueError, match=r"seq_len_q=3 disagrees with q's shape \[1, 2, 1, 2\]"):
        reference_decode(torch.zeros(1, 2, 1, 2, dtype=torch.float64), cache, table, lens, seq_len_q=3)
