"""End to end: `peagle train` on a tiny target writes a released-format checkpoint that loads,
serves in the decode loop, and resumes exactly where an uninterrupted run would be."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import user_error
from safetensors.torch import load_file
from train_cli_helpers import TINY_TEXT, make_tiny_train_target

from peagle.cli import main as peagle_main
from peagle.models import Eagle3Drafter

TEXT = TINY_TEXT


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_cli")
    target, data, tok = make_tiny_train_target(root)
    return root, target, data, tok


def _train(target, data, out, *extra):
    argv = [
        "train",
        "--target",
        str(target),
        "--data",
        str(data),
        "--data-glob",
        "*.py",
        "--output",
        str(out),
        "--device",
        "cpu",
        "--seq-len",
        "40",
        "--no-progress",
        "--log-every",
        "1",
        "--num-layers",
        "2",
        "--warmup-steps",
        "2",
        *extra,
    ]
    return peagle_main(argv)


def test_help_has_an_example(capsys):
    with pytest.raises(SystemExit) as e:
        peagle_main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "example" in out and "peagle train --target" in out and "--partitions" in out


def test_peagle_checkpoint_format_and_decode(tiny_target_dir):
    root, target, data, tok = tiny_target_dir
    out = root / "peagle"
    rc = _train(
        target,
        data,
        out,
        "--method",
        "peagle",
        "-k",
        "3",
        "--steps",
        "3",
        "--partitions",
        "2",
        "--draft-vocab-size",
        "100",
        "--save-every",
        "2",
    )
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["ptd_token_id"] == tok.convert_tokens_to_ids("<|mask|>")
    assert cfg["draft_vocab_size"] == 100 and cfg["vocab_size"] == len(tok)
    assert cfg["num_hidden_layers"] == 2 and cfg["torch_dtype"] == "bfloat16"
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["mask_hidden"].shape == (1, 1, 96)
    assert tensors["embed_tokens.weight"].shape == (len(tok), 32)
    assert tensors["lm_head.weight"].shape == (100, 32)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    draft_ids = torch.arange(100) + tensors["d2t"]
    assert torch.equal(tensors["t2d"].nonzero().flatten(), draft_ids)
    assert (draft_ids[1:] > draft_ids[:-1]).all()  # order preserving
    # the draft vocabulary is the 100 most frequent corpus tokens
    ids = [t for f in sorted(data.glob("*.py")) for t in tok(f.read_text())["input_ids"]]
    counts = torch.bincount(torch.tensor(ids), minlength=len(tok))
    assert counts[draft_ids].min() >= counts[tensors["t2d"].logical_not()].max()
    assert "train_state.pt" in {p.name for p in out.iterdir()}
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3]
    assert len(log[-1]["acc_per_depth"]) == 3 and log[-1]["tokens_per_s"] > 0

    drafter = Eagle3Drafter.from_pretrained(out, dtype=torch.float32)
    assert drafter.supports_parallel_drafting and drafter.dtype == torch.float32
    # it serves in the decode loop: greedy speculative output == the target's own greedy output
    from peagle.decode import SamplingParams, SpecDecoder
    from peagle.models import load_model_pair

    runner, d = load_model_pair(str(target), str(out), dtype=torch.float32)
    prompt = tok("def add(a, b):")["input_ids"]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    spec = SpecDecoder(runner, d, method="peagle", num_speculative_tokens=3, cuda_graphs="off")
    plain = SpecDecoder(runner, None, method="none", cuda_graphs="off")
    assert spec.generate([prompt], sp)[0].token_ids == plain.generate([prompt], sp)[0].token_ids


def test_resume_matches_uninterrupted_run(tiny_target_dir):
    root, target, data, _ = tiny_target_dir
    common = ("--method", "peagle", "-k", "3", "--steps", "4", "--seed", "3", "--save-every", "100")
    assert _train(target, data, root / "straight", *common) == 0
    # interrupted after one step by the time limit (status 75), then resumed to the end
    assert _train(target, data, root / "resumed", *common, "--time-limit", "1e-6") == 75
    state = torch.load(root / "resumed" / "train_state.pt", weights_only=False)
    assert state["step"] == 1 and state["position"] == 1
    assert _train(target, data, root / "resumed", *common) == 0
    a = torch.load(root / "straight" / "train_state.pt", weights_only=False)
    b = torch.load(root / "resumed" / "train_state.pt", weights_only=False)
    assert a["step"] == b["step"] == 4
    for k, v in a["model"].items():
        torch.testing.assert_close(b["model"][k], v, rtol=1e-6, atol=1e-7, msg=k)
    # the resumed run continued (one log line per step), and training moved the weights
    log = [json.loads(x) for x in (root / "resumed" / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3, 4]
    w1 = state["model"]["midlayer.self_attn.q_proj.weight"]
    assert not torch.equal(w1, b["model"]["midlayer.self_attn.q_proj.weight"])


def test_eagle3_head(tiny_target_dir):
    root, target, data, _ = tiny_target_dir
    out = root / "eagle3"
    assert _train(target, data, out, "--method", "eagle3", "-k", "4", "--steps", "2") == 0
    cfg = json.loads((out / "config.json").read_text())
    assert "ptd_token_id" not in cfg and "pard_token" not in cfg
    tensors = load_file(str(out / "model.safetensors"))
    assert "mask_hidden" not in tensors and "d2t" in tensors
    d = Eagle3Drafter.from_pretrained(out)
    assert not d.supports_parallel_drafting and d.num_layers == 2


def test_bad_arguments(tiny_target_dir, capsys):
    root, target, data, _ = tiny_target_dir
    argv = ["--target", str(target), "--data", str(data), "--device", "cpu", "--num-layers", "2"]
    user_error(capsys, ["train", *argv, "--output", str(root / "bad"), "--method", "eagle3",
                        "--partitions", "2"], match="partitioning applies to P-EAGLE")  # fmt: skip
    user_error(capsys, ["train", *argv, "--output", str(root / "bad2"), "--mask-token-id",
                        "100000", "--steps", "1"], match="mask token id")  # fmt: skip
    assert not (root / "bad").exists() and not (root / "bad2").exists()


def test_corpus_text_and_pretokenised_jsonl(tiny_target_dir, tmp_path):
    from peagle.train.corpus import SequenceOrder, iter_documents, tokenize_documents

    _, _, _, tok = tiny_target_dir
    f = tmp_path / "mix.jsonl"
    f.write_text(
        json.dumps({"text": TEXT}) + "\n\n" + json.dumps({"text": list(range(1, 30))}) + "\n"
    )
    docs = list(iter_documents([f]))
    assert docs[0] == TEXT and docs[1] == list(range(1, 30))
    seqs = tokenize_documents(docs, tok, seq_len=9, min_len=4)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n_text = -(-len(ids) // 10)
    got_text = torch.cat(seqs[:n_text]).tolist()
    assert got_text == ids[: len(got_text)] and all(s.numel() <= 10 for s in seqs)
    assert torch.cat(seqs[n_text:]).tolist() == list(range(1, 30))  # as given, no EOS added
    with pytest.raises(ValueError, match="no 'prompt' field"):
        list(iter_documents([f], field="prompt"))
    order = SequenceOrder(5, seed=1)
    first = [order.index(i)[1] for i in range(5)]
    assert sorted(first) == list(range(5)) and order.index(5)[0] == 1


def test_pack_consumes_pack_sequences_per_forward(tiny_target_dir, capsys):
    root, target, data, _ = tiny_target_dir
    out = root / "packed"
    common = ("--method", "peagle", "-k", "3", "--steps", "2", "--save-every", "100")
    assert _train(target, data, out, *common, "--pack", "3", "--grad-accum", "2") == 0
    state = torch.load(out / "train_state.pt", weights_only=False)
    assert state["step"] == 2 and state["position"] == 2 * 2 * 3
    assert _train(target, data, root / "bad-pack", *common, "--pack", "0") == 2
    assert "--pack 0: must be >= 1" in capsys.readouterr().err


def test_time_budget_ends_the_run_and_resume_keeps_the_count(tiny_target_dir, monkeypatch):
    root, target, data, _ = tiny_target_dir
    out = root / "budget"
    # a budget already spent by loading: the step count is revised down to the steps made (the
    # first, compiling, step and the first timed one)
    common = ("--method", "eagle3", "-k", "2", "--steps", "100000", "--save-every", "1000")
    assert _train(target, data, out, *common, "--time-budget", "1e-3") == 0
    state = torch.load(out / "train_state.pt", weights_only=False)
    assert state["budgeted_steps"] == state["step"] == 2
    # a rerun with another budget resumes the count the budget ended at: already finished
    assert _train(target, data, out, *common, "--time-budget", "1e6") == 0
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 2


def test_export_format_speculators(tiny_target_dir):
    """``--export-format speculators`` writes a speculators 0.9 P-EAGLE checkpoint (its verifier
    the target) that peagle loads back and decodes with, greedy output equal to no speculation."""
    root, target, data, tok = tiny_target_dir
    out = root / "spec"
    rc = _train(target, data, out, "--method", "peagle", "-k", "3", "--steps", "2",
                "--export-format", "speculators", "--save-dtype", "float32")  # fmt: skip
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle"
    assert cfg["mask_token_id"] == tok.convert_tokens_to_ids("<|mask|>")
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(target)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    assert "layers.0.hidden_norm.weight" in load_file(str(out / "model.safetensors"))
    from peagle.decode import SamplingParams, SpecDecoder
    from peagle.models import load_model_pair

    runner, d = load_model_pair(str(target), str(out), dtype=torch.float32)
    assert d.supports_parallel_drafting and d.config.source_format == "speculators"
    prompt = tok("def add(a, b):")["input_ids"]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    spec = SpecDecoder(runner, d, method="peagle", num_speculative_tokens=3, cuda_graphs="off")
    plain = SpecDecoder(runner, None, method="none", cuda_graphs="off")
    assert spec.generate([prompt], sp)[0].token_ids == plain.generate([prompt], sp)[0].token_ids
