"""The typed argument lists (fagen/codegen/args.py): each renders one consistent signature per spec, the launches and
AOT entries agree with the definitions, and the CLI's spec flags and the public score keywords come from one place."""

import ast
import dataclasses
import itertools

import pytest

import fagen
from fagen.codegen import args as A
from fagen.codegen.render import render
from fagen.spec.kernel import SCORE_SWITCHES, KernelSpec, SpecError


def _specs():
    """A sweep over backends, kinds, directions, masks, layouts and switch sets (the valid ones)."""
    for backend, kind, direction, mask, layout, bits in itertools.product(
            ("triton", "cuda", "gluon"), ("prefill", "decode"), ("fwd", "bwd"),
            ("none", "causal", "padding", "tree"), ("dense", "varlen", "paged"), (0, 1, 5, 15)):
        switches = {name: bool(bits >> i & 1) for i, name in enumerate(SCORE_SWITCHES)}
        try:
            yield KernelSpec(head_dim=64, mask=mask, dtype="bf16", direction=direction, backend=backend, kind=kind,
                             layout=layout, **switches)
        except SpecError:
            continue
    # User mods (docs/mods.md): captured tensors, scalars and a block mask add arguments per spec.
    for direction, mask, bits in itertools.product(("fwd", "bwd"), ("none", "causal", "padding", "tree"), (0, 15)):
        switches = {name: bool(bits >> i & 1) for i, name in enumerate(SCORE_SWITCHES)}
        yield KernelSpec(head_dim=64, mask=mask, dtype="bf16", direction=direction, **switches,
                         score_mod="score * cap + bias[h, q_idx - kv_idx + 63] * w[h]",
                         mask_mod="doc[q_idx] == doc[kv_idx]", mod_scalars=[["cap", "float"]],
                         mod_tensors=[["bias", "fp32", 2], ["doc", "i32", 1], ["w", "bf16", 1]])
    # deterministic=False's fused backward ([Note] Atomic dQ): its DQAccum arguments and the postprocess kernel.
    for mask, layout, bits in itertools.product(("none", "causal", "padding", "tree"), ("dense", "varlen"), (0, 15)):
        switches = {name: bool(bits >> i & 1) for i, name in enumerate(SCORE_SWITCHES)}
        try:
            yield KernelSpec(head_dim=64, mask=mask, dtype="bf16", direction="bwd", layout=layout,
                             deterministic=False, **switches)
        except SpecError:
            continue


SPECS = list(_specs())


def test_the_sweep_covers_every_backend_kind_and_layout():
    assert {(s.backend.value, s.kind.value, s.layout.value) for s in SPECS} >= {
        ("triton", "prefill", "dense"), ("triton", "prefill", "varlen"), ("triton", "prefill", "paged"),
        ("triton", "decode", "dense"), ("triton", "decode", "paged"), ("cuda", "prefill", "dense"),
        ("gluon", "prefill", "dense")}


@pytest.mark.parametrize("name", sorted(A.LISTS) + sorted(A.KERNELS))
def test_names_are_unique_in_every_spec(name):
    """A list may hold one name twice only under predicates no spec meets together (seqlens_k: dense or paged)."""
    items = A.LISTS[name] if name in A.LISTS else A.KERNELS[name].args
    for spec in SPECS:
        names = [a.name for a in A.expand(items, spec)]
        assert len(names) == len(set(names)), (spec.name, names)


@pytest.mark.parametrize("kernel", sorted(A.KERNELS))
def test_every_star_covers_the_arguments_after_it(kernel):
    """An argument without a host expression is passed by the star expression before it, or by its pack's star."""
    for spec in SPECS:
        star = False
        for a in A.KERNELS[kernel].of(spec):
            host = a.host(spec) if callable(a.host) else a.host
            if a.kind == A.CONSTEXPR or a.pack:
                star = False
                continue
            assert host or star, f"{kernel}.{a.name} has no host expression and no star before it ({spec.name})"
            star = host.startswith("*") or (star and not host)


def _definitions(source: str) -> dict[str, list[str]]:
    return {node.name: [a.arg for a in node.args.args] for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef)}


def test_rendered_definitions_are_the_lists():
    """Each entry kernel in a rendered module takes exactly its list's arguments for that spec, in order."""
    seen = set()
    for spec in SPECS:
        if spec.backend.value == "cuda":
            continue
        defs = _definitions(render(spec).source)
        for name, kernel in A.KERNELS.items():
            if name in defs:
                assert defs[name] == [a.name for a in kernel.of(spec)], (spec.name, name)
                seen.add(name)
    assert seen == set(A.KERNELS) - {"fagen_attn_fwd"}


@pytest.mark.parametrize("fields", [dict(mask="tree"), dict(mask="causal", layout="varlen", window=True, alibi=True,
                                                               sinks=True, softcap=True)])
def test_aot_entries_name_every_kernel_argument(fields):
    """AOT_KERNELS (rendered from the lists) gives every argument of each kernel a type, in the kernel's order, and
    each constexpr one value: what `fagen compile` needs (fagen/aot/artifacts.py checks the same)."""
    module = fagen.load(KernelSpec(head_dim=64, dtype="fp16", direction="bwd", **fields))
    assert [e["name"] for e in module.AOT_KERNELS] == ["_attn_fwd", "_attn_bwd_preprocess", "_attn_bwd_dkdv",
                                                       "_attn_bwd_dq"]
    for entry in module.AOT_KERNELS:
        assert list(entry["signature"]) == list(entry["fn"].arg_names), entry["name"]
        consts = {n for n, t in entry["signature"].items() if t == "constexpr"}
        assert consts == set(entry["constexprs"]), entry["name"]
        assert set(entry["divisible"]) <= set(entry["signature"]) - consts


def test_switch_keywords_cover_every_switch():
    assert list(A.SWITCH_KEYWORD) == list(SCORE_SWITCHES)
    assert A.SWITCH_KEYWORD["alibi"] == "alibi_slopes"


def test_cli_spec_flags_are_the_spec_fields():
    """fagen's spec flags are generated from KernelSpec's fields: one flag per field, enums as their choices."""
    from click.testing import CliRunner

    from fagen.cli import main

    text = CliRunner().invoke(main, ["generate", "--help"], catch_exceptions=False).output
    for field in dataclasses.fields(KernelSpec):
        flag = {"mod_tensors": "mod-tensor", "mod_scalars": "mod-scalar"}.get(field.name, field.name.replace("_", "-"))
        assert "--" + flag in text, field.name  # the mods' declarations repeat a singular flag
    assert "[none|causal|padding|causal+padding|tree]" in text and "--sinks / --no-sinks" in text


@pytest.mark.parametrize("switches", [dict(softcap=True), dict(alibi=True, sinks=True)], ids=lambda s: "+".join(s))
def test_autograd_tuple_follows_the_op_list(switches):
    """_Attention.backward returns one gradient per input of the launch form (rendered from the list): the same
    gradients as backward(), None for the inputs without one (a switch the spec lacks passes None)."""
    import torch

    from _env import DEVICE

    spec = KernelSpec(head_dim=16, mask="causal", gqa=2, dtype="fp32", direction="bwd", block_m=16, block_n=16,
                      **switches)
    module = fagen.load(spec)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 19, 16, generator=g).to(DEVICE) for h in (4, 2, 2))
    kw = dict(softcap=2.5) if spec.softcap else dict(alibi_slopes=torch.rand(4, generator=g).to(DEVICE),
                                                      sinks=torch.randn(4, generator=g).to(DEVICE))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if spec.sinks:
        kw["sinks"] = kw["sinks"].clone().requires_grad_()
    out = module.attention(*leaves, **kw)
    do = torch.randn(out.shape, generator=g).to(DEVICE)
    out.backward(do)
    want_out, lse = module.forward(q, k, v, **{n: (t.detach() if isinstance(t, torch.Tensor) else t)
                                             for n, t in kw.items()})
    want = module.backward(do, q, k, v, want_out, lse, **{n: (t.detach() if isinstance(t, torch.Tensor) else t)
                                                           for n, t in kw.items()})
    got = [t.grad for t in leaves] + ([kw["sinks"].grad] if spec.sinks else [])
    assert len(want) == len(got)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
