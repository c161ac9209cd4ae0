"""The cold path of fagen.attention (README "User mods", docs/mods.md "Cold start"): what a process's first call
imports, renders, loads and compiles, and that a warm cache skips the render."""

import subprocess
import sys

import pytest
import torch

import fagen
from _env import DEVICE


def _inputs(seed=0, heads=2, seq=40, dim=16):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, seq, dim, generator=gen).to(DEVICE) for _ in range(3)]


def _reference(q, k, v, bias):
    s = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
    i = torch.arange(q.shape[2], device=q.device)
    s = s + torch.where(i[:, None] >= i[None, :], bias, -0.5)
    return torch.softmax(s, -1) @ v.double()


def test_fagen_attention_and_a_mods_call_import_no_dynamo():
    """torch._dynamo costs about 1 s of a process's start: neither fagen.attention's import nor a plain or a mods
    call may pull it in ([Note] Dynamo on demand in fagen/runtime/api.py)."""
    code = ("import sys, torch, fagen\n"
            f"q = torch.randn(1, 2, 20, 16, device={str(DEVICE)!r})\n"
            "fagen.attention(q, q, q)\n"
            "c = 0.3\n"
            "fagen.attention(q, q, q, score_mod=lambda s, b, h, i, j: s + c * (i >= j))\n"
            "late = [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules]\n"
            "assert not late, late\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_a_traced_mods_call_runs_eagerly_behind_one_graph_break():
    """Under torch.compile a call with mods still breaks the graph once and runs eagerly (with Dynamo loaded after
    fagen, the disable wrapper is made on demand)."""
    torch._dynamo.reset()
    q, k, v = _inputs(1)
    bias = 0.25

    def layer(q, k, v):
        return fagen.attention(q + 1, k, v, score_mod=lambda s, b, h, i, j: s + torch.where(i >= j, bias, -0.5)) * 2

    explain = torch._dynamo.explain(layer)(q, k, v)
    assert explain.graph_break_count == 1, explain.break_reasons
    got = torch.compile(layer, backend="eager")(q, k, v)
    want = _reference(q + 1, k, v, bias) * 2
    assert (got.double() - want).abs().max().item() < 1e-4


_LITERAL = [0]


def _new_score_mod():
    """A score_mod no cache has seen: a new literal in its code is a new expression, so a new spec."""
    _LITERAL[0] += 1
    return eval(f"lambda s, b, h, i, j: s + torch.where(i >= j, {0.1 + _LITERAL[0] / 1000!r}, -0.5)",
                {"torch": torch}), 0.1 + _LITERAL[0] / 1000


@pytest.fixture
def seen(monkeypatch, tmp_path):
    """A fresh cache, fresh module memos, and the renders and module imports of this test, by variant name."""
    from fagen.codegen import render as codegen
    from fagen.runtime import loader, modded

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    log = {"render": [], "import": []}
    real_render, real_import = codegen._render, loader.import_module

    def render(spec, *rest):
        log["render"].append(spec.name)
        return real_render(spec, *rest)

    def import_module(path, *rest, **kw):
        log["import"].append(path.name)
        return real_import(path, *rest, **kw)

    def new_process():
        """What a new process starts without: imported modules, memoised modules and renders."""
        for name in [n for n in sys.modules if n.startswith("fagen_generated.")]:
            monkeypatch.delitem(sys.modules, name)
        for memo in ("_MODULES", "_MOD_SPECS", "_FORWARD_ONLY"):
            monkeypatch.setattr(modded, memo, {})
        monkeypatch.setattr(loader, "_loaded", {})
        real_render.cache_clear()
        log["render"].clear()
        log["import"].clear()

    render.cache_clear = real_render.cache_clear
    monkeypatch.setattr(codegen, "_render", render)
    monkeypatch.setattr(loader, "import_module", import_module)
    monkeypatch.setattr(codegen, "INDEX_TRUSTED", True)
    new_process()
    log["new_process"] = new_process
    return log


def test_a_warm_cache_serves_a_new_process_s_first_mods_call_without_rendering(seen):
    """[Note] Render index: the second process's first call of a mod imports the cached module and renders nothing."""
    mod, bias = _new_score_mod()
    q, k, v = _inputs(2)
    with torch.no_grad():
        fagen.attention(q, k, v, score_mod=mod)
    assert len(seen["render"]) == 1 and len(seen["import"]) == 1, seen
    seen["new_process"]()
    with torch.no_grad():
        out = fagen.attention(q, k, v, score_mod=mod)
    assert seen["render"] == [] and len(seen["import"]) == 1, seen
    assert (out.double() - _reference(q, k, v, bias)).abs().max().item() < 1e-4


def test_the_render_index_serves_only_whole_files_of_the_same_package(seen, monkeypatch):
    """A truncated source is rendered and repaired, never imported; a changed package (its stamp) or a cleared
    render memo (tables changed under it) renders again."""
    from fagen.codegen import render as codegen
    from fagen.runtime import loader

    spec = fagen.KernelSpec(head_dim=16, mask="causal", block_m=16, block_n=16, score_mod="score * 0.731")
    path = loader.source_path(spec)
    whole = path.read_bytes()
    assert seen["render"] == [spec.name]
    seen["new_process"]()
    assert loader.source_path(spec) == path and seen["render"] == []
    path.write_bytes(whole[: len(whole) // 3])
    assert loader.source_path(spec) == path and seen["render"] == [spec.name] and path.read_bytes() == whole
    seen["new_process"]()
    stamp = loader._package_stamp
    monkeypatch.setattr(loader, "_package_stamp", lambda: (("spec/tables.py", 1, 2),))
    assert loader.source_path(spec) == path and seen["render"] == [spec.name]
    monkeypatch.setattr(loader, "_package_stamp", stamp)
    seen["new_process"]()
    assert loader.source_path(spec) == path and seen["render"] == []
    codegen.render.cache_clear()
    assert loader.source_path(spec) == path and seen["render"] == [spec.name]


def test_the_render_memo_and_index_key_on_the_gluon_variant(seen, monkeypatch):
    """A render made under a variant set at run time (as measurement scripts set GluonBackend.variant) is not served
    under another, in this process (the render memo) or a new one (the render index); the default's entry still is."""
    from fagen import backends
    from fagen.codegen import render as codegen
    from fagen.runtime import loader

    spec = fagen.KernelSpec(head_dim=16, mask="causal", block_m=16, block_n=16, score_mod="score * 0.517")
    path = loader.source_path(spec)
    assert seen["render"] == [spec.name]
    seen["new_process"]()
    regs = backends.GLUON.variant["consumer_regs"]
    monkeypatch.setitem(backends.GLUON.variant, "consumer_regs", regs - 8)
    loader.source_path(spec)
    assert seen["render"] == [spec.name]  # a miss in the index: rendered under the new variant
    seen["render"].clear()
    loader.source_path(spec)
    assert seen["render"] == []  # the memo and the index now hold this variant's render too
    seen["new_process"]()
    monkeypatch.setitem(backends.GLUON.variant, "consumer_regs", regs)  # the default variant again
    assert loader.source_path(spec) == path and seen["render"] == []
    gluon = fagen.KernelSpec(backend="gluon", head_dim=128, mask="causal", dtype="bf16")
    assert f"CONSUMER_REGS = {regs}\n" in codegen.render(gluon).source
    monkeypatch.setitem(backends.GLUON.variant, "consumer_regs", regs - 8)
    assert f"CONSUMER_REGS = {regs - 8}\n" in codegen.render(gluon).source  # the memo holds both


def test_fagen_load_s_module_memo_keys_on_the_gluon_variant(seen, monkeypatch):
    """fagen.load's in-process memo (loader._loaded) serves the module rendered under the variant in force: a variant
    set at run time gets its own module, and the default's module is served again once the default is back."""
    from fagen import backends

    gluon = fagen.KernelSpec(backend="gluon", head_dim=128, mask="causal", dtype="bf16")
    regs = backends.GLUON.variant["consumer_regs"]
    default = fagen.load(gluon)
    assert default.CONSUMER_REGS == regs
    monkeypatch.setitem(backends.GLUON.variant, "consumer_regs", regs - 8)
    lever = fagen.load(gluon)
    assert lever is not default and lever.CONSUMER_REGS == regs - 8
    assert fagen.load(gluon) is lever
    monkeypatch.setitem(backends.GLUON.variant, "consumer_regs", regs)
    assert fagen.load(gluon) is default


def test_a_first_call_without_gradient_loads_only_the_module_it_runs(seen, monkeypatch):
    """[Note] Forward-only first calls: where a forward twin serves (sm_90's forward tiles, here a CPU stand-in), the
    first call without gradient imports that one module, not the bwd module of the same mods; a call with gradients
    loads the bwd module then."""
    from fagen.runtime import modded

    monkeypatch.setattr(modded, "gpu_arch", lambda: "sm_90")
    monkeypatch.setitem(modded.MODDED_FWD_TILES, ("sm_90", "mask", False, False), {"block_m": 32, "block_n": 16})
    _LITERAL[0] += 1
    width = 5 + _LITERAL[0] % 7
    mask_mod = eval(f"lambda b, h, i, j: (i - 2 * j) < {width}")  # a new literal; not a window (lower.py)
    q, k, v = _inputs(3, seq=37, dim=128)  # forward tiles are for head_dim > 64
    with torch.no_grad():
        out = fagen.attention(q, k, v, mask_mod=mask_mod)
    assert len(seen["import"]) == 1 and seen["import"][0].startswith("attn_fwd_"), seen["import"]
    i = torch.arange(37, device=q.device)
    s = (q.double() @ k.double().transpose(-1, -2)) / 128 ** 0.5
    want = torch.softmax(s.masked_fill(~((i[:, None] - 2 * i[None, :]) < width), float("-inf")), -1) @ v.double()
    assert (out.double() - want).abs().max().item() < 1e-4
    fagen.attention(q.requires_grad_(), k, v, mask_mod=mask_mod)
    assert len(seen["import"]) == 2 and seen["import"][1].startswith("attn_bwd_"), seen["import"]


def test_a_new_process_reuses_the_compiled_templates(seen, monkeypatch):
    """[Note] Template bytecode: a process whose cache holds Jinja's compiled templates compiles none (a new mod in
    a warm process renders without compiling the templates)."""
    import jinja2

    from fagen.codegen import render as codegen

    compiled, real = [], jinja2.Environment.compile

    def compile(self, source, name=None, *rest, **kw):
        compiled.append(name)
        return real(self, source, name, *rest, **kw)

    monkeypatch.setattr(jinja2.Environment, "compile", compile)
    codegen._environment.cache_clear()  # a new process's environment: every template is compiled or read
    codegen.render(fagen.KernelSpec(head_dim=16, block_m=16, block_n=16, score_mod="score * 0.419"))
    assert compiled, "the first process compiles its templates"
    seen["new_process"]()
    codegen._environment.cache_clear()
    compiled.clear()
    codegen.render(fagen.KernelSpec(head_dim=16, block_m=16, block_n=16, score_mod="score * 0.421"))
    assert compiled == []


def test_a_read_only_cache_without_index_or_template_code_still_loads(seen, monkeypatch, tmp_path):
    """The render index and the template bytecode are written best effort: a warm cache that is read-only and lacks
    them (shipped before they existed) renders in memory and loads what it holds."""
    from pathlib import Path

    from fagen import files
    from fagen.codegen import render as codegen
    from fagen.runtime import loader

    spec = fagen.KernelSpec(head_dim=16, mask="causal", block_m=16, block_n=16, score_mod="score * 0.617")
    path = loader.write_source(spec)  # a cache entry as an older fagen left it: the source only
    seen["new_process"]()
    codegen._environment.cache_clear()
    for code in (tmp_path / "cache" / "jinja").rglob("*.bin"):
        code.unlink()
    cache = str(tmp_path / "cache")
    real_mkdir, real_mkstemp = Path.mkdir, files.tempfile.mkstemp

    def refuse(where):
        if str(where).startswith(cache):
            raise PermissionError(13, "Permission denied", str(where))

    monkeypatch.setattr(Path, "mkdir", lambda p, *a, **kw: refuse(p) or real_mkdir(p, *a, **kw))
    monkeypatch.setattr(files.tempfile, "mkstemp", lambda *a, dir=None, **kw: refuse(dir) or real_mkstemp(
        *a, dir=dir, **kw))
    module = fagen.load(spec)
    assert module.__file__ == str(path) and seen["render"] == [spec.name]
    assert not (tmp_path / "cache" / "src" / "index").exists()
