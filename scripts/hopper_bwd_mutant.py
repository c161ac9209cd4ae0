"""Break the Gluon backward on purpose and run the GPU property test of tests/test_hopper.py against it: the test
must go red (docs/hopper.md, phase 4). Runs on an H100/H200.

    OUT=/tmp/out python scripts/hopper_bwd_mutant.py [NAME ...]   # writes $OUT/mutant.log

Each mutant is the rendered module of fagen.generate(spec) with one textual edit, written to a temp file and
imported; tests/test_hopper.py's test_backward_matches_the_reference_on_hopper then runs with fagen.load patched to
return it. A mutant whose edit does not apply is reported as such (the template changed), not as caught.
"""
import importlib.util
import os
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import fagen  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
LINES = []

# (name, old text, new text): each edit must match exactly once in the rendered module.
MUTANTS = [
    # the compute warps hand the writer a zero tile at the second step of every tile: one dQ contribution dropped
    ("drop-one-dq-step", "dq_smem.index(slot).store(dq)", "dq_smem.index(slot).store(gl.where(i == 1, 0.0, dq))"),
    # the writer adds without waiting for its turn (counters still counted): the adds of a query block run in
    # whatever order the key blocks reach it, so the float32 sums may differ between runs; only the bitwise check
    # can see it, and only if the order varies between the two runs
    ("no-turn-wait", "while seen != n_blk:", "while seen < 0:"),
    # the TMA reduce is never issued (dQ stays 0): a diagnostic for scripts/hopper_bwd_sweep.py (the cost of the add
    # itself, the protocol kept)
    # (an edit inside the jit code: triton's cache key does not cover the @builtin wrapper's body)
    ("no-reduce", "            _tma_reduce_add(dq_desc, [off_b, h0 + g, m0, 0],",
     "            if n_blk < 0: _tma_reduce_add(dq_desc, [off_b, h0 + g, m0, 0],"),
]


def log(msg):
    print(msg, flush=True)
    LINES.append(msg)


def mutant_module(spec, name, old, new):
    src = fagen.generate(spec)
    if src.count(old) != 1:
        return None
    folder = tempfile.mkdtemp(prefix="fagen_mutant_")
    path = os.path.join(folder, f"{spec.name}_{name.replace('-', '_')}.py")
    with open(path, "w") as f:
        f.write(src.replace(old, new))
    mspec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mspec.name] = module
    mspec.loader.exec_module(module)
    return module


def main():
    import test_hopper

    real_load = fagen.load
    for name, old, new in (m for m in MUTANTS if not sys.argv[1:] or m[0] in sys.argv[1:]):
        for mask, gqa in (("causal", 1), ("none", 4)):
            cache = {}

            def load(spec, *a, **kw):
                if spec.direction.value == "bwd" and spec.backend.value == "gluon":
                    if spec not in cache:
                        cache[spec] = mutant_module(spec, name, old, new)
                    if cache[spec] is None:
                        raise LookupError(f"mutant {name}: the edit does not apply to the rendered module")
                    return cache[spec]
                return real_load(spec, *a, **kw)

            test_hopper.fagen.load = load
            try:
                test_hopper.test_backward_matches_the_reference_on_hopper(mask, gqa)
                log(f"mutant {name} ({mask}, gqa {gqa}): SURVIVED (the test passed)")
            except LookupError as e:
                log(str(e))
            except AssertionError as e:
                first = str(e).strip().splitlines()[0][:200] if str(e).strip() else "assert"
                log(f"mutant {name} ({mask}, gqa {gqa}): caught (the test failed: {type(e).__name__}: {first})")
            except Exception as e:  # noqa: BLE001
                log(f"mutant {name} ({mask}, gqa {gqa}): error {type(e).__name__}: {e}")
                log(traceback.format_exc()[-1500:])
            finally:
                test_hopper.fagen.load = real_load
    with open(os.path.join(OUT, "mutant.log"), "w") as f:
        f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
