"""Issue 22 (a new user's walkthrough): one test per numbered item, driven through the CLI where
the user met it. Build items 1-2 are in tests/test_build_modes.py."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import user_error
from tiny_models import make_drafter, make_target, save_pair
from train_cli_helpers import make_tiny_train_target

from peagle.cli import main
from peagle.decode import SpecDecoder
from peagle.models import TargetRunner

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("pair22"))


@pytest.fixture(scope="module")
def train_target(tmp_path_factory):
    target, data, _ = make_tiny_train_target(tmp_path_factory.mktemp("train22"))
    return target, data


def no_hub(monkeypatch) -> None:
    """huggingface.co does not resolve (as on a machine without network); everything the CLI
    switches to offline mode is restored afterwards."""
    import socket

    import huggingface_hub.constants as hub_constants

    def no_dns(*a, **k):
        raise socket.gaierror("Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", hub_constants.HF_HUB_OFFLINE)


def gen(pair, *extra):
    tdir, ddir, _ = pair
    return ["generate", "--model", str(tdir), "--draft-model", str(ddir), *extra]


# ---------------------------------------------------------------------------------------------
# 3. Hangs and crashes: every numeric engine argument validated, naming it
# ---------------------------------------------------------------------------------------------

CLI_NUMBERS = [
    ("--max-num-seqs", "0"),
    ("--max-num-seqs", "-1"),
    ("-k", "0"),
    ("--max-model-len", "1"),
    ("--max-new-tokens", "0"),
    ("--top-k", "-1"),
    ("--top-p", "0"),
    ("--top-p", "1.5"),
    ("--temperature", "-0.5"),
    ("--threads", "0"),
]


@pytest.mark.parametrize(("flag", "value"), CLI_NUMBERS)
def test_item3_cli_numeric_args_are_validated(pair, capsys, flag, value):
    line = user_error(capsys, gen(pair, "--prompt", "w5", "--device", "cpu", flag, value))
    assert flag in line and "must be" in line


ENGINE_ARGS = [
    ("max_num_seqs", 0),
    ("max_num_seqs", -1),
    ("num_speculative_tokens", 0),
    ("max_model_len", 1),
    ("block_size", 0),
    ("num_blocks", 0),
    ("kv_cache_memory", 0),
    ("max_num_seqs", 2.5),
]


@pytest.mark.parametrize(("name", "value"), ENGINE_ARGS)
def test_item3_spec_decoder_args_are_validated(name, value):
    model, g = make_target("llama")
    with pytest.raises(ValueError, match=name):
        SpecDecoder(TargetRunner(model), make_drafter(model, g), method="peagle", **{name: value})


# ---------------------------------------------------------------------------------------------
# 4. One line, not a traceback
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_item4_generate_on_cuda_without_a_gpu(pair, capsys, device):
    line = user_error(capsys, gen(pair, "--prompt", "w5", "--device", device))
    assert f"--device {device}" in line and "--device cpu" in line


def test_item4_unknown_device(pair, capsys):
    line = user_error(capsys, gen(pair, "--prompt", "w5", "--device", "tpu"))
    assert "--device tpu: unknown device" in line


@pytest.mark.parametrize("command", [["bench", "e2e"], ["demo"]])
def test_item4_other_commands_refuse_an_unknown_device(capsys, command, tmp_path):
    argv = [*command, "--device", "tpu"]
    if command[0] == "bench":
        argv += ["--out", str(tmp_path / "e2e.json")]
    user_error(capsys, argv, match="--device tpu")


def test_item4_non_utf8_stdin(pair, capsys, monkeypatch):
    raw = io.TextIOWrapper(io.BytesIO(b"w5 w6\nw7 \xff\xfe\n"), encoding="utf-8")
    line = user_error(capsys, gen(pair, "--device", "cpu"), stdin=raw, monkeypatch=monkeypatch)
    assert "<stdin>:2: not UTF-8" in line
    # text stdin under a UTF-8 locale hands the bytes over as lone surrogates
    text = io.StringIO("w5 \udcff\n")
    line = user_error(capsys, gen(pair, "--device", "cpu"), stdin=text, monkeypatch=monkeypatch)
    assert "<stdin>:1: not UTF-8" in line


def test_item4_non_utf8_prompts_file(pair, capsys, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"w5 w6\n\xc3\x28\n")
    line = user_error(capsys, gen(pair, "--device", "cpu", "--prompts-file", str(f)))
    assert f"{f}:2: not UTF-8" in line


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_item4_truncated_safetensors(tmp_path, capsys, which):
    tdir, ddir, _ = save_pair(tmp_path)
    f = (tdir if which == "target" else ddir) / "model.safetensors"
    f.write_bytes(f.read_bytes()[:5])
    argv = ["generate", "--model", str(tdir), "--draft-model", str(ddir), "--prompt", "w5"]
    line = user_error(capsys, [*argv, "--device", "cpu"])
    assert str(f) in line and "not a readable safetensors file" in line


def _train_argv(target, data, out, *extra):
    return ["train", "--target", str(target), "--data", str(data), "--data-glob", "*.py",
            "--output", str(out), "--device", "cpu", "--seq-len", "40", "--no-progress",
            "--num-layers", "1", "--warmup-steps", "1", *extra]  # fmt: skip


def test_item4_train_input_errors_are_one_line_and_leave_no_directory(
    train_target, capsys, monkeypatch, tmp_path
):
    target, data = train_target
    out = tmp_path / "out"
    cases = [
        (["--data", str(tmp_path / "missing.txt")], "--data"),
        (["-k", "0"], "-k/--num-depths 0"),
        (["--steps", "0"], "--steps 0"),
        (["--lr", "0"], "--lr 0"),
        (["--method", "eagle3", "--partitions", "2"], "--partitions 2"),
        (["--mask-token-id", "100000", "--steps", "1"], "mask token id 100000"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "--device cuda"))
    for extra, expect in cases:
        line = user_error(capsys, _train_argv(target, data, out, *extra))
        assert expect in line, line
        assert not out.exists(), extra
    # the required-flag error of argparse is one line too
    line = user_error(capsys, ["train", "--target", str(target), "--output", str(out)])
    assert "--data" in line and "peagle train --help" in line
    # a hub id that cannot be fetched: offline, fast, one line
    no_hub(monkeypatch)
    line = user_error(capsys, _train_argv("nope", data, out))
    assert line.startswith("peagle: --target nope:") and not out.exists()


# ---------------------------------------------------------------------------------------------
# 5. The right line
# ---------------------------------------------------------------------------------------------


def test_item5_missing_local_model_says_no_such_directory(pair, capsys):
    line = user_error(capsys, gen(pair, "--prompt", "w5", "--model", "./nope"))
    assert line.startswith("peagle: --model ./nope: no such directory")


def test_item5_unreachable_hub_says_it_cannot_be_downloaded(capsys, monkeypatch):
    no_hub(monkeypatch)
    argv = ["generate", "--model", "nobody/no-such-model", "--method", "none", "--prompt", "x"]
    line = user_error(capsys, [*argv, "--device", "cpu"])
    assert "--model nobody/no-such-model" in line and "unreachable" in line


def test_item5_drafter_config_not_json_names_the_file(tmp_path, capsys):
    tdir, ddir, _ = save_pair(tmp_path)
    (ddir / "config.json").write_text("{\n")
    argv = ["generate", "--model", str(tdir), "--draft-model", str(ddir), "--prompt", "w5"]
    line = user_error(capsys, [*argv, "--device", "cpu"])
    assert str(ddir / "config.json") in line and "not valid JSON" in line


def test_item5_aux_layer_error_suggests_a_valid_default():
    from peagle.models.target import suggested_aux_layer_ids
    from peagle.train.init import aux_layers_for

    model, _ = make_target("llama")  # 6 layers? whatever it has: the suggestion must be valid
    n = model.config.num_hidden_layers
    with pytest.raises(ValueError) as e:
        TargetRunner(model, aux_layer_ids=[0, 0, 0])
    ids = json.loads(re.search(r"e\.g\. (\[[^\]]*\])", str(e.value)).group(1))
    assert ids == suggested_aux_layer_ids(n) == aux_layers_for(n)
    assert sorted(set(ids)) == ids and ids[-1] < n
    assert suggested_aux_layer_ids(6) == [1, 3, 5] and suggested_aux_layer_ids(32) == [2, 16, 29]


# ---------------------------------------------------------------------------------------------
# 6-8. Training does what it says
# ---------------------------------------------------------------------------------------------


def test_item6_resume_with_other_architecture_is_refused(train_target, capsys, tmp_path):
    target, data = train_target
    out = tmp_path / "run"
    assert main(_train_argv(target, data, out, "-k", "4", "--steps", "1")) == 0
    state = (out / "train_state.pt").read_bytes()
    capsys.readouterr()
    line = user_error(
        capsys,
        _train_argv(target, data, out, "-k", "6", "--steps", "2", "--num-layers", "2"),
    )
    assert "other architecture settings" in line
    assert "num_layers: 1 there, 2 now" in line and "num_depths: 4 there, 6 now" in line
    assert (out / "train_state.pt").read_bytes() == state  # untouched
    # the same flags resume
    assert main(_train_argv(target, data, out, "-k", "4", "--steps", "2")) == 0


def test_item7_time_budget_holds_with_slowing_steps(train_target, tmp_path, monkeypatch):
    """Steps get slower as training goes (1 s, then +2% per step): the budget still holds."""
    import peagle.train.trainer as trainer_mod

    target, data = train_target
    now = [0.0]
    cfg = trainer_mod.TrainConfig(
        target=str(target), data=[str(data)], data_glob="*.py", output=str(tmp_path / "b"),
        method="eagle3", num_layers=1, num_depths=2, seq_len=40, steps=100000,
        warmup_steps=1, save_every=10**6, log_every=10**6, time_budget_s=300.0,
        device="cpu", progress=False,
    )  # fmt: skip
    tr = trainer_mod.Trainer(cfg, log=lambda _: None, clock=lambda: now[0])
    real_step = tr.train_step
    done = [0]

    def slow_step():
        out = real_step()
        now[0] += 1.0 * 1.02 ** done[0]
        done[0] += 1
        return out

    monkeypatch.setattr(tr, "train_step", slow_step)
    result = tr.run()
    assert result["finished"]
    # within a few percent of the budget, not past it by more than one step
    assert 0.97 * 300 <= now[0] <= 300 + 1.02 ** done[0], (now[0], done[0])
    # a fixed count from the first 8 steps (the old rule) would have run ~300 steps: far past
    assert done[0] < 150


@pytest.mark.parametrize("excludes", [False, True])
def test_time_budget_can_exclude_the_first_steps_compile(
    train_target, tmp_path, monkeypatch, excludes
):
    """A first step of 60 s (loading + compile) then 1 s steps, a 100 s budget: counted from the
    start ~40 steps fit; with ``time_budget_excludes_startup`` ~100 steps after the first (the
    ablation's variants then train equally long whichever one compiled)."""
    import peagle.train.trainer as trainer_mod

    target, data = train_target
    now = [0.0]
    cfg = trainer_mod.TrainConfig(
        target=str(target), data=[str(data)], data_glob="*.py", output=str(tmp_path / "b"),
        method="eagle3", num_layers=1, num_depths=2, seq_len=40, steps=100000,
        warmup_steps=1, save_every=10**6, log_every=10**6, time_budget_s=100.0,
        time_budget_excludes_startup=excludes, device="cpu", progress=False,
    )  # fmt: skip
    tr = trainer_mod.Trainer(cfg, log=lambda _: None, clock=lambda: now[0])
    real_step = tr.train_step
    done = [0]

    def step():
        out = real_step()
        now[0] += 60.0 if done[0] == 0 else 1.0
        done[0] += 1
        return out

    monkeypatch.setattr(tr, "train_step", step)
    assert tr.run()["finished"]
    after_first = done[0] - 1
    if excludes:
        assert 97 <= after_first <= 101 and 157 <= now[0] <= 161, (done[0], now[0])
    else:
        assert 37 <= after_first <= 41 and now[0] <= 101, (done[0], now[0])


def test_item8_no_progress_prints_loss_lines(train_target, capsys, tmp_path):
    target, data = train_target
    argv = _train_argv(target, data, tmp_path / "log", "--steps", "4", "--log-every", "2")
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("step ")]
    assert [x.split(":")[0] for x in lines] == ["step 2/4", "step 4/4"]
    assert "loss" in lines[0] and "tok/s" in lines[0]


def test_item8_no_bar_when_not_a_terminal(train_target, capsys, tmp_path):
    target, data = train_target
    argv = [a for a in _train_argv(target, data, tmp_path / "tty", "--steps", "3")]
    argv.remove("--no-progress")  # stderr is not a terminal under pytest: no bar either
    assert main([*argv, "--log-every", "3"]) == 0
    cap = capsys.readouterr()
    assert "step/s" not in cap.err and "it/s" not in cap.err and "|" not in cap.err
    assert "step 3/3" in cap.out


def test_item8_train_help_shows_defaults():
    from peagle.cli import build_parser

    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices["train"]
    text = sub.format_help()
    for flag, default in [("--seq-len", "2048"), ("--steps", "1000"), ("--lr", "0.0006"),
                          ("--warmup-steps", "50"), ("--save-every", "200"),
                          ("--log-every", "10"), ("--jsonl-field", "text")]:  # fmt: skip
        entry = re.search(r"\n  " + re.escape(flag) + r" [A-Z_]+(.*?)(?=\n  -|\n\n)", text, re.S)
        assert entry and f"(default: {default})" in " ".join(entry.group(1).split()), flag


def test_item8_budget_message_clears_the_bar():
    from peagle.train.trainer import _around_bar

    seen = []
    _around_bar(seen.append)("time budget 10 s: ...")
    assert seen == ["time budget 10 s: ..."]


# ---------------------------------------------------------------------------------------------
# 9-10. Claims
# ---------------------------------------------------------------------------------------------


def test_item9_generate_help_says_what_is_measured():
    from peagle.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["generate"]
    text = " ".join(sub.format_help().split())
    assert "only makes it faster" not in text
    assert "peagle tune" in text and "1605" in text and "0.10-0.57x" in text
    assert "--threads" in text


def test_item9_cpu_threads_default_to_one(pair, capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(gen(pair, "--prompt", "w5", "--max-new-tokens", "2", "--device", "cpu")) == 0
        assert torch.get_num_threads() == 1
        argv = gen(pair, "--prompt", "w5", "--max-new-tokens", "2", "--device", "cpu")
        assert main([*argv, "--threads", "2"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_item10_readme_numbers_match_the_results():
    readme = " ".join((ROOT / "README.md").read_text().split())
    results = (ROOT / "docs" / "results.md").read_text()
    assert "0.6-0.9 ms" not in readme
    m = re.search(r"target pass costs ([0-9.]+)-([0-9.]+) ms per speculative step", readme)
    assert m and f"| {m.group(1)} |" in results and f"| {m.group(2)} |" in results
    m = re.search(
        r"drafting pass costs ([0-9.]+)-([0-9.]+) ms at every K, EAGLE-3's K passes "
        r"([0-9.]+)-([0-9.]+) ms",
        readme,
    )
    assert m and all(f"| {v} |" in results for v in m.groups())
    # the per-call host times are cited from the file that has them, and match it
    cite = r"; `host_us_per_call` in \[benchmarks/results/prep-h200.json\]"
    m = re.search(r"host time per call[^)]*?(\d+)-(\d+) µs vs (\d+)-(\d+) µs" + cite, readme)
    assert m
    host = json.loads((ROOT / "benchmarks" / "results" / "prep-h200.json").read_text())
    host = host["host_us_per_call"]
    for i, form in ((1, ",workspace"), (3, ",separate_outputs")):
        values = [v for k, v in host.items() if k.endswith(form)]
        assert (int(m.group(i)), int(m.group(i + 1))) == (round(min(values)), round(max(values)))


# ---------------------------------------------------------------------------------------------
# Small things users notice
# ---------------------------------------------------------------------------------------------


def test_small_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and re.match(r"peagle \d+\.\d+", capsys.readouterr().out)


def test_small_single_prompt_header_and_readable_finish_reason(pair, capsys):
    argv = gen(pair, "--prompt", "w5 w6", "--max-new-tokens", "3", "--ignore-eos")
    assert main([*argv, "--device", "cpu"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("=== [0] w5 w6\n")
    assert "(reached --max-new-tokens)" in cap.err and "(length)" not in cap.err


def test_small_k_above_the_trained_depth(tmp_path, capsys):
    tdir, ddir, _ = save_pair(tmp_path)
    cfg = json.loads((ddir / "config.json").read_text())
    cfg["peagle_training"] = {"method": "peagle", "num_depths": 2}
    (ddir / "config.json").write_text(json.dumps(cfg))
    base = ["generate", "--model", str(tdir), "--draft-model", str(ddir), "--prompt", "w5",
            "--max-new-tokens", "3", "--device", "cpu"]  # fmt: skip
    line = user_error(capsys, [*base, "-k", "1000"])
    assert "-k 1000" in line and "at most 2" in line
    assert main([*base, "-k", "2"]) == 0
    # EAGLE-3's serial passes run past the depth, with a warning that says what happens
    assert main([*base, "-k", "3", "--method", "eagle3"]) == 0
    assert "exceeds the depth" in capsys.readouterr().err


def test_small_peagle_drafter_under_eagle3_is_noted(pair, capsys):
    argv = gen(pair, "--prompt", "w5", "--max-new-tokens", "2", "--method", "eagle3")
    assert main([*argv, "--device", "cpu"]) == 0
    assert "this is a P-EAGLE drafter" in capsys.readouterr().err


def test_small_blank_stdin_lines_are_reported(pair, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("w5\n\n  \nw6\n"))
    assert main(gen(pair, "--max-new-tokens", "2", "--device", "cpu", "--json")) == 0
    cap = capsys.readouterr()
    assert len(cap.out.splitlines()) == 2
    assert "skipped 2 blank line(s) in <stdin>" in cap.err
