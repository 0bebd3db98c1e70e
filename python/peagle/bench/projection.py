"""Projected decode throughput for a larger target: per-pass timings of a random-weight model.

The default pair is tiny, so its end-to-end numbers are dominated by per-step overhead. To show
what speculation buys on a model whose passes cost real GPU time, this module builds a
Llama-shaped target with **random weights** (default: Llama-3.2-1B's shape, below) and P-EAGLE /
EAGLE-3 drafters of matching hidden size (layer counts of the default pair's drafters), puts them
in a :class:`~peagle.decode.SpecDecoder` and times, per K and concurrency C, the engine's own
graph-capturable phases on a uniform decode batch (every request at ``context`` tokens, K drafts):

* verify: ``SpecDecoder.target_and_verify_eager`` -- the target pass over K+1 rows per request
  (paged attention, KV writes) + ``verify_chain``;
* draft: ``SpecDecoder.draft_eager`` -- ``fc`` + ``prepare_draft_inputs`` + ONE drafter pass over
  the 2K-row layout (P-EAGLE) or the first pass + K-1 one-row passes (EAGLE-3).

On CUDA each phase is captured in a CUDA graph (as the engine runs uniform steps) and timed with
CUDA events (median of replays); on the CPU it runs eagerly, timed with ``perf_counter`` (tests).
:func:`project` combines the timings with the acceptance lengths AL(K) measured with the trained
pair (or ``pair.json``) and the measured host overhead per step:

    projected tokens/s = C * AL(K) / (t_verify(K) + t_draft(K) + overhead)

Every projected row carries ``"projection": true``: random weights give no acceptance of their
own; the AL comes from the small trained pair, which a larger trained pair would exceed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class ProjectionShape:
    """Target shape (Llama-3.2-1B by default: 1.24 B parameters, tied embeddings) and context."""

    hidden_size: int = 2048
    num_layers: int = 16
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 8192
    vocab_size: int = 128256
    context: int = 1024  # tokens already in each request's KV cache
    peagle_layers: int = 2  # drafter layers (the default pair's)
    eagle3_layers: int = 1

    def describe(self) -> str:
        return (
            f"Llama-shaped random-weight target: hidden {self.hidden_size}, {self.num_layers} "
            f"layers, {self.num_heads}/{self.num_kv_heads} heads x {self.head_dim}, intermediate "
            f"{self.intermediate_size}, vocab {self.vocab_size}; drafters hidden "
            f"{self.hidden_size} (P-EAGLE {self.peagle_layers} layers, EAGLE-3 "
            f"{self.eagle3_layers}); context {self.context} tokens per request"
        )

    def to_dict(self) -> dict:
        return asdict(self)


TINY_SHAPE = ProjectionShape(
    hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
    intermediate_size=256, vocab_size=512, context=48,
)  # fmt: skip


def build_target(shape: ProjectionShape, device, dtype, seed: int = 0):
    """A random-weight ``LlamaForCausalLM`` of ``shape`` wrapped in a ``TargetRunner``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from peagle.models import TargetRunner

    cfg = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max(2048, shape.context + 64),
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return TargetRunner(model.to(dtype).eval(), aux_layer_ids(shape.num_layers))


def aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default feature layers ``[2, L//2, L-3]``; three increasing layers for the tiny
    test shapes where the default is not increasing."""
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    return [0, num_layers // 2, num_layers - 1]


def build_drafter(shape: ProjectionShape, method: str, target, seed: int = 1):
    """A random-weight drafter of ``method`` ("peagle" or "eagle3") for ``target``."""
    from peagle.models import DrafterConfig, Eagle3Drafter

    aux = aux_layer_ids(shape.num_layers)
    d = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.peagle_layers if method == "peagle" else shape.eagle3_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": max(2048, shape.context + 64),
        "target_hidden_size": shape.hidden_size,
        "vocab_size": shape.vocab_size,
        "draft_vocab_size": shape.vocab_size,
        "eagle_config": {"use_aux_hidden_state": True},
    }
    d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = aux
    if method == "peagle":
        d["ptd_token_id"] = shape.vocab_size - 1
    torch.manual_seed(seed)
    with torch.device(target.device):
        drafter = Eagle3Drafter(DrafterConfig.from_dict(d), with_mask_hidden=method == "peagle")
        if drafter.mask_hidden is not None:
            torch.nn.init.normal_(drafter.mask_hidden, std=0.02)
    return drafter.to(target.dtype).eval()


def uniform_step(
    device, vocab_size: int, concurrency: int, k: int, context: int, block_size: int = 16
):
    """``(StepTensors, num_blocks)`` of a steady decode step: ``concurrency`` requests with
    ``context`` tokens, each verifying its last token + ``k`` drafts (the layout the engine's CUDA
    graphs run), and the KV blocks the layout needs (block 0 is the null block)."""
    from peagle.decode.blocks import blocks_for
    from peagle.decode.inputs import StepTensors

    dev, bs, c = torch.device(device), block_size, concurrency
    rows = k + 1
    width = blocks_for(context + 2 * k + 2, bs)
    # Request i owns blocks 1 + i*width ... (block 0 is the null block).
    table = 1 + torch.arange(c * width, dtype=torch.int32).view(c, width)
    p0 = context - 1
    pos = (p0 + torch.arange(rows)).repeat(c)
    req = torch.arange(c).repeat_interleave(rows)
    slots = table[req, pos // bs].long() * bs + pos % bs
    i32, i64 = torch.int32, torch.int64
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (c * rows,), generator=g, dtype=i32)
    all_rows = torch.arange(c * rows)
    seq = torch.full((c,), p0 + rows, dtype=i32)
    return StepTensors(
        input_ids=ids.to(dev),
        positions=pos.to(dev),
        slot_mapping=slots.to(dev),
        query_start_loc=(torch.arange(c + 1) * rows).to(i32).to(dev),
        seq_lens=seq.to(dev),
        block_table=table.to(dev),
        logits_indices=all_rows.to(dev),
        draft_row_indices=all_rows[all_rows % rows != 0].to(dev),
        cu_num_draft_tokens=((torch.arange(c) + 1) * k).to(i32).to(dev),
        temperature=torch.zeros(c, device=dev),
        top_k=None,
        top_p=None,
        seeds=torch.arange(c, dtype=i64).to(dev),
        offsets=torch.zeros(c, dtype=i64).to(dev),
        request_mask=None,
        backup_next_token_ids=ids.view(c, rows)[:, 0].contiguous().to(dev),
        drafter_seq_lens=seq.to(dev),
        max_query_len=rows,
    ), c * width + 1


def time_fn(fn, device: torch.device, replays: int = 20) -> float:
    """Median ms of ``fn()``: captured in a CUDA graph and replayed on CUDA, eager on the CPU."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(max(1, replays)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    from peagle.bench.timing import bench_graph

    return bench_graph(lambda _i: fn(), calls_per_graph=1, replays=replays, warmup=3) / 1e3


def time_passes(
    target, drafter, method: str, k: int, concurrency: int, shape: ProjectionShape,
    replays: int = 20,
) -> dict:  # fmt: skip
    """``{"t_verify_ms", "t_draft_ms"}`` of one steady step of ``method`` at K, concurrency."""
    from peagle.decode import SpecDecoder

    k_eff = 0 if method == "none" else k
    t, num_blocks = uniform_step(
        target.device, target.vocab_size, concurrency, k_eff, shape.context
    )
    engine = SpecDecoder(
        target,
        None if method == "none" else drafter,
        method=method,
        num_speculative_tokens=max(k, 1),
        max_num_seqs=concurrency,
        max_model_len=shape.context + 2 * k + 4,
        block_size=16,
        num_blocks=num_blocks,
        cuda_graphs="off",  # the phases are captured here, one graph per phase
    )
    with torch.inference_mode():
        t_verify = time_fn(lambda: engine.target_and_verify_eager(t, k_eff), target.device, replays)
        out_tokens, _, aux = engine.target_and_verify_eager(t, k_eff)
        t_draft = 0.0
        if method != "none":
            t_draft = time_fn(
                lambda: engine.draft_eager(t, out_tokens, aux), target.device, replays
            )
    return {"t_verify_ms": round(t_verify, 4), "t_draft_ms": round(t_draft, 4)}


# ---------------------------------------------------------------------------------------------
# Combining timings with measured acceptance lengths
# ---------------------------------------------------------------------------------------------


def acceptance_length(method: str, k: int, concurrency: int, measured: dict, pair_al: dict):
    """``(AL, source)``: the e2e row of (method, K, C), else the mean over the e2e rows of
    (method, K), else ``pair.json``'s held-out AL at K, else None."""
    if method == "none":
        return 1.0, "none"
    rows = [r for r in measured.values() if r["method"] == method and r["k"] == k]
    same = [r for r in rows if r["concurrency"] == concurrency]
    if same:
        return same[0]["acceptance_length"], "e2e"
    if rows:
        return statistics.mean(r["acceptance_length"] for r in rows), "e2e (other concurrency)"
    al = pair_al.get(method, {}).get(str(k))
    return (float(al), "pair.json") if al is not None else (None, "missing")


def overhead_ms(method: str, k: int, concurrency: int, measured: dict) -> tuple[float, str]:
    """Measured host overhead per step (e2e wall minus GPU phase time), same config if present,
    else the median over e2e rows of the same method and concurrency, else of all rows, else 0."""
    key = (method, 0 if method == "none" else k, concurrency)
    for r in measured.values():
        if (r["method"], r["k"], r["concurrency"]) == key and "overhead_ms_per_step" in r:
            return r["overhead_ms_per_step"], "e2e"
    for pick, src in (
        (lambda r: r["method"] == method and r["concurrency"] == concurrency, "e2e (other K)"),
        (lambda r: True, "e2e (all configs)"),
    ):
        vals = [r["overhead_ms_per_step"] for r in measured.values() if pick(r)]
        vals = [v for v in vals if v is not None]
        if vals:
            return statistics.median(vals), src
    return 0.0, "none measured (0)"


def project(timings: dict, measured: dict, pair_al: dict) -> list[dict]:
    """Projected rows from the timing rows (``results["projection"]``) and the measured e2e
    rows (``results["configs"]``); each has ``"projection": True``."""
    out = []
    for r in timings.values():
        m, k, c = r["method"], r["k"], r["concurrency"]
        al, al_src = acceptance_length(m, k, c, measured, pair_al)
        if al is None:
            continue
        ov, ov_src = overhead_ms(m, k, c, measured)
        step_ms = r["t_verify_ms"] + r["t_draft_ms"] + ov
        tps = c * al / (step_ms / 1e3)
        out.append({
            "method": m, "k": k, "concurrency": c, "projection": True,
            "tokens_per_s": round(tps, 1), "tpot_ms": round(step_ms / al, 4),
            "acceptance_length": round(al, 4), "t_verify_ms": r["t_verify_ms"],
            "t_draft_ms": r["t_draft_ms"], "overhead_ms_per_step": round(ov, 4),
            "al_source": al_src, "overhead_source": ov_src,
        })  # fmt: skip
    return out
