"""The vLLM adapter's op calls on CUDA tensors equal the same calls on CPU tensors.

No vLLM needed: the proposer and its attention metadata are stand-ins with the attributes the
adapter reads (vLLM 0.28's names), and the verifier gets its random draws directly. This covers
the adapter's device handling on the GPU machine, where vLLM cannot be installed; parity with
vLLM itself is tested on the CPU (tests/test_vllm_adapter*.py).
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from conftest import requires_cuda

from peagle.vllm import proposer as adapter_proposer
from peagle.vllm import sampler as adapter_sampler

pytestmark = requires_cuda


@dataclasses.dataclass
class Metadata:
    """The ``CommonAttentionMetadata`` fields and methods the adapter uses."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor

    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    def replace(self, **kwargs) -> Metadata:
        return dataclasses.replace(self, **kwargs)


def stand_in_proposer(k: int, hidden: int, dtype, device, mask, rows=256):
    g = torch.Generator().manual_seed(3)
    return types.SimpleNamespace(
        net_num_new_slots_per_request=k - 1, extra_slots_per_request=k,
        input_ids=torch.randint(0, 99, (rows,), generator=g, dtype=torch.int32).to(device),
        positions=torch.randint(0, 99, (rows,), generator=g).to(device),
        is_rejected_token_mask=torch.zeros(rows, dtype=torch.bool, device=device),
        is_masked_token_mask=torch.ones(rows, dtype=torch.bool, device=device),
        hidden_states=torch.randn(rows, hidden, generator=g).to(dtype).to(device),
        parallel_drafting_token_id=777, block_size=16, max_model_len=120,
        parallel_drafting_hidden_state_tensor=mask.to(device),
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_first_pass_cuda_equals_cpu(dtype):
    k, hidden, b = 4, 128, 5
    g = torch.Generator().manual_seed(1)
    qlens = [k + 1, 3, k + 1, 1, k + 1]
    nrej = torch.tensor([2, 0, k, 0, 0], dtype=torch.int32)
    p0 = [10, 0, 100, 40, 113]  # request 4 runs past max_model_len = 120
    qsl = torch.tensor([0, *qlens], dtype=torch.int32).cumsum(0).to(torch.int32)
    t_in = int(qsl[-1])
    positions = [torch.arange(a, a + q) for a, q in zip(p0, qlens, strict=True)]
    inputs = dict(
        target_token_ids=torch.randint(0, 1000, (t_in,), generator=g, dtype=torch.int32),
        next_token_ids=torch.randint(0, 1000, (b,), generator=g, dtype=torch.int32),
        target_positions=torch.cat(positions),
        target_hidden_states=torch.randn(t_in, hidden, generator=g).to(dtype),
    )  # fmt: skip
    mask = torch.randn(hidden, generator=g).to(dtype)
    block_table = torch.randperm(b * 8, generator=g).view(b, 8).to(torch.int32)
    outs = []
    for dev in ("cpu", "cuda"):
        p = stand_in_proposer(k, hidden, dtype, dev, mask)
        cad = Metadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl.clone(),
            seq_lens=torch.tensor([a + q for a, q in zip(p0, qlens, strict=True)],
                                  dtype=torch.int32, device=dev),
            num_reqs=b, num_actual_tokens=t_in, max_query_len=max(qlens), max_seq_len=125,
            block_table_tensor=block_table.to(dev), slot_mapping=torch.zeros(t_in, device=dev),
        )  # fmt: skip
        args = {name: t.to(dev) for name, t in inputs.items()}
        n, tis, new = adapter_proposer.set_inputs_first_pass(
            p, cad=cad, num_rejected_tokens_gpu=nrej.to(dev), **args
        )
        outs.append(
            dict(
                n=n,
                tis=tis.cpu(),
                ids=p.input_ids.cpu(),
                pos=p.positions.cpu(),
                rej=p.is_rejected_token_mask.cpu(),
                msk=p.is_masked_token_mask.cpu(),
                hid=p.hidden_states.cpu(),
                qsl=new.query_start_loc.cpu(),
                qsl_cpu=new.query_start_loc_cpu,
                seq=new.seq_lens.cpu(),
                slots=new.slot_mapping.cpu(),
                scalars=(new.num_actual_tokens, new.max_query_len, new.max_seq_len),
            )  # fmt: skip
        )
        assert new.query_start_loc_cpu.device.type == "cpu"
        assert new.slot_mapping.device.type == torch.device(dev).type
    cpu, cuda = outs
    assert cpu["n"] == cuda["n"] == t_in + b * (k - 1)
    for key in cpu:
        a, c = cpu[key], cuda[key]
        assert torch.equal(a, c) if isinstance(a, torch.Tensor) else a == c, key
    assert (cpu["slots"] == -1).sum() > int(nrej.sum())  # rejected rows and rows past the limit


@pytest.mark.parametrize("mode", ["greedy", "random", "mixed"])
def test_verify_cuda_equals_cpu(mode):
    b, k, vocab = 16, 4, 3001
    g = torch.Generator().manual_seed(2)
    n = [k if r % 4 else int(torch.randint(0, k + 1, (1,), generator=g)) for r in range(b)]
    t = sum(n)
    logits = torch.randn(t, vocab, generator=g) * 5
    drafts = torch.where(
        torch.rand(t, generator=g) < 0.7,
        logits.argmax(-1),
        torch.randint(0, vocab, (t,), generator=g),
    ).to(torch.int32)
    cu = torch.tensor(n, dtype=torch.int32).cumsum(0).to(torch.int32)
    bonus = torch.randint(0, vocab, (b, 1), generator=g, dtype=torch.int32)
    temperature = {"greedy": None, "random": torch.ones(b),
                   "mixed": (torch.arange(b) % 2).float()}[mode]  # fmt: skip
    uniforms = torch.rand(t, generator=g, dtype=torch.float64)
    exponentials = torch.empty(b, vocab).exponential_(generator=g)
    outs = []
    for dev in ("cpu", "cuda"):
        outs.append(
            adapter_sampler.verify_with_draws(
                drafts.to(dev),
                cu.to(dev),
                k,
                None,
                logits.to(dev),
                bonus.to(dev),
                None if temperature is None else temperature.to(dev),
                None if mode == "greedy" else uniforms.to(dev),
                None if mode == "greedy" else exponentials.to(dev),
            ).cpu()  # fmt: skip
        )
    same = (outs[0] == outs[1]).all(1)
    if mode == "greedy":
        assert same.all()
    else:  # CPU and CUDA may round the softmax normaliser differently (SPEC §0.1)
        assert same.float().mean() >= 0.9, (outs[0], outs[1])
    assert ((outs[1] >= 0) & (outs[1] < vocab) | (outs[1] == -1)).all()
