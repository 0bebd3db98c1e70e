"""Real vLLM objects on the CPU for the adapter tests (tests/test_vllm_adapter*.py): vLLM 0.28 or
0.33 (CI runs both, each in its own venv), any release the adapter knows in between.

``load_vllm()`` skips the calling test module when vLLM is not installed (the GPU machine) and
fails it when ``PEAGLE_REQUIRE_VLLM=1`` (CI, where the install must have worked). It sets the
environment vLLM needs on a machine without a GPU before importing it: ``CUDA_VISIBLE_DEVICES=""``
(set and empty: unset makes vLLM swap in a stub Triton), ``TRITON_INTERPRET=1`` (vLLM's Triton
kernels then run on CPU tensors) and ``HF_HUB_OFFLINE=1`` (the configs below are local files).

Release differences are found by feature detection, as the adapter does: the launchers the spies
count (0.28's Triton kernels, launched ``kernel[grid](...)``; the warm-up dispatchers 0.30+ calls
directly) and the pinned-memory switch (0.28's module flag ``PIN_MEMORY``; 0.30+'s
``CpuGpuBuffer(pin_memory=PIN_MEMORY)`` default, which asks the CUDA driver with the CUDA wheel).

Configs are tiny local ``config.json`` files (no weights): a Llama target, an EAGLE-3 drafter with
``ptd_token_id`` (P-EAGLE) and a Llama draft model with ``pard_token`` (PARD, no EAGLE shift).
Proposers are vLLM's own classes built from a real ``VllmConfig`` on ``device="cpu"``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

VOCAB = 512
HIDDEN = 64
MASK_TOKEN = 500  # ptd_token_id / pard_token of the tiny drafters
BLOCK_SIZE = 16
MAX_MODEL_LEN = 512


def load_vllm() -> types.SimpleNamespace:
    """Import the vLLM modules the tests use (or skip / fail the module, see above)."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("PEAGLE_REQUIRE_VLLM") == "1":
            pytest.fail("PEAGLE_REQUIRE_VLLM=1 but vLLM is not installed", pytrace=False)
        pytest.skip("vLLM is not installed (pip install .[vllm])", allow_module_level=True)
    if torch.cuda.is_available():
        pytest.skip(
            "the vLLM adapter tests run vLLM's Triton kernels on CPU tensors under "
            "TRITON_INTERPRET=1 (CPU CI); this machine has a GPU",
            allow_module_level=True,
        )
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (see conftest.py)")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import vllm
    import vllm.plugins
    from vllm import config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode import llm_base_proposer, utils
    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    no_pinned_memory(llm_base_proposer)

    def first(module, *names):  # the launcher a release calls (feature detection)
        return next(n for n in names if n in vars(module))

    return types.SimpleNamespace(
        vllm=vllm, config=config, CommonAttentionMetadata=CommonAttentionMetadata,
        rejection_sampler=rejection_sampler, LogitsProcessors=LogitsProcessors,
        SamplingMetadata=SamplingMetadata, Sampler=Sampler, llm_base_proposer=llm_base_proposer,
        utils=utils, DraftModelProposer=DraftModelProposer, EagleProposer=EagleProposer,
        SpecDecodeMetadata=SpecDecodeMetadata,
        # Launchers in the module that calls them: 0.28-0.29's kernels / 0.30+'s dispatchers.
        copy_and_expand=first(llm_base_proposer, "_copy_and_expand_eagle_inputs",
                              "copy_and_expand_eagle_inputs_kernel"),
        verify_launchers=tuple(
            first(rejection_sampler, f"_{name}", f"{name}_kernel")
            for name in ("rejection_greedy_sample", "rejection_random_sample",
                         "sample_recovered_tokens")
        ),
    )  # fmt: skip


def no_pinned_memory(llm_base_proposer) -> None:
    """No pinned-memory allocations without an accelerator: 0.28 reads the module flag
    ``PIN_MEMORY`` at call time; 0.30+ builds its host buffers with ``CpuGpuBuffer``, whose
    ``pin_memory=PIN_MEMORY`` default was fixed at import and whose ``copy_to_gpu`` reads its own
    module's flag (True with the CUDA wheel on a GPU-less machine, where pinning then fails:
    "Found no NVIDIA driver")."""
    buffer = getattr(llm_base_proposer, "CpuGpuBuffer", None)
    for module in (llm_base_proposer, sys.modules.get(getattr(buffer, "__module__", ""))):
        if hasattr(module, "PIN_MEMORY"):
            module.PIN_MEMORY = False
    defaults = getattr(getattr(buffer, "__init__", None), "__kwdefaults__", None)
    if defaults and "pin_memory" in defaults:
        defaults["pin_memory"] = False


def write_configs(root: Path) -> dict[str, Path]:
    """Tiny ``config.json`` model directories: target, EAGLE-3 drafter, PARD draft model."""
    base = {
        "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": MAX_MODEL_LEN, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
        "rope_theta": 10000.0,
    }  # fmt: skip
    cfgs = {
        "target": {**base, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4},
        "eagle3": {**base, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 2,
                   "draft_vocab_size": VOCAB, "ptd_token_id": MASK_TOKEN},
        "pard": {**base, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                 "pard_token": MASK_TOKEN},
    }  # fmt: skip
    dirs = {}
    for name, cfg in cfgs.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg))
        dirs[name] = d
    return dirs


def make_vllm_config(v, dirs, method="eagle3", k=3, parallel=True, dtype="float32", **spec_kw):
    """A ``VllmConfig`` with a speculative config for ``method`` (``eagle3`` or ``draft_model``)."""
    mc = v.config.ModelConfig(
        model=str(dirs["target"]), skip_tokenizer_init=True, dtype=dtype,
        max_model_len=MAX_MODEL_LEN,
    )  # fmt: skip
    draft = dirs["eagle3"] if method == "eagle3" else dirs["pard"]
    sc = v.config.SpeculativeConfig(
        method=method, model=str(draft), num_speculative_tokens=k, parallel_drafting=parallel,
        target_model_config=mc, target_parallel_config=v.config.ParallelConfig(), **spec_kw,
    )  # fmt: skip
    return v.config.VllmConfig(
        model_config=mc, speculative_config=sc, device_config=v.config.DeviceConfig("cpu")
    )


def make_proposer(v, vllm_config, mask_hidden: torch.Tensor | None = None):
    """vLLM's proposer for the config on the CPU, with what ``load_model`` /
    ``initialize_attn_backend`` would have set (block size, the projected mask vector)."""
    spec = vllm_config.speculative_config
    cls = v.EagleProposer if spec.method == "eagle3" else v.DraftModelProposer
    p = cls(vllm_config, torch.device("cpu"))
    p.block_size = BLOCK_SIZE
    if mask_hidden is not None and p.parallel_drafting_hidden_state_tensor is not None:
        p.parallel_drafting_hidden_state_tensor.copy_(mask_hidden)
    return p


class Spy:
    """Counts calls of a function or a warm-up dispatcher (0.30+), or launches of a Triton kernel
    (``kernel[grid](...)``, 0.28); other attributes are the target's (a dispatcher's
    ``register_warmup``, a kernel's ``fn``)."""

    def __init__(self, target):
        self.target, self.calls = target, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.target(*args, **kwargs)

    def __getitem__(self, grid):
        self.calls += 1
        return self.target[grid]

    def __getattr__(self, name):
        return getattr(self.target, name)


class StubRequest:
    """The one ``CachedRequestState`` method Stage A's host code calls."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def get_token_id(self, idx: int) -> int:
        return self.tokens[idx]


def stub_input_batch(backup_tokens: list[int], vocab_size: int):
    """``requests`` and an ``InputBatch`` stand-in such that request ``i``'s backup token (its
    token at ``num_tokens_no_spec[i] - 1``) is ``backup_tokens[i]``."""
    n = len(backup_tokens)
    req_ids = [f"req{i}" for i in range(n)]
    requests = {
        rid: StubRequest([7, 8, tok]) for rid, tok in zip(req_ids, backup_tokens, strict=True)
    }
    batch = types.SimpleNamespace(
        num_reqs=n, req_ids=req_ids, num_tokens_no_spec=np.full(n, 3, dtype=np.int64),
        vocab_size=vocab_size,
    )  # fmt: skip
    return requests, batch


def sampling_metadata(v, temperature, generators=None, top_k=None, top_p=None):
    """A ``SamplingMetadata`` without penalties / processors (temperature None = all greedy)."""
    all_greedy = temperature is None
    all_random = not all_greedy and bool((temperature != 0).all())
    empty = torch.tensor([])
    return v.SamplingMetadata(
        temperature=temperature, all_greedy=all_greedy, all_random=all_random, top_p=top_p,
        top_k=top_k, generators=generators or {}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=empty, presence_penalties=empty,
        repetition_penalties=empty, output_token_ids=[], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=v.LogitsProcessors(), spec_token_ids=[],
    )  # fmt: skip
