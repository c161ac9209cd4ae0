"""The verification engine: runs each property under Hypothesis, shrinks failures into replayable blobs, reports."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import time
import warnings
from types import ModuleType
from typing import Callable, Iterable

from hypothesis import HealthCheck, Phase, Verbosity, given, seed as hypothesis_seed, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException

from fagen import __version__
from fagen.codegen.render import generate
from fagen.runtime.loader import load, load_source
from fagen.spec.axes import Direction, DType, Kind, Mask
from fagen.spec.kernel import KernelSpec
from fagen.verify.counterexamples import Counterexample
from fagen.verify.mutants import GLUON_MUTANTS, LAYOUT_MOD_MUTANTS, LAYOUT_MUTANTS, MOD_MUTANTS, MUTANTS, Mutant
from fagen.verify.properties import BY_NAME, PROPERTIES, Property
from fagen.verify.tolerances import TOLERANCE, PropertyFailure

# Each example that fails starts shrinking; this many more kernel runs at most go into making it minimal.
SHRINK_RUNS = 150
DEFAULT_EXAMPLES = {"cpu": 20, "gpu": 50}


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
                "worst_by_dtype": {str(k): {"out": v[0], "lse": v[1], "tolerance": TOLERANCE[k]}
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
        except PropertyFailure as e:
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
    chosen = PROPERTIES if names is None else [BY_NAME[n] for n in names]
    if spec.shared_kv:  # a shared latent cache takes v=None: only "reference" knows that form yet
        chosen = [p for p in chosen if p.name == "reference"]
    return [p for p in chosen if p.applies(spec, module)]


def replay(example: Counterexample, device: str = "cpu") -> str | None:
    """Run one recorded example once; the failure message, or None when it passes."""
    module = mutant_module(example.spec, example.mutant) if example.mutant else load(example.spec)
    try:
        with _quiet_interpreter():
            BY_NAME[example.property].check(module, example.spec, example.problem, device)
    except PropertyFailure as e:
        return str(e)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


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
            module = load(spec)
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
    kinds = ({**blocks}, {**blocks, "direction": Direction.BWD}, {**decode_blocks, "kind": Kind.DECODE})
    plain = tuple(KernelSpec(head_dim=head_dim, mask=m, gqa=2, dtype="fp16", **fields) for fields in kinds for m in Mask)
    # Every score switch on, for the mutants that edit their code (fp32: the switches' bugs, not rounding, show).
    scored = tuple(KernelSpec(head_dim=head_dim, mask="causal", gqa=2, dtype="fp32", window=True, softcap=True,
                              alibi=True, sinks=True, **fields) for fields in kinds)
    return plain + scored


def mutant_module(spec: KernelSpec, name: str) -> ModuleType:
    """The rendered source of `spec` with mutant `name` applied, loaded as a module."""
    mutant = next(m for m in MUTANTS + LAYOUT_MUTANTS + MOD_MUTANTS + LAYOUT_MOD_MUTANTS + GLUON_MUTANTS
                  if m.name == name)
    return load_source(mutant.apply(generate(spec)), f"{spec.name}__{mutant.name.replace('-', '_')}")


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


