"""Ring attention (fagen.distributed) on real gloo processes (2, and 3) against a float64 single-process reference.

One spawn of 2 workers runs every case, and one of 3 workers the lengths 3 ranks can cut (process start-up and
the interpreter dominate; one spawn per session keeps the file fast), saving each rank's shards; the tests below
put the shards back together and compare. The workers run the kernels through Triton's interpreter
(TRITON_INTERPRET=1): gloo moves CPU tensors.
"""

import datetime
import fcntl
import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fagen.distributed as cp
from fagen.distributed import ContextParallelError, bench, ring

WORLD = 2
# name: (mask, layout, dtype, q heads, kv heads, full sequence length, head_dim)
CASES = {
    "none-contiguous-fp32": ("none", "contiguous", torch.float32, 2, 2, 64, 16),
    "none-zigzag-gqa-fp16": ("none", "zigzag", torch.float16, 4, 2, 64, 16),
    "causal-contiguous-gqa-fp32": ("causal", "contiguous", torch.float32, 4, 2, 64, 16),
    "causal-zigzag-gqa-fp32": ("causal", "zigzag", torch.float32, 4, 2, 64, 16),
    "causal-zigzag-bf16": ("causal", "zigzag", torch.bfloat16, 2, 2, 64, 32),
    # lengths that 3 ranks cut too (6 zigzag chunks): a ring of 3 passes blocks and dK/dV on over several hops
    "causal-zigzag-gqa-fp32-s48": ("causal", "zigzag", torch.float32, 4, 2, 48, 16),
    "causal-contiguous-fp16-s48": ("causal", "contiguous", torch.float16, 4, 2, 48, 16),
    "none-contiguous-gqa-fp32-s48": ("none", "contiguous", torch.float32, 4, 2, 48, 16),
}
WORLD3_CASES = [name for name in CASES if name.endswith("-s48")]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}  # max abs error, outputs and gradients
BATCH = 2


def full_problem(case, seed=0):
    """The full (unsharded) q, k, v and upstream gradient of a case; random, the same in every process."""
    mask, layout, dtype, hq, hkv, seq, d = CASES[case]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, hq, seq, d, generator=g)
    k = torch.randn(BATCH, hkv, seq, d, generator=g)
    v = torch.randn(BATCH, hkv, seq, d, generator=g)
    do = torch.randn(BATCH, hq, seq, d, generator=g)
    return [t.to(dtype) for t in (q, k, v, do)]


def reference(q, k, v, do, mask):
    """float64 attention (causal: query i sees key j <= i) and its gradients by autograd."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    gqa = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1)
    s = q @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask == "causal":
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ vv
    out.backward(do.double())
    return out.detach(), q.grad, k.grad, v.grad


def run_case(case, *, group=None, seed=0, **kwargs):
    """This rank's (out, dq, dk, dv) shards of ring attention on the case's full problem."""
    mask, layout = CASES[case][:2]
    q, k, v, do = (cp.shard_for_group(t, group=group, layout=layout) for t in full_problem(case, seed))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    before = [t.detach().clone() for t in (q, k, v)]
    out = cp.ring_attention(q, k, v, group=group, mask=mask, layout=layout, **kwargs)
    out.backward(do)
    if not all(torch.equal(a, b) for a, b in zip(before, (q, k, v))):
        raise AssertionError(f"{case}: ring_attention wrote into its inputs")
    return [t.detach().clone() for t in (out, q.grad, k.grad, v.grad)]


# Mutants: deliberately broken variants of the ring that the comparison must catch.
def merge_without_rescale(acc_out, acc_lse, out, lse):
    """Adds the block's output and lse as if the weights were equal (no exp(lse_i - lse) rescaling)."""
    acc_out.add_(out.float()).mul_(0.5)
    acc_lse.copy_(torch.logaddexp(acc_lse, lse))


ORIGINAL_BLOCK = ring._Ring.block


def block_with_zigzag_chunk_swapped(self, step):
    """The zigzag plan with the earlier rank's chunks swapped: all queries against the second (future) chunk."""
    todo = ORIGINAL_BLOCK(self, step)
    return ("all", "second", "none") if todo == ("all", "first", "none") else todo


def expect_error(fn):
    try:
        fn()
    except ContextParallelError as e:
        return str(e)
    return None


def worker(rank, init_file, out_dir):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # 127.0.0.1 only
    os.environ["TRITON_INTERPRET"] = "1"  # gloo moves CPU tensors: the interpreter, also on a GPU machine
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))  # a hang in the ring fails instead
    results = {}
    for case in CASES:
        results[case] = run_case(case)
    results["determinism"] = run_case("causal-zigzag-gqa-fp32", check_ranks=False)  # the check changes nothing
    results["shards"] = {layout: cp.gather(cp.shard_for_group(full_problem("none-contiguous-fp32")[0], layout=layout),
                                           layout=layout) for layout in cp.LAYOUTS}
    original_merge = ring._merge_into
    try:
        ring._merge_into = merge_without_rescale
        results["mutant-merge"] = run_case("causal-zigzag-gqa-fp32")
    finally:
        ring._merge_into = original_merge
    try:
        ring._Ring.block = block_with_zigzag_chunk_swapped
        results["mutant-zigzag"] = run_case("causal-zigzag-gqa-fp32")
    finally:
        ring._Ring.block = ORIGINAL_BLOCK
    # Errors: every rank must raise the same clear error (and none may hang in the ring).
    x = torch.randn(1, 2, 16, 16)
    errors = {
        "unequal-shards": lambda: cp.ring_attention(*(torch.randn(1, 2, 16 + 8 * rank, 16),) * 3),
        "dtypes": lambda: cp.ring_attention(*(x.to(torch.float16 if rank else torch.float32),) * 3),
        "mask-across-ranks": lambda: cp.ring_attention(x, x, x, mask="causal" if rank else "none"),
        "zigzag-odd": lambda: cp.ring_attention(*(torch.randn(1, 2, 15, 16),) * 3, layout="zigzag"),
        "causal-lengths": lambda: cp.ring_attention(x, x[:, :, :8], x[:, :, :8], mask="causal"),
        "mask": lambda: cp.ring_attention(x, x, x, mask="tree"),
        "layout": lambda: cp.ring_attention(x, x, x, layout="striped"),
        "heads": lambda: cp.ring_attention(torch.randn(1, 3, 16, 16), x, x),
        "head_dim": lambda: cp.ring_attention(*(torch.randn(1, 2, 16, 12),) * 3),
    }
    results["errors"] = {name: expect_error(fn) for name, fn in errors.items()}
    # A group of one rank runs the local kernel on the whole problem.
    solo = [dist.new_group([r]) for r in range(WORLD)]
    results["solo"] = run_case("causal-zigzag-gqa-fp32", group=solo[rank], seed=rank)
    # The benchmark's code path (timings on the interpreter mean nothing; the rows and the check must come out).
    shape = dict(heads=4, kv_heads=2, head_dim=16, mask="causal", layout="zigzag")
    results["bench"] = bench.run_cp_bench(seq=64, dtype="fp32", warmup=0, iters=1, **shape)
    results["check"] = bench.check_against_one_gpu(seq=64, dtype=torch.float32, **shape)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def worker3(rank, init_file, out_dir):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=60))
    torch.save({case: run_case(case) for case in WORLD3_CASES}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def spawned(tmp_path_factory, fn, nprocs):
    """Every rank's results of fn on nprocs gloo processes, spawned once per test session: under pytest-xdist the
    first worker to get here runs them and the others read its file (a lock in the session's shared temp dir)."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    key = f"{fn.__module__}.{fn.__name__}"  # two test files may both have a worker3
    done = root / f"{key}.pt"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            with tempfile.TemporaryDirectory() as tmp:
                mp.spawn(fn, args=(os.path.join(tmp, "init"), tmp), nprocs=nprocs, join=True)
                ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(nprocs)]
            torch.save(ranks, done)
    return torch.load(done, weights_only=False)


@pytest.fixture(scope="module")
def results3(tmp_path_factory):
    return spawned(tmp_path_factory, worker3, 3)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawned(tmp_path_factory, worker, WORLD)


def assembled(results, key, layout):
    """The full (out, dq, dk, dv) from every rank's shards."""
    return [cp.unshard([per_rank[key][i] for per_rank in results], layout=layout) for i in range(4)]


def max_errors(got, case, seed=0):
    q, k, v, do = full_problem(case, seed)
    want = reference(q, k, v, do, CASES[case][0])
    return [float((g.double() - w).abs().max()) for g, w in zip(got, want)]


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_match_float64_reference(results, case):
    errors = max_errors(assembled(results, case, CASES[case][1]), case)
    tol = TOL[CASES[case][2]]
    assert max(errors) < tol, f"{case}: max |error| of out, dq, dk, dv = {errors} (tolerance {tol})"


@pytest.mark.parametrize("case", WORLD3_CASES)
def test_a_ring_of_three_matches_float64_reference(results3, case):
    errors = max_errors(assembled(results3, case, CASES[case][1]), case)
    tol = TOL[CASES[case][2]]
    assert max(errors) < tol, f"{case} on 3 ranks: max |error| of out, dq, dk, dv = {errors} (tolerance {tol})"


def test_deterministic_for_a_fixed_world_size(results):
    for r in range(WORLD):
        for a, b in zip(results[r]["causal-zigzag-gqa-fp32"], results[r]["determinism"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mutant", ["mutant-merge", "mutant-zigzag"])
def test_mutant_is_caught(results, mutant):
    case = "causal-zigzag-gqa-fp32"
    errors = max_errors(assembled(results, mutant, "zigzag"), case)
    assert max(errors) > 100 * TOL[torch.float32], f"{mutant} passed the comparison: errors {errors}"


def test_group_of_one_runs_the_local_kernel(results):
    case = "causal-zigzag-gqa-fp32"
    for r in range(WORLD):
        errors = max_errors(results[r]["solo"], case, seed=r)
        assert max(errors) < TOL[torch.float32], errors


def test_shard_gather_round_trip(results):
    full = full_problem("none-contiguous-fp32")[0]
    for r in range(WORLD):
        for layout in cp.LAYOUTS:
            assert torch.equal(results[r]["shards"][layout], full)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_shard_unshard_round_trip(layout, world):
    x = torch.randn(2, 3, 24, 5)
    shards = [cp.shard(x, r, world, layout=layout) for r in range(world)]
    assert all(s.shape[2] == 24 // world for s in shards)
    assert torch.equal(cp.unshard(shards, layout=layout), x)


def test_zigzag_layout_chunks():
    x = torch.arange(8).view(1, 1, 8, 1)
    assert cp.shard(x, 0, 2, layout="zigzag").flatten().tolist() == [0, 1, 6, 7]
    assert cp.shard(x, 1, 2, layout="zigzag").flatten().tolist() == [2, 3, 4, 5]
    assert cp.shard(x, 1, 2, layout="contiguous").flatten().tolist() == [4, 5, 6, 7]


EXPECTED_ERRORS = {
    "unequal-shards": "q shard length differs across the ranks",
    "dtypes": "dtype differs across the ranks",
    "mask-across-ranks": "mask differs across the ranks",
    "zigzag-odd": "length must be even",
    "causal-lengths": "q and k shards of one length",
    "mask": "ring attention supports 'none', 'causal'",
    "layout": "layout: got 'striped'",
    "heads": "q's heads must be a multiple",
    "head_dim": "no fagen kernel for these shards: head_dim: got 12",
}


@pytest.mark.parametrize("name", list(EXPECTED_ERRORS))
def test_bad_input_gets_a_clear_error_on_every_rank(results, name):
    for r in range(WORLD):
        message = results[r]["errors"][name]
        assert message is not None, f"{name}: rank {r} raised no ContextParallelError"
        assert EXPECTED_ERRORS[name] in message, message


def test_errors_without_a_process_group():
    x = torch.randn(1, 2, 16, 16)
    with pytest.raises(ContextParallelError, match="init_process_group"):
        cp.ring_attention(x, x, x)
    with pytest.raises(ContextParallelError, match="pad it to a multiple of 4"):
        cp.shard(torch.randn(1, 1, 10, 4), 0, 2, layout="zigzag")


def test_bench_rows_and_check(results):
    rows = results[0]["bench"]
    assert [(r["direction"], r["gpus"]) for r in rows] == [("fwd", 1), ("fwd", 2), ("bwd", 1), ("bwd", 2)]
    assert all(r["ms"] > 0 and r["tflops_per_gpu"] > 0 for r in rows)
    assert rows[1]["kv_bytes_per_gpu"] * 2 == rows[0]["kv_bytes_per_gpu"]
    assert "| fwd | 2 |" in bench.format_table(rows)
    check = results[0]["check"]
    assert max(check["max_abs_diff_vs_one_gpu"].values()) < TOL[torch.float32], check
    assert max(check["head0_out_max_abs_err_vs_float64"].values()) < TOL[torch.float32], check


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the launcher takes one process per GPU")
def test_bench_launcher_under_torchrun(tmp_path, monkeypatch):
    """python -m fagen.distributed.bench through torch.distributed.run, 2 CPU processes on gloo; --device cpu sets
    the ranks' TRITON_INTERPRET (unset here) and --quick their sizes."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    out = tmp_path / "cp.json"
    rc = bench.launch_cp_bench(["--device", "cpu", "--quick", "--dtype", "fp32", "--mask", "none", "--layout",
                                "contiguous", "--directions", "fwd", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [(r["direction"], r["gpus"]) for r in rows] == [("fwd", 1), ("fwd", 2)]


@pytest.mark.parametrize("args, message", [
    (["--seq", "66"], "--seq 66: the zigzag layout over 2 ranks cuts the sequence into 4 equal chunks"),
    (["--head-dim", "12"], "head_dim: got 12"),
    (["--heads", "6", "--kv-heads", "4"], "--heads 6 must be a positive multiple of --kv-heads 4"),
    (["--directions", "sideways"], "--directions: got 'sideways'"),
])
def test_bench_launcher_refuses_bad_flags_in_one_line(capsys, args, message):
    assert bench.launch_cp_bench(args, nproc=2) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
