"""``peagle generate`` on a tiny saved target/drafter pair (CPU, no downloads)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch
from cli_helpers import user_error
from tiny_models import make_tokenizer, save_pair, word

from peagle import default_models
from peagle.cli import main

CHAT = "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("pair"))


def greedy_ids(model, prompt_ids, n, eos=None):
    """transformers' greedy continuation, cut after the first ``eos``."""
    x = torch.tensor([prompt_ids])
    mask = torch.ones_like(x)  # explicit: token 0 must not be taken for padding
    out = model.generate(x, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)
    ids = out[0, len(prompt_ids) :].tolist()
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def greedy_text(model, prompt_ids, n, eos=None):
    return " ".join(word(t) for t in greedy_ids(model, prompt_ids, n, eos) if t > 1)


def run_cli(argv, capsys, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    if "--device" not in argv:  # the tiny models (head_dim 16) are CPU-only; CUDA serves 64/128
        argv = [*argv, "--device", "cpu"]
    rc = main(["generate", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_generate_json_matches_greedy(pair, capsys):
    tdir, ddir, model = pair
    prompts = ["w5 w7 w9", "w11 w3 w60 w2"]
    argv = ["--model", str(tdir), "--draft-model", str(ddir), "-k", "3", "--max-new-tokens", "12"]
    argv += ["--json", "--seed", "0", "--device", "cpu"]
    for p in prompts:
        argv += ["--prompt", p]
    rc, out, _ = run_cli(argv, capsys)
    assert rc == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 2
    tok = make_tokenizer()
    for p, rec in zip(prompts, records, strict=True):
        for key in ("text", "num_generated_tokens", "acceptance_length", "tokens_per_second"):
            assert key in rec
        assert rec["prompt"] == p
        expect = greedy_ids(model, tok(p)["input_ids"], 12, eos=1)  # <eos> is id 1
        assert rec["token_ids"] == expect and rec["num_generated_tokens"] == len(expect)
        assert rec["finish_reason"] == ("stop" if expect[-1] == 1 else "length")
        assert rec["text"] == greedy_text(model, tok(p)["input_ids"], 12, eos=1)
        assert 1.0 <= rec["acceptance_length"] <= 4.0 and rec["tokens_per_second"] > 0


@pytest.mark.parametrize("method", ["eagle3", "none"])
def test_generate_methods_agree(pair, capsys, method):
    tdir, ddir, model = pair
    argv = ["--model", str(tdir), "--method", method, "--prompt", "w8 w1 w20", "--json"]
    argv += ["--max-new-tokens", "9", "--chat-template", "none", "--ignore-eos"]
    if method != "none":
        argv += ["--draft-model", str(ddir), "-k", "2"]
    rc, out, _ = run_cli(argv, capsys)
    rec = json.loads(out)
    assert rc == 0 and rec["num_generated_tokens"] == 9
    ids = make_tokenizer()("w8 w1 w20")["input_ids"]
    assert rec["text"] == greedy_text(model, ids, 9)
    if method == "none":
        assert rec["acceptance_length"] == 1.0


def test_prompts_from_stdin_and_file(pair, capsys, monkeypatch, tmp_path):
    tdir, ddir, _ = pair
    base = ["--model", str(tdir), "--draft-model", str(ddir), "--max-new-tokens", "4"]
    rc, out, err = run_cli(base, capsys, stdin="w5 w6\n\nw7 w8 w9\n", monkeypatch=monkeypatch)
    assert rc == 0 and out.count("=== [") == 2 and "acceptance length" in err
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "w5 w6"}\n"w9"\n{"text": "w10 w11"}\n')
    rc, out, _ = run_cli(base + ["--prompts-file", str(f), "--json"], capsys)
    assert [json.loads(x)["prompt"] for x in out.splitlines()] == ["w5 w6", "w9", "w10 w11"]


def test_chat_template_auto(tmp_path, capsys):
    tdir, ddir, model = save_pair(tmp_path, chat_template=CHAT)
    argv = ["--model", str(tdir), "--draft-model", str(ddir), "--prompt", "w50", "--json"]
    argv += ["--max-new-tokens", "5", "--ignore-eos"]
    rc, out, _ = run_cli(argv, capsys)
    ids = make_tokenizer()("w3 w50 w4")["input_ids"]  # what the template renders
    assert json.loads(out)["text"] == greedy_text(model, ids, 5)
    rc, out2, _ = run_cli(argv + ["--chat-template", "none"], capsys)
    assert json.loads(out2)["text"] == greedy_text(model, make_tokenizer()("w50")["input_ids"], 5)


def test_cli_errors(pair, capsys, tmp_path):
    tdir, ddir, _ = pair
    if not default_models.available():  # otherwise the packaged pair is the default
        user_error(capsys, ["generate", "--prompt", "w5"], match="--model: required")
    user_error(capsys, ["generate", "--model", str(tdir), "--prompt", "w5"],
               match="needs --draft-model")  # fmt: skip
    argv = ["generate", "--model", str(tdir), "--method", "none", "--prompts-file", "nope"]
    user_error(capsys, argv, match="--prompts-file nope: no such file")
    save_pair(tmp_path, parallel=False)
    argv = ["generate", "--model", str(tdir), "--draft-model", str(tmp_path / "drafter")]
    user_error(capsys, [*argv, "--prompt", "w5", "--device", "cpu"], match="mask_hidden")


def test_python_m_help():
    res = subprocess.run(
        [sys.executable, "-m", "peagle", "generate", "--help"], capture_output=True, text=True
    )
    assert res.returncode == 0
    for flag in ("--draft-model", "--prompts-file", "--num-speculative-tokens", "--json"):
        assert flag in res.stdout
    assert "examples:" in res.stdout


def test_generate_refuses_k_beyond_the_trained_depth(tmp_path, capsys):
    tdir, ddir, _ = save_pair(tmp_path)
    cfg_path = ddir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["peagle_training"] = {"method": "peagle", "num_depths": 2}
    cfg_path.write_text(json.dumps(cfg))
    base = ["--model", str(tdir), "--draft-model", str(ddir), "--prompt", "w5",
            "--max-new-tokens", "3"]  # fmt: skip
    user_error(capsys, ["generate", *base, "-k", "3", "--device", "cpu"],
               match="trained for at most 2 parallel drafts")  # fmt: skip
    rc, _, err = run_cli([*base, "-k", "2"], capsys)
    assert rc == 0 and "exceeds the depth" not in err
    rc, _, err = run_cli([*base, "-k", "3", "--method", "eagle3"], capsys)
    assert rc == 0 and "K=3 exceeds the depth this drafter was trained for (2)" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only torch")
def test_demo_on_cuda_without_cuda_is_a_clear_error(capsys):
    user_error(capsys, ["demo", "--device", "cuda"], match="needs a CUDA build of torch")


def test_output_into_a_closed_pipe_is_no_traceback(tmp_path):
    """`peagle tune ... | head -1` used to end in a BrokenPipeError traceback (the output is
    larger than a pipe buffer, so the writer outlives the reader)."""
    rows = {
        f"{m},K={k},C=1": {"method": m, "k": k, "concurrency": 1, "tokens_per_s": 100.0 + k}
        for m, ks in (("none", [0]), ("peagle", range(1, 4000)), ("eagle3", range(1, 4000)))
        for k in ks
    }
    res_file = tmp_path / "e2e.json"
    res_file.write_text(json.dumps({"configs": rows}))
    cmd = f"{sys.executable} -m peagle tune --results {res_file} | head -1"
    res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert res.stdout.startswith("== concurrency 1")
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr
