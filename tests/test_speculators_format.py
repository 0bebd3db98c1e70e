"""Speculators-format drafters: P-EAGLE (``speculators_model_type: "peagle"``) and EAGLE-3 heads
with Llama or Qwen3 (q/k norm) layers, with and without sliding windows.

The fixtures are written here from speculators 0.9's published field names (config: the nested
``transformer_layer_config`` as its transformers diff dict, ``mask_token_id``,
``eagle_aux_hidden_state_layer_ids``, ``speculators_config``; tensors: layer 0 as ``layers.0.*``,
``d2t``/``t2d`` only for a reduced draft vocabulary) -- nothing is downloaded, and no peagle code
writes them. Each is compared with the same weights saved in peagle's EAGLE-3 format (the converted
checkpoint); decode runs greedy on CPU in float32 against no speculation.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import requires_cuda
from safetensors.torch import load_file, save_file
from tiny_models import HIDDEN, VOCAB, make_drafter, make_target

from peagle.decode import SamplingParams, SpecDecoder
from peagle.models import Eagle3Drafter, load_model_pair
from peagle.models.drafter_config import DrafterConfig

MASK_ID = VOCAB - 1
AUX_IDS = [1, 3, 5]
LAYERS = {
    "llama": {},
    "llama-window": {"sliding_window": 4},
    "qwen3": {"model_type": "qwen3"},
    "qwen3-window": {
        "model_type": "qwen3",
        "sliding_window": 3,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}


def speculators_layer_config(cfg: DrafterConfig, layers: str) -> dict:
    """``transformer_layer_config`` as speculators serializes it (``to_diff_dict`` of a Llama or
    Qwen3 config), spelled out field by field."""
    d = {
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
    extra = LAYERS[layers]
    if "sliding_window" in extra:
        d["sliding_window"] = extra["sliding_window"]
        d["layer_types"] = extra.get("layer_types", ["sliding_attention"] * cfg.num_hidden_layers)
        if cfg.model_type == "qwen3":
            d["use_sliding_window"] = True
    return d


def write_speculators_checkpoint(path, drafter: Eagle3Drafter, layers: str, parallel: bool):
    """A speculators 0.9 checkpoint of ``drafter``'s weights (field and tensor names as
    speculators writes them)."""
    cfg = drafter.config
    kind = "peagle" if parallel else "eagle3"
    config = {
        "speculators_model_type": kind,
        "speculators_version": "0.9.0",
        "architectures": ["PEagleSpeculator" if parallel else "Eagle3Speculator"],
        "transformer_layer_config": speculators_layer_config(cfg, layers),
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": AUX_IDS,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": parallel,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": "float32",
    }
    if parallel:
        config["mask_token_id"] = MASK_ID
    tensors = {}
    for k, v in drafter.state_dict().items():
        if k in ("d2t", "t2d"):
            continue  # full draft vocabulary: speculators registers neither
        name = "layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k
        tensors[name] = v.detach().clone().contiguous()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "model.safetensors"))
    return config


def tiny_drafter(layers: str, parallel: bool, seed: int = 0, head_dim: int | None = None):
    target, g = make_target() if head_dim is None else make_target(head_dim=head_dim)
    d = make_drafter(
        target,
        g,
        parallel=parallel,
        mask_token_id=MASK_ID if parallel else None,
        aux_layer_ids=AUX_IDS,
        seed=seed,
        **LAYERS[layers],
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # q/k norm weights away from 1: a dropped norm changes the logits
        for layer in d.decoder_layers():
            if layer.self_attn.q_norm is not None:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5, generator=gen)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5, generator=gen)
    return target, d


def causal_logits(d: Eagle3Drafter, gen: torch.Generator, n: int = 13) -> torch.Tensor:
    """Draft logits of one ``n``-row sequence under causal attention with each layer's window
    (the training mask's depth-0 layout, SDPA: any dtype, float64 included)."""
    from peagle.train.attention import MaskedAttention
    from peagle.train.mask import ElementMeta

    el = ElementMeta(
        torch.arange(n), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    )
    attention = MaskedAttention("dense")
    prepared = attention.prepare_layers(el, el, d.config.layer_windows())
    scale = d.config.head_dim**-0.5

    def attend(i, q, k, v):
        return attention(prepared[i], q, k, v, scale)

    ids = torch.randint(0, VOCAB, (n,), generator=gen)
    hidden = torch.randn(n, HIDDEN, generator=gen, dtype=d.dtype)
    with torch.no_grad():
        normed, _ = d(ids, hidden, positions=torch.arange(n), attend=attend)
        return d.compute_logits(normed)


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
@pytest.mark.parametrize("layers", list(LAYERS))
def test_speculators_checkpoint_equals_converted_checkpoint(tmp_path, layers, parallel):
    """Config fields, tensors and float64 logits of a speculators checkpoint are those of the same
    weights in peagle's EAGLE-3 format."""
    _, d = tiny_drafter(layers, parallel)
    write_speculators_checkpoint(tmp_path / "spec", d, layers, parallel)
    d.save_pretrained(tmp_path / "converted")
    spec = Eagle3Drafter.from_pretrained(tmp_path / "spec", dtype=torch.float64)
    conv = Eagle3Drafter.from_pretrained(tmp_path / "converted", dtype=torch.float64)
    sc, cc = spec.config, conv.config
    assert sc.source_format == "speculators" and cc.source_format == "eagle3"
    assert sc.model_type == cc.model_type == LAYERS[layers].get("model_type", "llama")
    assert sc.layer_windows() == cc.layer_windows() == d.config.layer_windows()
    assert sc.aux_layer_ids == cc.aux_layer_ids == AUX_IDS
    assert sc.mask_token_id == (MASK_ID if parallel else None) == cc.mask_token_id
    assert spec.supports_parallel_drafting == parallel == conv.supports_parallel_drafting
    for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "vocab_size", "draft_vocab_size", "rope_theta",
              "rms_norm_eps", "target_hidden_size", "norm_before_residual"):  # fmt: skip
        assert getattr(sc, f) == getattr(cc, f), f
    a, b = spec.state_dict(), conv.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    la = causal_logits(spec, torch.Generator().manual_seed(1))
    lb = causal_logits(conv, torch.Generator().manual_seed(1))
    assert la.dtype == torch.float64 and torch.equal(la, lb)


def test_speculators_qwen3_default_and_unsupported_fields(tmp_path):
    """No ``model_type`` in ``transformer_layer_config`` means Qwen3 (speculators' default class);
    options peagle's forward does not implement, or unknown layer types, are refused."""
    _, d = tiny_drafter("qwen3", parallel=True)
    cfg = write_speculators_checkpoint(tmp_path / "spec", d, "qwen3", parallel=True)
    del cfg["transformer_layer_config"]["model_type"]
    (tmp_path / "spec" / "config.json").write_text(json.dumps(cfg))
    assert Eagle3Drafter.from_pretrained(tmp_path / "spec").config.qk_norm
    for field, value, match in [
        ("norm_before_fc", True, "norm_before_fc"),
        ("fc_norm", True, "fc_norm"),
        ("norm_output", True, "norm_output"),
        ("speculators_model_type", "dflash", "dflash"),
    ]:
        bad = {**cfg, field: value}
        with pytest.raises(ValueError, match=match):
            DrafterConfig.from_dict(bad)
    bad = json.loads(json.dumps(cfg))
    bad["transformer_layer_config"].update(
        sliding_window=4, use_sliding_window=True, layer_types=["sliding_attention"]
    )
    with pytest.raises(ValueError, match="layer_types"):
        DrafterConfig.from_dict(bad)
    bad["transformer_layer_config"]["model_type"] = "mistral"
    with pytest.raises(ValueError, match="mistral"):
        DrafterConfig.from_dict(bad)


CASES = [("peagle", "llama"), ("peagle", "qwen3-window"), ("eagle3", "llama-window"),
         ("eagle3", "qwen3")]  # fmt: skip


@pytest.mark.parametrize("method,layers", CASES)
def test_speculators_head_decodes_greedy_equal_to_no_speculation(tmp_path, method, layers):
    """A speculators-format head loaded next to its target (``load_model_pair``, as ``peagle
    generate`` does) decodes exactly what the target decodes alone (CPU, float32)."""
    target, d = tiny_drafter(layers, parallel=method == "peagle")
    target.save_pretrained(tmp_path / "target")
    write_speculators_checkpoint(tmp_path / "spec", d, layers, parallel=method == "peagle")
    runner, drafter = load_model_pair(str(tmp_path / "target"), str(tmp_path / "spec"))
    assert runner.aux_layer_ids == AUX_IDS and drafter.config.source_format == "speculators"
    prompts = [[5], [11, 3, 60], [42, 17, 8, 90, 33, 2, 71]]
    sp = SamplingParams(max_new_tokens=16)
    plain = SpecDecoder(runner, None, method="none", cuda_graphs="off").generate(prompts, sp)
    spec_eng = SpecDecoder(runner, drafter, method=method, num_speculative_tokens=3,
                           cuda_graphs="off", block_size=4)  # fmt: skip
    outs = spec_eng.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.stats.num_accepted_tokens for o in outs) > 0  # the head drafts usefully


@requires_cuda
@pytest.mark.parametrize("method,layers", CASES)
def test_speculators_head_decodes_on_cuda_bf16_under_the_near_tie_rule(tmp_path, method, layers):
    """The same speculators-format heads loaded on CUDA in bf16 (head_dim 64, which the CUDA
    attention serves), CUDA graphs on: greedy output equals no speculation up to bf16 near-ties
    (the rule of tests/test_decode_cuda.py: every divergence sits where the transformers bf16
    model's two logits are within TIE of each other)."""
    from test_decode_cuda import hf_greedy, match_rate

    target, d = tiny_drafter(layers, parallel=method == "peagle", head_dim=64)
    target.save_pretrained(tmp_path / "target")
    write_speculators_checkpoint(tmp_path / "spec", d, layers, parallel=method == "peagle")
    runner, drafter = load_model_pair(str(tmp_path / "target"), str(tmp_path / "spec"),
                                      device="cuda", dtype=torch.bfloat16)  # fmt: skip
    assert drafter.config.source_format == "speculators"
    prompts = [[5], [11, 3, 60], [42, 17, 8, 90, 33, 2, 71]]
    sp = SamplingParams(max_new_tokens=24)
    plain = SpecDecoder(runner, None, method="none").generate(prompts, sp)
    eng = SpecDecoder(runner, drafter, method=method, num_speculative_tokens=3, max_num_seqs=4)
    outs = eng.generate(prompts, sp)
    assert eng.graphs is not None and eng.graphs.graphs  # decode steps ran in CUDA graphs
    low = runner.model
    rate = match_rate(low, prompts, [o.token_ids for o in outs], [o.token_ids for o in plain])
    assert rate >= 0.9, rate
    assert sum(o.stats.num_accepted_tokens for o in outs) > 0
    refs = hf_greedy(low, prompts, 24)
    assert match_rate(low, prompts, [o.token_ids for o in plain], refs) >= 0.9


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
@pytest.mark.parametrize("layers", ["llama", "qwen3-window"])
def test_save_speculators_format_round_trip(tmp_path, layers, parallel):
    """``save_pretrained(format="speculators")`` writes speculators' field and tensor names, and
    loads back to the same weights and logits."""
    _, d = tiny_drafter(layers, parallel)
    d.save_pretrained(tmp_path / "out", format="speculators", speculative_tokens=4)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    kind = "peagle" if parallel else "eagle3"
    assert cfg["speculators_model_type"] == kind
    assert cfg["architectures"] == ["PEagleSpeculator" if parallel else "Eagle3Speculator"]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert ("mask_token_id" in cfg) == parallel and "ptd_token_id" not in cfg
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == LAYERS[layers].get("model_type", "llama")
    names = set(load_file(str(tmp_path / "out" / "model.safetensors")))
    assert "layers.0.hidden_norm.weight" in names and not any(
        n.startswith("midlayer") for n in names
    )
    assert "d2t" not in names and "t2d" not in names  # full draft vocabulary
    back = Eagle3Drafter.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert back.config.layer_windows() == d.config.layer_windows()
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    gen = torch.Generator().manual_seed(2)
    la = causal_logits(back, gen)
    assert torch.equal(la, causal_logits(d, torch.Generator().manual_seed(2)))


def test_save_speculators_reduced_draft_vocab_writes_d2t_and_t2d(tmp_path):
    _, d = tiny_drafter("llama", parallel=True)
    cfg = DrafterConfig.from_dict({**d.config.to_dict(), "draft_vocab_size": 40})
    small = Eagle3Drafter(cfg)
    with torch.no_grad():
        small.d2t.copy_(torch.arange(40) * 2 - torch.arange(40))  # draft i -> target 2i
    small.save_pretrained(tmp_path / "out", format="speculators")
    t = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(t["t2d"].nonzero().flatten(), torch.arange(40) * 2)
    back = Eagle3Drafter.from_pretrained(tmp_path / "out")
    assert torch.equal(back.d2t, small.d2t)


def _speculators():
    """speculators 0.9 if installed (required where PEAGLE_REQUIRE_SPECULATORS=1, as in CI)."""
    if os.environ.get("PEAGLE_REQUIRE_SPECULATORS") == "1":
        import speculators

        return speculators
    return pytest.importorskip("speculators")


@pytest.mark.parametrize("layers", ["llama", "qwen3-window"])
def test_exported_checkpoint_loads_in_speculators(tmp_path, layers):
    """speculators' own config class and model read what ``format="speculators"`` writes, to the
    same tensors."""
    _speculators()
    from speculators.models.peagle import PEagleSpeculatorConfig

    target, d = tiny_drafter(layers, parallel=True)
    target.save_pretrained(tmp_path / "target")  # speculators loads the verifier's weights too
    d.save_pretrained(
        tmp_path / "out",
        format="speculators",
        verifier_name_or_path=str(tmp_path / "target"),
        verifier_architectures=["LlamaForCausalLM"],
    )
    cfg = PEagleSpeculatorConfig.from_pretrained(str(tmp_path / "out"))
    assert cfg.mask_token_id == MASK_ID
    assert cfg.transformer_layer_config.model_type == LAYERS[layers].get("model_type", "llama")
    assert cfg.transformer_layer_config.num_hidden_layers == d.num_layers
    assert getattr(cfg.transformer_layer_config, "sliding_window", None) == (
        d.config.sliding_window
    )
    from speculators.models.peagle import PEagleDraftModel

    model = PEagleDraftModel.from_pretrained(str(tmp_path / "out"))
    theirs = model.state_dict()
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    for k, v in ours.items():
        assert torch.equal(theirs[k].to(v.dtype), v), k
    assert sorted(set(theirs) - set(ours)) == ["verifier_lm_head.weight", "verifier_norm.weight"]


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
@pytest.mark.parametrize("layers", ["llama", "qwen3-window"])
def test_exported_checkpoint_reads_in_vllm_speculators_path(tmp_path, layers, parallel):
    """vLLM's speculators config path (``SpeculatorsConfig``: the drafter's transformers config and
    the speculative config it derives; config only, vLLM's weight loading is not run here) reads
    what ``format="speculators"`` writes: the P-EAGLE / EAGLE-3 architecture for the layer type,
    the mask token as ``pard_token``, the aux layers, the proposal length, and
    ``norm_before_residual`` as written (vLLM defaults a missing one to True for EAGLE-3)."""
    from vllm_env import load_vllm

    load_vllm()  # skips without vLLM; fails with PEAGLE_REQUIRE_VLLM=1
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    _, d = tiny_drafter(layers, parallel)
    d.save_pretrained(tmp_path / "out", format="speculators", speculative_tokens=4)
    cfg = SpeculatorsConfig.from_pretrained(str(tmp_path / "out"))
    qwen3 = LAYERS[layers].get("model_type") == "qwen3"
    arch = {
        (True, False): "PeagleLlamaForCausalLM", (True, True): "PeagleQwen3ForCausalLM",
        (False, False): "Eagle3LlamaForCausalLM", (False, True): "Eagle3Qwen3ForCausalLM",
    }[(parallel, qwen3)]  # fmt: skip
    assert cfg.architectures == [arch]
    assert getattr(cfg, "pard_token", None) == (MASK_ID if parallel else None)
    assert cfg.eagle_aux_hidden_state_layer_ids == AUX_IDS
    assert cfg.norm_before_residual is False and cfg.num_hidden_layers == d.num_layers
    assert cfg.hidden_size == HIDDEN and cfg.draft_vocab_size == VOCAB
    assert getattr(cfg, "sliding_window", None) == d.config.sliding_window
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    spec = SpeculatorsConfig.extract_vllm_speculative_config(raw)
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 4
    assert spec.get("parallel_drafting", False) == parallel  # P-EAGLE: vLLM's parallel drafting
