"""``peagle bench e2e --projection-shape gpt-oss-20b|qwen3-coder-30b-a3b --synthetic-acceptance``.

The full shapes are checked on ``meta`` (memory plan, heads' shapes, what fits one H200); the run
itself goes through the same code with the ``-tiny`` shapes (the same architectures shrunk).
"""

from __future__ import annotations

import json

import pytest
import torch

from peagle.bench import acceptance_tables as A
from peagle.bench import e2e
from peagle.bench import released as R
from peagle.cli import main
from peagle.models import released_configs as RC

GIB = 2**30


def test_released_cli_names_match_the_modules():
    assert e2e.RELEASED_SHAPES == tuple(R.shape_choices())
    assert e2e.TABLE_NAMES == tuple(A.TABLES)


def test_released_plan_runs_the_goal_configs_first():
    configs = R.plan(["peagle", "eagle3", "none"], R.KS, [64, 8, 1], R.CONTEXTS)
    assert len(configs) == 2 * 3 * (1 + 2 * 5)
    goal = configs[:11]
    assert all(c == 1 and ctx == 1024 for _, _, c, ctx in goal)
    assert goal[0] == ("none", 0, 1, 1024) and ("peagle", 7, 1, 1024) in goal
    assert [c for _, _, c, ctx in configs if ctx == 1024][::11] == [1, 8, 64]


@pytest.mark.parametrize("name,gib", [("gpt-oss-20b", 39.0), ("qwen3-coder-30b-a3b", 56.9)])
def test_released_dry_run_estimates_full_shape_memory_on_meta(name, gib):
    configs = R.plan(["peagle", "none"], [7], [1, 64], [1024, 8192])
    p = R.dry_run(name, False, configs, 256)
    assert p["target_weights_gib"] == pytest.approx(gib, rel=0.01)
    rows = {r["key"]: r for r in p["configs"]}
    cfg = RC.config_fields(name)
    per_tok = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    blocks = -(-(8192 + 256 + 1) // R.BLOCK_SIZE)
    none = rows["none,K=0,C=64,ctx=8192"]
    assert none["kv_gib"] == pytest.approx(64 * blocks * 16 * per_tok / GIB, abs=1e-3)
    assert none["requests"] == 64 and rows["none,K=0,C=1,ctx=1024"]["requests"] == 8
    assert rows["peagle,K=7,C=1,ctx=1024"]["weights_gib"] > none["weights_gib"]
    assert R.fits(name)[0]


def test_released_gpt_oss_120b_does_not_fit_one_h200_in_bf16():
    ok, why = R.fits("gpt-oss-120b")
    assert not ok and "does not fit" in why and "MXFP4" in why


@pytest.mark.parametrize("name", R.SHAPES)
def test_released_heads_have_the_released_shapes(name):
    head = RC.TARGETS[name]["head"]
    layers = RC.config_fields(name)["num_hidden_layers"]
    pe, e3 = R.head_dict(name, "peagle", False, layers), R.head_dict(name, "eagle3", False, layers)
    assert pe["num_hidden_layers"] == 4 and e3["num_hidden_layers"] == 1
    assert pe["hidden_size"] == head["h"] and pe["vocab_size"] == head["v"]
    assert pe["ptd_token_id"] == head["mask"] and "ptd_token_id" not in e3
    assert (pe["num_attention_heads"], pe["num_key_value_heads"], pe["head_dim"]) == (32, 8, 64)
    ids = pe["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [2, layers // 2, layers - 3]


@pytest.mark.parametrize("shape", ["gpt-oss-20b-tiny", "qwen3-coder-30b-a3b-tiny"])
def test_released_tiny_shapes_decode_with_synthetic_acceptance(tmp_path, capsys, shape):
    out = tmp_path / "r.json"
    argv = ["bench", "e2e", "--device", "cpu", "--projection-shape", shape,
            "--synthetic-acceptance", "vllm-pr32628", "--k", "2", "--concurrency", "2",
            "--contexts", "24", "--max-new-tokens", "6", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["synthetic_acceptance"]["enabled"] and data["synthetic_acceptance"]["rates"]
    assert data["released_shape"]["target"] == shape.removesuffix("-tiny")
    assert "ASSUMED" in data["released_shape"]["head_widths"] and "random" in data["routing"]
    rows = data["configs"]
    assert set(rows) == {"none,K=0,C=2,ctx=24", "peagle,K=2,C=2,ctx=24", "eagle3,K=2,C=2,ctx=24"}
    for key, r in rows.items():
        assert r["num_requests"] == 8 and r["output_tokens"] == 8 * 6
        assert r["outputs_are_model_text"] is False and "random" in r["routing"]
        assert r["synthetic_acceptance"] == (r["method"] != "none")
        for f in ("target_ms_per_step", "drafter_ms_per_step", "overhead_ms_per_step",
                  "tokens_per_s", "tpot_ms", "decode_tokens_per_s"):  # fmt: skip
            assert r[f] >= 0, (key, f)
        bd = r["breakdown"]
        assert {"target_pass_ms", "verify_ms", "drafter_ms", "host_ms"} <= set(bd)
        assert (bd["drafter_ms"] == 0) == (r["method"] == "none")
    pe = rows["peagle,K=2,C=2,ctx=24"]
    assert pe["rates"] == list(A.get_table("vllm-pr32628").rates["peagle"][:2])
    floor = data["floor"]
    assert set(floor) == {"none,K=0", "peagle,K=7"}
    assert floor["peagle,K=7"]["tokens_in_pass"] == 8 and floor["none,K=0"]["tokens_in_pass"] == 1
    top_k = RC.config_fields(shape.removesuffix("-tiny"), tiny=True)["num_experts_per_tok"]
    assert all(n == top_k for n in floor["none,K=0"]["experts_touched_per_layer"])
    assert floor["peagle,K=7"]["expert_bytes"] > floor["none,K=0"]["expert_bytes"]
    # a rerun resumes: nothing left to do
    capsys.readouterr()
    assert main(argv) == 0
    assert "tok/s" not in capsys.readouterr().out


def test_released_shapes_need_a_rate_table(tmp_path):
    argv = ["bench", "e2e", "--device", "cpu", "--projection-shape", "gpt-oss-20b-tiny",
            "--out", str(tmp_path / "x.json")]  # fmt: skip
    assert main(argv) != 0


def test_released_streamed_bytes_count_the_routed_experts():
    target = R.build_target("qwen3-coder-30b-a3b", "cpu", torch.float32, tiny=True)
    n_layers = target.num_layers
    routed = [torch.tensor([[0, 1], [1, 2]])] * n_layers
    sb = R.streamed_bytes(target, routed, 2)
    e = target.layers[0].mlp.experts
    per = sum(p.numel() * 4 for p in e.parameters()) / RC.config_fields(
        "qwen3-coder-30b-a3b", tiny=True)["num_experts"]  # fmt: skip
    assert sb["experts_touched_per_layer"] == [3] * n_layers
    assert sb["expert_bytes"] == int(3 * per * n_layers)
    assert sb["bytes"] == sb["dense_bytes"] + sb["expert_bytes"]


def test_full_size_released_shape_is_refused_on_the_cpu(tmp_path, capsys):
    """A full-size shape on the CPU would spend minutes building ~80 GiB of float32 weights
    before running out of memory: refused at once with one line naming the tiny shape."""
    from cli_helpers import user_error

    argv = ["bench", "e2e", "--device", "cpu", "--projection-shape", "gpt-oss-20b",
            "--synthetic-acceptance", "paper", "--out", str(tmp_path / "x.json")]  # fmt: skip
    user_error(capsys, argv, match="gpt-oss-20b-tiny")
    assert not (tmp_path / "x.json").exists()


def test_dry_run_says_what_it_fits(capsys):
    R.print_dry_run({"target": "gpt-oss-20b", "tiny": False, "target_weights_gib": 39.0,
                     "head_weights_gib": 2.9, "configs": [{"key": "none,K=0,C=1,ctx=1024"}]},
                    (True, "20.91 B parameters"))  # fmt: skip
    assert "fits one 139 GiB GPU: 20.91 B parameters" in capsys.readouterr().out
