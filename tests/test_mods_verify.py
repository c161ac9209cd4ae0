"""fagen verify on specs with mods: Hypothesis draws shapes and captured values (ids, lengths, biases, numbers) and,
for two problems in three of a mask_mod, a block mask; each mod mutant is caught by a property."""

from _env import DEVICE, SCALE
from fagen.spec.kernel import KernelSpec
from fagen.verify import engine
from fagen.verify.mutants import MOD_MUTANTS

SPEC = KernelSpec(head_dim=16, dtype="fp32", mask="causal", gqa=2, direction="bwd", block_m=16, block_n=16,
                  score_mod="cap * tanh(score / cap) + bias[h, q_idx - kv_idx + 40]",
                  mask_mod="(doc[q_idx] == doc[kv_idx]) | (kv_idx < n)",
                  mod_tensors=[["bias", "fp32", 2], ["doc", "i32", 1]], mod_scalars=[["cap", "float"], ["n", "int"]])


def test_verify_passes_a_modded_spec():
    report = engine.verify_specs([SPEC], examples=2, scale=SCALE, device=DEVICE,
                                 properties=["reference", "bwd-reference"])
    assert report.passed, [r for r in report.results if not r.passed]


def test_verify_catches_every_mod_mutant():
    report, pairs = engine.verify_mutants([SPEC], mutants=MOD_MUTANTS, examples=5, scale=SCALE, device=DEVICE, shrink_runs=0,
                                          properties=["reference", "bwd-reference"])
    for mutant, spec in pairs:
        assert spec is not None and engine.mutant_catch(report, mutant, spec) is not None, mutant.name
