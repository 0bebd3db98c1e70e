"""tools/ncu_lines.py: an ncu per-instruction profile matched to a -lineinfo disassembly and
credited to source functions and lines (synthetic inputs in the tools' formats)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "ncu_lines.py"
spec = importlib.util.spec_from_file_location("ncu_lines", TOOL)
ncu_lines = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_lines)

SOURCE = """\
#include "x.cuh"

__device__ __forceinline__ float helper(float x) {
  return x * 2.0f;
}

template <int N>
__global__ void __launch_bounds__(256, 2)
    my_kernel(const float* in, float* out) {
  out[0] = helper(in[0]);
}
"""

# An instantiation with other opcodes first: the match must pick the second one.
LISTING = """\
.text._Z5otheri:
	//## File "/build/src/k.cu", line 4
        /*0000*/                   MOV R1, R2 ;
        /*0010*/                   EXIT ;
.text._Z9my_kernelILi1EEvPKfPf:
	//## File "/build/src/k.cu", line 10
        /*0000*/                   LDG.E R2, desc[UR4][R2.64] ;
	//## File "/build/src/k.cu", line 4
        /*0010*/                   FADD R2, R2, R2 ;
        /*0020*/              @!P0 FMUL R2, R2, 0.5 ;
	//## File "/build/src/k.cu", line 10
        /*0030*/                   STG.E desc[UR4][R4.64], R2 ;
        /*0040*/                   EXIT ;
"""

HEAD = (
    '"Address","Source","Warp Stall Sampling (All Samples)",'
    '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed",'
    '"stall_barrier","stall_long_sb","stall_long_sb (Not Issued)"'
)
PROFILE = "\n".join(
    [
        '"Kernel Name","void my_kernel<1>(const float *, float *)"',
        HEAD,
        '"0x7f00","      LDG.E R2, desc[UR4][R2.64]","10","9","8","0","10","9"',
        '"0x7f10","      FADD R2, R2, R2","3","1","8","3","0","0"',
        '"0x7f20","@!P0  FMUL R2, R2, 0.5","0","0","0","0","0","0"',
        '"0x7f30","      STG.E desc[UR4][R4.64], R2","1,000","2","1,024","0","0","0"',
        '"0x7f40","      EXIT","0","0","8","0","0","0"',
    ]
)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "k.cu").write_text(SOURCE)
    (tmp_path / "prof.csv").write_text(PROFILE)
    (tmp_path / "all.sass").write_text(LISTING)
    return tmp_path


def test_function_heads_include_launch_bounds_kernels(files):
    assert ncu_lines.function_starts(files / "src" / "k.cu") == [(3, "helper"), (8, "my_kernel")]


def test_profile_is_matched_and_credited_to_functions_and_lines(files, capsys):
    out = files / "lines.json"
    ncu_lines.main([str(files / "prof.csv"), str(files / "all.sass"), "--src",
                    str(files / "src"), "--json", str(out)])  # fmt: skip
    import json

    res = json.loads(out.read_text())
    assert res["kernel"] == "void my_kernel<1>(const float *, float *)"
    assert res["function"] == "_Z9my_kernelILi1EEvPKfPf"
    funcs = {d["function"]: d for d in res["functions"]}
    # line 10 -> my_kernel: LDG, STG and EXIT executed (3 distinct), "1,024" parsed as 1024
    assert funcs["k.cu:my_kernel"]["distinct"] == 3
    assert funcs["k.cu:my_kernel"]["warp_instr"] == 8 + 1024 + 8
    assert funcs["k.cu:my_kernel"]["samples"] == 10 + 1000
    assert funcs["k.cu:my_kernel"]["top_stalls"] == {"long_sb": 10.0}
    # line 4 -> helper: FADD executed, FMUL never (not distinct, no samples)
    assert funcs["k.cu:helper"] == {"function": "k.cu:helper", "distinct": 1, "warp_instr": 8.0,
                                    "samples": 3.0, "top_stalls": {"barrier": 3.0}}  # fmt: skip
    assert res["distinct"] == 4 and res["samples"] == 1013
    assert res["lines"][0]["line"] == "k.cu:10"
    assert "4 distinct instructions executed" in capsys.readouterr().out


def test_a_listing_of_another_build_is_refused(files):
    other = LISTING.replace("FADD", "FMUL")
    (files / "all.sass").write_text(other)
    with pytest.raises(SystemExit, match="same build"):
        ncu_lines.main([str(files / "prof.csv"), str(files / "all.sass")])
