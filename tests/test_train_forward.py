"""The training forward agrees with inference: the N×K layout of one anchor is exactly the
P-EAGLE drafter batch of the decode loop (paged forward), a depth-0-only layout is the causal
float64 reference forward, and the online target features are the decode runner's features."""

from __future__ import annotations

import pytest
import torch
from reference.drafter import drafter_forward_ref
from train_helpers import MASK_ID, VOCAB, tiny_drafter, tiny_target

from peagle.models.paged import AttentionMetadata
from peagle.models.target import TargetRunner
from peagle.train.attention import MaskedAttention
from peagle.train.forward import masked_forward
from peagle.train.mask import ElementMeta
from peagle.train.target_features import shift_sequence, target_forward

BLOCK = 16


def _one_request_meta(num_rows: int, first_position: int) -> AttentionMetadata:
    nb = -(-num_rows // BLOCK)
    return AttentionMetadata(
        positions=torch.arange(first_position, first_position + num_rows),
        slot_mapping=torch.arange(num_rows) + BLOCK,  # blocks 1..nb, contiguous
        query_start_loc=torch.tensor([0, num_rows], dtype=torch.int32),
        seq_lens=torch.tensor([num_rows], dtype=torch.int32),
        block_table=torch.arange(1, nb + 2, dtype=torch.int32)[None],
        max_query_len=num_rows,
    )


def _masked(drafter, meta_el, ids, hidden, positions):
    """The training forward with the training mask, each layer under its own window."""
    scale = drafter.config.head_dim**-0.5
    attention = MaskedAttention("dense")
    prepared = attention.prepare_layers(meta_el, meta_el, drafter.config.layer_windows())

    def attend(i, q, k, v):
        return attention(prepared[i], q, k, v, scale)

    return masked_forward(drafter, ids, hidden, positions, attend)


@pytest.mark.parametrize(
    "window,layer_types",
    [
        (None, None),
        (3, None),
        (4, ["sliding_attention", "full_attention", "sliding_attention"]),
    ],
)
def test_anchor_chain_equals_decode_batch(window, layer_types):
    """Elements (0..a, 0) + (a, 1..K-1) vs the paged forward over [x_1..x_{a+1}, MASK x (K-1)];
    with sliding windows shorter than the chain's reach the training mask (window from the
    reference position a + d) must give the paged attention's rows (window_left = window - 1)."""
    target = tiny_target(0)
    drafter = tiny_drafter(target, layers=3, dtype=torch.float32).eval()
    drafter.config.sliding_window, drafter.config.layer_types = window, layer_types
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB - 1, (16,), generator=gen)
    aux, logits = target_forward(target, tokens, drafter.config.aux_layer_ids)
    seq = shift_sequence(tokens, aux, logits)
    a, k = 9, 5
    anchors = torch.cat([torch.arange(a + 1), torch.full((k - 1,), a)])
    depths = torch.cat([torch.zeros(a + 1, dtype=torch.long), torch.arange(1, k)])
    el = ElementMeta(anchors, depths, torch.zeros_like(anchors))
    with torch.no_grad():
        mask_vec = drafter.mask_vector()
        ids = torch.where(depths == 0, seq.input_ids[anchors], MASK_ID)
        hidden = torch.where((depths == 0)[:, None], drafter.fc(seq.features[anchors]), mask_vec)
        positions = seq.positions[anchors + depths]
        assert positions.tolist() == list(range(1, a + k + 1))
        got_n, got_p = _masked(drafter, el, ids, hidden, positions)
        kv = drafter.make_kv_cache(num_blocks=4, block_size=BLOCK)
        ref_n, ref_p = drafter(ids, hidden, _one_request_meta(a + k, 1), kv)
    torch.testing.assert_close(got_p, ref_p, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_n, ref_n, rtol=1e-5, atol=1e-5)


def test_depth0_layout_is_the_causal_reference_forward():
    target = tiny_target(1)
    drafter = tiny_drafter(target, layers=2, dtype=torch.float64).eval()
    gen = torch.Generator().manual_seed(1)
    n = 17
    ids = torch.randint(0, VOCAB, (n,), generator=gen)
    hid = torch.randn(n, drafter.config.hidden_size, generator=gen, dtype=torch.float64)
    pos = torch.arange(1, n + 1)
    el = ElementMeta(
        torch.arange(n), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    )
    with torch.no_grad():
        got_n, got_p = _masked(drafter, el, ids, hid, pos)
    ref_n, ref_p, _ = drafter_forward_ref(
        drafter.state_dict(), drafter.config.to_dict(), ids, hid, pos
    )
    # transformers' RMSNorm normalises in float32: float32-level agreement.
    torch.testing.assert_close(got_p, ref_p, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_n, ref_n, rtol=1e-5, atol=1e-5)


def test_online_features_equal_decode_runner_features():
    target = tiny_target(2, layers=7)
    ids = [2, 4, 5]
    tokens = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(2))
    aux, logits = target_forward(target, tokens, ids)
    runner = TargetRunner(target, aux_layer_ids=ids)
    kv = runner.make_kv_cache(num_blocks=4, block_size=BLOCK)
    meta = _one_request_meta(tokens.numel(), 0)
    r_logits, r_aux = runner.forward(tokens, meta, kv)
    torch.testing.assert_close(aux, r_aux, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, r_logits, rtol=1e-5, atol=1e-5)


def test_eagle_shift():
    tokens = torch.tensor([5, 6, 7, 8])
    aux = torch.arange(4.0)[:, None].repeat(1, 6)
    logits = torch.arange(4.0)[:, None].repeat(1, 10) * torch.arange(10.0)
    lm = torch.tensor([True, True, False, True])
    seq = shift_sequence(tokens, aux, logits, loss_mask=lm, draft_to_target=torch.tensor([1, 3]))
    assert seq.input_ids.tolist() == [6, 7, 8]  # x_{t+1}
    assert seq.features[:, 0].tolist() == [0.0, 1.0, 2.0]  # g_t
    assert seq.positions.tolist() == [1, 2, 3]  # start at 1
    assert seq.target_logits.tolist() == [[1.0, 3.0], [2.0, 6.0], [3.0, 9.0]]  # p_{t+1}, draft ids
    assert seq.loss_mask.tolist() == [True, False, True]  # l_{t+1}
