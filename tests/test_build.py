"""fagen compile / build: AOT artifacts, the content-addressed cache, concurrency, kills, and prebuilt launches."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from filelock import FileLock, Timeout

import fagen
from fagen import files
from fagen.aot import keys
from fagen.cli import main
from fagen.aot.artifacts import artifact_key
from fagen.runtime.prebuilt import PrebuiltError, PrebuiltKernel
from fagen.verify.strategies import Problem
from fagen.spec.targets import ARCH_CAPABILITY
from fagen.verify.properties import check_forward
from _env import DEVICE, ON_GPU

ROOT = Path(__file__).resolve().parent.parent
# Tiny kernels: Triton's AOT compile costs ~1.5 s each on a CPU core, so tests build few and small.
TINY = dict(head_dim=16, block_m=16, block_n=16, num_warps=1, num_stages=1)
CAUSAL = fagen.KernelSpec(mask="causal", **TINY)
TREE = fagen.KernelSpec(mask="tree", dtype="bf16", gqa=2, **TINY)


def manifest_text(kernels, archs=("sm_80", "sm_90")) -> str:
    lines = ["[defaults]", f"arch = {json.dumps(list(archs))}"]
    for spec in kernels:
        lines += ["[[kernel]]", *(f"{k} = {json.dumps(v)}" for k, v in spec.to_dict().items())]
    return "\n".join(lines) + "\n"


def write_manifest(path: Path, kernels, archs=("sm_80", "sm_90")) -> Path:
    path.write_text(manifest_text(kernels, archs))
    return path


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def subprocess_env(cache_dir: Path, **extra) -> dict:
    """A CLI process as a user runs it: compiled Triton (no interpreter), its own cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "FAGEN_CACHE_DIR": str(cache_dir), **extra}


def tree_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def without_volatile(manifest: bytes) -> dict:
    """manifest.json less what may differ between two correct builds: who compiled and who took the cache."""
    data = json.loads(manifest)
    for v in data["variants"]:
        v.pop("cached")
    data.pop("manifest")
    return data


# -- CLI surface ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("[[kernel]\nhead_dim = 64\n", "not valid TOML"),
    ("[kernels]\nhead_dim = 64\n", "unknown section"),
    ("[[kernel]]\nhead_dim = 12\n", "head_dim"),
    ("[[sweep]]\nhead_dim = [64]\nmask = []\n", "mask is an empty list"),
    ("[defaults]\narch = [\"sm_75\"]\n[[kernel]]\nhead_dim = 64\n", "sm_75"),
    ("[defaults]\narch = 90\n[[kernel]]\nhead_dim = 64\n", "arch"),
    ("[defaults]\narch = [\"sm_90\"]\n", "no variants"),
])
def test_bad_manifest_is_one_clear_line(tmp_path, text, expected):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = run_cli("build", path, "-o", tmp_path / "out")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists(), "nothing is written for a bad manifest"


def test_missing_manifest_file(tmp_path):
    result = run_cli("build", tmp_path / "nope.toml", "-o", tmp_path / "out")
    assert result.exit_code == 1 and "cannot be read" in result.output


@pytest.mark.parametrize("arch", ["sm_75", "sm_80,", "90", ""])
def test_bad_arch_exits_2(tmp_path, arch):
    result = run_cli("compile", "--head-dim", 64, "--arch", arch, "-o", tmp_path)
    assert result.exit_code == 2 and "--arch" in result.output and "sm_80, sm_90" in result.output


def test_compile_needs_a_spec(tmp_path):
    result = run_cli("compile", "-o", tmp_path)
    assert result.exit_code == 2 and "--head-dim" in result.output


# -- a real build, shared by the tests below --------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("build")
    # Its own cache while this module runs, so the first build compiles everything whatever ran before it
    # in this worker (another test may have built the same specs into the worker's cache).
    old_cache = os.environ.get("FAGEN_CACHE_DIR")
    os.environ["FAGEN_CACHE_DIR"] = str(tmp / "cache")
    manifest = write_manifest(tmp / "kernels.toml", [CAUSAL, TREE])
    start = time.perf_counter()
    first = run_cli("build", manifest, "-o", tmp / "out", "-j", 2)
    first_s = time.perf_counter() - start
    assert first.exit_code == 0, first.output
    yield tmp / "out", manifest, first, first_s
    if old_cache is None:
        os.environ.pop("FAGEN_CACHE_DIR", None)
    else:
        os.environ["FAGEN_CACHE_DIR"] = old_cache


def test_build_writes_every_variant_and_arch(built):
    out, _, first, _ = built
    data = json.loads((out / "manifest.json").read_text())
    assert [(v["name"], v["arch"]) for v in data["variants"]] == [
        (s.name, a) for s in (CAUSAL, TREE) for a in ("sm_80", "sm_90")]
    assert not data["failures"]
    for v in data["variants"]:
        assert v["hash"] == fagen.KernelSpec(**v["spec"]).hash and not v["cached"]
        assert (out / v["source"]).read_text() == fagen.generate(fagen.KernelSpec(**v["spec"]))
        (k,) = v["kernels"]
        ptx = (out / k["ptx"]).read_text()
        assert ptx.startswith("//") and f".target sm_{v['arch'][3:]}" in ptx
        assert (out / k["cubin"]).read_bytes()[:4] == b"\x7fELF"
        assert 0 < k["registers"] <= 255 and k["shared"] > 0 and k["spills"] >= 0 and v["seconds"] > 0
    assert "attn_fwd_causal_d16" in first.output and "compile s" in first.output


PTX_PARAM = {"*": ".u64 .ptr", "i32": ".u32", "i64": ".u64", "fp32": ".f32"}


def test_launch_record_matches_the_kernel_abi_in_the_ptx(built):
    """The prebuilt launcher passes the recorded params, then two scratch pointers: the PTX entry must agree."""
    out = built[0]
    for spec in (CAUSAL, TREE):
        variant = json.loads((out / spec.name / "variant.json").read_text())
        for arch, info in variant["archs"].items():
            (kernel,) = info["kernels"]
            ptx = (out / spec.name / kernel["ptx"]).read_text()
            entry = ptx[ptx.index(f".entry {kernel['launch']['symbol']}("):]
            got = re.findall(r"\.param (\.\w+(?: \.ptr)?)", entry[:entry.index(")")])
            want = [PTX_PARAM["*" if t.startswith("*") else t] for _, t in kernel["launch"]["params"]]
            want += [".u64 .ptr"] * 2  # global and profile scratch
            assert got == want, (spec.name, arch)


def test_second_build_is_all_cached_and_byte_identical(built, tmp_path):
    out, manifest, _, first_s = built
    before = tree_files(out)
    start = time.perf_counter()
    again = run_cli("build", manifest, "-o", out, "--json")
    again_s = time.perf_counter() - start
    assert again.exit_code == 0
    report = json.loads(again.output)
    assert len(report["variants"]) == 4 and all(v["cached"] for v in report["variants"])
    assert again_s < 0.5 * first_s, (again_s, first_s)
    after = tree_files(out)
    assert set(after) == set(before)
    assert [n for n in after if n != "manifest.json" and after[n] != before[n]] == []
    assert without_volatile(after["manifest.json"]) == without_volatile(before["manifest.json"])


def test_compile_command_writes_variant_dir(built, tmp_path):
    result = run_cli("compile", "--spec", _spec_file(tmp_path, CAUSAL), "--arch", "sm_90", "-o", tmp_path / "c")
    assert result.exit_code == 0, result.output
    variant = json.loads((tmp_path / "c" / CAUSAL.name / "variant.json").read_text())
    assert list(variant["archs"]) == ["sm_90"]
    (kernel,) = variant["archs"]["sm_90"]["kernels"]
    assert {"registers", "spills", "shared", "ptx", "cubin", "launch"} <= set(kernel)
    assert (tmp_path / "c" / CAUSAL.name / "sm_90" / "_attn_fwd.cubin").exists()
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_unset_tiles_resolve_per_arch_into_two_named_variants(tmp_path):
    spec = fagen.KernelSpec(head_dim=16, mask="causal")  # tiles unset: sm_80 and sm_90 give different ones
    sm80, sm90 = spec.for_arch("sm_80"), spec.for_arch("sm_90")
    assert sm80.name != sm90.name == spec.name
    result = run_cli("compile", "--head-dim", 16, "--mask", "causal", "--arch", "sm_80,sm_90", "-o", tmp_path,
                     "--json")
    assert result.exit_code == 0, result.output
    assert [(v["name"], v["arch"]) for v in json.loads(result.stdout)["variants"]] == [
        (sm80.name, "sm_80"), (sm90.name, "sm_90")]
    for s, arch in ((sm80, "sm_80"), (sm90, "sm_90")):
        variant = json.loads((tmp_path / s.name / "variant.json").read_text())
        assert list(variant["archs"]) == [arch] and variant["hash"] == s.hash
        assert (tmp_path / s.name / arch / "_attn_fwd.cubin").exists()


def test_an_unwritable_cache_fails_before_compiling(tmp_path, monkeypatch):
    import fagen.aot.build as aot_build

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "a-file" / "cache"))  # unwritable even for root
    monkeypatch.setattr(aot_build, "_run_one", lambda *a: pytest.fail("compiled before checking the cache"))
    monkeypatch.setattr(aot_build, "_run_pool", lambda *a: pytest.fail("compiled before checking the cache"))
    result = run_cli("build", write_manifest(tmp_path / "k.toml", [CAUSAL]), "-o", tmp_path / "out", "-q")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip().splitlines() == [
        f"Error: the kernel cache {tmp_path / 'a-file' / 'cache' / 'aot'} is not writable (Not a directory); set "
        "FAGEN_CACHE_DIR to a writable folder. Nothing was compiled"]
    result = run_cli("build", write_manifest(tmp_path / "k.toml", [CAUSAL]), "-o", tmp_path / "a-file" / "out")
    assert result.exit_code == 1 and "the output folder" in result.output and "choose a writable -o" in result.output


def test_variants_a_build_leaves_out_are_counted_with_their_reasons(tmp_path):
    tiny = {k: v for k, v in CAUSAL.to_dict().items() if k not in ("kind", "direction")}
    manifest = tmp_path / "m.toml"
    manifest.write_text(manifest_text([CAUSAL], ["sm_90"]) + "[[sweep]]\nkind = \"decode\"\n"
                        'direction = ["fwd", "bwd"]\n' + "".join(f"{k} = {json.dumps(v)}\n" for k, v in tiny.items()))
    result = run_cli("build", manifest, "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [v["name"] for v in report["variants"]] == [CAUSAL.name]
    assert report["skipped"] == 2 and report["not_started"] == 0
    assert set(report["skip_reasons"].values()) == {1}
    assert any("forward-only" in why for why in report["skip_reasons"])
    assert any("decode kernels have no ahead-of-time build" in why for why in report["skip_reasons"])
    assert sorted(line.split(":")[0] for line in result.stderr.splitlines()) == ["left out 1 variant"] * 2


def _spec_file(tmp_path: Path, spec) -> Path:
    path = tmp_path / "spec.json"
    path.write_text(spec.to_json())
    return path


# -- prebuilt artifacts at run time -------------------------------------------------------------------------
def test_load_from_build_dir_matches_reference(built):
    """On the CPU the prebuilt module runs its checks, then the interpreted kernel (no cubin can run here)."""
    out = built[0]
    for spec, problem in ((CAUSAL, Problem(batch=2, heads_kv=1, seq_q=37, seq_k=53, seed=11)),
                          (TREE, Problem(batch=1, heads_kv=2, seq_q=9, seq_k=30, seed=12,
                                         parents=((-1, 0, 1, 1, 0, 4, -1, 6, 2),)))):
        module = fagen.load(spec, build_dir=out)
        assert isinstance(module._attn_fwd, PrebuiltKernel)
        assert fagen.load(spec, build_dir=out) is module
        check_forward(module, spec, problem, DEVICE)


def test_prebuilt_refuses_inputs_it_was_not_built_for(built):
    module = fagen.load(CAUSAL, build_dir=built[0])
    q = torch.randn(1 + 2 * 20 * 16, dtype=torch.float16, device=DEVICE)[1:].view(1, 2, 20, 16)  # 2-byte offset
    k = v = torch.randn(1, 2, 20, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(module.InputError, match="16-byte aligned"):
        module.forward(q, k, v)


def test_prebuilt_refuses_a_tampered_or_missing_build(built, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(built[0], copy)
    cubin = copy / CAUSAL.name / "sm_90" / "_attn_fwd.cubin"
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))
    with pytest.raises(PrebuiltError, match="changed after it was built"):
        fagen.load(CAUSAL, build_dir=copy)
    with pytest.raises(PrebuiltError, match="build the variant first"):
        fagen.load(fagen.KernelSpec(head_dim=32), build_dir=copy)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="launching a prebuilt cubin needs a CUDA device")
def test_prebuilt_cubin_runs_on_the_gpu_without_compiling(tmp_path, monkeypatch):
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    if arch not in ARCH_CAPABILITY:
        pytest.skip(f"fagen builds for {', '.join(ARCH_CAPABILITY)}, this GPU is {arch}")
    big = fagen.KernelSpec(head_dim=128, mask="causal", gqa=2)  # default tiles: > 48 KB of dynamic shared memory
    cases = [
        (big, Problem(batch=2, heads_kv=2, seq_q=1000, seq_k=1531, seed=1)),
        (fagen.KernelSpec(head_dim=64, mask="tree", dtype="bf16"),
         Problem(batch=2, heads_kv=3, seq_q=7, seq_k=519, seed=2, parents=((-1, 0, 0, 1, 1, 2, -1),) * 2)),
        (fagen.KernelSpec(head_dim=80, mask="causal+padding"),  # head_dim not a multiple of 16: no stride hints
         Problem(batch=2, heads_kv=1, seq_q=700, seq_k=900, seqlens_q=(700, 333), seqlens_k=(650, 900), seed=3)),
    ]
    out = tmp_path / "out"
    result = run_cli("build", write_manifest(tmp_path / "m.toml", [s for s, _ in cases], [arch]), "-o", out, "-q")
    assert result.exit_code == 0, result.output
    triton_cache = tmp_path / "triton-cache"
    triton_cache.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_cache))  # a JIT compile from here on would write here
    for spec, problem in cases:
        module = fagen.load(spec, build_dir=out)
        assert isinstance(module._attn_fwd, PrebuiltKernel)
        check_forward(module, spec, problem, "cuda")
        torch.cuda.synchronize()
        jit = module.AOT_KERNELS[0]["fn"]
        assert not any(c[0] for c in jit.device_caches.values()), f"{spec.name}: Triton JIT-compiled a kernel"
    launched = json.loads((out / big.name / "variant.json").read_text())["archs"][arch]["kernels"][0]["launch"]
    assert arch != "sm_90" or launched["dynamic_shared"] > 48 * 1024, "the opt-in path above 48 KB was not used"
    assert not any(triton_cache.rglob("*")), "Triton wrote to its cache: something was compiled at run time"


# -- the cache under concurrency, kills and template edits --------------------------------------------------
def test_two_builds_at_once_share_the_cache(tmp_path):
    cache_dir = tmp_path / "cache"
    manifest = write_manifest(tmp_path / "m.toml", [CAUSAL, fagen.KernelSpec(mask="none", **TINY)], ["sm_90"])
    procs = [subprocess.Popen([sys.executable, "cli.py", "build", manifest, "-o", tmp_path / name, "-q", "-j", "1"],
                              cwd=ROOT,
                              env=subprocess_env(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for name in ("a", "b")]
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    a, b = tree_files(tmp_path / "a"), tree_files(tmp_path / "b")
    assert set(a) == set(b) and all(a[n] == b[n] for n in a if n != "manifest.json")
    assert without_volatile(a["manifest.json"]) == without_volatile(b["manifest.json"])
    entries = list((cache_dir / "aot").glob("*/*/entry.json"))
    assert len(entries) == 2 and not list(cache_dir.rglob("*.tmp")), "one entry per (variant, arch), no leftovers"


def _processes_started_with(text: str) -> list[int]:
    """Pids of live processes whose initial environment contains `text` (Linux /proc)."""
    pids = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if text.encode() in (d / "environ").read_bytes() and (d / "stat").read_text().split()[2] != "Z":
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the build's processes through /proc")
@pytest.mark.parametrize("jobs", [1, 2])  # 1: the build process compiles; 2: fork-server workers compile
def test_a_killed_build_leaves_no_lock_held_and_no_process(tmp_path, monkeypatch, jobs):
    cache_dir = tmp_path / "cache"
    spec = fagen.KernelSpec(mask="padding", **TINY)
    manifest = write_manifest(tmp_path / "m.toml", [spec], ["sm_80", "sm_90"])
    env = subprocess_env(cache_dir, TRITON_CACHE_DIR=str(tmp_path / "triton"))  # a real, seconds-long compile
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(cache_dir))  # the lock lives under the cache root
    lock_path = files.lock_for(keys.entry_dir(artifact_key(spec, "sm_80"))).lock_file
    proc = subprocess.Popen([sys.executable, "cli.py", "build", manifest, "-o", tmp_path / "out", "-q", "-j", str(jobs)],
                            cwd=ROOT, env=env)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:  # until the build holds the entry's lock
        try:
            with FileLock(lock_path, timeout=0):
                pass
        except Timeout:
            break
        time.sleep(0.01)
    else:
        proc.kill()
        pytest.fail("the build never held the entry lock while it ran")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while _processes_started_with(str(cache_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_started_with(str(cache_dir)), "workers outlived the killed build"
    with FileLock(lock_path, timeout=0):  # the holder is gone, and flock locks die with their holder
        pass
    again = run_cli("build", manifest, "-o", tmp_path / "out", "--json")  # same cache (monkeypatched env)
    assert again.exit_code == 0, again.output
    assert len(json.loads(again.stdout)["variants"]) == 2


# [Note] Template edits in a fresh process
# Compiling needs a process whose triton is not the interpreter's, so this scenario runs as one script in a
# fresh process (one torch import, builds in-process with -j 1). It replaces the decode template with a copy of
# the prefill one (so it builds ahead of time), a template only one variant reads, and sets the sm_80
# shared-memory limit per build. Each build's exit code, stdout (--json) and stderr are printed as JSON for the
# test to check.
TEMPLATE_SCENARIO = """
import json, os, sys
from pathlib import Path
from click.testing import CliRunner
from fagen.spec import targets
from fagen.aot import artifacts
from fagen.cli import main

artifacts.aot_missing = lambda spec: None  # the copy has the prefill's AOT_KERNELS
templates, manifest, tmp = map(Path, sys.argv[1:])
results = []

def build(*flags, limit=163 * 1024, cache="cache"):
    targets.ARCH_SMEM_LIMIT["sm_80"] = limit
    os.environ["FAGEN_CACHE_DIR"] = str(tmp / cache)
    r = CliRunner().invoke(main, ["build", str(manifest), "-o", str(tmp / "out"), "-j", "1", "--json", *flags])
    results.append({"code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr})

def append(name, text):
    with open(templates / name, "a") as f:
        f.write(text)

build()
append("triton/decode.py.j2", "# a comment only decode kernels carry\\n")
build()
build()
(templates / "triton" / "unused.j2").write_text("{# no spec reads this #}\\n")  # keys hash the render
build()
masks = templates / "triton" / "masks.j2"  # an edit both renders show (a comment-only edit changes no render)
masks.write_text(masks.read_text().replace("{% macro lengths() %}\\n", "{% macro lengths() %}\\n    # edited\\n", 1))
build()
build(limit=2048, cache="fresh")
build("--keep-going", limit=2048, cache="fresh")
build(limit=512, cache="fresh")
print(json.dumps(results))
"""


def test_template_edit_rebuilds_exactly_its_users_and_limits_are_enforced(tmp_path):
    templates = tmp_path / "templates"
    shutil.copytree(ROOT / "fagen" / "templates", templates)
    shutil.copy(templates / "triton" / "attention.py.j2", templates / "triton" / "decode.py.j2")
    # The decode kernel comes first and is the bigger one (3 KB of shared memory on sm_80; CAUSAL needs 1 KB).
    decode = {**fagen.KernelSpec(head_dim=32, block_m=32, block_n=16, num_warps=1, num_stages=1).to_dict(),
              "kind": "decode"}  # a kind with a template only in the scenario's process
    manifest = tmp_path / "m.toml"
    manifest.write_text('[defaults]\narch = ["sm_80"]\n[[kernel]]\n'
                        + "".join(f"{k} = {json.dumps(v)}\n" for k, v in decode.items())
                        + manifest_text([CAUSAL], ["sm_80"]).split("\n", 2)[2])
    proc = subprocess.run([sys.executable, "-c", TEMPLATE_SCENARIO, templates, manifest, tmp_path], cwd=ROOT,
                          env=subprocess_env(tmp_path / "unused", FAGEN_TEMPLATE_DIR=str(templates)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(proc.stdout)
    for run in runs:
        assert run["code"] in (0, 1) and "Traceback" not in run["stderr"], run["stderr"]
        variants = json.loads(run["stdout"])["variants"] if run["stdout"].strip() else []
        run["cached"] = {v["name"].split("_")[0]: v["cached"] for v in variants}
    first, decode_edit, again, unused, masks, over, keep_going, over_cached = runs
    assert first["code"] == 0 and first["cached"] == {"decode": False, "attn": False}, first["stderr"]
    assert decode_edit["cached"] == {"decode": False, "attn": True}, "only the decode variant reads decode.py.j2"
    assert again["cached"] == unused["cached"] == {"decode": True, "attn": True}
    assert masks["cached"] == {"decode": False, "attn": False}, "both render masks.j2's lengths()"

    # Over the arch's shared memory (a 2 KB limit here): rejected by the shared-memory formula before any compile
    # (fagen.backends.triton.smem_bytes); the first failure stops the build with exit 1, and the message
    # names the variant, what it needs, the limit and what to change.
    assert over["code"] == 1 and not over["cached"]
    assert "decode_fwd_full_d32_m32n16w1s1_g1_fp16 [sm_80]: needs 4 KB of shared memory per block but sm_80 " \
           "allows 2 KB" in over["stderr"] and "(estimated before compiling)" in over["stderr"]
    assert "smaller block_n (now 16) or block_m (now 32)" in over["stderr"]
    assert "fewer num_stages (now 1)" in over["stderr"] and "1 not started" in over["stderr"]
    assert keep_going["code"] == 1 and "1 of 2 variant builds failed" in keep_going["stderr"]
    assert keep_going["cached"] == {"attn": False}, "--keep-going builds the rest"
    assert over_cached["code"] == 1, "the limit is checked on cache hits too"
    assert "needs 1 KB of shared memory per block but sm_80 allows 0.5 KB" in over_cached["stderr"]


def test_rendering_is_fast():
    from fagen.spec.manifest import DEFAULT_CATALOG, load_manifest

    specs = load_manifest(DEFAULT_CATALOG).specs
    fagen.generate(specs[0])  # template compile, once per process
    start = time.perf_counter()
    for spec in specs:
        fagen.generate(spec)
    per_variant = (time.perf_counter() - start) / len(specs)
    assert per_variant < 0.05, f"rendering takes {per_variant * 1000:.1f} ms per variant"


def test_a_corrupted_cache_entry_is_rebuilt_not_served(built):
    out, manifest, _, _ = built
    (causal_sm80,) = [v for v in json.loads((out / "manifest.json").read_text())["variants"]
                      if v["name"] == CAUSAL.name and v["arch"] == "sm_80"]
    good = (out / causal_sm80["kernels"][0]["cubin"]).read_bytes()
    entry_cubin = keys.entry_dir(causal_sm80["key"]) / "_attn_fwd.cubin"
    entry_cubin.write_bytes(good[:-8])  # truncated, as by a full disk
    result = run_cli("build", manifest, "-o", out, "--json")
    assert result.exit_code == 0
    rebuilt = [(v["name"], v["arch"]) for v in json.loads(result.stdout)["variants"] if not v["cached"]]
    assert rebuilt == [(CAUSAL.name, "sm_80")]
    # A recompile need not be byte-identical (on the H100 machine one byte of the cubin's notes differed), so
    # the check is: a whole ELF again, the same in the cache and in the output, and not the truncated one.
    rebuilt_cubin = entry_cubin.read_bytes()
    assert rebuilt_cubin[:4] == b"\x7fELF" and len(rebuilt_cubin) == len(good)
    assert rebuilt_cubin == (out / causal_sm80["kernels"][0]["cubin"]).read_bytes()
