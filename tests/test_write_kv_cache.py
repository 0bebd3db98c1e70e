"""write_kv_cache vs the pure-PyTorch reference (SPEC §5): rows land at their slots, slot -1
rows write nothing, every other cache row is left untouched, strided caches and strided K/V
views are honoured."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from reference.paged_attention import paged_attention_ref
from reference.write_kv_cache import write_kv_cache_ref

import peagle


def make_caches(gen, num_blocks, block_size, hkv, d, dtype, device, layout):
    shape = (num_blocks, block_size, hkv, d)
    if layout == "plain":
        kc = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
        vc = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
        return kc, vc
    if layout == "split2":
        kv = torch.randn((2,) + shape, generator=gen).to(dtype=dtype, device=device)
        return kv[0], kv[1]
    if layout == "interleaved":
        kv = torch.randn((num_blocks, 2) + shape[1:], generator=gen).to(dtype=dtype, device=device)
        return kv[:, 0], kv[:, 1]
    raise ValueError(layout)


def make_rows(gen, t, hkv, d, dtype, device, strided):
    if strided:  # k and v as views into a fused qkv projection output
        hq = 2 * hkv
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype=dtype, device=device)
        k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        return k, v
    k = torch.randn(t, hkv, d, generator=gen).to(dtype=dtype, device=device)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype=dtype, device=device)
    return k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "layout,strided,d,block_size",
    [("plain", False, 64, 16), ("split2", True, 128, 8), ("interleaved", False, 40, 32)],
)
def test_matches_reference(device, gen, dtype, layout, strided, d, block_size):
    num_blocks, hkv, t = 7, 4, 23
    kc, vc = make_caches(gen, num_blocks, block_size, hkv, d, dtype, device, layout)
    k, v = make_rows(gen, t, hkv, d, dtype, device, strided)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[torch.randperm(t, generator=gen)[:5]] = -1  # padding rows
    slots[0] = num_blocks * block_size - 1  # last slot of the cache
    slots = slots.to(device)
    want_k, want_v = write_kv_cache_ref(k, v, kc, vc, slots)
    peagle.write_kv_cache(k, v, kc, vc, slots)
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)


def test_all_padding_and_empty(device, gen):
    kc, vc = make_caches(gen, 3, 16, 2, 64, torch.bfloat16, device, "split2")
    before = (kc.clone(), vc.clone())
    k, v = make_rows(gen, 5, 2, 64, torch.bfloat16, device, False)
    peagle.write_kv_cache(k, v, kc, vc, torch.full((5,), -1, dtype=torch.int64, device=device))
    peagle.write_kv_cache(k[:0], v[:0], kc, vc, torch.zeros(0, dtype=torch.int64, device=device))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_bad_slots(device, gen):
    kc, vc = make_caches(gen, 3, 8, 2, 64, torch.float16, device, "plain")
    before = (kc.clone(), vc.clone())
    k, v = make_rows(gen, 3, 2, 64, torch.float16, device, False)
    for bad in (24, -2, 1 << 40):
        slots = torch.tensor([5, bad, 7], dtype=torch.int64, device=device)
        if device == "cpu":
            with pytest.raises(RuntimeError, match=r"slot_mapping\[1\]"):
                peagle.write_kv_cache(k, v, kc, vc, slots)
            # Nothing was written before the error.
            assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
        else:
            # CUDA cannot raise without a host sync: the bad row is skipped, never written OOB.
            want_k, want_v = write_kv_cache_ref(k[[0, 2]], v[[0, 2]], kc, vc, slots[[0, 2]])
            peagle.write_kv_cache(k, v, kc, vc, slots)
            torch.cuda.synchronize()
            assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)


def test_bad_shapes_and_dtypes(device, gen):
    kc, vc = make_caches(gen, 3, 8, 2, 64, torch.bfloat16, device, "plain")
    k, v = make_rows(gen, 3, 2, 64, torch.bfloat16, device, False)
    slots = torch.tensor([0, 1, 2], dtype=torch.int64, device=device)
    cases = [
        ((k.half(), v, kc, vc, slots), "value must have dtype"),
        ((k, v.half(), kc, vc, slots), "value must have dtype"),
        ((k, v, kc.half(), vc, slots), "key_cache must have dtype"),
        ((k, v[:, :1], kc, vc, slots), "value must have shape"),
        ((k, v, kc, vc[..., :32], slots), "value_cache must have shape"),
        ((k, v, kc[:, :, :1], vc, slots), "key_cache must have shape"),
        ((k, v, kc, vc, slots.int()), "slot_mapping must have dtype"),
        ((k, v, kc, vc, slots[:2]), "slot_mapping must have shape"),
        ((k.transpose(1, 2), v, kc, vc, slots), "value must have shape|unit stride"),
        ((k, v, kc, vc.transpose(2, 3), slots), "value_cache must have shape|unit stride"),
        ((k.int(), v.int(), kc, vc, slots), "bfloat16/float16/float32"),
    ]
    for args, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            peagle.write_kv_cache(*args)
    # Non-unit stride in D is rejected (not silently copied).
    kd = torch.randn(3, 2, 128, device=device).to(torch.bfloat16)[..., ::2]
    with pytest.raises(RuntimeError, match="unit stride"):
        peagle.write_kv_cache(kd, v, kc, vc, slots)


def test_write_then_attend(device, gen):
    # Round trip: write a request's rows through slot_mapping, then attend over them.
    hq, hkv, d, bs, nb = 8, 2, 64, 16, 6
    kc, vc = make_caches(gen, nb, bs, hkv, d, torch.bfloat16, device, "split2")
    table = torch.tensor([[4, 1, 3]], dtype=torch.int32, device=device)
    kv_len, q_len = 37, 5
    k, v = make_rows(gen, q_len, hkv, d, torch.bfloat16, device, True)
    pos = torch.arange(kv_len - q_len, kv_len)
    slots = (table[0].cpu()[pos // bs].long() * bs + pos % bs).to(device)
    peagle.write_kv_cache(k, v, kc, vc, slots)
    q = torch.randn(q_len, hq, d, generator=gen).to(dtype=torch.bfloat16, device=device)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device=device)
    sl = torch.tensor([kv_len], dtype=torch.int32, device=device)
    out = peagle.paged_attention(q, kc, vc, table, qsl, sl)
    ref, _ = paged_attention_ref(q, kc, vc, table, qsl, sl)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2, atol=2e-2)
    # The last row attends to its own key with the largest weight when q == k.
    q2 = k.repeat_interleave(hq // hkv, dim=1) * 8
    out2 = peagle.paged_attention(q2, kc, vc, table, qsl, sl)
    last_v = v[-1].repeat_interleave(hq // hkv, dim=0).float()
    torch.testing.assert_close(out2[-1].float(), last_v, rtol=0.05, atol=0.05)


def test_opcheck(device, gen):
    kc, vc = make_caches(gen, 3, 8, 2, 64, torch.bfloat16, device, "plain")
    k, v = make_rows(gen, 4, 2, 64, torch.bfloat16, device, False)
    slots = torch.tensor([3, -1, 17, 9], dtype=torch.int64, device=device)
    torch.library.opcheck(torch.ops.peagle.write_kv_cache.default, (k, v, kc, vc, slots))


def test_torch_compile_fullgraph(device, gen):
    kc, vc = make_caches(gen, 3, 8, 2, 64, torch.bfloat16, device, "split2")
    k, v = make_rows(gen, 4, 2, 64, torch.bfloat16, device, False)
    slots = torch.tensor([3, -1, 17, 9], dtype=torch.int64, device=device)

    def step(k, v, kc, vc, slots):
        peagle.write_kv_cache(k * 2, v, kc, vc, slots)
        return kc.sum()

    want_k, want_v = write_kv_cache_ref(k * 2, v, kc, vc, slots)
    compiled = torch.compile(step, fullgraph=True)
    compiled(k, v, kc, vc, slots)
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)


@requires_cuda
def test_cuda_misaligned_and_large(gen):
    # Odd head_dim (2-byte rows only) and a large batch through the vectorised path.
    for d, t in ((62, 9), (128, 4096)):
        kc, vc = make_caches(gen, 300, 16, 8, d, torch.bfloat16, "cuda", "split2")
        k, v = make_rows(gen, t, 8, d, torch.bfloat16, "cuda", t > 100)
        slots = torch.randperm(300 * 16, generator=gen)[:t]
        slots[::7] = -1
        slots = slots.cuda()
        want_k, want_v = write_kv_cache_ref(k, v, kc, vc, slots)
        peagle.write_kv_cache(k, v, kc, vc, slots)
        assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)
