"""The target runner's fused dense-layer paths (peagle.models.fused) vs transformers' modules.

The fused RMSNorm / q-k-v / gate-up paths must give the modules' math (float64 exactly up to
rounding, bfloat16 within its rounding), share the modules' weight storage (no extra memory,
in-place updates visible), fall back to the module where the layer is not plain (biases on q/k/v
fuse too; other MLPs and norms are left alone), and rebuild after the weights change device or
dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_models import BLOCK, PagedRun
from tiny_models import VOCAB, make_drafter, make_target

from peagle.models import Eagle3Drafter, TargetRunner
from peagle.models.fused import fuse_layer, rms_norm


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fused_rms_norm_equals_transformers(gen, dtype):
    model, _ = make_target()
    norm = model.model.layers[1].input_layernorm.to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=gen).to(dtype) * 2 + 0.1)
    x = (torch.randn(9, norm.weight.shape[0], generator=gen) * 3 + 0.5).to(dtype)
    ref = norm(x)  # transformers computes in float32 even for float64 inputs
    out = rms_norm(norm)(x)
    assert out.dtype == ref.dtype == dtype
    x64, w64 = x.double(), norm.weight.double()
    exact = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    if dtype == torch.float64:
        torch.testing.assert_close(out, exact, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:  # one rounding of the normalised rows, one of the product, as transformers
        torch.testing.assert_close(out, ref, rtol=8e-3, atol=8e-3)
        torch.testing.assert_close(out.double(), exact, rtol=1.6e-2, atol=1.6e-2)


def test_unfused_modules_keep_their_forward():
    class OtherNorm(torch.nn.Module):
        def forward(self, x):
            return x

    m = OtherNorm()
    assert rms_norm(m) is m


def test_fused_layer_shares_weight_storage(gen):
    model, _ = make_target()
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    before = [
        p.detach().clone() for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    ]
    f = fuse_layer(layer)
    assert f.qkv is not None and f.gate_up is not None
    w = f.qkv[0]
    assert attn.q_proj.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    assert (
        mlp.up_proj.weight.untyped_storage().data_ptr() == f.gate_up[0].untyped_storage().data_ptr()
    )
    for p, b in zip(
        (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight), before, strict=True
    ):
        torch.testing.assert_close(p, b, rtol=0, atol=0)
    x = torch.randn(5, attn.q_proj.in_features, generator=gen)
    with torch.no_grad():
        attn.k_proj.weight.mul_(2.0)  # an in-place update is what the fused GEMM sees
        q, k, v = f.project_qkv(attn, x)
        torch.testing.assert_close(k, attn.k_proj(x))
        torch.testing.assert_close(q, attn.q_proj(x))
        torch.testing.assert_close(v, attn.v_proj(x))
        torch.testing.assert_close(f.mlp(layer, x, None), mlp(x))


def test_qkv_biases_fuse_and_other_mlps_fall_back(gen):
    model, _ = make_target()
    layer = model.model.layers[0]
    attn = layer.self_attn
    for p in (attn.q_proj, attn.k_proj, attn.v_proj):
        p.bias = torch.nn.Parameter(torch.randn(p.out_features, generator=gen))
    layer.mlp.act_fn = torch.nn.GELU()  # not silu: the module's own forward
    f = fuse_layer(layer)
    assert f.qkv[1] is not None and f.gate_up is None
    x = torch.randn(4, attn.q_proj.in_features, generator=gen)
    with torch.no_grad():
        q, k, v = f.project_qkv(attn, x)
        torch.testing.assert_close(v, attn.v_proj(x))
        used = []
        f.mlp(layer, x, lambda la, y: used.append(1) or la.mlp(y))
    assert used == [1]


def _forward(runner, ids, gen_seed=3):
    kv = runner.make_kv_cache(num_blocks=12, block_size=BLOCK)
    run = PagedRun(kv, [len(ids)], torch.Generator().manual_seed(gen_seed))
    return runner.forward(ids, run.meta([0], [len(ids)]), kv)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fused_runner_equals_unfused_and_rebuilds_after_dtype_change(kind, gen, monkeypatch):
    model, _ = make_target(kind)
    ids = torch.randint(0, VOCAB, (11,), generator=gen)
    monkeypatch.setenv("PEAGLE_FUSED_TARGET", "0")
    plain = TargetRunner(model)
    assert not plain.fused_layers
    ref_logits, ref_aux = _forward(plain, ids)
    monkeypatch.delenv("PEAGLE_FUSED_TARGET")
    runner = TargetRunner(model)
    assert runner.fused_layers
    logits, aux = _forward(runner, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux, ref_aux, rtol=1e-5, atol=1e-5)
    model.to(torch.bfloat16)  # the fused weights were float32 views: rebuilt from the new ones
    logits16, _ = _forward(runner, ids)
    assert logits16.dtype == torch.bfloat16
    assert runner._fused[0].qkv[0].dtype == torch.bfloat16
    plain16, _ = _forward(plain, ids)  # the modules' own forwards in bfloat16
    scale = plain16.float().abs().max()
    assert (logits16.float() - plain16.float()).abs().max() <= 0.02 * scale


# -- the drafter's fused inference path ---------------------------------------------------------


def _drafter(kind: str, norm_before_residual: bool, parallel: bool = True):
    model, g = make_target(kind)
    d = make_drafter(model, g, parallel=parallel, num_layers=3, model_type=kind)
    d.config.norm_before_residual = norm_before_residual
    for layer in d.decoder_layers():
        layer.norm_before_residual = norm_before_residual
    with torch.no_grad():  # non-trivial norm weights: a norm applied twice or skipped shows
        gen = torch.Generator().manual_seed(11)
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    return d


def _drafter_forward(d, seed=5):
    gen = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 12]
    kv = d.make_kv_cache(num_blocks=16, block_size=BLOCK)
    run = PagedRun(kv, lengths, torch.Generator().manual_seed(seed + 1))
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
    hidden = torch.randn(sum(lengths), d.config.hidden_size, generator=gen).to(d.dtype)
    return d(ids, hidden, run.meta([0, 0, 0], lengths), kv)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_fused_drafter_equals_module_forwards(kind, norm_before_residual, monkeypatch):
    d = _drafter(kind, norm_before_residual)
    monkeypatch.setenv("PEAGLE_FUSED_DRAFTER", "0")
    plain = _drafter(kind, norm_before_residual)
    plain.load_state_dict(d.state_dict())
    assert not plain.fused_layers and d.fused_layers
    with torch.no_grad():
        ref = _drafter_forward(plain)
        out = _drafter_forward(d)
        assert plain.fused_plan() is None and d.fused_plan() is not None
    for a, b in zip(out, ref, strict=True):  # float32 (the paged ops' widest dtype)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_drafter_trains_through_the_module_parameters():
    """With gradients enabled the plan is off (the fused tensors are not the parameters); after
    an inference pass fused the weights (views of one tensor), training still reaches them."""
    d = _drafter("llama", False)
    with torch.no_grad():
        _drafter_forward(d)
    q = d.midlayer.self_attn.q_proj.weight
    assert d._fused is not None and q.untyped_storage().data_ptr() == (
        d._fused[0].layer.qkv[0].untyped_storage().data_ptr()
    )
    assert d.fused_plan() is None  # grad enabled here

    def causal(_i, q, k, v):  # differentiable attention over one sequence (the training path)
        rep = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(rep, dim=1).transpose(0, 1) for x in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
        return o.transpose(0, 1)

    t = 9
    ids = torch.randint(0, VOCAB, (t,), generator=torch.Generator().manual_seed(2))
    hidden = torch.randn(t, d.config.hidden_size, generator=torch.Generator().manual_seed(3))
    normed, _ = d(ids, hidden, positions=torch.arange(t), attend=causal)
    normed.square().sum().backward()
    for name in ("midlayer.self_attn.q_proj.weight", "layers.1.mlp.up_proj.weight",
                 "midlayer.hidden_norm.weight", "norm.weight"):  # fmt: skip
        grad = d.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    with torch.no_grad():  # an optimizer's in-place step is what the fused GEMM reads next
        before = _drafter_forward(d)[0]
        for p in d.parameters():
            if p.grad is not None:
                p.sub_(0.1 * p.grad)
        after = _drafter_forward(d)[0]
        d.fused_layers = False
        plain = _drafter_forward(d)[0]
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, plain, rtol=1e-5, atol=1e-5)


def test_fused_drafter_rebuilds_after_a_dtype_round_trip():
    """float32 -> bfloat16 -> float32 with no pass in between gives every weight new storage at
    the same dtype: the plan is rebuilt, not left reading the first concatenation."""
    d = _drafter("llama", False)
    with torch.no_grad():
        first = _drafter_forward(d)[0]
        d.to(torch.bfloat16)
        d.to(torch.float32)
        d.midlayer.self_attn.v_proj.weight.mul_(3.0)
        again = _drafter_forward(d)[0]
        d.fused_layers = False
        plain = _drafter_forward(d)[0]
    torch.testing.assert_close(again, plain, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(again, first, rtol=1e-2, atol=1e-2)  # the weights did change


def test_fused_drafter_saves_and_reloads(tmp_path):
    """safetensors refuses tensors that share storage: saving a fused drafter writes copies."""
    d = _drafter("llama", False, parallel=True)
    with torch.no_grad():
        ref = _drafter_forward(d)[0]
    d.save_pretrained(tmp_path / "head")
    back = Eagle3Drafter.from_pretrained(tmp_path / "head")
    with torch.no_grad():
        torch.testing.assert_close(_drafter_forward(back)[0], ref, rtol=1e-6, atol=1e-6)


def test_fused_runner_rebuilds_after_a_dtype_round_trip(gen):
    model, _ = make_target()
    ids = torch.randint(0, VOCAB, (6,), generator=gen)
    runner = TargetRunner(model)
    first, _ = _forward(runner, ids)
    model.to(torch.bfloat16)
    model.to(torch.float32)  # same dtype as the plan's, new storage
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.mul_(3.0)
        model.model.layers[1].mlp.up_proj.weight.mul_(-1.0)
    again, _ = _forward(runner, ids)
    runner.fused_layers = False
    plain, _ = _forward(runner, ids)
    torch.testing.assert_close(again, plain, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(again, first, rtol=1e-2, atol=1e-2)
