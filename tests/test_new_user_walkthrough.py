"""What a second new-user walkthrough (issue 22's promise: one ``peagle:`` line and exit 2 for
every user error) still found: one test per finding, through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import user_error
from test_issue22 import _train_argv, gen, no_hub
from tiny_models import save_pair
from train_cli_helpers import make_tiny_train_target

from peagle.cli import main
from peagle.train.corpus import iter_documents


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("pair-walkthrough"))


@pytest.fixture(scope="module")
def train_target(tmp_path_factory):
    target, data, _ = make_tiny_train_target(tmp_path_factory.mktemp("train-walkthrough"))
    return target, data


@pytest.mark.parametrize("ids", [["1", "2", "99"], ["1", "2", "4"]])
def test_train_aux_layer_ids_past_the_target_is_one_line(train_target, capsys, tmp_path, ids):
    target, data = train_target  # a 4-layer target
    out = tmp_path / "out"
    line = user_error(capsys, _train_argv(target, data, out, "--aux-layer-ids", *ids),
                      match=r"--aux-layer-ids .*: the target has 4 layers")  # fmt: skip
    assert "e.g. 1 2 3" in line
    assert not out.exists()


def test_train_negative_aux_layer_ids_are_refused(train_target, capsys, tmp_path):
    target, data = train_target
    out = tmp_path / "out"
    user_error(capsys, _train_argv(target, data, out, "--aux-layer-ids", "-1", "2", "3"),
               match="strictly increasing layer indices >= 0")  # fmt: skip
    assert not out.exists()


def test_train_bad_jsonl_names_the_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: not JSON"):
        list(iter_documents([f]))
    f.write_bytes(b'{"text": "ok"}\n\xff\xfe\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: not UTF-8"):
        list(iter_documents([f]))


def test_train_non_utf8_text_files_are_skipped_with_a_note(tmp_path, capsys):
    (tmp_path / "a.py").write_text("def a():\n    return 1\n")
    (tmp_path / "b.bin").write_bytes(b"\xff\xfe\x00binary")
    docs = list(iter_documents([tmp_path]))
    assert docs == ["def a():\n    return 1\n"]
    err = capsys.readouterr().err
    assert "skipped 1 file(s) that are not UTF-8 text" in err and "b.bin" in err


def test_unknown_flag_names_the_subcommand_once(pair, capsys):
    line = user_error(capsys, gen(pair, "--promt", "x"), match=r"^peagle: generate: unrecognized")
    assert "peagle: peagle" not in line and "see peagle generate --help" in line


def test_unknown_command_is_one_line(capsys):
    line = user_error(capsys, ["generat"], match="invalid choice")
    assert not line.startswith("peagle: peagle")


def test_draft_model_hub_id_offline_is_one_line(pair, capsys, monkeypatch):
    no_hub(monkeypatch)
    tdir, _, _ = pair
    user_error(capsys, ["generate", "--model", str(tdir), "--draft-model", "some-org/drafter",
                        "--prompt", "w5", "--max-new-tokens", "2"],
               match="--draft-model some-org/drafter: cannot be downloaded")  # fmt: skip


def test_draft_model_hub_id_is_fetched(pair, capsys, monkeypatch):
    """A hub id is resolved through huggingface_hub (here: a stand-in returning the local
    drafter), then decoded like a directory."""
    import huggingface_hub

    tdir, ddir, _ = pair
    asked = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kw):
        asked.append((repo_id, tuple(allow_patterns)))
        return str(ddir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    # --device cpu: the tiny pair's head_dim 16 runs on the CPU kernels only
    rc = main(["generate", "--model", str(tdir), "--draft-model", "some-org/drafter", "--json",
               "--prompt", "w5 w6", "--max-new-tokens", "4", "--no-progress",
               "--device", "cpu"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and json.loads(out.splitlines()[-1])["num_generated_tokens"] == 4
    assert asked and asked[0][0] == "some-org/drafter" and "*.safetensors" in asked[0][1]


def test_cuda_engine_refuses_head_dim_the_cuda_kernels_do_not_serve():
    """A model whose head_dim the CUDA attention kernels do not serve is refused when the engine is
    built on CUDA (one clear error naming the model), not by paged_attention mid-decode."""
    from types import SimpleNamespace

    from peagle.decode.config import validate_engine_args

    args = dict(method="peagle", num_speculative_tokens=3, max_num_seqs=1, max_model_len=None,
                block_size=16, num_blocks=None, kv_cache_memory=None)  # fmt: skip
    cuda_target = SimpleNamespace(device=torch.device("cuda", 0), head_dim=16)
    with pytest.raises(ValueError, match=r"the target model has head_dim 16: .* 64 and 128"):
        validate_engine_args(**args, target=cuda_target)
    cpu_target = SimpleNamespace(device=torch.device("cpu"), head_dim=16)
    validate_engine_args(**args, target=cpu_target)  # the CPU kernels serve any head_dim
    drafter = torch.nn.Linear(2, 2).to("meta")  # a stand-in: parameters on a non-CUDA device
    drafter.config = SimpleNamespace(head_dim=16)
    validate_engine_args(**args, target=cpu_target, drafter=drafter)
    validate_engine_args(**args, target=SimpleNamespace(device="cuda", head_dim=128))
