"""The FlashInfer peer of the benchmarks (issue 21) on CPU: it skips cleanly without FlashInfer
or CUDA, records a failing backend instead of crashing, feeds a paged-attention backend the
cache the way peagle reads it, the chi-square check accepts a right sampler and rejects wrong
ones, and the carry tool selects the modules the peers need."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from peagle import ops
from peagle.bench import flashinfer_peers as fp
from peagle.bench import paged_attention as pa
from peagle.bench.stats import chi_square_pit, chi_square_sf, target_probs

ROOT = Path(__file__).resolve().parents[1]
WHEEL = Path(
    os.environ.get(
        "PEAGLE_FLASHINFER_WHEEL", "/work/wheels-fi/flashinfer_python-0.7.4-py3-none-any.whl"
    )
)


def _carry_tool():
    spec = importlib.util.spec_from_file_location(
        "flashinfer_carry", ROOT / "tools/flashinfer_carry.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------
# optional dependency
# ---------------------------------------------------------------------------------------------


def test_load_skips_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fi, why = fp.load()
    assert fi is None and why == "no CUDA device"


def test_load_skips_when_flashinfer_does_not_import(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    fi, why = fp.load()
    assert fi is None and why.startswith("flashinfer not importable: ")


def test_bench_arguments_have_the_flashinfer_switches():
    import argparse

    from peagle.bench import verify_chain as vc

    ap = argparse.ArgumentParser()
    pa.add_arguments(ap)
    a = ap.parse_args(["--no-flashinfer", "--flashinfer-backends", "fa2,xqa"])
    assert a.no_flashinfer and a.flashinfer_backends == "fa2,xqa"
    assert ap.parse_args([]).flashinfer_backends.split(",") == list(fp.ATTENTION_BACKENDS)
    ap = argparse.ArgumentParser()
    vc.add_arguments(ap)
    assert ap.parse_args(["--no-flashinfer"]).no_flashinfer


# ---------------------------------------------------------------------------------------------
# attention plumbing, against a fake FlashInfer computing attention in torch
# ---------------------------------------------------------------------------------------------


class _FakePrefillWrapper:
    """Reads the paged cache from (qo_indptr, kv_indptr, indices, last_page_len) like
    FlashInfer's paged prefill with a bottom-right causal mask, in plain torch."""

    def __init__(self, workspace, layout, backend="auto", **kw):
        assert layout == "NHD"
        if backend == "fa3":
            raise RuntimeError("fa3 is not served here")

    def plan(self, qo_indptr, kv_indptr, indices, last_page_len, hq, hkv, d, page, *,
             causal, sm_scale, **kw):  # fmt: skip
        assert causal and kw["q_data_type"] == torch.bfloat16
        self.args = (qo_indptr, kv_indptr, indices, last_page_len, hq, hkv, d, page, sm_scale)

    def run(self, q, kv_cache, out):
        qo, kvp, idx, last, hq, hkv, d, page, scale = self.args
        k_cache, v_cache = kv_cache
        for r in range(qo.numel() - 1):
            pages = idx[kvp[r] : kvp[r + 1]].long()
            n = (pages.numel() - 1) * page + int(last[r])
            k = k_cache[pages].flatten(0, 1)[:n].float()  # [n, hkv, d]
            v = v_cache[pages].flatten(0, 1)[:n].float()
            qr = q[qo[r] : qo[r + 1]].float()  # [m, hq, d]
            m = qr.shape[0]
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
            s = torch.einsum("mhd,nhd->hmn", qr, k) * scale
            visible = torch.arange(n)[None, :] <= (n - m + torch.arange(m))[:, None]
            s = s.masked_fill(~visible, float("-inf"))
            out[qo[r] : qo[r + 1]] = torch.einsum("hmn,nhd->mhd", s.softmax(-1), v).to(out.dtype)
        return out


def test_attention_peer_reads_the_cache_like_peagle(monkeypatch):
    monkeypatch.setattr(fp, "WORKSPACE_BYTES", 1024)
    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_FakePrefillWrapper)
    c = pa.Case(2, 4, 2, 16, 37, n_sets=2, seed=3, device="cpu")  # a partial last page
    peers = fp.AttentionPeers(fake, c, 2, backends=("fa2", "fa3", "xqa"))
    assert set(peers.fns) == {"flashinfer-fa2"}
    assert peers.errors["flashinfer-fa3"] == "RuntimeError: fa3 is not served here"
    assert "xqa" in peers.errors["flashinfer-xqa"] or "decode" in peers.errors["flashinfer-xqa"]
    errs = pa.check_outputs(c, peers.fns)
    assert errs["flashinfer-fa2"] < 0.05
    out1 = peers.fns["flashinfer-fa2"](1).clone()  # set 1: another page table, another query
    want = c.peagle(1)
    assert (out1.float() - want.float()).abs().max() < 0.05


def test_attention_check_catches_a_wrong_mask(monkeypatch):
    class TopLeft(_FakePrefillWrapper):  # causal from the first key: a wrong peer
        def run(self, q, kv_cache, out):
            super().run(q, kv_cache, out)
            return out * 0.5

    monkeypatch.setattr(fp, "WORKSPACE_BYTES", 1024)
    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=TopLeft)
    c = pa.Case(1, 4, 2, 16, 40, n_sets=1, seed=5, device="cpu")
    peers = fp.AttentionPeers(fake, c, 1, backends=("fa2",))
    assert pa.check_outputs(c, peers.fns)["flashinfer-fa2"] > 0.1


def test_xqa_mask_bits():
    m = fp.xqa_causal_mask(3, 14)
    assert m.shape == (3, 14, 2) and m.dtype == torch.uint16
    words = m.view(torch.int32).view(3, 14).to(torch.int64) & 0xFFFFFFFF
    for i in range(14):
        assert int(words[1, i]) == (1 << (i + 1)) - 1  # keys 0..i of the 14 draft rows
    m = fp.xqa_causal_mask(1, 40)  # two 32-bit words per row
    w = m.view(torch.int32).view(40, 2).to(torch.int64) & 0xFFFFFFFF
    assert int(w[35, 0]) == 0xFFFFFFFF and int(w[35, 1]) == (1 << 4) - 1
    assert int(w[3, 1]) == 0


# ---------------------------------------------------------------------------------------------
# chi-square
# ---------------------------------------------------------------------------------------------


def test_chi_square_sf_matches_known_values():
    assert abs(chi_square_sf(3.841458820694124, 1) - 0.05) < 1e-6
    assert abs(chi_square_sf(30.143527205646155, 19) - 0.05) < 1e-6


def _rows(n_rows=16, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_rows, v, generator=g) * 3.0


@pytest.mark.parametrize("top", [None, (20, 0.9)])
def test_chi_square_accepts_the_right_sampler(top):
    logits = _rows()
    p = target_probs(logits, 0.7, *(top or (None, None)))
    g = torch.Generator().manual_seed(1)
    reps = 256
    samples = torch.multinomial(p, reps, replacement=True, generator=g).T.reshape(-1)
    rows = torch.arange(p.shape[0]).repeat(reps)
    chi = chi_square_pit(samples, p, rows=rows, generator=torch.Generator().manual_seed(2))
    assert chi.n == 16 * reps and chi.dof == 19
    assert chi.ok(), chi


def test_chi_square_rejects_wrong_samplers():
    logits = _rows()
    right = target_probs(logits, 0.7)
    g = torch.Generator().manual_seed(1)
    reps = 256
    rows = torch.arange(16).repeat(reps)

    def draw(p):
        return torch.multinomial(p, reps, replacement=True, generator=g).T.reshape(-1)

    # Wrong temperature: same support, other weights.
    chi = chi_square_pit(draw(target_probs(logits, 1.0)), right, rows=rows)
    assert not chi.ok() and chi.p_value < 1e-6, chi
    # Top-k/top-p not applied: tokens outside the filtered support fail outright.
    filtered = target_probs(logits, 0.7, 5, 0.8)
    chi = chi_square_pit(draw(right), filtered, rows=rows)
    assert chi.p_value == 0.0
    # The two most likely tokens of every row swapped.
    swapped = right.clone()
    top2 = right.topk(2, dim=-1).indices
    a, b = top2[:, 0:1], top2[:, 1:2]
    swapped.scatter_(1, a, right.gather(1, b)).scatter_(1, b, right.gather(1, a))
    chi = chi_square_pit(draw(swapped), right, rows=rows)
    assert not chi.ok(), chi


def test_target_probs_filters():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert torch.allclose(target_probs(logits, 1.0), torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert torch.allclose(target_probs(logits, 1.0, 2), torch.tensor([[4 / 7, 3 / 7, 0, 0]]))
    # top-p 0.6: 0.4 alone is short of 0.6, 0.4 + 0.3 reaches it.
    assert torch.allclose(
        target_probs(logits, 1.0, None, 0.6), torch.tensor([[4 / 7, 3 / 7, 0, 0]])
    )
    assert torch.allclose(
        target_probs(logits, 1.0, 3, 0.99), torch.tensor([[4 / 9, 3 / 9, 2 / 9, 0]])
    )


def _tied_rows(b: int, v: int, seed: int) -> torch.Tensor:
    """bf16 logits like the benchmark's (randn * 3), on a 1/4 grid so that ties are common."""
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(b, v, generator=g) * 3.0 * 4).round() / 4).to(torch.bfloat16)


def _per_token_cut_differs(logits, temp, top_k, top_p) -> int:
    """Rows where a per-token top-p cut in sort order (vLLM's sort-based rule) keeps only part of
    a tied group: the tie cases the reference must get right."""
    p = torch.softmax(logits.float() / temp, dim=-1)
    kth = p.topk(top_k, dim=-1).values[:, -1:]
    p = torch.where(p >= kth, p, 0.0)
    srt = (p / p.sum(-1, keepdim=True)).sort(-1, descending=True).values
    n_keep = ((srt.cumsum(-1) - srt) < top_p).sum(-1)
    straddles = srt.gather(1, (n_keep - 1).unsqueeze(1)) == srt.gather(1, n_keep.unsqueeze(1))
    return int(straddles.sum())


def test_target_probs_keeps_ties_like_verify_chain():
    # Two rows, the same weights in other token orders: the three tied 0.1s straddle the top-p
    # boundary (0.5 alone is short of 0.55, 0.5 + 0.1 passes it). verify_chain keeps the whole
    # group in both rows (the mass strictly above it, 0.5, is < 0.55), whatever the sort order;
    # a per-token cut in sort order would keep one of the three.
    w = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])
    perm = torch.tensor([7, 3, 5, 0, 6, 1, 4, 2])
    rows = torch.stack([w, w[perm]])
    logits = rows.log().to(torch.bfloat16)
    keep = target_probs(logits, 1.0, None, 0.55) > 0
    assert torch.equal(keep, rows >= 0.1)
    # Top-k ties at the k-th value are kept too (k = 2 keeps the maximum and the three 0.1s).
    assert (target_probs(logits, 1.0, 2) > 0).sum(-1).tolist() == [4, 4]
    # Random bf16 rows with many ties, B > 1: the kept set is SPEC §6.9's, tests/reference's.
    from reference.verify_chain import kept_mask, scores

    logits = _tied_rows(32, 3000, seed=5)
    assert _per_token_cut_differs(logits, 0.7, 50, 0.9) >= 5  # the case is exercised
    keep = target_probs(logits, 0.7, 50, 0.9) > 0
    want = torch.stack([kept_mask(scores(row, 0.7), 50, 0.9) for row in logits])
    assert torch.equal(keep, want)


def test_verify_chain_cpu_samples_pass_chi_square_with_tied_top_k_top_p():
    # peagle bench ops verify's check (check_peagle_random) at B = 64 with bf16 ties, on the CPU op.
    from peagle.bench.verify_chain import check_peagle_random

    b, k, v, temp, top = 64, 7, 3000, 0.7, (50, 0.9)
    logits = _tied_rows(b * (k + 1), v, seed=6)
    assert _per_token_cut_differs(logits.view(b, k + 1, v)[:, 0], temp, *top) >= 10
    draft_rows = (torch.arange(b * k) // k) * (k + 1) + torch.arange(b * k) % k
    drafts = logits[draft_rows].float().argmax(-1).to(torch.int32)
    g = torch.Generator().manual_seed(7)
    rand_ids = torch.randint(0, v, (b * k,), generator=g, dtype=torch.int32)
    drafts = torch.where(torch.rand(b * k, generator=g) < 0.8, drafts, rand_ids)
    s = {
        "logits": logits, "drafts": drafts, "cu": torch.arange(1, b + 1, dtype=torch.int32) * k,
        "temperature": torch.full((b,), temp), "seeds": torch.arange(b, dtype=torch.int64) + 1234,
        "offsets": torch.zeros(b, dtype=torch.int64),
        "top_k": torch.full((b,), top[0], dtype=torch.int32), "top_p": torch.full((b,), top[1]),
    }  # fmt: skip

    def peagle_cpu(s):
        return ops.verify_chain(
            s["logits"], s["drafts"], s["cu"], s["temperature"], s["seeds"], s["offsets"],
            top_k=s["top_k"], top_p=s["top_p"], max_num_draft_tokens=k,
        )  # fmt: skip

    chi = check_peagle_random(peagle_cpu, s, temp, top)
    assert chi.n == 4096 and chi.ok(), chi


# ---------------------------------------------------------------------------------------------
# the carry tool
# ---------------------------------------------------------------------------------------------


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_import_closure_follows_module_level_and_core_lazy_imports(tmp_path):
    tool = _carry_tool()
    _write(tmp_path, "flashinfer/__init__.py", "from .a import x\nfrom . import jit\n")
    a_src = "try:\n    from .b import y\nexcept ImportError:\n    pass\n"
    _write(tmp_path, "flashinfer/a.py", a_src + "def f():\n    from .lazy import z\n")
    _write(tmp_path, "flashinfer/b.py", "import flashinfer.c\n")
    _write(tmp_path, "flashinfer/c.py", "")
    _write(tmp_path, "flashinfer/lazy.py", "from .lazy_dep import w\n")
    _write(tmp_path, "flashinfer/lazy_dep.py", "")
    _write(tmp_path, "flashinfer/unused.py", "")
    _write(tmp_path, "flashinfer/jit/__init__.py", "from .core import gen\n")
    _write(tmp_path, "flashinfer/jit/core.py", "def gen():\n    from ..other import q\n")
    _write(tmp_path, "flashinfer/other.py", "")
    base = tool.import_closure(tmp_path, ["flashinfer"])
    assert base == {"flashinfer", "flashinfer.a", "flashinfer.b", "flashinfer.c",
                    "flashinfer.jit", "flashinfer.jit.core"}  # fmt: skip
    full = tool.import_closure(tmp_path, ["flashinfer"], core=["flashinfer.a"])
    assert full == base | {"flashinfer.lazy", "flashinfer.lazy_dep"}
    assert "flashinfer.other" not in full and "flashinfer.unused" not in full


@pytest.mark.skipif(not WHEEL.exists(), reason=f"no FlashInfer wheel at {WHEEL}")
def test_carry_selection_on_the_real_wheel(tmp_path):
    tool = _carry_tool()
    with zipfile.ZipFile(WHEEL) as z:
        keep = (*tool.DATA_SUFFIXES, ".py")
        names = [n for n in z.namelist() if n.startswith("flashinfer/")
                 and not n.startswith("flashinfer/data/") and n.endswith(keep)]  # fmt: skip
        z.extractall(tmp_path, members=names)
    files = tool.python_files(tmp_path)
    need = ["flashinfer/__init__.py", "flashinfer/prefill.py", "flashinfer/decode.py",
            "flashinfer/xqa.py", "flashinfer/sampling.py", "flashinfer/topk.py",
            "flashinfer/attention/_core.py", "flashinfer/jit/core.py", "flashinfer/jit/xqa.py",
            "flashinfer/jit/attention/modules.py", "flashinfer/jit/sampling.py"]  # fmt: skip
    assert set(need) <= set(files)
    raw = sum((tmp_path / f).stat().st_size for f in files)
    total = sum((tmp_path / n).stat().st_size for n in names)
    assert raw < 0.75 * total  # pruned: the closure leaves most of the package behind
    assert raw < 32 * 2**20  # compresses (xz) to well under the carry budget
    assert not any(f.startswith("flashinfer/experimental/b12x/") for f in files)


@pytest.mark.skipif(
    not all(shutil.which(t) for t in ("gcc", "strip", "nm")), reason="needs gcc, strip and nm"
)
def test_pack_strips_a_module_keeping_its_dynamic_symbols(tmp_path):
    tool = _carry_tool()
    src = tmp_path / "m.c"
    src.write_text(
        "static int helper(int x) { return x + 1; }\nint exported(int x) { return helper(x); }\n"
    )
    so = tmp_path / "m.so"
    subprocess.run(["gcc", "-g", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    before, after = tool.strip_module(so)
    assert after < before
    assert "exported" in tool.dynamic_symbols(so)


def test_install_unpacks_the_xz_aot_archive(tmp_path):
    tool = _carry_tool()
    carry, root = tmp_path / "carry", tmp_path / "root"
    rel = "flashinfer/data/aot/m/m.so"
    _write(root, rel, "not really a module")
    _write(root, "flashinfer/__init__.py", "")
    carry.mkdir()
    tool._tar(carry / "flashinfer-aot.tar.xz", root, [rel], xz=True)
    tool._tar(carry / "flashinfer-py.tar.xz", root, ["flashinfer/__init__.py"], xz=True)
    target = tmp_path / "site"
    tool.main(["install", "--carry", str(carry), "--target", str(target)])
    assert (target / rel).read_text() == "not really a module"
    assert os.access(target / rel, os.X_OK)
    assert (target / "flashinfer/__init__.py").exists()


# Runs in a subprocess: imports FlashInfer from ROOT (argv[2]) with a stub pynvml (the NVML
# bindings FlashInfer imports at module level; nothing here calls them), then either records
# the files the tool's spec generators read ("files") or calls the wrappers' module getters with
# JIT off, every JitSpec.build_and_load standing in for a loaded AOT module ("plan").
_SPEC_SCRIPT = """
import importlib.util, json, os, sys, types
from unittest import mock
what, root, tool_path = sys.argv[1:4]
sys.modules.setdefault("pynvml", types.ModuleType("pynvml"))
sys.path.insert(0, root)
try:
    import flashinfer
except Exception as e:
    print("IMPORT-FAILED", type(e).__name__, e)
    sys.exit(3)
assert flashinfer.__file__.startswith(root), flashinfer.__file__
spec = importlib.util.spec_from_file_location("flashinfer_carry", tool_path)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
if what == "files":
    print(json.dumps(tool.generator_files(flashinfer)[1]))
else:
    with mock.patch.object(flashinfer.jit.core.JitSpec, "build_and_load",
                           lambda self: mock.MagicMock()):
        print(json.dumps(tool.plan_check(flashinfer)))
"""


def _spec_subprocess(tmp_path: Path, what: str, root: Path):
    env = dict(os.environ, FLASHINFER_WORKSPACE_BASE=str(tmp_path / f"ws-{what}"),
               FLASHINFER_CUDA_ARCH_LIST="9.0a")  # fmt: skip
    env.pop("FLASHINFER_DISABLE_JIT", None)
    tool = str(ROOT / "tools/flashinfer_carry.py")
    args = [sys.executable, "-c", _SPEC_SCRIPT, what, str(root), tool]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    if r.returncode == 3 and "IMPORT-FAILED" in r.stdout:
        pytest.skip(f"FlashInfer does not import here: {r.stdout.strip()[:200]}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not WHEEL.exists(), reason=f"no FlashInfer wheel at {WHEEL}")
def test_carry_has_every_source_the_module_specs_read(tmp_path):
    """The wrappers make specs at plan time that the carried modules alone do not show (the fa2
    prefill getter also makes the independent-stride paged variant's spec, copying
    csrc/batch_prefill_paged.cu even with JIT off): with only the carried Python modules and
    the carried generator sources, every getter the peers reach still runs."""
    pytest.importorskip("jinja2")
    pytest.importorskip("tvm_ffi")
    tool = _carry_tool()
    full, carried = tmp_path / "full", tmp_path / "carried"
    with zipfile.ZipFile(WHEEL) as z:
        keep = (*tool.DATA_SUFFIXES, ".py")
        py = [n for n in z.namelist() if n.startswith("flashinfer/")
              and not n.startswith("flashinfer/data/") and n.endswith(keep)]  # fmt: skip
        # What the generators read lies directly in csrc (templates, host sources); the
        # kernels' headers (deeper, hundreds of MB) are only compiled, never read at spec time.
        csrc = [n for n in z.namelist()
                if n.startswith("flashinfer/data/csrc/") and n.count("/") == 3]  # fmt: skip
        z.extractall(full, members=py + csrc)
    files = _spec_subprocess(tmp_path, "files", full)
    src = tool.jit_source_files(full, {}, {"_generators": {"files": files}})
    assert "flashinfer/data/csrc/batch_prefill_paged.cu" in src
    for rel in tool.python_files(full) + src:
        (carried / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(full / rel, carried / rel)
    assert _spec_subprocess(tmp_path, "plan", carried) == {}
