"""A pruned, carryable FlashInfer for the offline H200 machine (issue 21).

The flashinfer-python wheel (0.7.4: 101 MB, 715 MB unpacked) does not fit the 64 MiB a device
run carries. This tool keeps only what the benchmark peers need (paged attention through the
prefill wrapper fa2/fa3, the decode wrapper with ``q_len_per_req``, XQA and the persistent
``BatchAttention``; sampling: softmax, top-k/top-p renorm, ``chain_speculative_sampling``,
``top_k_top_p_sampling_from_logits``):

``build``  imports FlashInfer from the unpacked wheel with ``FLASHINFER_CUDA_ARCH_LIST=9.0a``
    (no GPU needed), creates the JIT specs the peers request at plan time (:func:`module_specs`,
    the same arguments the wrappers pass) and compiles each with ninja + nvcc, timing it. The
    modules link no torch (tvm-ffi), only libcudart.so.13 / libcuda.so.1 (a stub libcuda is made
    for the link when the toolkit has none), so they load under the H200's torch 2.11.
``pack``   writes ``OUT`` (default ``.deps/flashinfer``):

    * ``flashinfer-py.tar.xz``: the Python modules: the import closure of the entry modules
      (module-level imports, transitively) plus the function-level imports of the modules on the
      peers' paths (:data:`CORE`), and the small data files next to them (json);
    * ``flashinfer-aot.tar.xz``: the built modules as ``flashinfer/data/aot/<name>/<name>.so``,
      FlashInfer's own AOT location (``jit/env.py: get_aot_artifacts``), so no JIT runs there;
      each stripped of its static symbol table (``strip --strip-unneeded``; the dynamic symbols
      tvm-ffi loads are checked unchanged with ``nm -D``) and xz-compressed (the fatbins shrink
      about 2x);
    * ``flashinfer-jit-src.tar.xz``: the sources, templates and every header the builds read
      (from ninja's dependency files), so the JIT can still rebuild a module there, and every
      file the spec generators read at plan time (:func:`generator_files`: the specs of
      :func:`module_specs` and of :func:`lazy_specs`, which the wrappers make without loading);
    * the ``apache-tvm-ffi`` wheel for the H200's Python (3.12), FlashInfer's one import-time
      dependency that the image lacks; ``MANIFEST.json``: files, sizes, compile times.

    python tools/flashinfer_carry.py build --wheel WHEEL --tvm-ffi-wheel TVM_FFI_CP3XX_WHL \
        [--work /tmp/fi-carry] [--jobs 2] [--only sampling]
    python tools/flashinfer_carry.py pack --wheel WHEEL --tvm-ffi-wheel TVM_FFI_CP312_WHL \
        [--work /tmp/fi-carry] [--out .deps/flashinfer]
    python tools/flashinfer_carry.py deps --wheel WHEEL --tvm-ffi-wheel TVM_FFI_CP3XX_WHL
    python tools/flashinfer_carry.py install --carry .deps/flashinfer --target /tmp/fi-site  # H200
    PYTHONPATH=/tmp/fi-site python3 tools/flashinfer_carry.py prebuild --out $OUT/fi-jit.json

``deps`` lists, by ``nvcc -M``, the headers of modules not compiled here (``pack`` needs a list
for every module). ``install`` (used by ``tools/h200.sh flashinfer``) unpacks the three archives
(``flashinfer-aot.tar`` too, the uncompressed form older carries have) and the wheel into
``--target`` (put it on PYTHONPATH); ``prebuild`` then loads every module (AOT) or JIT-builds
the missing ones in one parallel ninja run, timing each, then calls the wrappers' module
getters (:func:`plan_check`) as the peers' plan() does. docs/benchmarks.md has the H200
commands.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

ARCH = "9.0a"
Q_LEN = 14  # 2K query rows per request, K = 7 (python/peagle/bench/paged_attention.py)
PAGE = 16
HEAD_CONFIGS = [(64, 8, 64), (32, 8, 128)]  # (q heads, kv heads, head_dim)
ENTRY = [
    "flashinfer",
    "flashinfer.prefill",
    "flashinfer.decode",
    "flashinfer.xqa",
    "flashinfer.sampling",
    "flashinfer.topk",
    "flashinfer.attention",
]
# Modules on the peers' paths whose function-level (lazy) imports are carried too.
CORE = [
    "flashinfer.prefill",
    "flashinfer.decode",
    "flashinfer.xqa",
    "flashinfer.sampling",
    "flashinfer.topk",
    "flashinfer.attention._core",
    "flashinfer.utils",
    "flashinfer.jit.core",
    "flashinfer.jit.cpp_ext",
    "flashinfer.jit.env",
    "flashinfer.jit.attention.modules",
    "flashinfer.jit.xqa",
    "flashinfer.jit.sampling",
    "flashinfer.jit.topk",
]
DATA_SUFFIXES = (".json", ".typed")
# What the carried copy may take of the 64 MiB per run: the repository's tracked files (~19 MB),
# the rest of .deps (CUTLASS wheel, 6.2 MB) and .ab (~2 MB) take the others, with a margin.
SIZE_BUDGET = 30 * 1024 * 1024
AOT_ARCHIVES = ("flashinfer-aot.tar.xz", "flashinfer-aot.tar")  # packed now / older carries


# ---------------------------------------------------------------------------------------------
# module specs: the JIT modules the benchmark peers load on SM90
# ---------------------------------------------------------------------------------------------


def module_specs(fi=None) -> list[tuple[str, object]]:
    """(label, JitSpec) for every module the peers need, built with the arguments the wrappers
    pass at plan time for bf16 q/kv/o, int32 indices, no RoPE / window / soft-cap."""
    import torch

    if fi is None:
        import flashinfer as fi  # noqa: F401
    from flashinfer.jit.attention.modules import (
        _gen_batch_attention_primary_module,
        _gen_batch_prefill_primary_module,
        gen_batch_prefill_module,
    )
    from flashinfer.jit.sampling import gen_sampling_module
    from flashinfer.jit.topk import gen_topk_module
    from flashinfer.jit.xqa import gen_xqa_module

    bf16, i32 = torch.bfloat16, torch.int32
    specs = [("sampling", gen_sampling_module()), ("topk", gen_topk_module())]
    for hq, hkv, d in HEAD_CONFIGS:
        # BatchPrefillWithPagedKVCacheWrapper.plan (prefill.py) and the tensor-core decode
        # wrapper (decode.py) both call get_batch_prefill_module(backend, q, kv, o, idx, d, d,
        # pos_encoding=0, use_sliding_window, use_logits_soft_cap, use_fp16_qk_reduction,
        # use_token_head_sf); fa2 builds its primary (equal K/V strides) module.
        args = (bf16, bf16, bf16, i32, d, d, 0, False, False, False, False)
        specs.append((f"prefill-fa2-d{d}", _gen_batch_prefill_primary_module("fa2", *args)))
        specs.append((f"prefill-fa3-d{d}", gen_batch_prefill_module("fa3", *args)))
        # BatchAttention.plan (attention/_core.py): (q, kv, o, idx, d_qk, d_vo, pos, softcap,
        # profiler).
        ba = (bf16, bf16, bf16, i32, d, d, 0, False, False)
        specs.append((f"batch-attention-d{d}", _gen_batch_attention_primary_module(*ba)))
        # xqa() (xqa.py): (q dtype, kv dtype, page, head_dim, group, sliding window, o dtype,
        # q_seq_len, ragged); uniform q_len, so not ragged.
        specs.append(
            (f"xqa-d{d}-g{hq // hkv}", gen_xqa_module(bf16, bf16, PAGE, d, hq // hkv, False,
                                                      bf16, Q_LEN, False))
        )  # fmt: skip
    return specs


def lazy_specs(fi=None) -> list[tuple[str, object]]:
    """(label, JitSpec) for the modules the wrappers only *describe* at plan time: the fa2
    prefill getter (``prefill.py: get_batch_prefill_module``, which the tensor-core decode
    wrapper calls too) and ``BatchAttention.plan`` also make the spec of the variant they load
    only when the K and V caches have different strides (``_LazyPagedKVStrideModule``). The
    peers pass the two halves of one cache (equal strides), so these modules are neither built
    nor carried; but making a spec copies its sources from ``flashinfer/data/csrc`` into the
    generation directory (``gen_customize_batch_prefill_module``: batch_prefill_paged.cu,
    ...), with FLASHINFER_DISABLE_JIT too, so those sources must be carried: without them the
    fa2 wrappers raise FileNotFoundError at plan time although their AOT module loads. Their
    compilations include the same headers as the primary modules' (same #includes)."""
    import torch

    if fi is None:
        import flashinfer as fi  # noqa: F401
    from flashinfer.jit.attention.modules import (
        _gen_batch_attention_independent_module,
        _gen_batch_prefill_independent_paged_module,
    )

    bf16, i32 = torch.bfloat16, torch.int32
    specs = []
    for _, _, d in HEAD_CONFIGS:
        args = (bf16, bf16, bf16, i32, d, d, 0, False, False, False, False)
        specs.append(
            (f"prefill-fa2-paged-d{d}", _gen_batch_prefill_independent_paged_module("fa2", *args))
        )
        ba = (bf16, bf16, bf16, i32, d, d, 0, False, False)
        specs.append((f"batch-attention-independent-d{d}",
                      _gen_batch_attention_independent_module(*ba)))  # fmt: skip
    return specs


def generator_files(fi=None) -> tuple[list[str], list[str]]:
    """(labels, files): the files opened while the specs of :func:`module_specs` and
    :func:`lazy_specs` are made (templates rendered, sources copied)."""
    opened: set[str] = set()
    active = [True]

    def hook(event, hook_args):
        if active[0] and event == "open" and isinstance(hook_args[0], (str, Path)):
            opened.add(str(hook_args[0]))

    sys.addaudithook(hook)  # audit hooks cannot be removed: switched off below
    try:
        specs = module_specs(fi) + lazy_specs(fi)
    finally:
        active[0] = False
    return [label for label, _ in specs], sorted(opened)


def plan_check(fi=None) -> dict[str, str]:
    """Calls FlashInfer's own module getters the way the peers' wrappers do at plan time
    (loading each module, AOT or cached JIT; never building: FLASHINFER_DISABLE_JIT=1 while it
    runs) for every backend and head dim; returns {getter: error} for those that raise (empty:
    all pass). Catches what loading the modules alone does not, e.g. a source that a spec
    generator reads missing from the carry."""
    import torch

    if fi is None:
        import flashinfer as fi  # noqa: F401
    from flashinfer.attention import _core
    from flashinfer.prefill import get_batch_prefill_module
    from flashinfer.sampling import get_sampling_module
    from flashinfer.topk import get_topk_module
    from flashinfer.xqa import get_xqa_module

    bf16, i32 = torch.bfloat16, torch.int32
    calls = [("sampling", get_sampling_module, ()), ("topk", get_topk_module, ())]
    for hq, hkv, d in HEAD_CONFIGS:
        args = (bf16, bf16, bf16, i32, d, d, 0, False, False, False, False)
        ba = (bf16, bf16, bf16, i32, d, d, 0, False, False)
        calls += [
            (f"get_batch_prefill_module(fa2, d{d})", get_batch_prefill_module, ("fa2", *args)),
            (f"get_batch_prefill_module(fa3, d{d})", get_batch_prefill_module, ("fa3", *args)),
            (f"get_holistic_attention_module(d{d})", _core.get_holistic_attention_module, ba),
            (f"get_holistic_attention_independent_module(d{d})",
             _core.get_holistic_attention_independent_module, ba),
            (f"get_xqa_module(d{d})", get_xqa_module,
             (bf16, bf16, PAGE, d, hq // hkv, False, bf16, Q_LEN, False)),
        ]  # fmt: skip
    errors = {}
    saved = os.environ.get("FLASHINFER_DISABLE_JIT")
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    try:
        for name, fn, a in calls:
            try:
                fn(*a)
            except Exception as e:  # noqa: BLE001  (reported, not raised)
                errors[name] = f"{type(e).__name__}: {e}"[:500]
    finally:
        if saved is None:
            del os.environ["FLASHINFER_DISABLE_JIT"]
        else:
            os.environ["FLASHINFER_DISABLE_JIT"] = saved
    return errors


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------


def unpack_wheel(wheel: Path, dest: Path) -> Path:
    """Unpacks the wheel once into dest (reused when already there); returns dest."""
    marker = dest / ".unpacked"
    if marker.exists() and marker.read_text() == str(wheel.resolve()):
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest)
    marker.write_text(str(wheel.resolve()))
    return dest


def _stub_libcuda(work: Path) -> Path:
    """A libcuda.so (soname libcuda.so.1, no symbols) to link against where the toolkit ships no
    driver stub; at load time the driver's libcuda.so.1 provides the symbols."""
    d = work / "stubs"
    so = d / "libcuda.so"
    if not so.exists():
        d.mkdir(parents=True, exist_ok=True)
        src = d / "empty.c"
        src.write_text("/* stub: resolved against the driver's libcuda.so.1 at load time */\n")
        subprocess.run(
            ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(so), str(src)],
            check=True,
        )
    return d


def _cuda_home() -> str:
    """CUDA_HOME, else the toolkit of the nvcc on PATH (following a shell wrapper's exec)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("nvcc not found")
    real = Path(nvcc).resolve()
    if real.stat().st_size < 4096:  # e.g. /usr/local/bin/nvcc: exec /usr/local/cuda-13.0/bin/nvcc
        m = re.search(r"exec\s+(\S+/nvcc)", real.read_text(errors="ignore"))
        if m:
            real = Path(m.group(1))
    return str(real.parent.parent)


def setup_env(work: Path, wheel: Path, tvm_ffi_wheel: Path | None, extra_includes=()) -> Path:
    """Environment and sys.path for importing the unpacked FlashInfer without a GPU."""
    site = unpack_wheel(wheel, work / "wheel")
    paths = [str(site)]
    if tvm_ffi_wheel is not None:
        paths.insert(0, str(unpack_wheel(tvm_ffi_wheel, work / "tvm-ffi")))
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = ARCH
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(work / "ws")
    os.environ.setdefault("CUDA_HOME", _cuda_home())
    cuda_lib = Path(os.environ["CUDA_HOME"]) / "lib64"
    stubs_dir = cuda_lib / "stubs"
    if not (stubs_dir / "libcuda.so").exists() and not (cuda_lib / "libcuda.so").exists():
        os.environ["FLASHINFER_EXTRA_LDFLAGS"] = f"-L{_stub_libcuda(work)}"
    for inc in extra_includes:  # e.g. curand.h where the toolkit lacks it (pip nvidia-curand)
        for var in ("FLASHINFER_EXTRA_CUDAFLAGS", "FLASHINFER_EXTRA_CFLAGS"):
            os.environ[var] = f"{os.environ.get(var, '')} -isystem {inc}".strip()
    return site


def cmd_build(args) -> None:
    work = Path(args.work)
    tvm = Path(args.tvm_ffi_wheel) if args.tvm_ffi_wheel else None
    setup_env(work, Path(args.wheel), tvm, args.include or ())
    import flashinfer

    specs = module_specs(flashinfer)
    manifest_path = work / "build.json"
    built = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    for label, spec in specs:
        if args.only and not any(o in label for o in args.only):
            continue
        so = spec.jit_library_path
        spec.write_ninja()
        t0 = time.perf_counter()
        cmd = ["ninja", "-C", str(spec.build_dir), "-f", str(spec.ninja_path), "-j", str(args.jobs)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            print(f"{label}: {spec.name}: FAILED after {dt:.0f} s\n{r.stdout[-4000:]}")
            built[label] = {"name": spec.name, "error": r.stdout[-4000:], "seconds": round(dt, 1)}
        else:
            noop = "no work to do" in r.stdout
            entry = built.get(label, {}) if noop else {}
            entry.update(name=spec.name, so=str(so), so_bytes=so.stat().st_size)
            if not noop:
                entry["seconds"] = round(dt, 1)
                entry["jobs"] = args.jobs
                entry["objects"] = len(spec.sources)
            built[label] = entry
            size = so.stat().st_size / 2**20
            note = " (up to date)" if noop else ""
            print(f"{label}: {spec.name}: {entry.get('seconds')} s (jobs {args.jobs}), "
                  f"{size:.1f} MiB{note}")  # fmt: skip
        manifest_path.write_text(json.dumps(built, indent=1) + "\n")


def cmd_deps(args) -> None:
    """Every file the modules' compilations read (``-M`` dependency lists of each compile
    command; preprocessing only, minutes instead of the compile's hours here)."""
    import shlex

    work = Path(args.work)
    tvm = Path(args.tvm_ffi_wheel) if args.tvm_ffi_wheel else None
    setup_env(work, Path(args.wheel), tvm, args.include or ())
    import flashinfer

    deps_path = work / "deps.json"
    deps = json.loads(deps_path.read_text()) if deps_path.exists() else {}
    # The generators read templates and copy sources from flashinfer/data at spec time, those of
    # the plan-time-only specs (lazy_specs) too: record every file opened while they are made.
    labels, opened = generator_files(flashinfer)
    deps["_generators"] = {"name": "files the spec generators read", "labels": labels,
                           "files": opened}  # fmt: skip
    deps_path.write_text(json.dumps(deps, indent=1) + "\n")
    specs = module_specs(flashinfer)
    for label, spec in specs:
        if label in deps and deps[label].get("files") and not args.force:
            continue
        t0 = time.perf_counter()
        files: set[str] = set()
        spec.build_dir.mkdir(parents=True, exist_ok=True)
        for cc in spec.get_compile_commands():
            words = shlex.split(cc["command"])
            if "-o" in words:
                i = words.index("-o")
                del words[i : i + 2]
            words = [("-M" if w == "-c" else w) for w in words]
            r = subprocess.run(words, capture_output=True, text=True, cwd=cc["directory"])
            if r.returncode != 0:
                raise SystemExit(f"{label}: {' '.join(words)[:300]}...\n{r.stderr[-3000:]}")
            text = r.stdout.replace("\\\n", " ")
            files.update(t for t in text.split() if not t.endswith(":"))
            files.update(str(s) for s in spec.sources)
        deps[label] = {"name": spec.name, "files": sorted(files)}
        print(f"{label}: {spec.name}: {len(files)} files ({time.perf_counter() - t0:.0f} s)")
        deps_path.write_text(json.dumps(deps, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------
# file selection
# ---------------------------------------------------------------------------------------------


def _module_file(root: Path, mod: str) -> tuple[Path | None, bool]:
    p = root.joinpath(*mod.split("."))
    if (p / "__init__.py").exists():
        return p / "__init__.py", True
    if p.with_suffix(".py").exists():
        return p.with_suffix(".py"), False
    return None, False


def module_imports(root: Path, mod: str, lazy: bool) -> set[str]:
    """flashinfer modules that ``mod`` imports: at module level (try/if blocks included, not
    function bodies) or, with ``lazy``, anywhere in the file."""
    f, is_pkg = _module_file(root, mod)
    if f is None:
        return set()
    tree = ast.parse(f.read_text(), filename=str(f))
    pkg = mod if is_pkg else mod.rpartition(".")[0]
    names: set[str] = set()
    stack = list(tree.body)
    while stack:
        n = stack.pop()
        if not lazy and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(n, ast.Import):
            names.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - (n.level - 1)]
                base = ".".join(parts + ([n.module] if n.module else []))
            else:
                base = n.module or ""
            names.add(base)
            names.update(f"{base}.{a.name}" for a in n.names)  # submodules imported by name
        stack.extend(ast.iter_child_nodes(n))
    out = set()
    for name in names:
        if not name.startswith("flashinfer"):
            continue
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # a package's __init__ runs on the way down
            m = ".".join(parts[:i])
            if _module_file(root, m)[0] is not None:
                out.add(m)
    return out


def import_closure(root: Path, entries, core=()) -> set[str]:
    """The module-level import closure of ``entries``, plus the lazy imports of ``core``."""

    def close(start) -> set[str]:
        seen: set[str] = set()
        todo = list(start)
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            todo.extend(module_imports(root, m, lazy=False) - seen)
        return seen

    mods = close(entries)
    extra = set()
    for c in core:
        extra |= module_imports(root, c, lazy=True)
    return close(mods | extra)


def python_files(root: Path) -> list[str]:
    """Relative paths (under root) of the carried Python modules and their package data."""
    mods = import_closure(root, ENTRY, CORE)
    files = {str(_module_file(root, m)[0].relative_to(root)) for m in mods}
    pkg_dirs = {str(Path(f).parent) for f in files}
    for d in pkg_dirs:  # json/typed data next to a carried module (tuning configs, ...)
        for p in (root / d).iterdir():
            if p.is_file() and p.suffix in DATA_SUFFIXES:
                files.add(str(p.relative_to(root)))
    return sorted(files)


def jit_source_files(root: Path, build: dict, deps: dict | None = None) -> list[str]:
    """The sources, templates and headers of the modules inside the wheel's ``flashinfer/data``
    (from ``deps`` -- :func:`cmd_deps` -- and the built modules' ninja and dependency files)."""
    data = (root / "flashinfer" / "data").resolve()
    files: set[str] = set()

    def add(p: str) -> None:
        # By the path below flashinfer/data/, so lists made in another work dir still apply.
        marker = "/flashinfer/data/"
        if marker not in p:
            return
        # Normalised: a member such as csrc/xqa/../x.h stops tarfile's extraction (FileExistsError
        # making csrc/xqa/..) and would duplicate csrc/x.h.
        rel = Path(os.path.normpath(Path("flashinfer/data") / p.split(marker, 1)[1]))
        if (root / rel).is_file():
            files.add(str(rel))

    for entry in (deps or {}).values():
        for f in entry["files"]:
            add(f)
    for entry in build.values():
        if "so" not in entry:
            continue
        bdir = Path(entry["so"]).parent
        for dep in bdir.glob("*.d"):
            text = dep.read_text().replace("\\\n", " ")
            for tok in text.split()[1:]:
                add(tok)
        ninja = (bdir / "build.ninja").read_text() if (bdir / "build.ninja").exists() else ""
        for line in ninja.splitlines():
            if line.startswith("build "):
                for tok in line.split()[2:]:
                    add(tok)
    # Templates the generators render at spec time (jit/attention/modules.py reads them).
    for p in (data / "csrc").rglob("*.jinja"):
        files.add(str(Path("flashinfer/data") / p.relative_to(data)))
    return sorted(files)


def dynamic_symbols(so: Path) -> list[str]:
    """The defined dynamic symbols of ``so`` (``nm -D --defined-only``), sorted."""
    r = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True,
                       check=True)  # fmt: skip
    return sorted(line.split()[-1] for line in r.stdout.splitlines() if line.strip())


def strip_module(so: Path) -> tuple[int, int]:
    """Strips ``so`` in place (``strip --strip-unneeded``: the static symbol table and debug
    sections; the dynamic symbols and the fatbin stay) and checks that its dynamic symbols are
    unchanged. Returns (bytes before, bytes after)."""
    before = so.stat().st_size
    want = dynamic_symbols(so)
    subprocess.run(["strip", "--strip-unneeded", str(so)], check=True)
    got = dynamic_symbols(so)
    if got != want:
        raise SystemExit(f"{so}: strip changed the dynamic symbols ({len(want)} -> {len(got)})")
    return before, so.stat().st_size


def _tar(out: Path, root: Path, files, xz: bool) -> int:
    mode = "w:xz" if xz else "w"
    with tarfile.open(out, mode, **({"preset": 6} if xz else {})) as t:
        for f in files:
            t.add(root / f, arcname=f, recursive=False)
    return out.stat().st_size


def cmd_pack(args) -> None:
    work = Path(args.work)
    root = unpack_wheel(Path(args.wheel), work / "wheel")
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build_path = work / "build.json"
    build = json.loads(build_path.read_text()) if build_path.exists() else {}
    py = python_files(root)
    manifest = {"flashinfer": _wheel_version(Path(args.wheel)), "arch": ARCH, "files": {}}
    sizes = {}
    sizes["flashinfer-py.tar.xz"] = _tar(out / "flashinfer-py.tar.xz", root, py, xz=True)
    manifest["files"]["flashinfer-py.tar.xz"] = {
        "members": len(py),
        "raw_bytes": sum((root / f).stat().st_size for f in py),
    }
    aot_root = work / "aot"
    if aot_root.exists():
        shutil.rmtree(aot_root)
    aot = []
    skip = set(args.skip_modules or ())
    for label, entry in build.items():
        if "so" not in entry or label in skip:
            continue
        rel = Path("flashinfer/data/aot") / entry["name"] / f"{entry['name']}.so"
        (aot_root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(entry["so"], aot_root / rel)
        aot.append(str(rel))
    for tar in sorted(Path(args.aot_from).glob("fi-aot-*.tar")) if args.aot_from else []:
        with tarfile.open(tar) as t:  # modules built on the H200 (prebuild --export)
            for m in t.getmembers():
                if m.isfile() and m.name.startswith("flashinfer/data/aot/") and m.name not in aot:
                    t.extract(m, aot_root, filter="data")
                    aot.append(m.name)
    if aot:
        stripped = {}
        if not args.no_strip:
            for rel in aot:
                before, after = strip_module(aot_root / rel)
                stripped[rel] = {"bytes": before, "stripped_bytes": after}
        name = AOT_ARCHIVES[0]
        sizes[name] = _tar(out / name, aot_root, aot, xz=True)
        manifest["files"][name] = {
            "members": aot,
            "raw_bytes": sum((aot_root / f).stat().st_size for f in aot),
            "strip": stripped,
        }
    if not args.no_jit_src:
        deps_path = work / "deps.json"
        deps = json.loads(deps_path.read_text()) if deps_path.exists() else {}
        labels = [label for label, _ in _labels()] + ["_generators"]
        missing = [label for label in labels if label not in deps]
        if missing:
            raise SystemExit(f"no dependency list for {missing}: run `deps` (or `build`) first")
        stale = sorted({lbl for lbl, _ in _labels() + _lazy_labels()}
                       - set(deps["_generators"].get("labels", ())))  # fmt: skip
        if stale:  # recorded before these specs were made (e.g. by an older version of `deps`)
            raise SystemExit(f"the generators' files lack the specs {stale}: run `deps` again")
        src = jit_source_files(root, build, deps)
        sizes["flashinfer-jit-src.tar.xz"] = _tar(
            out / "flashinfer-jit-src.tar.xz", root, src, xz=True
        )
        manifest["files"]["flashinfer-jit-src.tar.xz"] = {
            "members": len(src),
            "raw_bytes": sum((root / f).stat().st_size for f in src),
        }
    if args.tvm_ffi_wheel:
        w = Path(args.tvm_ffi_wheel)
        shutil.copy2(w, out / w.name)
        sizes[w.name] = w.stat().st_size
    manifest["modules"] = build
    manifest["sizes"] = sizes
    manifest["total_bytes"] = sum(sizes.values())
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for k, v in sizes.items():
        print(f"{k:45s} {v / 2**20:7.2f} MiB")
    total = manifest["total_bytes"]
    print(f"{'total':45s} {total / 2**20:7.2f} MiB (budget {SIZE_BUDGET / 2**20:.0f} MiB)")
    if total > SIZE_BUDGET:
        raise SystemExit("over the size budget")


def _labels():
    """The module labels of :func:`module_specs` without importing FlashInfer."""
    out = [("sampling", None), ("topk", None)]
    for hq, hkv, d in HEAD_CONFIGS:
        out += [(f"prefill-fa2-d{d}", None), (f"prefill-fa3-d{d}", None),
                (f"batch-attention-d{d}", None), (f"xqa-d{d}-g{hq // hkv}", None)]  # fmt: skip
    return out


def _lazy_labels():
    """The labels of :func:`lazy_specs` without importing FlashInfer."""
    out = []
    for _, _, d in HEAD_CONFIGS:
        out += [(f"prefill-fa2-paged-d{d}", None), (f"batch-attention-independent-d{d}", None)]
    return out


def _wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


# ---------------------------------------------------------------------------------------------
# install and prebuild (on the H200)
# ---------------------------------------------------------------------------------------------


def cmd_prebuild(args) -> None:
    """On the GPU machine, with the carried copy on PYTHONPATH: load every module the peers
    need from the carried AOT build, JIT-build the others in one parallel ninja run (all cores,
    ``--seconds`` at most; ``-k 0``: one failure stops no other module), copy what was built to
    the AOT path of the installed copy (so the benchmarks can run with FLASHINFER_DISABLE_JIT=1)
    and, with ``--export DIR``, into tars of <= 15 MiB that come back in $OUT for ``pack
    --aot-from``. Prints / writes the time of each step. ``--no-jit`` builds nothing: it checks
    a carry (the AOT modules load through tvm-ffi without a GPU; libcudart.so.13 must be found);
    ``--only`` limits the modules (labels of :func:`module_specs`) to those a run needs. Then
    :func:`plan_check` calls the wrappers' module getters (JIT off) and reports those that fail."""
    import flashinfer
    import tvm_ffi
    from flashinfer.jit import env as jit_env

    report = {"flashinfer": flashinfer.__version__, "modules": {}}
    jit = []
    for label, spec in module_specs(flashinfer):
        entry = report["modules"].setdefault(label, {"name": spec.name})
        if args.only and not any(o in label for o in args.only):
            entry["source"] = "skipped"  # not asked for: neither loaded nor built
            continue
        if spec.is_aot:
            t0 = time.perf_counter()
            try:
                tvm_ffi.load_module(str(spec.aot_path))
                entry.update(source="aot", load_s=round(time.perf_counter() - t0, 2))
                continue
            except Exception as e:  # noqa: BLE001  (falls back to the JIT)
                entry["aot_error"] = f"{type(e).__name__}: {e}"[:500]
        jit.append((label, spec))
    exported = []
    if jit and args.no_jit:  # a check of the carry (e.g. here, without a GPU): build nothing
        for label, _ in jit:
            report["modules"][label]["source"] = "missing"
        jit = []
    if jit:
        lines = ["ninja_required_version = 1.3"]
        for _, spec in jit:
            spec.write_ninja()
            lines.append(f"subninja {spec.ninja_path}")
        top = jit_env.FLASHINFER_JIT_DIR / "peagle_prebuild.ninja"
        top.write_text("\n".join(lines) + "\n")
        jobs = str(args.jobs or os.cpu_count() or 8)
        cmd = [
            "ninja",
            "-C",
            str(jit_env.FLASHINFER_JIT_DIR),
            "-f",
            str(top),
            "-k",
            "0",
            "-j",
            jobs,
        ]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.seconds)
            report["jit_rc"] = r.returncode
            if r.returncode != 0:
                report["jit_log_tail"] = r.stdout[-3000:]
        except subprocess.TimeoutExpired:
            report["jit_rc"] = "timeout"
        report["jit_build_s"] = round(time.perf_counter() - t0, 1)
        for label, spec in jit:
            entry = report["modules"][label]
            so = spec.jit_library_path
            if not so.exists():
                entry.update(source="missing")
                continue
            aot = Path(jit_env.FLASHINFER_AOT_DIR) / spec.name / f"{spec.name}.so"
            aot.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(so, aot)
            exported.append(aot)
            t1 = time.perf_counter()
            try:
                tvm_ffi.load_module(str(aot))
                entry.update(source="jit", load_s=round(time.perf_counter() - t1, 2),
                             so_bytes=so.stat().st_size)  # fmt: skip
            except Exception as e:  # noqa: BLE001
                entry.update(source="jit-unloadable", error=f"{type(e).__name__}: {e}"[:500])
    if args.export and exported:
        report["exported"] = _export_tars(exported, Path(args.export))
    # The wrappers' own module getters, as at plan time (lazy specs included): a source a spec
    # generator reads and the carry lacks fails here, not in every benchmark shape.
    report["plan_errors"] = plan_check(flashinfer)
    for label, e in report["modules"].items():
        print(f"{label:24s} {e.get('source', '?'):8s} load {e.get('load_s', '-')} s  "
              f"{e.get('aot_error', '') or e.get('error', '')}")  # fmt: skip
    bad = report["plan_errors"]
    note = " (--only: the getters of modules left out fail)" if bad and args.only else ""
    print(f"plan-time getters: {len(bad)} failed{note}")
    for name, err in bad.items():
        print(f"  {name}: {err[:200]}")
    if jit:
        print(f"JIT build of {len(jit)} modules: {report['jit_build_s']} s, rc {report['jit_rc']}")
        if "jit_log_tail" in report:
            print(report["jit_log_tail"][-1500:])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


def _export_tars(sos: list[Path], dest: Path, limit: int = 15 * 2**20) -> list[str]:
    """Tars of the built modules (as flashinfer/data/aot/<name>/<name>.so), each <= limit
    unless one module alone is larger."""
    dest.mkdir(parents=True, exist_ok=True)
    groups: list[list[Path]] = [[]]
    size = 0
    for so in sorted(sos, key=lambda p: p.stat().st_size, reverse=True):
        if groups[-1] and size + so.stat().st_size > limit:
            groups.append([])
            size = 0
        groups[-1].append(so)
        size += so.stat().st_size
    names = []
    for i, g in enumerate(groups):
        out = dest / f"fi-aot-{i}.tar"
        with tarfile.open(out, "w") as t:
            for so in g:
                t.add(so, arcname=f"flashinfer/data/aot/{so.parent.name}/{so.name}")
        names.append(out.name)
    return names


def cmd_install(args) -> None:
    carry, target = Path(args.carry), Path(args.target)
    target.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for name in ("flashinfer-py.tar.xz", "flashinfer-jit-src.tar.xz", *AOT_ARCHIVES):
        p = carry / name
        if p.exists():
            with tarfile.open(p) as t:
                t.extractall(target, filter="data")
    for whl in sorted(carry.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            z.extractall(target)
    for so in target.rglob("*.so"):  # zip extraction drops the executable bits
        so.chmod(0o755)
    print(f"flashinfer carry installed in {target} ({time.perf_counter() - t0:.1f} s)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the peers' JIT modules for sm_90a here")
    dp = sub.add_parser("deps", help="list the files the modules' compilations read")
    p = sub.add_parser("pack", help="write the carried directory")
    for s in (b, dp):
        s.add_argument("--include", nargs="*", help="extra -isystem dirs (e.g. curand headers)")
    dp.add_argument("--force", action="store_true", help="recompute lists already made")
    for s in (b, dp, p):
        s.add_argument("--wheel", required=True)
        s.add_argument("--tvm-ffi-wheel", help="apache-tvm-ffi wheel (build: this Python's)")
        s.add_argument("--work", default="/tmp/fi-carry")
    b.add_argument("--jobs", type=int, default=2)
    b.add_argument("--only", nargs="*", help="labels containing one of these")
    p.add_argument("--out", default=".deps/flashinfer")
    p.add_argument("--no-jit-src", action="store_true", help="carry no JIT sources")
    p.add_argument("--aot-from", help="a folder of fi-aot-*.tar from `prebuild --export`")
    p.add_argument("--no-strip", action="store_true", help="carry the modules unstripped")
    p.add_argument("--skip-modules", nargs="*", help="built modules (labels) to leave out")
    pb = sub.add_parser("prebuild", help="load / JIT-build the peers' modules (on the H200)")
    pb.add_argument("--out", help="write the timings here (JSON)")
    pb.add_argument("--seconds", type=float, default=480, help="JIT build time limit")
    pb.add_argument("--jobs", type=int, default=0, help="ninja -j (default: all cores)")
    pb.add_argument("--export", help="write the JIT-built modules here as fi-aot-*.tar")
    pb.add_argument("--only", nargs="*", help="only the modules whose labels contain one of these")
    pb.add_argument(
        "--no-jit", action="store_true", help="load the AOT modules, report the missing (no GPU)"
    )
    i = sub.add_parser("install", help="unpack the carried copy (on the H200)")
    i.add_argument("--carry", default=".deps/flashinfer")
    i.add_argument("--target", default="/tmp/fi-site")
    args = ap.parse_args(argv)
    cmds = {"build": cmd_build, "deps": cmd_deps, "pack": cmd_pack, "install": cmd_install,
            "prebuild": cmd_prebuild}  # fmt: skip
    cmds[args.cmd](args)


if __name__ == "__main__":
    main()
