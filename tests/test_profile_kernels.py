"""tools/profile_kernels.py summarize: ncu CSV -> the per-kernel results file, and the report's
table of it (synthetic CSV, CPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from peagle.bench import kernel_profile_report, report

_SPEC = importlib.util.spec_from_file_location(
    "profile_kernels", Path(__file__).resolve().parents[1] / "tools" / "profile_kernels.py"
)
pk = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(pk)

HEAD = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'  # noqa: E501


def _row(i: int, name: str, metric: str, unit: str, value: str) -> str:
    return (f'"{i}","1","python3","h","{name}","1","7","(256, 1, 1)","(3, 512, 1)","0","9.0",'
            f'"","{metric}","{unit}","{value}"')  # fmt: skip


def _kernel(i: int, name: str, ns: float, dram: float) -> list[str]:
    return [_row(i, name, "gpu__time_duration.sum", "nsecond", f"{ns:,.0f}"),
            _row(i, name, "dram__throughput.avg.pct_of_peak_sustained_elapsed", "%", str(dram)),
            _row(i, name, "dram__bytes_read.sum", "Mbyte", "206.16")]  # fmt: skip


def _csv(calls_per_case: dict[str, list[tuple[str, float]]]) -> str:
    lines = ["==PROF== Connected to process 1"]
    lines += [f"verify {case}" for case in calls_per_case]
    lines.append(HEAD)
    i = 0
    for kernels in calls_per_case.values():
        for rep in range(3):
            # a torch helper kernel between calls: not ours, left out
            lines += _kernel(i, "void at::native::fill_kernel(float)", 2000, 0.1)
            i += 1
            for name, us in kernels:
                lines += _kernel(i, f"void peagle::<unnamed>::{name}(peagle::Args)",
                                 (us + rep) * 1000, 50.0)  # fmt: skip
                i += 1
    return "\n".join(lines) + "\n"


def test_calls_are_split_at_the_first_kernel_and_medians_taken():
    text = _csv({
        "B=64 T=0.7": [("row_stats_kernel<2, 0>", 68.0), ("decide_sample_kernel<2>", 52.0)],
        "B=64 top_k=50": [("row_stats_kernel<2, 0>", 84.0), ("row_filter_kernel<2, 0>", 162.0),
                          ("decide_sample_kernel<2>", 52.0)],
    })  # fmt: skip
    rows = pk.parse_ncu_csv(text, "verify")
    assert [(r["case"], r["kernel"]) for r in rows] == [
        ("B=64 T=0.7", "row_stats_kernel<2, 0>"),
        ("B=64 T=0.7", "decide_sample_kernel<2>"),
        ("B=64 top_k=50", "row_stats_kernel<2, 0>"),
        ("B=64 top_k=50", "row_filter_kernel<2, 0>"),
        ("B=64 top_k=50", "decide_sample_kernel<2>"),
    ]
    assert rows[0]["time_us"] == 69.0  # median of 68, 69, 70 (ns -> us)
    assert rows[3]["time_us"] == 163.0 and rows[3]["dram_read_mb"] == 206.16
    assert rows[0]["grid"] == "(3, 512, 1)" and rows[0]["dram_pct"] == 50.0


def test_a_profile_cut_short_is_refused():
    text = _csv({"B=1 T=0.7": [("row_stats_kernel<2, 0>", 9.0), ("decide_sample_kernel<2>", 24.0)]})
    text = text.replace("verify B=1 T=0.7", "verify B=1 T=0.7\nverify B=1 T=0.0")  # 2 cases
    with pytest.raises(ValueError, match="2 cases"):
        pk.parse_ncu_csv(text, "verify")


def test_summarize_writes_the_file_the_report_renders(tmp_path):
    csv_path = tmp_path / "v.csv"
    csv_path.write_text(_csv({"B=1 T=0.7": [("row_stats_kernel<2, 0>", 9.0),
                                            ("decide_sample_kernel<2>", 24.0)]}))  # fmt: skip
    out = tmp_path / kernel_profile_report.FILE
    assert pk.main(["summarize", "--commit", "abc", "--out", str(out),
                    f"verify:default={csv_path}", f"verify:X=1={csv_path}"]) == 0  # fmt: skip
    d = json.loads(out.read_text())
    assert [(p["family"], p["label"]) for p in d["profiles"]] == [("verify", "default"),
                                                                  ("verify", "X=1")]  # fmt: skip
    lines = kernel_profile_report.section(d, "verify")
    assert any("| B=1 T=0.7 | X=1 | `decide_sample_kernel<2>` |" in ln for ln in lines)
    assert kernel_profile_report.section(d, "attention") == []
    # the report places it under verify_chain when the file is there
    (tmp_path / "verify-h200.json").write_text(json.dumps({
        "gpu": "G", "commit": "c", "command": "x", "copy_ceiling_gbps": 4000.0,
        "rows": [{"case": "B=1,K=7,V=201088,T=0.7", "impl": "peagle", "median_us": 19.8,
                  "gbps": 162.5, "mode": "graph"}]}))  # fmt: skip
    report.generate(tmp_path, tmp_path / "docs")
    md = (tmp_path / "docs" / "results.md").read_text()
    assert md.index("## verify_chain") < md.index("`decide_sample_kernel<2>`")


def test_lines_profile_is_rendered_under_verify_chain(tmp_path):
    """A per-instruction profile (tools/ncu_lines.py --json plus the run's facts) becomes a
    per-function table after the verify_chain section; shares are of all stall samples."""
    (tmp_path / "verify-h200.json").write_text(json.dumps({
        "gpu": "G", "commit": "c", "command": "x", "copy_ceiling_gbps": 4000.0,
        "rows": [{"case": "B=1,K=7,V=201088,T=0.7", "impl": "peagle", "median_us": 19.8,
                  "gbps": 162.5, "mode": "graph"}]}))  # fmt: skip
    (tmp_path / "profile-verify-x-lines-h200.json").write_text(json.dumps({
        "gpu": "G", "commit": "abc", "command": "h200.sh lines", "case": "B=64",
        "kernel": "void ns::decide_sample_kernel<(ns::D)2, 1>(P, W)", "distinct": 40,
        "warp_instr": 800.0, "samples": 200.0,
        "stall_totals": {"barrier": 100.0, "no_inst": 50.0, "long_sb": 50.0},
        "functions": [{"function": "k.cu:weights_of", "distinct": 30, "warp_instr": 600.0,
                       "samples": 80.0, "top_stalls": {"no_inst": 50.0, "barrier": 30.0}},
                      {"function": "k.cu:decide", "distinct": 10, "warp_instr": 200.0,
                       "samples": 120.0, "top_stalls": {"long_sb": 50.0}}]}))  # fmt: skip
    report.generate(tmp_path, tmp_path / "docs")
    md = (tmp_path / "docs" / "results.md").read_text()
    kernel = "one `void ns::decide_sample_kernel<(ns::D)2, 1>` launch"
    assert md.index("## verify_chain") < md.index(kernel)
    assert "40 distinct instructions executed, 800 warp instructions, 200 stall samples " \
           "(barrier 50 %, no_inst 25 %, long_sb 25 %)" in md  # fmt: skip
    # most stall samples first
    assert md.index("| `k.cu:decide` | 10 | 200 | 60.0 | long_sb 50 |") < md.index(
        "| `k.cu:weights_of` | 30 | 600 | 40.0 | no_inst 50, barrier 30 |"
    )
