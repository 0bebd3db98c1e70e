"""Tiny randomly initialised target/drafter pairs for the decode-loop tests (no downloads).

The target is a small Llama / Qwen3 whose ``lm_head`` is built from its own (normalised) token
embeddings through a permutation ``g``: the model then mostly predicts ``g(current token)``, with
clear logit margins, while attention and MLPs (scaled, not removed) still make the prediction
depend on the context. The drafter copies the embedding and predicts ``g(g(t))`` from the target
features, so its NTP drafts are usually right and deeper drafts sometimes: every acceptance pattern
(none, partial, full) occurs.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from peagle.models import DrafterConfig, Eagle3Drafter

VOCAB = 97  # odd on purpose
HIDDEN = 64
LAYERS = 7  # default aux layers [2, 3, 4]


def _perm(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(n, generator=gen)


def _unit_rows(w: torch.Tensor) -> torch.Tensor:
    return w / w.pow(2).mean(-1, keepdim=True).sqrt()


def make_target(
    kind: str = "llama",
    seed: int = 0,
    sharpen: float = 0.5,
    layer_scale: float = 0.3,
    max_position_embeddings: int = 256,
    eos_token_id: int | None = None,
    constant_token: int | None = None,
    head_dim: int = 16,
):
    """A tiny causal LM (float32) with mostly-bigram, clear-margin greedy behaviour.

    With ``constant_token`` every embedding shares a large common direction ``u`` and
    ``lm_head[constant_token] = u``: the model then always predicts that token (and a drafter
    built with the same ``constant_token`` always drafts it: full acceptance).
    """
    common = dict(
        vocab_size=VOCAB,
        hidden_size=4 * head_dim,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, use_sliding_window=False))
    else:
        raise ValueError(kind)
    gen = torch.Generator().manual_seed(seed + 1)
    g = _perm(VOCAB, gen)
    with torch.no_grad():
        e = model.model.embed_tokens.weight
        e.normal_(0.0, 1.0, generator=gen)
        # logits[v] = sharpen * <unit(E[g^-1(v)]), x / rms(x)>: argmax v = g(t) for x ~ E[t].
        w = torch.empty_like(model.lm_head.weight)
        w[g] = _unit_rows(e)
        if constant_token is not None:
            u = common_direction(seed, e.shape[1])
            e.add_(8.0 * u)
            w[constant_token] = 2.0 * u
        model.lm_head.weight.copy_(w * sharpen)
        f = (HIDDEN / e.shape[1]) ** 0.5  # same activation scales at any width
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                lin.weight.normal_(0.0, 0.2 * f, generator=gen)
            layer.self_attn.o_proj.weight.normal_(0.0, 0.2 * f * layer_scale, generator=gen)
            layer.mlp.gate_proj.weight.normal_(0.0, 0.2 * f, generator=gen)
            layer.mlp.up_proj.weight.normal_(0.0, 0.2 * f, generator=gen)
            layer.mlp.down_proj.weight.normal_(0.0, 0.1 * layer_scale, generator=gen)
    return model.eval(), g


def drafter_config_dict(
    *,
    mask_token_id: int | None = VOCAB - 1,
    num_layers: int = 2,
    aux_layer_ids=None,
    max_position_embeddings: int = 256,
    head_dim: int = 16,
    model_type: str = "llama",
    sliding_window: int | None = None,
    layer_types: list[str] | None = None,
) -> dict:
    """A ``config.json`` dictionary in the released P-EAGLE layout (SPEC §2.3); ``model_type``
    ``"qwen3"`` gives Qwen3 layers (q/k norms), ``sliding_window`` / ``layer_types`` windows."""
    d = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": model_type,
        "hidden_size": 4 * head_dim,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "intermediate_size": 96,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "norm_before_residual": False,
        "target_hidden_size": 4 * head_dim,
        "vocab_size": VOCAB,
        "draft_vocab_size": VOCAB,
        "eagle_config": {"use_aux_hidden_state": True},
        "torch_dtype": "float32",
    }
    if aux_layer_ids is not None:
        d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    if mask_token_id is not None:
        d["ptd_token_id"] = mask_token_id
    if sliding_window is not None:
        d["sliding_window"] = sliding_window
    if layer_types is not None:
        d["layer_types"] = list(layer_types)
    return d


def common_direction(seed: int, hidden: int = HIDDEN) -> torch.Tensor:
    return _unit_rows(torch.randn(hidden, generator=torch.Generator().manual_seed(seed + 3)))


def make_drafter(
    target: torch.nn.Module,
    g: torch.Tensor,
    seed: int = 0,
    parallel: bool = True,
    sharpen: float = 0.5,
    constant_token: int | None = None,
    **cfg_kw,
) -> Eagle3Drafter:
    """A drafter that mostly predicts ``g(g(t_p))`` from the target features of position p
    (always ``constant_token`` if given)."""
    cfg_kw.setdefault("head_dim", target.config.head_dim)
    cfg = DrafterConfig.from_dict(drafter_config_dict(**cfg_kw))
    gen = torch.Generator().manual_seed(seed + 7)
    d = Eagle3Drafter(cfg, with_mask_hidden=parallel)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                continue
            p.normal_(0.0, 0.2 if "proj" in name else 1.0, generator=gen)
        for layer in d.decoder_layers():
            layer.self_attn.o_proj.weight.mul_(0.25)
            layer.mlp.down_proj.weight.mul_(0.25)
        d.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        h = cfg.hidden_size
        eye = torch.eye(h)
        d.fc.weight.copy_(torch.cat([eye, eye, eye], dim=1) / 3)
        gg = g[g]
        w = torch.empty_like(d.lm_head.weight)
        w[gg] = _unit_rows(target.model.embed_tokens.weight)
        if constant_token is not None:
            u = common_direction(seed, h)
            w[constant_token] = 8.0 * u
            if d.mask_hidden is not None:
                d.mask_hidden.copy_(torch.cat([u, u, u]).view(1, 1, -1) * 8.0)
        d.lm_head.weight.copy_(w * sharpen)
    return d.eval()


def word(i: int) -> str:
    return {0: "<unk>", 1: "<eos>"}.get(i, f"w{i}")


def make_tokenizer(chat_template: str | None = None):
    """A word-level tokenizer over ``VOCAB`` words (``<unk>``, ``<eos>``, ``w2`` ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({word(i): i for i in range(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def save_pair(tmp_path, kind="llama", parallel=True, chat_template=None, **target_kw):
    """Save a target (+ tokenizer) and a drafter under ``tmp_path``; returns their paths and the
    in-memory target model."""
    model, g = make_target(kind, **target_kw)
    tdir, ddir = tmp_path / "target", tmp_path / "drafter"
    model.save_pretrained(tdir)
    make_tokenizer(chat_template).save_pretrained(tdir)
    make_drafter(model, g, parallel=parallel).save_pretrained(ddir)
    return tdir, ddir, model
