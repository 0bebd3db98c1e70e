"""The decode loop's step staging buffer (peagle.decode.staging) and the graph layout built on it.

CPU: the staging layout and upload segments; greedy outputs through the CUDA-graph static-buffer
layout (``cuda_graphs="emulate"``) and the eager loop equal transformers' greedy tokens for every
method with ragged batches (prompts of different lengths, requests finishing at different steps,
a queued request joining, the batch shrinking through every padded size).
CUDA (skipped without a GPU): the host buffer is page-locked and never rewritten while an upload
reading it is in flight; captured graphs give the emulated layout's tokens exactly.
"""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from test_decode import engine, hf_greedy
from tiny_models import make_drafter, make_target

from peagle.decode import SamplingParams, SpecDecoder
from peagle.decode.staging import StepStaging
from peagle.models import TargetRunner

# 5 requests, max_num_seqs 4: the fifth waits, joins mid-flight (a prefill among decodes), and
# the requests finish at different steps (the batch shrinks 4 -> 3 -> 2 -> 1).
RAGGED = [[5], [11, 3, 60, 7], [42, 17, 8, 90, 33, 2, 71], [9, 9, 4, 66, 2, 13, 58, 7] * 2, [3, 8]]
NEW = [7, 20, 3, 13, 16]


@pytest.fixture(scope="module")
def llama():
    model, g = make_target("llama")
    refs = [hf_greedy(model, p, n) for p, n in zip(RAGGED, NEW, strict=True)]
    return model, g, TargetRunner(model), refs


# ---------------------------------------------------------------------------------------------
# StepStaging
# ---------------------------------------------------------------------------------------------


def test_layout_aligned_disjoint_and_drafter_segment_last():
    st = StepStaging(rows=37, reqs=5, table_width=7, device=torch.device("cpu"))
    spans = sorted(
        (off, off + n * torch.empty((), dtype=dt).element_size(), name)
        for name, (off, n, dt) in st.layout.items()
    )
    for (a0, a1, _), (b0, _, _) in zip(spans, spans[1:], strict=False):
        assert a0 % 64 == 0 and a1 <= b0
    assert spans[-1][1] <= st.nbytes
    drafter = {name for off, _, name in spans if off >= st.drafter_offset}
    assert drafter == {"drafter_seq_lens", "block_table"}
    assert st.dev["block_table"].numel() == 5 * 7 and st.dev["input_ids"].numel() == 37
    assert st.dev["seeds"].dtype == torch.int64 and st.dev["request_mask"].dtype == torch.bool


def test_upload_segments():
    st = StepStaging(rows=16, reqs=3, table_width=4, device=torch.device("cpu"))
    h = st.host()
    for name, arr in h.items():
        arr[:] = 1 if name != "request_mask" else True
    st.upload()
    assert all(bool((st.dev[n] == 1).all()) for n in st.dev)
    h = st.host()
    for arr in h.values():
        arr[:] = 0
    st.upload("drafter")  # only drafter_seq_lens + block_table travel
    for name, t in st.dev.items():
        expect = 0 if name in ("drafter_seq_lens", "block_table") else 1
        assert bool((t == expect).all()), name


def test_step_view_aliases_the_device_buffer_and_is_cached():
    st = StepStaging(rows=16, reqs=3, table_width=4, device=torch.device("cpu"))
    v = st.step_view(10, 2, 3, 5, 3, 4, top_k=False, top_p=True, request_mask=False)
    assert v is st.step_view(10, 2, 3, 5, 3, 4, top_k=False, top_p=True, request_mask=False)
    assert v.top_k is None and v.request_mask is None and v.top_p.shape == (2,)
    assert v.block_table.shape == (2, 3) and v.block_table.is_contiguous()
    lo, hi = st._dev.data_ptr(), st._dev.data_ptr() + st.nbytes
    for name in ("input_ids", "positions", "block_table", "seeds", "drafter_seq_lens"):
        assert lo <= getattr(v, name).data_ptr() < hi
    st.host()["block_table"][:6] = range(6)
    st.upload()
    assert v.block_table.tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="exceeds the staging capacity"):
        st.step_view(17, 2, 3, 5, 3, 4, top_k=False, top_p=False, request_mask=False)


# ---------------------------------------------------------------------------------------------
# Ragged batches through the eager loop and the graph layout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,k", [("none", 1), ("peagle", 1), ("peagle", 4), ("eagle3", 1), ("eagle3", 4)]
)
@pytest.mark.parametrize("graphs", ["off", "emulate"])
def test_ragged_greedy_matches_transformers(llama, method, k, graphs):
    model, g, runner, refs = llama
    eng = engine(runner, model, g, method, k, cuda_graphs=graphs, max_num_seqs=4)
    params = [SamplingParams(max_new_tokens=n) for n in NEW]
    outs = eng.generate(RAGGED, params)
    assert [o.token_ids for o in outs] == refs
    assert eng.allocator.num_allocated == 0
    if graphs == "emulate":
        assert eng.graphs.graphs  # some steps ran through the padded static-buffer layout
    # a second generate on the same engine (staging buffers reused, stale contents overwritten)
    assert [o.token_ids for o in eng.generate(RAGGED[::-1], params[::-1])] == refs[::-1]


def test_graph_layout_used_at_every_padded_size(llama):
    model, g, runner, refs = llama
    eng = engine(runner, model, g, "peagle", 1, cuda_graphs="emulate", max_num_seqs=4)
    new = [30, 4, 12, 20]
    outs = eng.generate(RAGGED[:4], [SamplingParams(max_new_tokens=n) for n in new])
    assert [o.token_ids for o in outs] == [
        hf_greedy(model, p, n) for p, n in zip(RAGGED[:4], new, strict=True)
    ]
    assert set(eng.graphs.graphs) == {1, 2, 4}


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------


@requires_cuda
def test_cuda_upload_is_never_overwritten_in_flight():
    """The upload is queued behind a long kernel; :meth:`host` must wait for it before the host
    buffer can be rewritten, so the device receives the values of upload time."""
    st = StepStaging(rows=64, reqs=8, table_width=16, device=torch.device("cuda"))
    assert st._host.is_pinned()
    h = st.host()
    h["seeds"][:] = 1
    h["block_table"][:] = 1
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the copy
    st.upload()
    h = st.host()  # blocks until the copy has read the buffer
    h["seeds"][:] = 2
    h["block_table"][:] = 2
    torch.cuda.synchronize()
    assert bool((st.dev["seeds"] == 1).all()) and bool((st.dev["block_table"] == 1).all())
    st.upload("drafter")
    torch.cuda.synchronize()
    assert bool((st.dev["seeds"] == 1).all()) and bool((st.dev["block_table"] == 2).all())


@requires_cuda
@pytest.mark.parametrize("method,k", [("none", 1), ("peagle", 1), ("peagle", 4), ("eagle3", 3)])
def test_cuda_graphs_match_emulated_layout_exactly(method, k):
    """Captured graphs (async pinned uploads) vs the same padded layout run eagerly: identical
    shapes and kernels, so identical tokens, with ragged batches."""
    model, g = make_target(head_dim=64)
    low = make_target(head_dim=64)[0].to("cuda", torch.bfloat16)
    low.load_state_dict(model.state_dict())
    drafter = None
    if method != "none":
        drafter = make_drafter(model, g, parallel=method == "peagle").to("cuda", torch.bfloat16)
    runs = []
    for mode in ("on", "emulate"):
        eng = SpecDecoder(
            TargetRunner(low), drafter, method=method, num_speculative_tokens=k,
            cuda_graphs=mode, max_num_seqs=4,
        )  # fmt: skip
        params = [SamplingParams(max_new_tokens=n + 20) for n in NEW]
        runs.append([o.token_ids for o in eng.generate(RAGGED, params)])
        assert eng.graphs.graphs
    assert runs[0] == runs[1]
