"""MoE targets (GPT-OSS, Qwen3-MoE) in the paged target runner, on CPU in float32.

* GPT-OSS attention semantics: ``paged_attention`` with ``window_left = W - 1`` and ``sinks``
  equals transformers' own GPT-OSS eager attention under transformers' own sliding-window mask
  function, for prefill rows and bottom-right aligned verify rows (the "window 128" vs
  ``window_left`` off-by-one is pinned here and end to end below).
* The runner's logits and auxiliary hidden states equal the transformers model's forward over
  ragged chunks with rejected-draft junk rows (verify steps), sequences several windows long; a
  window off by one, a missing window or missing sinks is caught by the same comparison.
* MXFP4 checkpoints: the load plan (keep / dequantize, memory estimate, refusal), and a tiny
  GPT-OSS checkpoint with hand-written MXFP4 experts loads dequantized to the values computed
  independently here.
"""

from __future__ import annotations

import pytest
import torch
from moe_models import KINDS, SLIDING_WINDOW, make_moe_target, moe_config, quantize_experts_to_mxfp4
from test_models import BLOCK, PagedRun
from tiny_models import LAYERS, VOCAB
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.gpt_oss import modeling_gpt_oss

from peagle import ops
from peagle.models import TargetRunner
from peagle.models.mxfp4 import (
    MXFP4_BYTES_PER_WEIGHT,
    count_parameters,
    is_mxfp4_config,
    plan_quantized_load,
)

TOL = dict(rtol=1e-4, atol=1e-4)  # float32 paged computation vs transformers float32


# ---------------------------------------------------------------------------------------------
# GPT-OSS attention: paged_attention(window_left, sinks) == transformers' eager attention
# ---------------------------------------------------------------------------------------------


class _Stub(torch.nn.Module):
    """What transformers' GPT-OSS ``eager_attention_forward`` reads from its module."""

    def __init__(self, sinks: torch.Tensor, groups: int) -> None:
        super().__init__()
        self.sinks = sinks
        self.num_key_value_groups = groups


@pytest.mark.parametrize("window", [1, 3, 8, None])
@pytest.mark.parametrize("qlen,kv_len", [(13, 13), (4, 17), (1, 9)])
def test_gpt_oss_attention_matches_transformers(gen, window, qlen, kv_len):
    hq, hkv, d, bs = 4, 2, 16, 4
    q = torch.randn(qlen, hq, d, generator=gen)
    k = torch.randn(kv_len, hkv, d, generator=gen)
    v = torch.randn(kv_len, hkv, d, generator=gen)
    sinks = torch.randn(hq, generator=gen) * 2
    scale = d**-0.5
    # transformers: absolute query positions kv_len-qlen .. kv_len-1, its own mask functions.
    q_idx = torch.arange(kv_len - qlen, kv_len)[:, None]
    kv_idx = torch.arange(kv_len)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    if window is None:
        allowed = kv_idx <= q_idx
    else:
        allowed = sliding_window_causal_mask_function(window)(zero, zero, q_idx, kv_idx)
    mask = torch.where(allowed, 0.0, float("-inf"))[None, None]
    ref, _ = modeling_gpt_oss.eager_attention_forward(
        _Stub(sinks, hq // hkv),
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        mask,
        scaling=scale,
    )
    # peagle: one request, shuffled pages.
    nb = -(-kv_len // bs)
    kc = torch.randn(nb + 3, bs, hkv, d, generator=gen)
    vc = torch.randn(nb + 3, bs, hkv, d, generator=gen)
    table = (torch.randperm(nb + 3, generator=gen)[:nb]).int()[None]
    slots = torch.stack([table[0, p // bs].long() * bs + p % bs for p in range(kv_len)])
    ops.write_kv_cache(k, v, kc, vc, slots)
    out = ops.paged_attention(
        q,
        kc,
        vc,
        table,
        torch.tensor([0, qlen], dtype=torch.int32),
        torch.tensor([kv_len], dtype=torch.int32),
        softmax_scale=scale,
        window_left=-1 if window is None else window - 1,
        sinks=sinks,
    )
    torch.testing.assert_close(out, ref[0], rtol=1e-5, atol=1e-5)
    if window is not None and kv_len > window:  # the off-by-one would be visible
        off = ops.paged_attention(
            q, kc, vc, table, torch.tensor([0, qlen], dtype=torch.int32),
            torch.tensor([kv_len], dtype=torch.int32), softmax_scale=scale,
            window_left=window, sinks=sinks,
        )  # fmt: skip
        assert (off - ref[0]).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# Runner vs transformers
# ---------------------------------------------------------------------------------------------


def _chunked_run(runner, model, gen, lengths, plan):
    """Run ``plan`` (per step and request: (real rows, junk rows)) through the runner and return
    the largest logit / aux difference to transformers' forward over the real sequences."""
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    ids_aux = runner.aux_layer_ids
    with torch.no_grad():
        ref = [model(s[None], output_hidden_states=True) for s in seqs]
    ref_logits = [o.logits[0] for o in ref]
    ref_aux = [torch.cat([o.hidden_states[i][0] for i in ids_aux], -1) for o in ref]
    kv = runner.make_kv_cache(num_blocks=48, block_size=BLOCK)
    run = PagedRun(kv, [n + 4 for n in lengths], gen)
    starts = [0] * len(lengths)
    err_logits = err_aux = 0.0
    for step in plan:
        counts = [a + b for a, b in step]
        ids, real_rows, o = [], [], 0
        for r, (a, b) in enumerate(step):
            s = starts[r]
            junk = torch.randint(0, VOCAB, (b,), generator=gen)
            ids.append(torch.cat([seqs[r][s : s + a], junk]))
            real_rows.append(list(range(o, o + a)))
            o += a + b
        logits, aux = runner.forward(torch.cat(ids), run.meta(starts, counts), kv)
        for r, (a, _) in enumerate(step):
            s = starts[r]
            d_logits = logits[real_rows[r]] - ref_logits[r][s : s + a]
            d_aux = aux[real_rows[r]] - ref_aux[r][s : s + a]
            err_logits = max(err_logits, float(d_logits.abs().max()))
            err_aux = max(err_aux, float(d_aux.abs().max()))
        starts = [s + a for s, (a, _) in zip(starts, step, strict=True)]
    assert starts == lengths
    scale = max(float(x.abs().max()) for x in ref_logits)
    return err_logits, err_aux, scale


# Prefill chunks, then verify-like steps: 1 real row + up to 3 junk rows (rejected drafts whose KV
# the next step overwrites), for sequences 4-5 windows long.
LENGTHS = [27, 33]
PLAN = (
    [[(9, 0), (12, 0)]]
    + [[(1, 3), (2, 2)], [(3, 1), (1, 3)], [(2, 2), (4, 0)], [(1, 0), (1, 3)]] * 2
    + [[(4, 0), (5, 0)]]
)


@pytest.mark.parametrize("kind", KINDS)
def test_runner_matches_transformers(kind, gen):
    model, _ = make_moe_target(kind)
    runner = TargetRunner(model)
    w = SLIDING_WINDOW - 1
    if kind == "gpt_oss":
        assert runner.window_left == [w, -1] * 3 + [w] and all(runner.has_sinks)
    else:
        assert runner.window_left == [w] * 7 and not any(runner.has_sinks)
    assert runner.cuda_graph_blocker is None  # transformers' grouped_mm experts
    assert [sum(step[r][0] for step in PLAN) for r in range(2)] == LENGTHS
    err_logits, err_aux, scale = _chunked_run(runner, model, gen, LENGTHS, PLAN)
    # float32: max |logit error| <= 2e-5 * max |logit| (observed ~2e-6), aux features 1e-4.
    assert scale > 1.0
    assert err_logits <= 2e-5 * scale and err_aux <= 1e-4, (err_logits, err_aux, scale)


@pytest.mark.parametrize(
    "change",
    ["window_plus_one", "window_minus_one", "no_window", "no_sinks"],
)
def test_runner_comparison_catches_attention_mistakes(change, gen):
    """The comparison above fails for each plausible mistake (so it pins the semantics)."""
    model, _ = make_moe_target("gpt_oss")
    runner = TargetRunner(model)
    sliding = [w >= 0 for w in runner.window_left]
    if change == "window_plus_one":
        runner.window_left = [SLIDING_WINDOW if s else -1 for s in sliding]
    elif change == "window_minus_one":
        runner.window_left = [SLIDING_WINDOW - 2 if s else -1 for s in sliding]
    elif change == "no_window":
        runner.window_left = [-1] * runner.num_layers
    else:
        runner.has_sinks = [False] * runner.num_layers
    plan = [[(9, 0), (12, 0)], [(1, 3), (2, 2)], [(8, 0), (3, 0)]]
    err_logits, _, _ = _chunked_run(runner, model, gen, [18, 17], plan)
    assert err_logits > 100 * TOL["atol"], err_logits


def test_experts_implementation_and_graph_safety():
    model, _ = make_moe_target("qwen3_moe", layers=3)
    if not hasattr(model, "set_experts_implementation"):
        pytest.skip("transformers without selectable experts implementations")
    runner = TargetRunner(model, aux_layer_ids=[0, 1, 2])
    assert runner.cuda_graph_blocker is None
    model.set_experts_implementation("eager")
    assert "syncs with the host" in runner.cuda_graph_blocker


# ---------------------------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------------------------


def _mxfp4_config(**kw):
    cfg = moe_config("gpt_oss", **kw)
    cfg.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": None}
    return cfg


def test_parameter_count_and_estimates():
    cfg = _mxfp4_config(num_experts=4, intermediate_size=96)
    pc = count_parameters(cfg)
    h, i, e = 64, 96, 4
    assert pc.mxfp4 == LAYERS * e * (h * 2 * i + i * h)
    model = make_moe_target("gpt_oss", num_experts=4, intermediate_size=96)[0]
    assert pc.total == sum(p.numel() for p in model.parameters())
    assert pc.bytes(torch.bfloat16, mxfp4_native=False) == 2 * pc.total
    native = 2 * (pc.total - pc.mxfp4) + pc.mxfp4 * MXFP4_BYTES_PER_WEIGHT
    assert pc.bytes(torch.bfloat16, mxfp4_native=True) == int(native)
    assert is_mxfp4_config(cfg) and not is_mxfp4_config(moe_config("gpt_oss"))


def test_mxfp4_plan_decisions():
    cfg = _mxfp4_config()
    assert plan_quantized_load(moe_config("gpt_oss"), device="cpu") is None  # not quantized
    # CPU: no kernels -> dequantize, with the numbers in the message.
    p = plan_quantized_load(cfg, device="cpu", name="tiny")
    assert not p.native and "CUDA" in p.reason and p.dtype == torch.bfloat16
    assert "dequantizing" in p.message and "MXFP4" in p.message
    assert f"of its {p.params.total / 1e3:.2f}K parameters" in p.message
    assert f"~{p.dequantized_bytes / 2**20:.1f} MiB dequantized to bfloat16" in p.message
    assert p.weight_bytes == p.dequantized_bytes > p.mxfp4_bytes
    with pytest.raises(ValueError, match="requested natively, but"):
        plan_quantized_load(cfg, device="cpu", mode="native")
    with pytest.raises(ValueError, match="mxfp4 mode"):
        plan_quantized_load(cfg, device="cpu", mode="fp4")
    # A device with usable kernels keeps MXFP4 (auto and native), dequantizes on request.
    ok = lambda dev: None  # noqa: E731
    big = dict(memory_bytes=lambda dev: 1 << 40)
    p = plan_quantized_load(cfg, device="cuda", kernel_status=ok, **big)
    assert p.native and p.weight_bytes == p.mxfp4_bytes and "Keeping MXFP4" in p.message
    assert p.fallback is not None and not p.fallback.native  # auto falls back if the load fails
    p = plan_quantized_load(cfg, device="cuda", mode="native", kernel_status=ok, **big)
    assert p.native and p.fallback is None
    p = plan_quantized_load(cfg, device="cuda", mode="dequantize", kernel_status=ok, **big)
    assert not p.native and "requested" in p.message
    # A dequantized load larger than the device is refused before loading anything.
    no = lambda dev: "no triton"  # noqa: E731
    with pytest.raises(ValueError, match=r"no triton, so its MXFP4 experts would be dequantized"):
        plan_quantized_load(cfg, device="cuda", kernel_status=no, memory_bytes=lambda d: 1000)


def test_tiny_mxfp4_checkpoint_loads_dequantized(tmp_path, gen):
    model, _ = make_moe_target("gpt_oss", intermediate_size=96)
    model.save_pretrained(tmp_path / "t")
    expect = quantize_experts_to_mxfp4(tmp_path / "t", gen)
    messages = []
    runner = TargetRunner.from_pretrained(
        str(tmp_path / "t"), dtype=torch.float32, log=messages.append
    )
    assert runner.load_plan is not None and not runner.load_plan.native
    assert len(messages) == 1 and "dequantizing" in messages[0]
    sd = runner.model.state_dict()
    assert len(expect) == 2 * LAYERS
    for name, value in expect.items():
        assert sd[name].dtype == torch.float32
        torch.testing.assert_close(sd[name], value, rtol=0, atol=0)
    # The other weights are the saved ones, and the dequantized model runs in the runner.
    ref = model.state_dict()
    for name, value in ref.items():
        if name not in expect:
            torch.testing.assert_close(sd[name], value, rtol=0, atol=0)
    kv = runner.make_kv_cache(num_blocks=16, block_size=BLOCK)
    run = PagedRun(kv, [12], gen)
    ids = torch.randint(0, VOCAB, (12,), generator=gen)
    logits, _ = runner.forward(ids, run.meta([0], [12]), kv)
    with torch.no_grad():
        torch.testing.assert_close(logits, runner.model(ids[None]).logits[0], **TOL)
