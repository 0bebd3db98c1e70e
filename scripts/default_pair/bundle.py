"""A finished pair and its records as at most 8 files of at most 16 MiB (what a GPU run returns).

``pack``: every ``*.safetensors`` of the package as a file of its own (named
``<model>__<file>``), everything else (configs, tokenizer, ``pair.json``, results, report, logs)
in ``records.tar.gz``. ``unpack`` restores the package directory (a model directory it restores
loses the weight files the bundle does not hold: a sharded target must not sit next to an older
``model.safetensors``, which loaders prefer) and copies the report into ``docs/`` and the work
records into ``docs/default-model-pair-<recipe>-records/``::

    python scripts/default_pair/bundle.py unpack BUNDLE_DIR --package-dir DIR [--docs-dir DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

MAX_FILES = 8
MAX_FILE_BYTES = 16 * 2**20
RECORDS = "records.tar.gz"
_WORK_RECORDS = ("log.txt", "results.json", "done.json", "target_run/result.json")
_HEAD_RECORDS = ("train_log.jsonl",)


def pack(package_dir: Path, work_dir: Path, out_dir: Path, recipe: object = None) -> list[Path]:
    """Write the bundle into ``out_dir``; returns its files. Raises ``SystemExit`` when it would
    break the limits."""
    package_dir, work_dir, out_dir = Path(package_dir), Path(work_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in sorted(package_dir.rglob("*")):
            if not f.is_file():
                continue
            rel = f.relative_to(package_dir)
            if f.suffix == ".safetensors":
                dst = out_dir / "__".join(rel.parts)
                shutil.copy2(f, dst)
                files.append(dst)
            elif f.suffix != ".py" and "__pycache__" not in rel.parts:
                tar.add(f, arcname=f"package/{rel}")
        for name in _WORK_RECORDS:
            if (work_dir / name).is_file():
                tar.add(work_dir / name, arcname=f"work/{name}")
        for head in ("peagle", "eagle3"):
            for name in _HEAD_RECORDS:
                if (work_dir / head / name).is_file():
                    tar.add(work_dir / head / name, arcname=f"work/{head}/{name}")
        if recipe is not None:
            from default_pair.report import DOCS_DIR

            report = DOCS_DIR / f"default-model-pair-{recipe.report_name or recipe.name}.md"
            if report.is_file():
                tar.add(report, arcname=f"docs/{report.name}")
    rec = out_dir / RECORDS
    rec.write_bytes(buf.getvalue())
    files.append(rec)
    big = [(f.name, f.stat().st_size) for f in files if f.stat().st_size > MAX_FILE_BYTES]
    if len(files) > MAX_FILES or big:
        raise SystemExit(f"bundle breaks the limits ({len(files)} files; over 16 MiB: {big})")
    return files


def _is_weights(name: str) -> bool:
    return name.endswith(".safetensors") or name.endswith(".safetensors.index.json")


def unpack(bundle_dir: Path, package_dir: Path, docs_dir: Path | None = None) -> None:
    """Restore the package (and the records: ``docs_dir/default-model-pair-<recipe>-records/``)
    from a bundle."""
    bundle_dir, package_dir = Path(bundle_dir), Path(package_dir)
    weights = {
        package_dir.joinpath(*f.name.split("__")): f
        for f in sorted(bundle_dir.glob("*__*.safetensors"))
    }
    with tarfile.open(bundle_dir / RECORDS, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and ".." not in Path(m.name).parts]
        restored = set(weights)
        restored |= {package_dir / m.name.partition("/")[2] for m in members}
        restored = {p for p in restored if p.is_relative_to(package_dir)}
        for model_dir in {p.parent for p in weights}:
            for old in model_dir.glob("*") if model_dir.is_dir() else ():
                if old.is_file() and _is_weights(old.name) and old not in restored:
                    old.unlink()
        for dst, f in weights.items():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst)
        recipe = "unknown"
        for m in members:
            if m.name == "package/pair.json":
                recipe = json.loads(tar.extractfile(m).read()).get("recipe", recipe)
        for m in members:
            top, _, rest = m.name.partition("/")
            if top == "package":
                dst = package_dir / rest
            elif docs_dir is not None and top == "docs":
                dst = Path(docs_dir) / rest
            elif docs_dir is not None and top == "work":
                dst = Path(docs_dir) / f"default-model-pair-{recipe}-records" / rest
            else:
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(tar.extractfile(m).read())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("unpack")
    u.add_argument("bundle_dir", type=Path)
    u.add_argument("--package-dir", type=Path, required=True)
    u.add_argument("--docs-dir", type=Path)
    args = ap.parse_args(argv)
    unpack(args.bundle_dir, args.package_dir, args.docs_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
