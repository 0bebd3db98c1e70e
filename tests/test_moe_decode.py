"""Speculative decoding with MoE targets (GPT-OSS, Qwen3-MoE) on CPU in float32.

* With and without speculation (P-EAGLE and EAGLE-3 drafters), greedy output equals transformers'
  own ``generate`` on the same model (sequences several sliding windows long); the CUDA-graph
  path's padded static-buffer layout too.
* A P-EAGLE head *trained* here for a tiny GPT-OSS-shaped target (a short loop over the drafter's
  own forward, with the P-EAGLE attention rule given to its attention layers) decodes with it:
  identical greedy output, and clearly more accepted drafts than the untrained head.
"""

from __future__ import annotations

import copy

import pytest
import torch
from moe_models import KINDS, make_moe_target, quantize_experts_to_mxfp4
from test_decode import PROMPTS, N, hf_greedy
from tiny_models import VOCAB, drafter_config_dict, make_drafter

import peagle.models.drafter as drafter_module
from peagle.decode import SamplingParams, SpecDecoder
from peagle.models import DrafterConfig, Eagle3Drafter, TargetRunner


@pytest.fixture(scope="module", params=KINDS)
def target(request):
    model, g = make_moe_target(request.param, seed=1)
    refs = [hf_greedy(model, p) for p in PROMPTS]
    return request.param, model, g, refs


@pytest.mark.parametrize("method,k", [("none", 1), ("peagle", 3), ("eagle3", 2)])
def test_greedy_equivalence(target, method, k):
    _, model, g, refs = target
    drafter = None if method == "none" else make_drafter(model, g, parallel=method == "peagle")
    eng = SpecDecoder(
        TargetRunner(model), drafter, method=method, num_speculative_tokens=k, block_size=4
    )
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=N))
    assert [o.token_ids for o in outs] == refs
    if method != "none":
        drafted = sum(o.stats.num_draft_tokens for o in outs)
        accepted = sum(o.stats.num_accepted_tokens for o in outs)
        assert 0 < accepted < drafted  # acceptance and rejection both happened
    assert eng.allocator.num_allocated == 0


def test_greedy_equivalence_graph_layout(target):
    """The CUDA-graph path's padded layout (3 requests padded to 4), run eagerly."""
    _, model, g, refs = target
    eng = SpecDecoder(
        TargetRunner(model), make_drafter(model, g), method="peagle", num_speculative_tokens=3,
        block_size=4, cuda_graphs="emulate", max_num_seqs=4,
    )  # fmt: skip
    outs = eng.generate(PROMPTS[1:], SamplingParams(max_new_tokens=N))
    assert [o.token_ids for o in outs] == refs[1:]
    assert 4 in eng.graphs.graphs


# ---------------------------------------------------------------------------------------------
# A P-EAGLE head trained for a tiny GPT-OSS-shaped target
# ---------------------------------------------------------------------------------------------

K_TRAIN = 3  # parallel positions trained: the NTP row + K-1 mask rows


class _DenseAttention:
    """Stands in for the paged attention of the drafter's layers during training: the batch is
    ``S`` sequences of ``R`` rows each with the same layout, attending within their sequence
    under a boolean ``allowed [R, R]`` (no KV cache)."""

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed

    def __call__(self, q, k, v, kv, meta, *, softmax_scale, window_left=-1, sinks=None):
        r = self.allowed.shape[0]
        rep = q.shape[1] // k.shape[1]
        q = q.view(-1, r, *q.shape[1:])
        k = k.repeat_interleave(rep, 1).view(q.shape)
        v = v.repeat_interleave(rep, 1).view(q.shape)
        s = torch.einsum("sqhd,skhd->shqk", q, k) * softmax_scale
        s = s.masked_fill(~self.allowed, float("-inf"))
        return torch.einsum("shqk,skhd->sqhd", s.softmax(-1), v).flatten(0, 1)


class _Positions:
    def __init__(self, positions):
        self.positions = positions


class _NoCache:
    def layer(self, i):
        return None


def _training_batch(model, mask_id: int, seqs: torch.Tensor, prompt_len: int) -> dict:
    """P-EAGLE training rows for greedy sequences ``seqs [S, L]`` (EAGLE shift, SPEC §8.1-8.3),
    the same ``R`` rows for every sequence:

    * NTP row ``j`` (``0 <= j < L-1``): token ``x_{j+1}``, target features of position ``j``,
      RoPE position ``j+1``; label ``x_{j+2}``.
    * mask row ``(j, d)``, ``1 <= d < K``: the mask token, ``fc(mask_hidden)``, position
      ``j+1+d``; label ``x_{j+2+d}``. It sees the NTP rows ``<= j`` and the mask rows
      ``(j, <= d)``, like the mask rows of a decode step.

    Only rows whose label is a generated token (the target's own argmax) are trained.
    """
    length = seqs.shape[1]
    with torch.no_grad():
        out = model(seqs, output_hidden_states=True)
    ids = TargetRunner(model).aux_layer_ids
    feats = torch.cat([out.hidden_states[i] for i in ids], -1)  # [S, L, 3H]
    rows = [(j, d) for d in range(K_TRAIN) for j in range(length - 2 - d)]
    j = torch.tensor([r[0] for r in rows])
    d = torch.tensor([r[1] for r in rows])
    is_mask = d > 0
    ntp_key = ~is_mask[None, :] & (j[None, :] <= j[:, None])
    chain = (j[None, :] == j[:, None]) & (d[None, :] <= d[:, None])
    allowed = torch.where(is_mask[:, None], ntp_key | chain, ntp_key)
    n_seq = seqs.shape[0]
    tokens = torch.where(is_mask, mask_id, seqs[:, j + 1])  # [S, R]
    return dict(
        input_ids=tokens.flatten(),
        features=feats[:, j].flatten(0, 1),
        is_mask=is_mask.repeat(n_seq),
        positions=(j + 1 + d).repeat(n_seq),
        labels=seqs[:, j + 2 + d].flatten(),
        trained=(j + 2 + d >= prompt_len).repeat(n_seq),
        allowed=allowed,
    )


def _greedy_sequences(model, gen, count, prompt_len, new):
    prompts = torch.randint(2, VOCAB, (count, prompt_len), generator=gen)
    with torch.no_grad():
        return model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip


LR = 1e-2
NUM_SEQS = 256  # greedy training sequences (3 random prompt tokens + 12 generated)
BATCH = 16  # sequences per step


def _train_peagle_head(model, gen, steps=100, prompt_len=3):
    cfg = DrafterConfig.from_dict(drafter_config_dict(num_layers=1, head_dim=model.config.head_dim))
    drafter = Eagle3Drafter(cfg, with_mask_hidden=True)
    with torch.no_grad():  # the usual recipe: small linears, the target's embedding and head
        for mod in drafter.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.normal_(0.0, 0.02, generator=gen)
        drafter.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        drafter.lm_head.weight.copy_(model.lm_head.weight)
        drafter.mask_hidden.normal_(0.0, 1.0, generator=gen)
    initial = copy.deepcopy(drafter).eval()
    seqs = _greedy_sequences(model, gen, NUM_SEQS, prompt_len, 12)
    data = _training_batch(model, cfg.mask_token_id, seqs, prompt_len)
    rows_per_seq = data["allowed"].shape[0]
    opt = torch.optim.Adam(drafter.parameters(), lr=LR)
    saved = drafter_module.paged_attention_forward
    drafter_module.paged_attention_forward = _DenseAttention(data["allowed"])
    losses = []
    try:
        for _ in range(steps):
            pick = torch.randperm(NUM_SEQS, generator=gen)[:BATCH]
            rows = (pick[:, None] * rows_per_seq + torch.arange(rows_per_seq)).flatten()
            batch = {k: v[rows] for k, v in data.items() if k != "allowed"}
            meta = _Positions(batch["positions"])
            h = drafter.project_target_hidden(batch["features"])
            mask_vec = drafter.project_target_hidden(drafter.mask_hidden.reshape(1, -1))
            h = torch.where(batch["is_mask"][:, None], mask_vec, h)
            normed, _ = drafter(batch["input_ids"], h, meta, _NoCache())
            logits = drafter.compute_logits(normed[batch["trained"]])
            loss = torch.nn.functional.cross_entropy(logits, batch["labels"][batch["trained"]])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        drafter_module.paged_attention_forward = saved
    return drafter.eval(), initial, losses


def test_trained_peagle_head_decodes_gpt_oss_target(gen):
    # Small layer contributions: the greedy next token is a function of the current one (the
    # logits still depend on attention, sinks, windows and experts), which a short training run
    # can learn well enough to generalise to unseen prompts.
    model, _ = make_moe_target("gpt_oss", seed=2, layer_scale=0.1)
    drafter, untrained, losses = _train_peagle_head(model, gen)
    assert losses[-1] < 0.25 * losses[0], losses[:: len(losses) // 6]
    # Held-out prompts (same distribution, not trained on).
    prompts = torch.randint(2, VOCAB, (6, 3), generator=gen).tolist()
    refs = [hf_greedy(model, p) for p in prompts]
    rates = []
    for d in (drafter, untrained):
        eng = SpecDecoder(TargetRunner(model), d, method="peagle", num_speculative_tokens=K_TRAIN)
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=N))
        assert [o.token_ids for o in outs] == refs
        drafted = sum(o.stats.num_draft_tokens for o in outs)
        rates.append(sum(o.stats.num_accepted_tokens for o in outs) / drafted)
    print(f"\ntrained P-EAGLE head: {rates[0]:.2f} of drafts accepted (at init: {rates[1]:.2f})")
    assert rates[0] > 0.4 and rates[0] > rates[1] + 0.3


# ---------------------------------------------------------------------------------------------
# peagle generate with an MXFP4 GPT-OSS checkpoint
# ---------------------------------------------------------------------------------------------


def test_generate_cli_with_mxfp4_gpt_oss(tmp_path, capsys):
    """``peagle generate`` on a saved tiny GPT-OSS whose experts are MXFP4: the memory message
    goes to stderr, the experts are dequantized, and P-EAGLE's greedy text equals transformers'
    greedy continuation of the same dequantized checkpoint."""
    from tiny_models import make_tokenizer, word
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from peagle.cli import main

    model, g = make_moe_target("gpt_oss", seed=1)
    tdir, ddir = tmp_path / "target", tmp_path / "drafter"
    model.save_pretrained(tdir)
    make_tokenizer().save_pretrained(tdir)
    make_drafter(model, g).save_pretrained(ddir)
    quantize_experts_to_mxfp4(tdir, torch.Generator().manual_seed(3))
    ref_model = AutoModelForCausalLM.from_pretrained(
        tdir, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    )
    prompt = [5, 7, 9, 11]
    ids = hf_greedy(ref_model, prompt, 16)
    ids = ids[: ids.index(1) + 1] if 1 in ids else ids  # the CLI stops at <eos> (id 1)
    ref = " ".join(word(t) for t in ids if t > 1)
    argv = ["generate", "--model", str(tdir), "--draft-model", str(ddir), "--device", "cpu"]
    argv += ["-k", "3", "--max-new-tokens", "16", "--prompt", " ".join(word(t) for t in prompt)]
    argv += ["--chat-template", "none", "--no-progress"]
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert "MXFP4 experts" in cap.err and "dequantizing the experts" in cap.err
    header, text = cap.out.strip().split("\n", 1)  # every prompt's text follows a header
    assert header.startswith("=== [0] ") and text == ref
