"""Drafter checkpoint format and forward, target runner vs the transformers model (CPU, float32).

* The released P-EAGLE checkpoint layout (SPEC.md §2.3-2.4), written here tensor by tensor with
  safetensors, loads unchanged; save -> load round-trips every tensor and config field.
* The drafter's paged forward (ragged batch, chunked like prefill + decode steps) equals an
  independent float64 dense reference of SPEC §2.2.
* The target runner's logits and auxiliary hidden states equal the transformers model's own
  forward (Llama and Qwen3), also after steps whose tail rows were rejected and overwritten.
"""

from __future__ import annotations

import json

import pytest
import torch
from reference.drafter import drafter_forward_ref
from safetensors.torch import load_file, save_file
from tiny_models import HIDDEN, VOCAB, drafter_config_dict, make_drafter, make_target

from peagle.models import (
    AttentionMetadata,
    DrafterConfig,
    Eagle3Drafter,
    TargetRunner,
    load_model_pair,
)

BLOCK = 4
TOL = dict(rtol=1e-4, atol=1e-4)  # float32 paged computation vs float64 / HF float32


# ---------------------------------------------------------------------------------------------
# Paged runs of one model over ragged requests in chunks
# ---------------------------------------------------------------------------------------------


class PagedRun:
    """Drive a model's paged forward: each request gets shuffled, non-contiguous blocks."""

    def __init__(self, kv, lengths, gen):
        self.kv = kv
        self.n_blocks = [-(-n // BLOCK) for n in lengths]
        ids = torch.randperm(kv.num_blocks - 1, generator=gen)[: sum(self.n_blocks)] + 1
        width = max(self.n_blocks) + 2
        self.table = torch.zeros(len(lengths), width, dtype=torch.int32)  # null-block padded
        o = 0
        for r, nb in enumerate(self.n_blocks):
            self.table[r, :nb] = ids[o : o + nb].int()
            o += nb

    def meta(self, starts, counts, writes=None):
        """Rows ``starts[r] .. starts[r]+counts[r]-1`` of each request (positions = indices)."""
        pos, slots, qsl = [], [], [0]
        for r, (s, c) in enumerate(zip(starts, counts, strict=True)):
            for p in range(s, s + c):
                pos.append(p)
                ok = writes is None or writes[r][p - s]
                slots.append(int(self.table[r, p // BLOCK]) * BLOCK + p % BLOCK if ok else -1)
            qsl.append(qsl[-1] + c)
        seq = [s + c for s, c in zip(starts, counts, strict=True)]
        return AttentionMetadata(
            positions=torch.tensor(pos, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq, dtype=torch.int32),
            block_table=self.table,
            max_query_len=max(counts),
        )


def rows_of(starts, counts):
    """Per request, the flat batch rows of this chunk."""
    out, o = [], 0
    for c in counts:
        out.append(list(range(o, o + c)))
        o += c
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoint format
# ---------------------------------------------------------------------------------------------

SPEC_H, SPEC_V, SPEC_I, SPEC_HQ, SPEC_HKV, SPEC_D = 32, 50, 48, 4, 2, 8


def spec_config() -> dict:
    """A config.json with the fields of SPEC §2.3, as in the GPT-OSS-20B P-EAGLE drafter."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": SPEC_H,
        "num_hidden_layers": 4,
        "num_attention_heads": SPEC_HQ,
        "num_key_value_heads": SPEC_HKV,
        "head_dim": SPEC_D,
        "intermediate_size": SPEC_I,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 4096,
        },
        "attention_bias": True,
        "mlp_bias": False,
        "norm_before_residual": False,
        "target_hidden_size": SPEC_H,
        "vocab_size": SPEC_V,
        "draft_vocab_size": SPEC_V,
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [1, 11, 20],
        },
        "ptd_token_id": SPEC_V - 3,
        "torch_dtype": "bfloat16",
    }


def spec_tensors(gen: torch.Generator, o_proj_bias: bool = True) -> dict[str, torch.Tensor]:
    """Tensors named and shaped exactly as SPEC §2.4 (q/k/v biases: attention_bias=True)."""
    h, v, i, hq, hkv, d = SPEC_H, SPEC_V, SPEC_I, SPEC_HQ, SPEC_HKV, SPEC_D
    r = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    t = {
        "embed_tokens.weight": r(v, h),
        "fc.weight": r(h, 3 * h),
        "mask_hidden": r(1, 1, 3 * h),
        "norm.weight": r(h),
        "lm_head.weight": r(v, h),
        "d2t": torch.zeros(v, dtype=torch.int64),
        "t2d": torch.ones(v, dtype=torch.bool),
    }
    for name, inp in [("midlayer", 2 * h)] + [(f"layers.{k}", h) for k in (1, 2, 3)]:
        t[f"{name}.input_layernorm.weight"] = r(h)
        t[f"{name}.post_attention_layernorm.weight"] = r(h)
        if name == "midlayer":
            t[f"{name}.hidden_norm.weight"] = r(h)
        for proj, out in (("q_proj", hq * d), ("k_proj", hkv * d), ("v_proj", hkv * d)):
            t[f"{name}.self_attn.{proj}.weight"] = r(out, inp)
            t[f"{name}.self_attn.{proj}.bias"] = r(out)
        t[f"{name}.self_attn.o_proj.weight"] = r(h, hq * d)
        if o_proj_bias:
            t[f"{name}.self_attn.o_proj.bias"] = r(h)
        t[f"{name}.mlp.gate_proj.weight"] = r(i, h)
        t[f"{name}.mlp.up_proj.weight"] = r(i, h)
        t[f"{name}.mlp.down_proj.weight"] = r(h, i)
    return t


def write_checkpoint(path, config: dict, tensors: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))


def test_spec_fixture_loads_unchanged(tmp_path, gen):
    cfg, tensors = spec_config(), spec_tensors(gen)
    write_checkpoint(tmp_path / "ckpt", cfg, tensors)
    d = Eagle3Drafter.from_pretrained(tmp_path / "ckpt")
    assert d.dtype == torch.bfloat16
    assert d.config.mask_token_id == SPEC_V - 3
    assert d.config.aux_layer_ids == [1, 11, 20]
    assert d.config.num_hidden_layers == 4 and d.supports_parallel_drafting
    sd = d.state_dict()
    assert set(sd) == set(tensors)
    for k, v in tensors.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    d.check_parallel_drafting()
    assert d.mask_vector().shape == (SPEC_H,)

    # Round trip: same tensor names and values, same config fields, the EAGLE-3 architecture.
    d.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(saved) == set(tensors)
    assert all(torch.equal(saved[k], v) for k, v in tensors.items())
    saved_cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved_cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    for k, v in cfg.items():
        if k not in ("architectures",):
            assert saved_cfg[k] == v, k


def test_spec_fixture_runs_with_llama3_rope(tmp_path, gen):
    write_checkpoint(tmp_path / "ckpt", spec_config(), spec_tensors(gen))
    d = Eagle3Drafter.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    kv = d.make_kv_cache(num_blocks=16, block_size=BLOCK)
    run = PagedRun(kv, [9], gen)
    ids = torch.randint(0, SPEC_V, (9,), generator=gen)
    hidden = torch.randn(9, SPEC_H, generator=gen)
    normed, prenorm = d(ids, hidden, run.meta([0], [9]), kv)
    assert normed.shape == prenorm.shape == (9, SPEC_H) and torch.isfinite(normed).all()
    assert d.greedy_draft(normed).dtype == torch.int32


def test_missing_o_proj_bias_is_zero_and_mask_token_priority(tmp_path, gen):
    cfg = spec_config()
    cfg["pard_token"] = 5  # vLLM v0.16 reads pard_token before ptd_token_id
    write_checkpoint(tmp_path / "ckpt", cfg, spec_tensors(gen, o_proj_bias=False))
    d = Eagle3Drafter.from_pretrained(tmp_path / "ckpt")
    assert d.config.mask_token_id == 5
    assert torch.count_nonzero(d.midlayer.self_attn.o_proj.bias) == 0
    d.save_pretrained(tmp_path / "saved")
    saved_cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved_cfg["pard_token"] == 5 and saved_cfg["ptd_token_id"] == SPEC_V - 3


def test_round_trip_random_drafter(tmp_path):
    target, g = make_target()
    d = make_drafter(target, g)
    d.save_pretrained(tmp_path / "d")
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "d")
    a, b = d.state_dict(), loaded.state_dict()
    assert set(a) == set(b) and "mask_hidden" in a and "d2t" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert loaded.config.to_dict() == d.config.to_dict()


def test_checkpoint_errors(tmp_path, gen):
    cfg, tensors = spec_config(), spec_tensors(gen)
    with pytest.raises(FileNotFoundError, match="config.json"):
        Eagle3Drafter.from_pretrained(tmp_path / "nothing")
    bad = dict(tensors)
    del bad["layers.3.mlp.up_proj.weight"]
    write_checkpoint(tmp_path / "missing", cfg, bad)
    with pytest.raises(ValueError, match=r"missing \['layers.3.mlp.up_proj.weight'\]"):
        Eagle3Drafter.from_pretrained(tmp_path / "missing")
    bad = dict(tensors, **{"fc.weight": torch.zeros(SPEC_H, 2 * SPEC_H)})
    write_checkpoint(tmp_path / "shape", cfg, bad)
    with pytest.raises(ValueError, match="fc.weight has shape"):
        Eagle3Drafter.from_pretrained(tmp_path / "shape")
    write_checkpoint(tmp_path / "arch", dict(cfg, architectures=["PEagleSpeculator"]), tensors)
    with pytest.raises(ValueError, match="architectures"):
        Eagle3Drafter.from_pretrained(tmp_path / "arch")
    write_checkpoint(tmp_path / "mask", dict(cfg, ptd_token_id=SPEC_V), tensors)
    d = Eagle3Drafter.from_pretrained(tmp_path / "mask")
    with pytest.raises(ValueError, match="mask token id 50 is outside the vocabulary"):
        d.check_parallel_drafting()


def test_compatibility_errors():
    target, g = make_target()
    d = make_drafter(target, g, parallel=False)
    with pytest.raises(ValueError, match="mask_hidden"):
        d.check_parallel_drafting()
    with pytest.raises(ValueError, match="hidden-size mismatch"):
        d.check_target(HIDDEN + 8, VOCAB)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        d.check_target(HIDDEN, VOCAB + 1)
    d.d2t[3] = VOCAB  # maps draft id 3 to VOCAB + 3
    with pytest.raises(ValueError, match="d2t maps"):
        d.check_target(HIDDEN, VOCAB)
    no_mask = make_drafter(target, g, mask_token_id=None)
    with pytest.raises(ValueError, match="ptd_token_id"):
        no_mask.check_parallel_drafting()
    cfg = DrafterConfig.from_dict(drafter_config_dict())
    cfg.hidden_size = HIDDEN * 2  # parallel drafting needs H == H_t (vLLM's mask buffer)
    with pytest.raises(ValueError, match="hidden_size == target_hidden_size"):
        Eagle3Drafter(cfg).check_parallel_drafting()


def test_autoregressive_eagle3_head_shares_target_embedding(tmp_path):
    """An EAGLE-3 head without mask_hidden and without embed_tokens loads next to its target."""
    target, g = make_target()
    d = make_drafter(target, g, parallel=False, mask_token_id=None)
    tensors = {k: v for k, v in d.state_dict().items() if k != "embed_tokens.weight"}
    write_checkpoint(tmp_path / "head", d.config.to_dict(), tensors)
    target.save_pretrained(tmp_path / "target")
    runner, head = load_model_pair(str(tmp_path / "target"), str(tmp_path / "head"))
    assert not head.supports_parallel_drafting and head.mask_hidden is None
    assert torch.equal(head.embed_tokens.weight, runner.embed_tokens.weight)
    with pytest.raises(ValueError, match="mask_hidden"):
        head.check_parallel_drafting()


# ---------------------------------------------------------------------------------------------
# Drafter forward vs the float64 reference
# ---------------------------------------------------------------------------------------------


LAYER_VARIANTS = {
    "llama": {},
    "llama-window": {"sliding_window": 4},
    "qwen3": {"model_type": "qwen3"},
    "qwen3-window": {
        "model_type": "qwen3",
        "sliding_window": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
}


def randomize_qk_norms(d, gen) -> None:
    """Qwen3 q/k norm weights away from 1, so a dropped or misplaced norm changes the output."""
    with torch.no_grad():
        for layer in d.decoder_layers():
            if layer.self_attn.q_norm is not None:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5, generator=gen)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5, generator=gen)


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("layers", list(LAYER_VARIANTS))
def test_drafter_forward_matches_reference(gen, norm_before_residual, layers):
    """Paged forward (ragged chunks) == the float64 reference, for Llama and Qwen3 (q/k norm)
    layers, with and without sliding windows (windows shorter than the sequences)."""
    target, g = make_target()
    d = make_drafter(target, g, num_layers=3, **LAYER_VARIANTS[layers])
    randomize_qk_norms(d, gen)
    d.config.norm_before_residual = norm_before_residual
    for layer in d.decoder_layers():
        layer.norm_before_residual = norm_before_residual
    cfg = d.config.to_dict()
    lengths = [11, 6]
    kv = d.make_kv_cache(num_blocks=32, block_size=BLOCK)
    run = PagedRun(kv, lengths, gen)
    ids = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    hid = [torch.randn(n, HIDDEN, generator=gen) for n in lengths]
    chunks = [[5, 2], [1, 3], [4, 1], [1, 0]]  # ragged: prefill-like then decode-like
    got_n = [[] for _ in lengths]
    got_p = [[] for _ in lengths]
    starts = [0, 0]
    with torch.no_grad():
        for counts in chunks:
            meta = run.meta(starts, counts)
            sl = [slice(s, s + c) for s, c in zip(starts, counts, strict=True)]
            normed, prenorm = d(
                torch.cat([x[s] for x, s in zip(ids, sl, strict=True)]),
                torch.cat([x[s] for x, s in zip(hid, sl, strict=True)]),
                meta,
                kv,
            )
            for r, rows in enumerate(rows_of(starts, counts)):
                got_n[r].append(normed[rows])
                got_p[r].append(prenorm[rows])
            starts = [s + c for s, c in zip(starts, counts, strict=True)]
    for r, n in enumerate(lengths):
        ref_n, ref_p, _ = drafter_forward_ref(d.state_dict(), cfg, ids[r], hid[r], torch.arange(n))
        torch.testing.assert_close(torch.cat(got_p[r]).double(), ref_p, **TOL)
        torch.testing.assert_close(torch.cat(got_n[r]).double(), ref_n, **TOL)


# ---------------------------------------------------------------------------------------------
# Target runner vs transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_target_runner_matches_transformers(kind, gen):
    """Ragged batch, chunked: real rows then junk rows (rejected drafts) whose KV the next chunk
    overwrites; every real row's logits and aux features equal the HF forward of the sequence."""
    model, _ = make_target(kind)
    runner = TargetRunner(model)
    assert runner.aux_layer_ids == [2, 3, 4]
    lengths = [14, 9]
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    with torch.no_grad():
        ref = [model(s[None], output_hidden_states=True) for s in seqs]
    ref_logits = [o.logits[0] for o in ref]
    ref_aux = [torch.cat([o.hidden_states[i][0] for i in (2, 3, 4)], -1) for o in ref]
    kv = runner.make_kv_cache(num_blocks=24, block_size=BLOCK)
    run = PagedRun(kv, [n + 4 for n in lengths], gen)
    # (real rows, junk rows) per request and step; junk stands for rejected drafts.
    plan = [[(6, 0), (4, 0)], [(1, 3), (2, 2)], [(3, 1), (1, 3)], [(4, 0), (2, 0)]]
    starts = [0, 0]
    for step in plan:
        counts = [a + b for a, b in step]
        ids, real_rows = [], []
        o = 0
        for r, (a, b) in enumerate(step):
            s = starts[r]
            junk = torch.randint(0, VOCAB, (b,), generator=gen)
            ids.append(torch.cat([seqs[r][s : s + a], junk]))
            real_rows.append(list(range(o, o + a)))
            o += a + b
        logits, aux = runner.forward(torch.cat(ids), run.meta(starts, counts), kv)
        for r, (a, _) in enumerate(step):
            s = starts[r]
            torch.testing.assert_close(logits[real_rows[r]], ref_logits[r][s : s + a], **TOL)
            torch.testing.assert_close(aux[real_rows[r]], ref_aux[r][s : s + a], **TOL)
        starts = [s + a for s, (a, _) in zip(starts, step, strict=True)]
    assert starts == lengths


def test_target_runner_logits_indices_and_errors():
    model, _ = make_target()
    runner = TargetRunner(model)
    kv = runner.make_kv_cache(num_blocks=8, block_size=BLOCK)
    run = PagedRun(kv, [5], torch.Generator().manual_seed(1))
    ids = torch.arange(5)
    full, _ = runner.forward(ids, run.meta([0], [5]), kv)
    part, _ = runner.forward(ids, run.meta([0], [5]), kv, torch.tensor([4, 1]))
    torch.testing.assert_close(part, full[[4, 1]])
    with pytest.raises(ValueError, match="strictly increasing"):
        runner.set_aux_layer_ids([3, 2, 4])
    with pytest.raises(ValueError, match="exactly 3"):
        runner.set_aux_layer_ids([1, 2])
    with pytest.raises(ValueError, match=r"\[0, 7\)"):
        runner.set_aux_layer_ids([2, 3, 7])
    # A target too shallow for the default [2, L//2, L-3] runs without features until they are
    # set, and a drafter without named layers is refused with the reason.
    shallow, g4 = make_target()
    shallow.model.layers = shallow.model.layers[:4]
    shallow.config.num_hidden_layers = 4
    r4 = TargetRunner(shallow)
    assert r4.aux_layer_ids == []
    kv4 = r4.make_kv_cache(num_blocks=8, block_size=BLOCK)
    run4 = PagedRun(kv4, [5], torch.Generator().manual_seed(1))
    logits4, aux4 = r4.forward(ids, run4.meta([0], [5]), kv4)
    assert logits4.shape[0] == 5 and aux4.shape == (5, 0)
    from peagle.decode import SpecDecoder

    with pytest.raises(ValueError, match="too few for the EAGLE-3 default"):
        SpecDecoder(r4, make_drafter(shallow, g4), method="eagle3", num_speculative_tokens=2,
                    cuda_graphs="off")  # fmt: skip
    r4.set_aux_layer_ids([0, 1, 3])
    assert r4.forward(ids, run4.meta([0], [5]), kv4)[1].shape == (5, 3 * r4.hidden_size)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=11))
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        TargetRunner(gpt2)
