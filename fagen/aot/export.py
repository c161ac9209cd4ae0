"""The build directory's layout: <out>/<variant>/ with the source, <arch>/ PTX and cubins, and variant.json."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fagen import __version__, backends
from fagen.aot.artifacts import ArchBuild
from fagen.codegen.render import render
from fagen.files import write_if_different
from fagen.spec.kernel import KernelSpec


def export(spec: KernelSpec, builds: list[ArchBuild], out_dir: Path) -> list[dict]:
    """Copy a variant's source and binaries into out_dir/<name>/ and write its variant.json.

    Returns one record per arch for manifest.json, with paths relative to out_dir.
    """
    vdir = out_dir / spec.name
    source = vdir / f"{spec.name}{backends.get(spec.backend).suffix}"
    write_if_different(source, render(spec).source)
    records, archs = [], {}
    for b in builds:
        kernels = []
        for k in b.kernels:
            cubin = k.cubin.read_bytes()
            write_if_different(vdir / b.arch / k.ptx.name, k.ptx.read_bytes())
            write_if_different(vdir / b.arch / k.cubin.name, cubin)
            kernels.append({"name": k.name, "ptx": f"{b.arch}/{k.ptx.name}", "cubin": f"{b.arch}/{k.cubin.name}",
                            "registers": k.registers, "spills": k.spills, "shared": k.shared, "seconds": k.seconds,
                            "cubin_sha256": hashlib.sha256(cubin).hexdigest()})
        archs[b.arch] = {"key": b.key, "seconds": b.seconds,
                         "kernels": [{**rec, "launch": k.launch} for rec, k in zip(kernels, b.kernels)]}
        records.append({
            "name": spec.name, "hash": spec.hash, "spec": spec.to_dict(), "arch": b.arch,
            "source": f"{spec.name}/{source.name}", "key": b.key, "seconds": b.seconds, "cached": b.cached,
            "kernels": [{**{k: v for k, v in rec.items() if k != "cubin_sha256"},
                         "ptx": f"{spec.name}/{rec['ptx']}", "cubin": f"{spec.name}/{rec['cubin']}"}
                        for rec in kernels],
        })
    source_sha = hashlib.sha256(source.read_bytes()).hexdigest()
    old = _read_json(vdir / "variant.json")
    if old.get("hash") == spec.hash and old.get("source_sha256") == source_sha:
        archs = {**old.get("archs", {}), **archs}  # an earlier compile of this same source for other archs
    variant = {"name": spec.name, "hash": spec.hash, "spec": spec.to_dict(), "source": source.name,
               "source_sha256": source_sha, "fagen_version": __version__, "archs": dict(sorted(archs.items()))}
    write_if_different(vdir / "variant.json", json.dumps(variant, indent=1, sort_keys=True) + "\n")
    return records


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
