"""Recipe v3's versions of the corpus stages, the measurement and the record (issue 19).

The corpus is every Python source of the machine (:mod:`default_pair.site_corpus`), split by
distribution into train / validation / evaluation before anything is trained. The tokenizer sees
only (a capped sample of) the training split; the target's loss during and after training is
measured on the validation split; the evaluation split and HumanEval are used by the final
measurement only.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from default_pair import humaneval, site_corpus
from default_pair.tokenizer import EOS_TOKEN, load_tokenizer, train_tokenizer

if TYPE_CHECKING:
    from default_pair.recipes import Recipe
    from default_pair.stages import Context

SPLITS = site_corpus.SPLITS


def corpus_dir(ctx: Context) -> Path:
    return ctx.work_dir / "corpus"


def tokenizer_texts(docs: list[site_corpus.SourceFile], max_bytes: int) -> list[str]:
    """The texts the BPE is trained on: training-split files in content-hash order until
    ``max_bytes`` (0 = all). Deterministic, and a spread over distributions (hash order)."""
    out, total = [], 0
    for d in sorted(docs, key=lambda d: d.sha256):
        if max_bytes and total >= max_bytes:
            break
        out.append(d.text)
        total += d.nbytes
    return out


def capped_docs(docs: list[dict], max_bytes: int) -> list[dict]:
    """The training stream's files under ``Recipe.train_max_bytes``: ``docs`` in content-hash
    order until ``max_bytes`` of text (0 = all, in their order). Deterministic, spread over
    distributions, and a superset of the tokenizer's files when ``max_bytes`` >= its cap."""
    if not max_bytes:
        return docs
    out, total = [], 0
    for d in sorted(docs, key=lambda d: d["sha256"]):
        if total >= max_bytes:
            break
        out.append(d)
        total += len(d["text"].encode())
    return out


def _write_split(path: Path, docs: list[site_corpus.SourceFile]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(
                json.dumps({"unit": d.unit, "path": d.path, "sha256": d.sha256, "text": d.text})
                + "\n"
            )
    tmp.replace(path)


def read_split(ctx: Context, split: str) -> list[dict]:
    with open(corpus_dir(ctx) / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def stage_tokenizer(ctx: Context) -> bool:
    corpus = site_corpus.collect(
        paths=ctx.corpus_paths, stdlib_root=ctx.stdlib_root, include_stdlib=ctx.include_stdlib
    )
    rec = corpus.record()
    for s in SPLITS:
        if not corpus.splits[s]:
            raise SystemExit(f"corpus v3: the {s} split is empty ({rec})")
    cdir = corpus_dir(ctx)
    cdir.mkdir(parents=True, exist_ok=True)
    for s in SPLITS:
        _write_split(cdir / f"{s}.jsonl", corpus.splits[s])
    (cdir / "splits.json").write_text(
        json.dumps({"unit_split": corpus.unit_split, "versions": corpus.versions}, indent=1)
    )
    ctx.log(
        "corpus v3: "
        + "; ".join(
            f"{s} {rec[s]['files']} files {rec[s]['bytes'] / 1e6:.1f} MB "
            f"({rec[s]['distributions']} units)"
            for s in SPLITS
        )
    )
    for s in ("validation", "evaluation"):
        ctx.log(f"corpus v3: {s} distributions: {', '.join(rec[s]['distribution_list'])}")
    texts = tokenizer_texts(corpus.splits["train"], ctx.recipe.tokenizer_max_bytes)
    trained_on = sorted(hashlib.sha256(t.encode()).hexdigest() for t in texts)
    tok = train_tokenizer(texts, ctx.recipe.vocab_size, ctx.tokenizer_dir)
    (ctx.work_dir / "tokenizer_trained_on.sha256").write_text("\n".join(trained_on) + "\n")
    rec["tokenizer_training"] = {
        "files": len(texts),
        "bytes": sum(len(t.encode()) for t in texts),
        "split": "train",
    }
    rec["vocab_size"] = len(tok)
    ctx.info["corpus"] = rec
    ctx.log(
        f"tokenizer: {len(tok)} tokens, trained on {len(texts)} training files "
        f"({rec['tokenizer_training']['bytes'] / 1e6:.1f} MB)"
    )
    return True


def _encode(tok, texts: list[str], eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stream int32, offsets int64 [docs + 1])``: the documents' tokens, each followed by EOS;
    document ``i`` is ``stream[offsets[i] : offsets[i + 1] - 1]``."""
    import numpy as np

    backend = tok.backend_tokenizer
    parts, lengths = [], []
    for s in range(0, len(texts), 512):
        for enc in backend.encode_batch(texts[s : s + 512], add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype=np.int32)
            parts.append(np.append(ids, np.int32(eos)))
            lengths.append(ids.size + 1)
    stream = torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, torch.int32)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return stream, offsets


def sample_prompts(
    tok: Any,
    docs: list[dict],
    stream: torch.Tensor,
    offsets: torch.Tensor,
    num: int,
    prompt_tokens: int,
    new_tokens: int,
    seed: int,
) -> list[dict]:
    """``num`` prompts: a window of ``prompt_tokens`` tokens at a random place of a random file
    with room for ``new_tokens`` more, the distribution drawn first (uniformly over the split's
    distributions, so one large package does not make the whole set)."""
    rng = random.Random(seed)
    by_unit: dict[str, list[int]] = {}
    for i, d in enumerate(docs):
        n = int(offsets[i + 1] - offsets[i]) - 1
        if n > prompt_tokens + new_tokens:
            by_unit.setdefault(d["unit"], []).append(i)
    if not by_unit:
        raise SystemExit(f"no file has more than {prompt_tokens + new_tokens} tokens")
    units = sorted(by_unit)
    out = []
    for _ in range(num):
        i = rng.choice(by_unit[rng.choice(units)])
        n = int(offsets[i + 1] - offsets[i]) - 1
        start = int(offsets[i]) + rng.randrange(0, n - prompt_tokens - new_tokens)
        ids = stream[start : start + prompt_tokens].tolist()
        out.append(
            {
                "prompt": tok.decode(ids),
                "token_ids": ids,
                "unit": docs[i]["unit"],
                "path": docs[i]["path"],
            }
        )
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def stage_tokenize(ctx: Context) -> bool:
    tok = load_tokenizer(ctx.tokenizer_dir)
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    r = ctx.recipe
    streams = {}
    for s in SPLITS:
        docs = read_split(ctx, s)
        if s == "train" and r.train_max_bytes:
            n_all = len(docs)
            docs = capped_docs(docs, r.train_max_bytes)
            ctx.info.setdefault("corpus", {}).setdefault(s, {})["stream_files"] = len(docs)
            ctx.log(f"train: the stream takes {len(docs)} of {n_all} files (train_max_bytes)")
        stream, offsets = _encode(tok, [d["text"] for d in docs], eos)
        torch.save(stream, ctx.work_dir / f"{s}_stream.pt")
        torch.save(offsets, ctx.work_dir / f"{s}_offsets.pt")
        streams[s] = (docs, stream, offsets)
        nbytes = sum(len(d["text"].encode()) for d in docs)
        ctx.log(
            f"{s}: {len(docs)} files, {stream.numel()} tokens "
            f"({nbytes / max(1, stream.numel()):.2f} bytes/token)"
        )
        ctx.info.setdefault("corpus", {}).setdefault(s, {})["tokens"] = stream.numel()
    sets = {"eval_prompts": ("evaluation", r.eval_prompts, 1234)}
    sets["validation_prompts"] = ("validation", r.validation_prompts, 4321)
    for name, (split, num, seed) in sets.items():
        if num <= 0:
            continue
        docs, stream, offsets = streams[split]
        prompts = sample_prompts(
            tok, docs, stream, offsets, num, r.eval_prompt_tokens, r.eval_new_tokens, seed
        )
        _write_jsonl(ctx.work_dir / f"{name}.jsonl", prompts)
        ctx.log(f"{name}: {len(prompts)} prompts of {r.eval_prompt_tokens} tokens ({split})")
    if r.humaneval:
        problems, source = humaneval.load_problems()
        if r.humaneval_prompts > 0:
            problems = problems[: r.humaneval_prompts]
        rows = [
            {
                "prompt": p["prompt"],
                "token_ids": tok(p["prompt"], add_special_tokens=False)["input_ids"],
                "task_id": p["task_id"],
            }
            for p in problems
        ]
        _write_jsonl(ctx.work_dir / "humaneval_prompts.jsonl", rows)
        ctx.info.setdefault("corpus", {})["humaneval"] = {"problems": len(rows), "source": source}
        ctx.log(f"humaneval: {len(rows)} prompts from {source}")
    return True


# (set name, prompt file) measured by the final measurement (the validation set is the
# ablation's; scripts/ablate_default_pair.py measures it)
def eval_sets(recipe: Recipe) -> list[tuple[str, str]]:
    sets = []
    if recipe.eval_prompts > 0:
        sets.append(("evaluation", "eval_prompts.jsonl"))
    if recipe.humaneval:
        sets.append(("humaneval", "humaneval_prompts.jsonl"))
    return sets


def load_prompt_ids(path: Path) -> list[list[int]]:
    with open(path) as f:
        return [json.loads(line)["token_ids"] for line in f if line.strip()]


def stage_measure(ctx: Context) -> bool:
    """Acceptance per K for both heads on every evaluation set (resumable by set, head, K), and
    the target's loss on the evaluation split (its first look at that split)."""
    import time

    from default_pair.measure import acceptance_lengths
    from default_pair.target_lm import eval_loss

    r = ctx.recipe
    partial_path = ctx.work_dir / "measure_partial.json"
    partial = json.loads(partial_path.read_text()) if partial_path.is_file() else {}
    measured_now = []

    def save_partial():
        tmp = partial_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(partial, indent=2))
        tmp.replace(partial_path)

    def should_stop():
        return time.monotonic() > ctx.deadline

    if "target_loss_evaluation" not in partial:
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(str(ctx.package_dir / "target"), dtype=dtype)
        model.to(ctx.device)
        stream = torch.load(ctx.work_dir / "evaluation_stream.pt")
        partial["target_loss_evaluation"] = eval_loss(
            model, stream, r.target_train.seq_len, ctx.device, 256, spread=True, batch=16
        )
        del model
        save_partial()
        ctx.log(f"target: evaluation-split loss {partial['target_loss_evaluation']:.4f}")
    for set_name, fname in eval_sets(r):
        ids = load_prompt_ids(ctx.work_dir / fname)
        for method in ("peagle", "eagle3"):
            key = f"{set_name}/{method}"
            done = {int(k): v for k, v in partial.get(key, {}).items()}
            if len(done) == len(r.ks):
                continue
            if measured_now and should_stop():
                return False

            def on_result(k, res, key=key):
                partial.setdefault(key, {})[str(k)] = res
                save_partial()
                measured_now.append(key)

            res = acceptance_lengths(
                ctx.package_dir / "target",
                ctx.package_dir / method,
                method,
                [],
                list(r.ks),
                r.eval_new_tokens,
                ctx.device,
                max_num_seqs=r.measure_batch,
                done=done,
                should_stop=should_stop,
                on_result=on_result,
                prompt_ids=ids,
            )
            if res is None:
                ctx.log(f"measure: paused ({key}: {len(partial.get(key, {}))} Ks done)")
                return False
            ctx.log(
                f"{set_name} {method} AL per K: "
                + " ".join(f"K={k}:{v['acceptance_length']:.2f}" for k, v in res.items())
            )
    results = {
        "python_version": sys.version.split()[0],
        "recipe": r.name,
        "max_new_tokens": r.eval_new_tokens,
        "target_loss_evaluation": partial["target_loss_evaluation"],
        "sets": {},
    }
    for set_name, fname in eval_sets(r):
        results["sets"][set_name] = {
            "num_prompts": len(load_prompt_ids(ctx.work_dir / fname)),
            "heads": {m: partial[f"{set_name}/{m}"] for m in ("peagle", "eagle3")},
        }
    (ctx.work_dir / "results.json").write_text(json.dumps(results, indent=2))
    ctx.info["results"] = results
    return True


EVAL_PROMPTS_FILE = "eval_prompts.jsonl"


def package_eval_prompts(ctx: Context) -> None:
    """Ship the evaluation split's prompts with the pair (``peagle bench e2e`` reads them: the
    evaluation distributions need not be installed where it runs); ``pair.json`` names the file."""
    import shutil

    src = ctx.work_dir / "eval_prompts.jsonl"
    dst = ctx.package_dir / EVAL_PROMPTS_FILE
    if src.is_file():
        shutil.copyfile(src, dst)
    elif dst.exists():
        dst.unlink()


def pair_record(ctx: Context) -> dict:
    """pair.json of a v3 pair."""
    r = ctx.recipe
    info = {
        "recipe": r.name,
        "python_version": ctx.info.get("corpus", {}).get("python_version"),
        "corpus": ctx.info.get("corpus", {}),
        "target": {
            "layers": r.target.num_layers,
            "hidden_size": r.target.hidden_size,
            "intermediate_size": r.target.intermediate_size,
            "head_dim": r.target.head_dim,
            "num_kv_heads": r.target.num_kv_heads,
            **ctx.info.get("target_result", {}),
        },
        "drafters": ctx.info.get("drafters", {}),
        "package_bytes": ctx.info.get("package_bytes", {}),
        "mask_token": "<|mask|>",
        "eos_token": EOS_TOKEN,
    }
    if (ctx.package_dir / EVAL_PROMPTS_FILE).is_file():
        info["eval_prompts"] = {
            "file": EVAL_PROMPTS_FILE,
            "split": "evaluation",
            "prompts": len(load_prompt_ids(ctx.package_dir / EVAL_PROMPTS_FILE)),
            "prompt_tokens": r.eval_prompt_tokens,
            "seed": 1234,
        }
    res = ctx.info.get("results")
    if res and res.get("sets"):
        info["target"]["evaluation_loss"] = res["target_loss_evaluation"]
        info["acceptance_length_by_set"] = {
            s: {
                m: {k: v["acceptance_length"] for k, v in per_k.items()}
                for m, per_k in d["heads"].items()
            }
            for s, d in res["sets"].items()
        }
        main_set = "evaluation" if "evaluation" in res["sets"] else next(iter(res["sets"]))
        info["acceptance_length"] = info["acceptance_length_by_set"][main_set]
        info["eval"] = {
            "sets": {s: d["num_prompts"] for s, d in res["sets"].items()},
            "prompts": res["sets"][main_set]["num_prompts"],
            "max_new_tokens": res["max_new_tokens"],
            "greedy": True,
            "ignore_eos": True,
        }
    return info
