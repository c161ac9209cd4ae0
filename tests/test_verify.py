"""`fagen verify`: the properties pass on correct kernels, each catches a broken one, failures replay."""

import dataclasses
import json
import sys
import types

import pytest
import torch
from click.testing import CliRunner

import fagen
from fagen.verify import counterexamples, engine, properties, reference
from fagen.verify import properties as verify
from fagen.verify import report as vreport
from fagen.cli import main
from fagen.verify.mutants import MUTANTS
from fagen.verify.strategies import Problem
from _env import DEVICE, ON_GPU, SCALE

BLOCKS = {} if ON_GPU else dict(block_m=32, block_n=16)  # short CPU sequences still span several blocks
RUN = ["--device", DEVICE, "--scale", SCALE]


def _spec(mask, dtype="fp16", gqa=2, **kw):
    return fagen.KernelSpec(head_dim=32 if not ON_GPU else 64, mask=mask, dtype=dtype, gqa=gqa, **BLOCKS, **kw)


def _cli(*args):
    return CliRunner().invoke(main, ["verify", *args], catch_exceptions=False)


@pytest.mark.parametrize("mask, dtype", [("none", "fp16"), ("causal", "bf16"), ("padding", "fp32"),
                                         ("causal+padding", "fp16"), ("tree", "bf16")])
def test_every_property_passes_on_correct_kernels(mask, dtype):
    spec = _spec(mask, dtype)
    report = engine.verify_specs([spec], examples=4, seed=1, scale=SCALE, device=DEVICE)
    names = {r.property for r in report.results}
    assert {"reference", "gqa", "lse-merge"} <= names
    assert ("permutation" in names) == (mask == "none")
    assert ("padding-garbage" in names) == (mask in ("padding", "causal+padding"))
    assert ("tree-star" in names) == (mask == "tree")
    failures = [vreport.failure_lines(r, DEVICE) for r in report.results if r.failure]
    assert report.passed, failures
    assert all(r.examples > 0 for r in report.results)


# Each property catches a bug on its own (run alone against a mutant), and its shrunk example replays.
@pytest.mark.parametrize("prop, mutant, mask", [
    ("reference", "causal-off-by-one", "causal"),
    ("gqa", "wrong-gqa-head", "none"),
    ("tree-chain", "tree-ignores-bits", "tree"),
    ("tree-star", "tree-ignores-bits", "tree"),  # no-finite-stand-in needs a rarer tree: test_teeth pins one
    ("padding-split", "causal-padding-global-shift", "causal+padding"),
    ("padding-split", "no-padding-rows", "padding"),
    ("padding-garbage", "padding-loads-garbage", "padding"),
    ("permutation", "dropped-rescale", "none"),
    ("lse-merge", "lse-base-2", "none"),
    ("lse-merge", "unmasked-tail", "none"),
])
def test_each_property_catches_a_mutant(prop, mutant, mask):
    spec = dataclasses.replace(_spec(mask), block_m=32, block_n=16)  # small shapes must still span several blocks
    module = engine.mutant_module(spec, mutant)
    # Small shapes and blocks on any device: each pairing is chosen for the shapes the CPU scale draws (a GPU-scale
    # tree rarely has the empty first block that no-finite-stand-in needs); --mutants covers the GPU scale.
    result = engine.run_property(module, spec, properties.BY_NAME[prop], examples=12, seed=0, scale="cpu",
                                   device=DEVICE, mutant=mutant, shrink_runs=40)
    assert result.failure is not None, f"{prop} missed {mutant}"
    assert result.failure.mutant == mutant and result.failure.property == prop
    example = counterexamples.Counterexample.from_blob(result.failure.blob())
    assert example == dataclasses.replace(result.failure, message="")
    assert engine.replay(example, DEVICE) == result.failure.message


# One mutant a test (`--mutant NAME`), so that xdist spreads the list over its workers; `--mutants` runs them all.
@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_each_mutant_is_caught_and_replays(tmp_path, name):
    report_path = tmp_path / "mutants.json"
    res = _cli("--mutant", name, "--examples", "6", "--shrink-runs", "25", "--json", str(report_path), *RUN)
    assert res.exit_code == 0, res.output
    assert "all 1 applicable mutants caught" in res.output
    data = json.loads(report_path.read_text())
    assert [m["mutant"] for m in data["mutants"]] == [name]
    assert data["mutants"][0]["caught_by"], data["mutants"]
    failures = [r["failure"] for r in data["results"] if not r["passed"]]
    assert len(failures) == 1 and failures[0]["mutant"] == name
    assert failures[0]["command"] in res.output  # the replay command is printed
    if name != MUTANTS[0].name:
        return
    replay = _cli("--reproduce", failures[0]["blob"], "--device", DEVICE)
    assert replay.exit_code == 1
    assert f"FAIL (reproduced): {failures[0]['message']}" in replay.output
    assert f"mutant:   {name}" in replay.output


def test_mutant_option_names_the_known_ones_and_defaults_to_all():
    from fagen.cli.verify import _chosen_mutants

    res = _cli("--mutant", "no-such-bug", *RUN)
    assert res.exit_code == 2 and "--mutant" in res.output and "no-such-bug" in res.output
    assert MUTANTS[0].name in res.output  # the message lists the known names
    assert _chosen_mutants(()) == MUTANTS
    assert _chosen_mutants((MUTANTS[1].name, MUTANTS[1].name)) == [MUTANTS[1]]


def test_verify_command_passes_prints_summary_and_json(tmp_path):
    report_path = tmp_path / "report.json"
    res = _cli("--head-dim", "32", "--mask", "tree", "--gqa", "2", "--block-m", "32", "--block-n", "16",
               "--examples", "3", "--json", str(report_path), *RUN)
    assert res.exit_code == 0, res.output
    assert "attn_fwd_tree_d32_m32n16" in res.output and "tree-chain" in res.output
    assert "worst error against float64 per dtype" in res.output
    data = json.loads(report_path.read_text())
    assert data["passed"] and data["seed"] == 0
    assert {r["property"] for r in data["results"]} == {"reference", "gqa", "tree-chain", "tree-star", "nan-propagates",
                                                        "lse-merge"}
    assert data["worst_by_dtype"]["fp16"]["out"] < verify.TOLERANCE[fagen.DType.FP16]["atol"] * 2


def test_failure_prints_a_replayable_counterexample(tmp_path):
    """A failing run exits 1 and prints spec, problem, property, message and the replay command."""
    spec = _spec("causal")
    good = engine.verify_specs([spec], examples=2, scale=SCALE, device=DEVICE, properties=["reference"])
    assert good.passed
    module = engine.mutant_module(spec, "causal-top-left")
    result = engine.run_property(module, spec, properties.BY_NAME["reference"], examples=10, seed=0, scale=SCALE,
                                   device=DEVICE, mutant="causal-top-left", shrink_runs=60)
    text = "\n".join(vreport.failure_lines(result, DEVICE))
    for needle in ("FAIL", "mutant causal-top-left", '"mask":"causal"', '"seq_q":', "replay:   fagen verify "):
        assert needle in text
    # Top-left alignment differs from bottom-right only when Sq != Sk: the shrunk problem shows exactly that.
    p = result.failure.problem
    assert p.seq_q != p.seq_k and p.batch == 1 and p.heads_kv == 1 and p.seed == 0


def test_spec_files_and_manifest(tmp_path):
    spec_file = tmp_path / "k.json"
    spec_file.write_text(_spec("none", gqa=2).to_json())
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[defaults]\nhead_dim = {_spec("none").head_dim}\n'
                        + "".join(f"{k} = {v}\n" for k, v in BLOCKS.items())
                        + '[[sweep]]\nmask = ["none", "causal"]\n')
    res = _cli(str(spec_file), "--manifest", str(manifest), "--examples", "2", "--property", "reference",
               "--quiet", *RUN)
    assert res.exit_code == 0, res.output
    assert "all 3 checks passed" in res.output and "┃" not in res.output  # --quiet: no tables


def test_time_budget_cuts_exploration_short():
    spec = _spec("none", gqa=1)
    report = engine.verify_specs([spec], examples=50, time_budget=1e-3, scale=SCALE, device=DEVICE)
    assert report.passed and all(r.out_of_time and r.examples <= 1 for r in report.results)


@pytest.mark.parametrize("args, code, message", [
    ([], 2, "name the kernels to verify"),
    (["--head-dim", "32", "--property", "bogus"], 2, "known: reference, gqa"),
    (["--reproduce", "not-a-blob!"], 2, "not a fagen reproduce blob"),
    (["--reproduce", "eyJ4IjoxfQ"], 2, "lacks spec, problem or property"),
    (["--reproduce", "eyJ4IjoxfQ", "--head-dim", "32"], 2, "give it no spec"),
    (["--reproduce", counterexamples.Counterexample(fagen.KernelSpec(head_dim=32), Problem(1, 1, 4, 4, seqlens_q=(9,)),
                                             "reference").blob()], 2, "seqlens_q must be an integer in [0, 4], got 9"),
    (["--reproduce", counterexamples.Counterexample(fagen.KernelSpec(head_dim=32, mask="tree"),
                                             Problem(1, 1, 2, 4, parents=((0, 0),)), "reference").blob()],
     2, "each -1 or an earlier node"),
    (["--head-dim", "12"], 2, "--head-dim"),
    (["--manifest", "/nonexistent.toml"], 1, "cannot be read"),
])
def test_bad_usage_gives_one_clear_line(args, code, message):
    res = _cli(*args)
    assert res.exit_code == code and message in res.output and "Traceback" not in res.output


@pytest.mark.skipif(ON_GPU, reason="checks the message shown without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    res = _cli("--head-dim", "32", "--device", "cuda")
    assert res.exit_code == 1 and "TRITON_INTERPRET=1 is set" in res.output


def test_kernels_imported_in_the_other_triton_mode_are_refused(monkeypatch):
    stale = types.ModuleType("fagen_generated.stale_compiled")
    stale._INTERPRET = DEVICE == "cuda"  # the opposite of what this device needs
    monkeypatch.setitem(sys.modules, stale.__name__, stale)
    res = _cli("--head-dim", "32", "--device", DEVICE)
    assert res.exit_code == 1 and "already imported kernels in the other Triton mode" in res.output


def test_blob_round_trip_and_replay_of_a_passing_example():
    spec = _spec("tree")
    problem = Problem(batch=1, heads_kv=1, seq_q=5, seq_k=9, parents=((-1, 0, 0, 0, 0),), seed=3)
    example = counterexamples.Counterexample(spec, problem, "tree-star")
    assert counterexamples.Counterexample.from_blob(example.blob()) == example
    assert engine.replay(example, DEVICE) is None
    res = _cli("--reproduce", example.blob(), "--device", DEVICE)
    assert res.exit_code == 0 and "pass: this example no longer fails" in res.output


def test_shaped_properties_reject_other_shapes():
    spec = _spec("tree")
    module = fagen.load(spec)
    bushy = Problem(batch=1, heads_kv=1, seq_q=3, seq_k=3, parents=((-1, 0, 1),))
    with pytest.raises(ValueError, match="star-shaped"):
        verify.check_tree_star(module, spec, bushy, DEVICE)
    star = dataclasses.replace(bushy, parents=((-1, -1, -1),))
    with pytest.raises(ValueError, match="chain-shaped"):
        verify.check_tree_chain(module, spec, star, DEVICE)


# -- backward properties, on a module whose backward is float64 autograd through the reference ------------

class _AutogradBackward:
    """forward: the generated kernel; backward: autograd through the float64 reference (optionally broken)."""

    def __init__(self, spec, broken=None):
        self.spec, self.broken, self.forward = spec, broken, fagen.load(spec).forward

    def backward(self, do, q, k, v, out, lse, *, scale=None, seqlens_q=None, seqlens_k=None, tree_mask=None):
        q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref, _ = reference.attention(q, k, v, mask=self.spec.mask, scale=scale, seqlens_q=seqlens_q,
                                     seqlens_k=seqlens_k, tree_mask=tree_mask)
        dtype, do = do.dtype, do.double()
        if seqlens_q is not None:  # the contract: dO rows past seqlens_q are never read (they may hold NaN)
            rows = torch.arange(do.shape[2], device=do.device)
            do = torch.where((rows[None, :] < seqlens_q[:, None])[:, None, :, None], do, 0.0)
        grads = [g.to(dtype) for g in torch.autograd.grad(ref, (q, k, v), do)]
        if self.broken == "noise":  # the last bits drift between runs, as with atomics in a random order
            grads[0] = grads[0] * (1 + torch.rand_like(grads[0]) * 1e-2)
        if self.broken == "rows":  # masked rows get the gradient of a uniform softmax
            grads[0] = grads[0] + 1e-3
        return tuple(grads)


@pytest.mark.parametrize("broken, prop", [(None, None), ("noise", "bwd-deterministic"),
                                          ("rows", "bwd-masked-rows")])
def test_backward_properties(broken, prop):
    spec = _spec("causal+padding")
    module = _AutogradBackward(spec, broken)
    names = [p.name for p in engine.properties_for(spec, module)]
    assert {"bwd-deterministic", "bwd-masked-rows"} <= set(names)
    assert ("bwd-reference" in names) == hasattr(verify, "check_backward")
    for name in ("bwd-deterministic", "bwd-masked-rows"):
        result = engine.run_property(module, spec, properties.BY_NAME[name], examples=5, seed=0, scale=SCALE,
                                       device=DEVICE, shrink_runs=10)
        assert result.passed == (name != prop), result.failure


def test_verify_reads_a_build_directory(tmp_path):
    spec = fagen.KernelSpec(head_dim=16, mask="causal", block_m=16, block_n=16)
    (tmp_path / "manifest.json").write_text(json.dumps({"variants": [{"spec": spec.to_dict(), "arch": "sm_80"},
                                                                     {"spec": spec.to_dict(), "arch": "sm_90"}]}))
    res = _cli(str(tmp_path), "--examples", "2", "--property", "reference", *RUN)
    assert res.exit_code == 0, res.output
    assert "all 1 checks passed" in res.output
    bad = _cli(str(tmp_path / "nothing-here"), *RUN)
    assert bad.exit_code == 2 and "does not exist" in bad.output


# -- --property: every name of both registries, and the layouts' results as a table -------------------------

def test_property_help_names_every_property():
    from fagen.verify.layouts import LAYOUT_PROPERTIES

    text = " ".join(CliRunner().invoke(main, ["verify", "--help"]).output.split())
    missing = [name for name in [*properties.BY_NAME, *LAYOUT_PROPERTIES] if name not in text]
    assert not missing, f"--property's help lacks {missing}"


def test_property_runs_one_dense_property_alone():
    res = _cli("--head-dim", "16", "--mask", "causal", "--block-m", "16", "--block-n", "16", "--examples", "2",
               "--property", "nan-propagates", *RUN)
    assert res.exit_code == 0, res.output
    assert "nan-propagates" in res.output and "all 1 checks passed" in res.output


def test_layout_properties_can_be_chosen_and_print_a_table(tmp_path):
    varlen = ["--head-dim", "16", "--mask", "causal", "--dtype", "fp32", "--layout", "varlen", "--block-m", "16",
              "--block-n", "16", "--examples", "2", "--device", DEVICE]
    report = tmp_path / "verify.json"
    res = _cli(*varlen, "--direction", "bwd", "--property", "layout-bwd-reference", "--json", str(report))
    assert res.exit_code == 0, res.output
    assert "┃ variant" in res.output and "│ attn_bwd_causal_d16" in res.output  # a rich table, not a plain line
    assert [v["property"] for v in json.loads(report.read_text())["layouts"]] == ["layout-bwd-reference"]
    dense_only = _cli("--head-dim", "16", "--property", "layout-reference", *RUN)
    assert dense_only.exit_code == 2 and "applies to none of the given specs" in dense_only.output


def test_layout_failures_are_lines_a_person_can_act_on():
    from fagen.verify.layouts import LayoutVerdict

    spec = fagen.KernelSpec(head_dim=16, mask="causal", layout="varlen")
    verdict = LayoutVerdict(spec, "layout-reference", 7, 1.5, "out (sequence 1): 0.5 against 0.25 (case: ...)")
    lines = vreport.layout_failure_lines(verdict)
    assert lines[0] == f"FAIL {spec.name} · layout-reference" and "out (sequence 1)" in lines[2]
    assert spec.to_json() in lines[3]
