"""generated/ is exactly the render of the default catalog: regenerating it must not change a byte."""

from pathlib import Path

from fagen.spec.manifest import DEFAULT_CATALOG, load_manifest
from fagen.codegen.render import generate
from fagen import backends

GENERATED = Path(__file__).resolve().parent.parent / "generated"
FIX = "run `python cli.py generate` (or `fagen generate`) and commit generated/"


def test_generated_is_the_render_of_the_default_catalog():
    assert GENERATED.is_dir(), f"{GENERATED} is missing; {FIX}"
    want = {f"{s.name}{backends.get(s.backend).suffix}": generate(s).encode()
            for s in load_manifest(DEFAULT_CATALOG).specs}
    have = {p.name: p.read_bytes() for p in GENERATED.iterdir() if p.is_file()}
    missing = sorted(set(want) - set(have))
    stale = sorted(set(have) - set(want))
    changed = sorted(n for n in set(want) & set(have) if want[n] != have[n])
    problems = [f"{label} ({len(names)}): {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                for label, names in (("missing", missing), ("changed", changed),
                                     ("stale, not in the catalog: delete them", stale)) if names]
    assert not problems, "generated/ is out of date: " + "; ".join(problems) + f"; {FIX}"
