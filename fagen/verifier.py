"""The verification engine: runs each property under Hypothesis, shrinks failures into replayable blobs, reports."""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import hashlib
import json
import math
import time
import warnings
from types import ModuleType
from typing import Callable, Iterable

from hypothesis import HealthCheck, Phase, Verbosity, given, seed as hypothesis_seed, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException

from fagen import __version__, render, runtime, strategies, verify
from fagen.enums import Direction, DType, Kind, Mask
from fagen.mutants import MUTANTS, Mutant
from fagen.spec import KernelSpec, SpecError
from fagen.strategies import Problem

# Each example that fails starts shrinking; this many more kernel runs at most go into making it minimal.
SHRINK_RUNS = 150
DEFAULT_EXAMPLES = {"cpu": 20, "gpu": 50}


# -- properties ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Property:
    name: str
    what: str  # the claim, in words
    check: Callable  # (module, spec, problem, device) -> verify.Outcome; raises verify.PropertyFailure
    applies: Callable[[KernelSpec, ModuleType], bool]
    bound: str  # what "equal" means: "tol" (TOLERANCE vs float64), "2·tol" (kernel vs kernel), "bitwise", "exact"
    shape: Callable | None = None  # (draw, problem) -> the problem this property needs (a chain, a star, ...)

    def problems(self, spec: KernelSpec, scale: str) -> st.SearchStrategy[Problem]:
        base = strategies.problems(spec, scale)
        if self.shape is None:
            return base
        return st.composite(lambda draw: self.shape(draw, draw(base)))()


def _chain(draw, p: Problem) -> Problem:
    return dataclasses.replace(p, parents=(verify.chain(p.seq_q),) * p.batch)


def _star(draw, p: Problem) -> Problem:
    fan = lambda n: (-1,) + (0,) * (n - 1)  # noqa: E731 - every node a child of node 0
    return dataclasses.replace(p, parents=tuple(
        draw(st.sampled_from([(-1,) * p.seq_q, fan(p.seq_q)])) for _ in range(p.batch)))


def _has_backward(spec, module) -> bool:
    return callable(getattr(module, "backward", None))


PROPERTIES = (
    Property("reference", "out and lse match the float64 reference; out never NaN or inf",
             verify.check_forward, lambda spec, m: True, "tol"),
    Property("gqa", "equals the MHA kernel on K/V repeated gqa times", verify.check_gqa,
             lambda spec, m: spec.gqa > 1, "2·tol"),
    Property("tree-chain", "a chain-shaped tree equals causal attention", verify.check_tree_chain,
             lambda spec, m: spec.mask is Mask.TREE, "2·tol", _chain),
    Property("tree-star", "a star-shaped tree sees only the prefix and itself", verify.check_tree_star,
             lambda spec, m: spec.mask is Mask.TREE, "tol", _star),
    Property("padding-split", "a padded batch equals each sequence run alone", verify.check_padding_split,
             lambda spec, m: spec.mask.padded, "2·tol"),
    Property("padding-garbage", "garbage (NaN) in padding never changes a valid output",
             verify.check_padding_garbage, lambda spec, m: spec.mask.padded, "bitwise"),
    Property("permutation", "permuting keys and values together changes nothing", verify.check_permutation,
             lambda spec, m: spec.mask is Mask.NONE, "2·tol"),
    Property("lse-merge", "two halves of the keys merged by log-sum-exp give the whole", verify.check_lse_merge,
             lambda spec, m: True, "2·tol"),
    Property("bwd-deterministic", "two backward runs are bitwise equal", verify.check_bwd_deterministic,
             _has_backward, "bitwise"),
    Property("bwd-masked-rows", "gradients finite; zero for rows and keys that see nothing",
             verify.check_bwd_masked_rows, _has_backward, "exact"),
    # Gradient values against float64 autograd: verify.check_backward, written with the backward kernel.
    Property("bwd-reference", "gradients match float64 autograd",
             lambda *a: verify.check_backward(*a),
             lambda spec, m: _has_backward(spec, m) and hasattr(verify, "check_backward"), "tol"),
)
BY_NAME = {p.name: p for p in PROPERTIES}


# -- counterexamples -------------------------------------------------------------------------------------

class BlobError(ValueError):
    """A --reproduce blob does not decode; the message says what is wrong with it."""


@dataclasses.dataclass(frozen=True)
class Counterexample:
    """A shrunk failing example: enough to replay it exactly (`fagen verify --reproduce <blob>`)."""

    spec: KernelSpec
    problem: Problem
    property: str
    message: str = ""
    mutant: str | None = None

    def blob(self) -> str:
        """urlsafe base64 of compact JSON {spec, problem, property, mutant?}, '=' padding dropped."""
        data = {"spec": self.spec.to_dict(), "problem": dataclasses.asdict(self.problem), "property": self.property}
        if self.mutant:
            data["mutant"] = self.mutant
        raw = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def command(self, device: str = "cpu") -> str:
        return f"fagen verify --reproduce {self.blob()}" + (" --device cuda" if device == "cuda" else "")

    @classmethod
    def from_blob(cls, blob: str) -> Counterexample:
        try:
            data = json.loads(base64.urlsafe_b64decode(blob.strip() + "=" * (-len(blob.strip()) % 4)))
        except (binascii.Error, ValueError, UnicodeDecodeError):
            raise BlobError("not a fagen reproduce blob (expected urlsafe base64 of JSON); "
                            "copy the whole blob from the failure report") from None
        if not isinstance(data, dict) or not {"spec", "problem", "property"} <= set(data):
            raise BlobError("the blob decodes, but lacks spec, problem or property")
        if data["property"] not in BY_NAME:
            raise BlobError(f"unknown property {data['property']!r}; known: {', '.join(BY_NAME)}")
        if data.get("mutant") is not None and data["mutant"] not in {m.name for m in MUTANTS}:
            raise BlobError(f"unknown mutant {data['mutant']!r}")
        try:
            spec = KernelSpec.from_dict(data["spec"])
            problem = _checked(Problem.from_json(json.dumps(data["problem"])))
        except (SpecError, TypeError, ValueError) as e:
            raise BlobError(f"the blob's spec or problem is invalid: {e}") from None
        return cls(spec, problem, data["property"], mutant=data.get("mutant"))


def _checked(p: Problem) -> Problem:
    """A problem read from outside: plain non-negative ints, lengths within the shapes, parents before children."""
    def count(name, v, hi=None):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (hi is not None and v > hi):
            raise ValueError(f"{name} must be an integer in [0, {hi if hi is not None else 'inf'}], got {v!r}")

    for name in ("batch", "heads_kv", "seq_q", "seq_k", "seed"):
        count(name, getattr(p, name))
    for name, lens, hi in (("seqlens_q", p.seqlens_q, p.seq_q), ("seqlens_k", p.seqlens_k, p.seq_k)):
        if lens is not None:
            if len(lens) != p.batch:
                raise ValueError(f"{name} needs {p.batch} lengths, got {len(lens)}")
            for v in lens:
                count(name, v, hi)
    for tree in p.parents or ():
        if len(tree) != p.seq_q or any(not isinstance(x, int) or not -1 <= x < i for i, x in enumerate(tree)):
            raise ValueError(f"parents must be {p.seq_q} indices, each -1 or an earlier node, got {list(tree)}")
    if not isinstance(p.magnitude, (int, float)) or not math.isfinite(p.magnitude):
        raise ValueError(f"magnitude must be a finite number, got {p.magnitude!r}")
    return p


# -- results ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class PropertyResult:
    spec: KernelSpec
    property: str
    examples: int = 0  # examples run before a failure (or all of them)
    shrink_runs: int = 0  # kernel runs spent making the failure minimal
    max_err: float = 0.0  # worst |out - expected| over the examples that passed
    max_lse_err: float = 0.0
    seconds: float = 0.0
    out_of_time: bool = False  # the time budget cut exploration short
    failure: Counterexample | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None

    def to_dict(self, device: str) -> dict:
        d = {"variant": self.spec.name, "spec": self.spec.to_dict(), "property": self.property,
             "examples": self.examples, "passed": self.passed, "max_err": self.max_err,
             "max_lse_err": self.max_lse_err, "seconds": round(self.seconds, 3), "out_of_time": self.out_of_time}
        if self.failure:
            f = self.failure
            d["failure"] = {"message": f.message, "problem": dataclasses.asdict(f.problem), "mutant": f.mutant,
                            "shrink_runs": self.shrink_runs, "blob": f.blob(), "command": f.command(device)}
        return d


@dataclasses.dataclass
class Report:
    results: list[PropertyResult]
    seed: int
    scale: str
    device: str
    examples: int
    seconds: float = 0.0
    errors: list[str] = dataclasses.field(default_factory=list)  # variants that could not even be loaded

    @property
    def passed(self) -> bool:
        return not self.errors and all(r.passed for r in self.results)

    def worst_by_dtype(self) -> dict[DType, tuple[float, float]]:
        worst: dict[DType, tuple[float, float]] = {}
        for r in self.results:
            if BY_NAME[r.property].bound != "tol" or r.property.startswith("bwd"):
                continue  # kernel-vs-kernel and bitwise checks have their own bounds
            e, le = worst.get(r.spec.dtype, (0.0, 0.0))
            worst[r.spec.dtype] = (max(e, r.max_err), max(le, r.max_lse_err))
        return worst

    def to_dict(self) -> dict:
        return {"fagen": __version__, "passed": self.passed, "seed": self.seed, "scale": self.scale,
                "device": self.device, "examples": self.examples, "seconds": round(self.seconds, 2),
                "errors": self.errors, "results": [r.to_dict(self.device) for r in self.results],
                "worst_by_dtype": {str(k): {"out": v[0], "lse": v[1], "tolerance": verify.TOLERANCE[k]}
                                   for k, v in self.worst_by_dtype().items()}}


# -- running one property --------------------------------------------------------------------------------

def _seed_for(seed: int, spec: KernelSpec, prop: Property, mutant: str | None) -> int:
    """A stable per-(spec, property) seed, so each property sees its own examples for one --seed."""
    key = f"{seed}/{spec.hash}/{prop.name}/{mutant or ''}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big")


class _Failed(Exception):
    pass


def run_property(module, spec: KernelSpec, prop: Property, *, examples: int, seed: int, scale: str,
                 device: str, deadline: float | None = None, mutant: str | None = None,
                 shrink_runs: int = SHRINK_RUNS, on_example: Callable[[str], None] | None = None) -> PropertyResult:
    """Run `prop` on up to `examples` drawn problems; a failure is shrunk by Hypothesis to a minimal problem.

    [Note] Budgets and shrinking. Every problem's verdict is cached, so a problem always answers the same way.
    Past `deadline` (and before any failure) new problems are not run: Hypothesis sees them pass. After a
    failure, shrinking may run the kernel `shrink_runs` more times; past that, problems never run count as
    passing, which only stops the shrinking early. The last example Hypothesis replays is its minimal failure.
    """
    result = PropertyResult(spec, prop.name)
    verdicts: dict[Problem, str | None] = {}
    last: list = []
    start = time.monotonic()

    def verdict(problem: Problem) -> str | None:
        """The failure message for `problem` (None: it passes), from the cache or by running the property."""
        if problem in verdicts:
            return verdicts[problem]
        if last:
            if result.shrink_runs >= shrink_runs:
                return None  # not run, not cached: shrinking stops here
            result.shrink_runs += 1
            if on_example:
                on_example("shrinking")
        elif deadline is not None and time.monotonic() > deadline:
            result.out_of_time = True
            return None
        try:
            outcome = prop.check(module, spec, problem, device)
        except verify.PropertyFailure as e:
            verdicts[problem] = str(e)
        except Exception as e:  # a crash (an InputError, a compile error) is a failure too
            verdicts[problem] = f"{type(e).__name__}: {e}"
        else:
            verdicts[problem] = None
        if not last:
            result.examples += 1
            if verdicts[problem] is None:
                result.max_err = max(result.max_err, _finite(outcome.max_err))
                result.max_lse_err = max(result.max_lse_err, _finite(outcome.max_lse_err))
            if on_example:
                on_example("example")
        return verdicts[problem]

    def attempt(problem: Problem) -> None:
        message = verdict(problem)
        if message is not None:
            last[:] = [problem, message]
            raise _Failed(message)  # one raise site: Hypothesis tells failures apart by where they were raised

    run = settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                   verbosity=Verbosity.quiet, report_multiple_bugs=False, print_blob=False,
                   suppress_health_check=list(HealthCheck),
                   phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink))(
        given(prop.problems(spec, scale))(attempt))
    run = hypothesis_seed(_seed_for(seed, spec, prop, mutant))(run)
    try:
        with _quiet_interpreter():
            run()
    except _Failed:
        pass
    except HypothesisException as e:  # e.g. a flaky kernel: report it, it is a failure too
        if not last:
            raise
        last[1] = f"{last[1]} (and Hypothesis reports: {type(e).__name__}: {e})"
    if last:
        result.failure = Counterexample(spec, last[0], prop.name, last[1], mutant)
    result.seconds = time.monotonic() - start
    return result


@contextlib.contextmanager
def _quiet_interpreter():
    """Silence numpy's "invalid value" warnings from a broken kernel's NaN: the property reports the NaN."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
        yield


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def properties_for(spec: KernelSpec, module, names: Iterable[str] | None = None) -> list[Property]:
    chosen = [BY_NAME[n] for n in names] if names else PROPERTIES
    return [p for p in chosen if p.applies(spec, module)]


def replay(example: Counterexample, device: str = "cpu") -> str | None:
    """Run one recorded example once; the failure message, or None when it passes."""
    module = mutant_module(example.spec, example.mutant) if example.mutant else runtime.load(example.spec)
    try:
        with _quiet_interpreter():
            BY_NAME[example.property].check(module, example.spec, example.problem, device)
    except verify.PropertyFailure as e:
        return str(e)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


# -- devices ---------------------------------------------------------------------------------------------

class DeviceError(RuntimeError):
    """The requested device cannot run kernels in this process; the message says why and what to do."""


def prepare_device(device: str | None = None) -> str:
    """Pick the device ("cpu" or "cuda") and set Triton's mode for it. Call before any kernel is loaded.

    [Note] Triton reads TRITON_INTERPRET when a @triton.jit function is defined, i.e. when a generated module
    is imported, and fagen memoises imported modules. So the variable is set here, first, and modules already
    imported in the other mode (by earlier code in this process) are refused rather than silently reused.
    """
    import os
    import sys

    import torch  # importing torch defines no Triton kernel, so the mode can still be chosen

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    interpret = device == "cpu"
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise DeviceError("TRITON_INTERPRET=1 is set, so kernels would run in the interpreter: unset it to verify "
                          "on the GPU (or use --device cpu)")
    stale = [name for name, mod in list(sys.modules.items())
             if name.startswith("fagen_generated.") and getattr(mod, "_INTERPRET", interpret) != interpret]
    if interpret and "triton" in sys.modules and not sys.modules["triton"].knobs.runtime.interpret:
        stale.append("triton (its interpret knob was switched off in code)")
    if stale:
        raise DeviceError(f"--device {device}: this process already imported kernels in the other Triton mode "
                          f"({', '.join(stale[:3])}); run fagen verify in a fresh process")
    if not interpret and not torch.cuda.is_available():
        raise DeviceError(f"--device cuda: torch sees no CUDA device (torch {torch.__version__}); "
                          "use --device cpu to verify through Triton's interpreter")
    return device


# -- many variants ---------------------------------------------------------------------------------------

Progress = Callable[[str, int, int], None]  # (label, examples done, examples in all)


def verify_specs(specs: Iterable[KernelSpec], *, examples: int | None = None, seed: int = 0, scale: str = "cpu",
                 device: str = "cpu", time_budget: float | None = None, properties: Iterable[str] | None = None,
                 shrink_runs: int = SHRINK_RUNS, progress: Progress | None = None) -> Report:
    """Verify every property that applies to each spec. `fagen verify` and `fagen build --verify` call this
    (after prepare_device(device)). A spec that cannot be rendered or loaded fails the report (Report.errors).
    """
    plan, errors = [], []
    for spec in specs:
        try:
            module = runtime.load(spec)
        except Exception as e:
            errors.append(f"{spec.name}: cannot be loaded ({type(e).__name__}: {e})")
            continue
        plan += [(module, spec, p, None) for p in properties_for(spec, module, properties)]
    return _execute(plan, errors, examples=examples, seed=seed, scale=scale, device=device, time_budget=time_budget,
                    shrink_runs=shrink_runs, stop_on_failure=False, progress=progress)


def _execute(plan, errors, *, examples, seed, scale, device, time_budget, shrink_runs, stop_on_failure,
             progress) -> Report:
    examples = examples or DEFAULT_EXAMPLES[scale]
    report = Report([], seed, scale, device, examples, errors=list(errors))
    start = time.monotonic()
    total, done = len(plan) * examples, 0
    caught: set[tuple[str, str | None]] = set()
    for i, (module, spec, prop, mutant) in enumerate(plan):
        key = (spec.name, mutant)
        if stop_on_failure and key in caught:
            done += examples
            continue
        label = f"{spec.name} · {prop.name}" + (f" · mutant {mutant}" if mutant else "")
        deadline = None
        if time_budget is not None:  # an equal share of what is left, so late variants get time too
            deadline = time.monotonic() + max(0.0, time_budget - (time.monotonic() - start)) / (len(plan) - i)
        counted = 0

        def tick(kind: str) -> None:
            nonlocal counted
            if kind == "example":
                counted += 1
            if progress:
                progress(label + (" (shrinking)" if kind == "shrinking" else ""), done + counted, total)

        if progress:
            progress(label, done, total)
        result = run_property(module, spec, prop, examples=examples, seed=seed, scale=scale, device=device,
                              deadline=deadline, mutant=mutant, shrink_runs=shrink_runs, on_example=tick)
        done += examples
        report.results.append(result)
        if result.failure:
            caught.add(key)
    if progress:
        progress("done", total, total)
    report.seconds = time.monotonic() - start
    return report


# -- mutants: proving the verifier has teeth --------------------------------------------------------------

def default_mutant_specs(scale: str = "cpu") -> tuple[KernelSpec, ...]:
    """Per mask a forward, a backward and a decode spec (gqa 2, so head-mapping bugs show), so every mutant
    has a spec it applies to; small blocks on the CPU keep the interpreter fast."""
    blocks = dict(block_m=32, block_n=16) if scale == "cpu" else {}
    decode_blocks = dict(block_m=16, block_n=16) if scale == "cpu" else {}
    head_dim = 32 if scale == "cpu" else 64
    return tuple(
        KernelSpec(head_dim=head_dim, mask=m, gqa=2, dtype="fp16", **fields)
        for fields in ({**blocks}, {**blocks, "direction": Direction.BWD}, {**decode_blocks, "kind": Kind.DECODE})
        for m in Mask)


def mutant_module(spec: KernelSpec, name: str) -> ModuleType:
    """The rendered source of `spec` with mutant `name` applied, loaded as a module."""
    mutant = next(m for m in MUTANTS if m.name == name)
    return runtime.load_source(mutant.apply(render.generate(spec)), f"{spec.name}__{mutant.name.replace('-', '_')}")


def verify_mutants(specs: Iterable[KernelSpec], *, mutants: Iterable[Mutant] = MUTANTS, examples: int | None = None,
                   seed: int = 0, scale: str = "cpu", device: str = "cpu", properties: Iterable[str] | None = None,
                   time_budget: float | None = None, shrink_runs: int = SHRINK_RUNS,
                   progress: Progress | None = None) -> tuple[Report, list[tuple[Mutant, KernelSpec | None]]]:
    """Run the suite on each mutant (against the first spec it applies to) until a property catches it.

    Returns the report (a mutant is caught when one of its results failed) and the (mutant, spec) pairs;
    spec is None for a mutant that applies to none of the specs.
    """
    specs = list(specs)
    pairs, plan = [], []
    for mutant in mutants:
        spec = next((s for s in specs if mutant.applies(s)), None)
        pairs.append((mutant, spec))
        if spec is not None:
            module = mutant_module(spec, mutant.name)
            plan += [(module, spec, p, mutant.name) for p in properties_for(spec, module, properties)]
    report = _execute(plan, [], examples=examples, seed=seed, scale=scale, device=device, time_budget=time_budget,
                      shrink_runs=shrink_runs, stop_on_failure=True, progress=progress)
    return report, pairs


def mutant_catch(report: Report, mutant: Mutant, spec: KernelSpec | None) -> PropertyResult | None:
    """The result that caught `mutant` on `spec`, or None if it survived."""
    return next((r for r in report.results if r.failure and r.failure.mutant == mutant.name
                 and spec is not None and r.spec == spec), None)


# -- presenting results ----------------------------------------------------------------------------------

def describe(problem: Problem) -> str:
    """A one-line summary of a problem: shapes, lengths, tree, seed."""
    parts = [f"B={problem.batch} Hkv={problem.heads_kv} Sq={problem.seq_q} Sk={problem.seq_k}"]
    if problem.seqlens_q is not None:
        parts.append(f"seqlens_q={list(problem.seqlens_q)} seqlens_k={list(problem.seqlens_k)}")
    if problem.parents is not None:
        trees = [list(p) if len(p) <= 40 else f"[{len(p)} nodes]" for p in problem.parents]
        parts.append(f"parents={trees[0] if len(set(map(str, trees))) == 1 else trees}")
    if problem.magnitude != 1.0:
        parts.append(f"magnitude={problem.magnitude:g}")
    if problem.poison:
        parts.append("NaN padding")
    parts.append(f"seed={problem.seed}")
    return " ".join(parts)


def failure_lines(result: PropertyResult, device: str) -> list[str]:
    """A failure as lines a person can act on: what broke, on what, and the one command that replays it."""
    f = result.failure
    title = f"FAIL {result.spec.name} · {f.property}" + (f" · mutant {f.mutant}" if f.mutant else "")
    return [title,
            f"  property: {f.property}: {BY_NAME[f.property].what}",
            f"  message:  {f.message}",
            f"  spec:     {f.spec.to_json()}",
            f"  problem:  {f.problem.to_json()}",
            f"            ({describe(f.problem)}; found at example {result.examples}, "
            f"shrunk in {result.shrink_runs} runs)",
            f"  replay:   {f.command(device)}"]


def summary_table(report: Report):
    """A rich table: one row per variant and property, then the worst error per dtype."""
    from rich.table import Table

    table = Table(title=f"fagen verify: {report.device}, {report.scale} scale, seed {report.seed}, "
                        f"up to {report.examples} examples each", title_justify="left")
    for col, kw in (("variant", {}), ("property", {}), ("examples", dict(justify="right")),
                    ("result", {}), ("bound", {}), ("worst |Δout|", dict(justify="right")),
                    ("worst |Δlse|", dict(justify="right")), ("time", dict(justify="right"))):
        table.add_column(col, **kw)
    for r in report.results:
        verdict = "[green]pass[/]" if r.passed else "[bold red]FAIL[/]"
        if r.out_of_time and r.passed:
            verdict += " [yellow](time)[/]"
        table.add_row(r.spec.name, r.property, str(r.examples), verdict, BY_NAME[r.property].bound, f"{r.max_err:.2e}",
                      f"{r.max_lse_err:.2e}", f"{r.seconds:.1f}s")
    return table


def dtype_table(report: Report):
    from rich.table import Table

    table = Table(title="worst error against float64 per dtype (tol = its tolerance)", title_justify="left")
    for col in ("dtype", "worst |Δout|", "out atol / rtol", "worst |Δlse|", "lse atol / rtol"):
        table.add_column(col)
    for dtype, (err, lse_err) in report.worst_by_dtype().items():
        tol, lt = verify.TOLERANCE[dtype], verify.LSE_TOLERANCE
        table.add_row(str(dtype), f"{err:.2e}", f"{tol['atol']:g} / {tol['rtol']:g}", f"{lse_err:.2e}",
                      f"{lt['atol']:g} / {lt['rtol']:g}")
    return table


def mutant_table(report: Report, pairs):
    from rich.table import Table

    table = Table(title="mutants: each deliberately broken variant must be caught", title_justify="left")
    for col in ("mutant", "bug", "spec", "caught by", "shrunk problem"):
        table.add_column(col)
    for mutant, spec in pairs:
        hit = mutant_catch(report, mutant, spec)
        if spec is None:
            row = ("-", "[yellow]n/a[/] (no spec with a matching mask/gqa)", "")
        elif hit is None:
            row = (spec.name, "[bold red]SURVIVED[/]", "")
        else:
            row = (spec.name, f"[green]{hit.property}[/] at example {hit.examples}", describe(hit.failure.problem))
        table.add_row(mutant.name, mutant.what, *row)
    return table
