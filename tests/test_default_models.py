"""The packaged default pair: size budget, shapes the CUDA kernels serve, offline loading, and
lossless speculative decoding with both heads."""

from __future__ import annotations

import json

import pytest
import torch

from peagle import default_models

pytestmark = pytest.mark.skipif(
    not default_models.available(), reason="this build ships no default model pair"
)


def test_size_budget_and_record():
    # the whole pair within 32 MiB of the wheel, every file within a GPU run's 16-MiB return limit
    files = [f for f in default_models.ROOT.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 32 * 1024 * 1024
    assert max(f.stat().st_size for f in files) <= 16 * 1024 * 1024
    info = default_models.info()
    assert info["python_version"].count(".") == 2
    assert set(info["acceptance_length"]) == {"peagle", "eagle3"}


def test_shapes_and_dtypes():
    from safetensors import safe_open

    cfg = json.loads((default_models.target_dir() / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["head_dim"] in (64, 128)
    for d in (default_models.target_dir(), *map(default_models.drafter_dir, ("peagle", "eagle3"))):
        # one file, or shards named by an index (the v3 target); never both
        shards = sorted(d.glob("*.safetensors"))
        assert shards and ((d / "model.safetensors.index.json").is_file() == (len(shards) > 1))
        dtypes = set()
        for shard in shards:
            with safe_open(str(shard), "pt") as f:
                dtypes |= {f.get_slice(k).get_dtype() for k in f.keys() if k not in ("d2t", "t2d")}
        assert dtypes == {"BF16"}, (d, dtypes)
    p = json.loads((default_models.drafter_dir("peagle") / "config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_models.target_dir()))
    assert p["ptd_token_id"] == tok.convert_tokens_to_ids("<|mask|>")
    assert p["head_dim"] == cfg["head_dim"] and p["hidden_size"] == cfg["hidden_size"]
    with pytest.raises(ValueError, match="drafters for"):
        default_models.drafter_dir("medusa")


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_offline_load_and_lossless_decode(method, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    from peagle.decode import SamplingParams, SpecDecoder
    from peagle.models import load_model_pair

    target_dir = str(default_models.target_dir())
    tok = AutoTokenizer.from_pretrained(target_dir)
    runner, drafter = load_model_pair(
        target_dir, str(default_models.drafter_dir(method)), dtype=torch.float32
    )
    prompts = [tok(p)["input_ids"] for p in ("def fib(n):\n", "import os\n\nclass Path")]
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    spec = SpecDecoder(runner, drafter, method=method, num_speculative_tokens=5, cuda_graphs="off")
    plain = SpecDecoder(runner, None, method="none", cuda_graphs="off")
    got = spec.generate(prompts, sp)
    want = plain.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # the drafter is useful: more than one token per target step on average
    assert sum(o.stats.num_accepted_tokens for o in got) > 0


def test_generate_uses_the_packaged_pair_by_default(capsys):
    from peagle.cli import main

    rc = main(
        [
            "generate",
            "--prompt",
            "def parse(text):\n",
            "--max-new-tokens",
            "16",
            "--device",
            "cpu",
            "--json",
            "--no-progress",
            "-k",
            "4",
        ]
    )
    assert rc == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["num_generated_tokens"] == 16 or record["finish_reason"] == "stop"
    assert record["acceptance_length"] >= 1.0 and record["text"]


def test_generate_without_speculation_on_the_packaged_target(capsys):
    """Without a drafter the target needs no EAGLE-3 feature layers (``peagle generate --method
    none`` crashed on the 4-layer CPU-recipe target, too shallow for the defaults)."""
    from peagle.cli import main

    argv = ["generate", "--prompt", "def parse(text):\n", "--max-new-tokens", "12", "--device",
            "cpu", "--json", "--no-progress", "--ignore-eos"]  # fmt: skip
    assert main([*argv, "--method", "none"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*argv, "--method", "peagle", "-k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plain["text"] and plain["text"] == spec["text"]
