"""The API's edges: inputs a newcomer gets wrong are refused with one line naming the input and the fix."""

import pytest
import torch

import fagen
from fagen.runtime.resolve import AttentionError

from _env import DEVICE, ON_GPU


def _dense(sq=5, sk=7, d=16, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, s, d, generator=g).to(DEVICE).requires_grad_(requires_grad) for s in (sq, sk, sk))
    return q, k, v


def _packed(d=16):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(12, 2, d, generator=g).to(DEVICE), torch.randn(14, 2, d, generator=g).to(DEVICE)
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 7, 14], dtype=torch.int32, device=DEVICE)
    return q, k, k.clone(), dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=7)


@pytest.mark.parametrize("extra", ["seqlens_q", "seqlens_k", "tree_mask"])
def test_packed_sequences_refuse_dense_mask_inputs(extra):
    """cu_seqlens with seqlens_q, seqlens_k or tree_mask: refused, naming the input (they used to be ignored)."""
    q, k, v, layout = _packed()
    value = torch.ones(2, 2, 2, dtype=torch.bool) if extra == "tree_mask" else torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(AttentionError, match=f"^{extra}: packed sequences .* drop {extra}$"):
        fagen.attention(q, k, v, **layout, **{extra: value.to(DEVICE)})


@pytest.mark.parametrize("requires_grad", [False, True], ids=["forward", "differentiable"])
@pytest.mark.parametrize("window, message", [
    (5, r"window: expected \(left, right\), two ints >= 0 or None, got 5"),
    ((3,), r"window: expected \(left, right\), two ints >= 0 or None, got \(3,\)"),
    (("a", 1), "window: left extent must be an int >= 0 or None"),
    ((2, -1), "window: right extent must be an int >= 0 or None"),
])
def test_attention_window_errors_are_the_modules(window, message, requires_grad):
    """fagen.attention refuses a malformed window with the generated module's InputError (one check, not two)."""
    q, k, v = _dense(requires_grad=requires_grad)
    with pytest.raises(ValueError, match=message) as info:
        fagen.attention(q, k, v, window=window)
    assert type(info.value).__name__ == "InputError"


def test_compiled_attention_refuses_a_malformed_window_too():
    """Under torch.compile the operator carries [left, right] with -1 for None: a window it cannot carry (-1 once
    read as unbounded) runs eagerly into the module's check."""
    q, k, v = _dense()
    f = torch.compile(lambda q, w: fagen.attention(q, k, v, window=w), backend="eager")
    with pytest.raises(ValueError, match="left extent must be an int >= 0"):
        f(q, (-1, 0))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_meta_inputs_raise_input_error(varlen):
    """Meta tensors hold no data: an InputError naming the device, not the interpreter's NotImplementedError."""
    if varlen:
        q, k, v, layout = _packed()
        layout = {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in layout.items()}
    else:
        (q, k, v), layout = _dense(), {}
    with pytest.raises(ValueError, match="inputs are on meta; Triton kernels run on a CUDA device") as info:
        fagen.attention(q.to("meta"), k.to("meta"), v.to("meta"), **layout)
    assert type(info.value).__name__ == "InputError"


@pytest.mark.parametrize("fields, message", [
    (dict(foo=1), "^foo: got 1; unknown spec field; known fields: alibi, backend, .*, window$"),
    (dict(head_dim=64, maks="causal"), "^maks: got 'causal'; unknown spec field \\(did you mean mask\\?\\); known"),
    (dict(head_dim=64, xx=1, dtyp=2), "^spec: got 'xx, dtyp'; unknown spec fields \\(did you mean dtype\\?\\)"),
    (dict(mask="causal"), "^head_dim: got None; is required"),
])
def test_spec_constructor_names_unknown_and_missing_fields(fields, message):
    """KernelSpec(...) refuses a misspelt or missing field as from_dict does: a SpecError, not a TypeError."""
    with pytest.raises(fagen.SpecError, match=message):
        fagen.KernelSpec(**fields)


def test_spec_still_pickles_copies_and_replaces():
    import copy
    import dataclasses
    import pickle

    spec = fagen.KernelSpec(64, "causal", window=True)
    assert pickle.loads(pickle.dumps(spec)) == spec and copy.deepcopy(spec) == spec
    assert dataclasses.replace(spec, gqa=2).gqa == 2
    with pytest.raises(fagen.SpecError, match="did you mean gqa"):
        dataclasses.replace(spec, gq=2)


@pytest.mark.parametrize("field, value, hint", [
    ("window", 4096, "window is a switch, and its extents are runtime arguments: forward(..., window=(4096, 0))"),
    ("window", (128, 0), "forward(..., window=(128, 0))"),
    ("softcap", 30.0, "softcap is a switch, and its cap is a runtime argument: forward(..., softcap=30.0)"),
    ("alibi", [0.5], "forward(..., alibi_slopes=<float32 [q heads]>)"),
    ("sinks", 1, "forward(..., sinks=<float32 [q heads]>)"),
])
def test_switch_given_a_value_says_it_is_a_runtime_argument(field, value, hint):
    with pytest.raises(fagen.SpecError, match="must be true or false") as info:
        fagen.KernelSpec(head_dim=64, **{field: value})
    assert str(info.value).endswith(hint)


# -- index dtypes ([Note] Index dtypes in fagen/templates/host/checks.py.j2) -------------------------------------
def _paged_decode():
    spec = fagen.KernelSpec(head_dim=16, mask="causal", gqa=2, kind="decode", layout="paged", block_n=16)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 2, 16, generator=g).half().to(DEVICE)
    kc, vc = (torch.randn(6, 4, 2, 16, generator=g).half().to(DEVICE) for _ in range(2))
    table = torch.tensor([[5, 1, 2], [3, 0, 4]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([11, 6], dtype=torch.int32, device=DEVICE)
    return fagen.load(spec), q, kc, vc, dict(block_table=table, seqlens_k=lens)


@pytest.mark.parametrize("check", [False, True])
def test_int64_index_inputs_equal_int32(check):
    """cu_seqlens (fagen.attention), block_table and paged seqlens_k (module.forward), padding seqlens: int64 gives
    exactly the int32 result."""
    q, k, v, layout = _packed()
    want = fagen.attention(q, k, v, mask="causal", check=check, **layout)
    wide = {n: t.long() if isinstance(t, torch.Tensor) else t for n, t in layout.items()}
    assert torch.equal(fagen.attention(q, k, v, mask="causal", check=check, **wide), want)

    module, q, kc, vc, paging = _paged_decode()
    want = module.forward(q, kc, vc, check=check, **paging)
    got = module.forward(q, kc, vc, check=check, **{n: t.long() for n, t in paging.items()})
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    q, k, v = _dense()
    lens = dict(seqlens_q=torch.tensor([4], device=DEVICE), seqlens_k=torch.tensor([6], device=DEVICE))
    want = fagen.attention(q, k, v, mask="padding", check=check, **{n: t.int() for n, t in lens.items()})
    assert torch.equal(fagen.attention(q, k, v, mask="padding", check=check, **lens), want)


def test_int32_index_inputs_are_not_copied():
    module, q, kc, vc, paging = _paged_decode()
    _, seqlens_k, _, block_table = module._check_layout(q, kc, vc, **paging, check=False)
    assert seqlens_k is paging["seqlens_k"] and block_table is paging["block_table"]
    q, k, v, layout = _packed()
    varlen = fagen.load(fagen.KernelSpec(head_dim=16, layout="varlen", dtype="fp32", block_m=16, block_n=16))
    cu_q, cu_k, *_ = varlen._check_layout(q, k, v, **layout, check=False)
    assert cu_q is layout["cu_seqlens_q"] and cu_k is layout["cu_seqlens_k"]


def test_int64_values_past_int32_are_refused_with_check_not_wrapped():
    module, q, kc, vc, paging = _paged_decode()
    lens = paging["seqlens_k"].long() + 2**32  # 11 and 6 after a wrap to int32
    with pytest.raises(module.InputError, match=r"seqlens_k: lengths must lie in \[0, 12\]"):
        module.forward(q, kc, vc, check=True, **{**paging, "seqlens_k": lens})
    with pytest.raises(module.InputError, match="block_table: expected dtype torch.int32 or torch.int64, got "
                                                "torch.float32"):
        module.forward(q, kc, vc, **{**paging, "block_table": paging["block_table"].float()})


# -- fagen bench --suite cp ----------------------------------------------------------------------------------------
@pytest.mark.skipif(ON_GPU, reason="--device cpu in a process that already runs compiled kernels is refused there")
def test_bench_cp_passes_device_quick_dtype_on(monkeypatch):
    """`fagen bench --suite cp` hands --device, --quick, --dtype (and the shape flags) to the ranks' command line."""
    from click.testing import CliRunner

    from fagen.cli import main
    from fagen.distributed import bench

    seen = []
    monkeypatch.setattr(bench, "launch_cp_bench", lambda args: seen.append(args) or 0)
    result = CliRunner().invoke(main, ["bench", "--suite", "cp", "--device", "cpu", "--quick", "--dtype", "fp32",
                                      "--heads", "4", "--mask", "none"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert seen == [["--device", "cpu", "--quick", "--heads", "4", "--dtype", "fp32", "--mask", "none"]]


def test_cp_ranks_on_the_cpu_get_the_interpreter_and_quick_sizes(monkeypatch):
    from fagen.distributed import bench

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cmd, env = bench.cp_command(["--device", "cpu", "--quick"])
    assert env["TRITON_INTERPRET"] == "1" and "--nproc-per-node=2" in cmd and cmd[-3:] == ["--device", "cpu", "--quick"]
    quick = bench._parse(["--quick", "--heads", "4"])
    assert (quick.seq, quick.heads, quick.head_dim, quick.warmup, quick.iters) == (64, 4, 16, 0, 1)
    full = bench._parse([])
    assert (full.seq, full.heads, full.head_dim, full.warmup, full.iters) == (131072, 32, 128, 2, 5)


# -- fagen tune's own table -------------------------------------------------------------------------------------
ENTRY = dict(arch="sm_90", head_dim=64, mask="causal", dtype="fp16", direction="fwd", kind="prefill", block_m=64,
             block_n=32, num_warps=4, num_stages=4)


@pytest.fixture
def own_tables(tmp_path, monkeypatch):
    """A fresh cache root (so a fresh user table) and a stand-in for the shipped table."""
    from fagen.spec import tuned

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuned, "TUNED_PATH", tmp_path / "shipped.json")
    tuned._index.cache_clear()
    yield tuned
    tuned._index.cache_clear()


def test_the_user_table_lives_in_the_cache_root_and_wins_over_the_shipped_one(own_tables, tmp_path):
    tuned = own_tables
    assert tuned.user_table_path() == tmp_path / "cache" / "tuned.json"
    tuned.upsert(tuned.TUNED_PATH, ENTRY)
    tuned.upsert(tuned.TUNED_PATH, {**ENTRY, "mask": "none", "block_m": 128})
    tuned.upsert(tuned.user_table_path(), {**ENTRY, "block_n": 16})
    spec = fagen.KernelSpec(head_dim=64, mask="causal")
    assert (spec.block_m, spec.block_n) == (64, 16)  # the user's entry for this key
    assert fagen.KernelSpec(head_dim=64, mask="none").block_m == 128  # no user entry: the shipped one
    assert tuned.lookup(64, "causal", "fp16", "fwd", "prefill", path=tuned.TUNED_PATH)["block_n"] == 32


@pytest.mark.skipif(ON_GPU, reason="the CPU's refusal to tune is what this checks")
def test_tune_defaults_to_the_user_table_and_says_so(own_tables, tmp_path):
    from click.testing import CliRunner

    from fagen.cli import main

    res = CliRunner().invoke(main, ["tune", "--device", "cpu", "--quick", "--head-dim", "16"],
                             catch_exceptions=False)
    assert res.exit_code == 2 and f"your tuned table ({tmp_path / 'cache' / 'tuned.json'})" in res.output


def test_a_relative_cache_dir_is_resolved_once(tmp_path, monkeypatch):
    """A relative FAGEN_CACHE_DIR names one folder for the whole process and its children, whatever chdir does."""
    import subprocess
    import sys

    from fagen import files as cache

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setenv("FAGEN_CACHE_DIR", "rel/cache")
    monkeypatch.chdir(tmp_path / "a")
    assert cache.cache_root() == tmp_path / "a" / "rel" / "cache"
    monkeypatch.chdir(tmp_path / "b")
    assert cache.cache_root() == tmp_path / "a" / "rel" / "cache"
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['FAGEN_CACHE_DIR'])"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(tmp_path / "a" / "rel" / "cache")


def test_a_strided_paged_seqlens_k_is_read_as_its_values():
    """The kernels read lengths at stride 1: a strided view (every other entry) is made contiguous first."""
    module, q, kc, vc, paging = _paged_decode()
    lens = torch.stack([paging["seqlens_k"], paging["seqlens_k"] - 1], 1).reshape(-1)[::2]  # 11, 6 at stride 2
    assert lens.stride(0) == 2 and lens.tolist() == paging["seqlens_k"].tolist()
    want = module.forward(q, kc, vc, **paging)
    got = module.forward(q, kc, vc, **{**paging, "seqlens_k": lens})
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
