"""tools/profile_target_pass.py (issue 20, goal 2): kernels are attributed to the model part whose
host-side range contains their launch, and the annotations leave the model unchanged."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_SPEC = importlib.util.spec_from_file_location(
    "profile_target_pass",
    Path(__file__).resolve().parent.parent / "tools" / "profile_target_pass.py",
)
ptp = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ptp)


def _x(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {}}
    if corr is not None:
        e["args"]["correlation"] = corr
    return e


def test_kernels_go_to_the_innermost_annotation_containing_their_launch():
    trace = {"traceEvents": [
        _x("user_annotation", "moe_other", 0, 100),
        _x("user_annotation", "experts", 10, 50),
        _x("user_annotation", "norm", 200, 10),
        _x("user_annotation", "norm", 0, 100, tid=2),  # other thread: must not capture tid 1
        _x("cuda_runtime", "cudaLaunchKernel", 5, 1, corr=1),     # moe_other only
        _x("cuda_runtime", "cudaLaunchKernelExC", 20, 1, corr=2),  # inside experts
        _x("cuda_runtime", "cudaLaunchKernel", 205, 1, corr=3),   # norm
        _x("cuda_runtime", "cudaMemsetAsync", 300, 1, corr=4),    # no annotation
        _x("cuda_runtime", "cudaStreamSynchronize", 21, 1, corr=9),  # not a launch
        _x("kernel", "index_kernel", 1000, 3.0, tid=7, corr=1),
        _x("kernel", "grouped_gemm", 1010, 40.0, tid=7, corr=2),
        _x("kernel", "rms", 1100, 2.0, tid=7, corr=3),
        _x("gpu_memset", "Memset", 1200, 1.0, tid=7, corr=4),
        _x("kernel", "orphan", 1300, 5.0, tid=7, corr=77),
        {"ph": "i", "name": "marker"},
    ]}  # fmt: skip
    got = [(k["name"], k["part"]) for k in ptp.attribute_kernels(trace)]
    assert got == [("index_kernel", "moe_other"), ("grouped_gemm", "experts"), ("rms", "norm"),
                   ("Memset", "unannotated"), ("orphan", "unannotated")]  # fmt: skip
    s = ptp.summarize(ptp.attribute_kernels(trace), passes=1)
    assert s["kernels_per_pass"] == 5
    assert s["kernel_sum_ms"] == pytest.approx(0.051)
    assert list(s["parts"])[0] == "experts" and s["parts"]["experts"]["us"] == 40.0
    assert sum(p["share"] for p in s["parts"].values()) == pytest.approx(1.0, abs=1e-3)
    # Two passes halve the per-pass numbers.
    assert ptp.summarize(ptp.attribute_kernels(trace), passes=2)["kernel_sum_ms"] == pytest.approx(
        0.0255
    )


@pytest.mark.parametrize("shape", ["gpt-oss-20b", "qwen3-coder-30b-a3b"])
def test_annotations_cover_every_part_and_leave_the_model_unchanged(shape):
    import peagle.models.target as T
    from peagle.bench import projection as P
    from peagle.bench import released as R
    from peagle.models.paged import AttentionMetadata

    target = R.build_target(shape, torch.device("cpu"), torch.float32, tiny=True)
    t, nb = P.uniform_step("cpu", target.vocab_size, 1, 3, 40)
    kv = target.make_kv_cache(nb, R.BLOCK_SIZE)
    meta = AttentionMetadata(t.positions, t.slot_mapping, t.query_start_loc, t.seq_lens,
                             t.block_table, t.max_query_len)  # fmt: skip
    before = target.forward(t.input_ids, meta, kv, t.logits_indices)[0].clone()
    orig_attn, orig_rope = T.paged_attention_forward, target.apply_rope
    ann = ptp._Annotator(target)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            during = target.forward(t.input_ids, meta, kv, t.logits_indices)[0]
    finally:
        ann.remove()
    names = {e.key for e in prof.key_averages()}
    assert set(ptp.PARTS) <= names, set(ptp.PARTS) - names
    assert T.paged_attention_forward is orig_attn and target.apply_rope is orig_rope
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in target.model.modules())
    torch.testing.assert_close(during, before, rtol=0, atol=0)
