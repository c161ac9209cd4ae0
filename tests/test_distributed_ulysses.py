"""Ulysses, the 2D hybrid and the rings over packed documents (fagen.distributed) on real gloo processes (2, 3 and
4) against float64 references; plus the document plans' balance, on the host.

As in tests/test_distributed.py, one spawn per world size runs every case of that size (process start-up and the
interpreter dominate) and saves each rank's shards; the tests put them back together and compare.
"""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from test_distributed import TOL, expect_error, spawned

import fagen.distributed as cp
from fagen.distributed import ContextParallelError
from fagen.distributed.packing import plan_documents
from fagen.verify import reference

CU = [0, 7, 30, 31, 52, 64]  # five documents, one of a single token; 64 packed rows
D = 16


def dense_problem(hq, hkv, seq, dtype=torch.float32, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, hq, seq, D), (batch, hkv, seq, D), (batch, hkv, seq, D), (batch, hq, seq, D)]
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


def packed_problem(hq, hkv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(CU[-1], hq, D), (CU[-1], hkv, D), (CU[-1], hkv, D), (CU[-1], hq, D)]
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


def packed_reference(q, k, v, do, mask):
    """float64 attention within each document of CU (causal: token i sees its document's tokens up to i)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    outs = []
    for a, b in zip(CU, CU[1:]):
        o, _ = reference.attention(*(t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)), mask=mask)
        outs.append(o[0].transpose(0, 1))
    out = torch.cat(outs)
    out.backward(do.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def dense_reference(q, k, v, do, mask, **kw):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    kw = {n: (t.double().requires_grad_() if n == "sinks" else t) for n, t in kw.items()}
    out, _ = reference.attention(q, k, v, mask=mask, **kw)
    out.backward(do.double())
    return [out.detach(), q.grad, k.grad, v.grad] + ([kw["sinks"].grad] if "sinks" in kw else [])


def run_dense(fn, problem, shard, **kw):
    """This rank's (out, dq, dk, dv) shards of fn on the full problem (shard cuts a full tensor)."""
    q, k, v, do = problem
    qs, ks, vs = (shard(t).requires_grad_() for t in (q, k, v))
    out = fn(qs, ks, vs, **kw)
    out.backward(shard(do))
    return [t.detach().clone() for t in (out, qs.grad, ks.grad, vs.grad)]


SLOPES = torch.rand(4, generator=torch.Generator().manual_seed(3))
SINKS = torch.randn(4, generator=torch.Generator().manual_seed(4))
LENS = torch.tensor([29, 11], dtype=torch.int32)
# name: (mask, layout, q heads, kv heads, seq, dtype, batch, keyword arguments) for Ulysses on 2 ranks
ULYSSES2 = {
    "causal-zigzag-gqa": ("causal", "zigzag", 4, 2, 32, torch.float32, 1, {}),
    "none-contiguous-mqa-fp16": ("none", "contiguous", 4, 1, 24, torch.float16, 1, {}),
    "causal+padding-alibi": ("causal+padding", "contiguous", 2, 2, 32, torch.float32, 2,
                             dict(seqlens_q=LENS, seqlens_k=LENS, alibi_slopes=SLOPES[:2])),
    "window-softcap-sinks": ("causal", "zigzag", 4, 2, 32, torch.float32, 1, dict(window=(5, 0), softcap=3.0,
                                                                                  sinks=SINKS)),
}


def ulysses_case(name, group=None):
    mask, layout, hq, hkv, seq, dtype, batch, kw = ULYSSES2[name]
    kw = dict(kw)
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].clone().requires_grad_()
    got = run_dense(cp.ulysses_attention, dense_problem(hq, hkv, seq, dtype, batch),
                    lambda t: cp.shard_for_group(t, group=group, layout=layout), mask=mask, layout=layout, group=group,
                    **kw)
    if "sinks" in kw:  # each rank holds its heads' share: the sum over the group is the gradient
        dist.all_reduce(kw["sinks"].grad, group=group)
        got.append(kw["sinks"].grad)
    return got


def packed_case(fn, world, rank, mask, balance, hq=2, hkv=1, seed=0, **kw):
    plan = plan_documents(CU, world, balance=balance, mask=mask, min_chunk=4)
    return run_dense(fn, packed_problem(hq, hkv, seed=seed), lambda t: plan.shard(t, rank), mask=mask, plan=plan,
                     **kw)


def init(rank, world, init_file):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def finish(results, out_dir, rank):
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def worker2(rank, init_file, out_dir):
    init(rank, 2, init_file)
    res = {("ulysses", name): ulysses_case(name) for name in ULYSSES2}
    res["ulysses-again"] = ulysses_case("window-softcap-sinks")
    for mask, balance in (("causal", "zigzag"), ("none", "greedy")):
        res[("ring", mask, balance)] = packed_case(cp.ring_attention, 2, rank, mask, balance)
    res["ring-again"] = packed_case(cp.ring_attention, 2, rank, "causal", "zigzag")
    res[("ulysses", "causal", "greedy")] = packed_case(cp.ulysses_attention, 2, rank, "causal", "greedy")
    x = torch.randn(1, 2, 16, D)
    plan = plan_documents(CU, 2, mask="causal", min_chunk=4)
    xp = torch.randn(plan.shard_len, 2, D)
    errors = {  # a bad input on one rank: every rank raises, none hangs
        "one-rank-mask": lambda: cp.ulysses_attention(x, x, x, mask="tree2" if rank else "none"),
        "one-rank-dims": lambda: cp.ring_attention(x[0] if rank else x, x, x),
        "heads": lambda: cp.ulysses_attention(torch.randn(1, 3, 16, D), torch.randn(1, 1, 16, D),
                                              torch.randn(1, 1, 16, D)),
        "kv-heads": lambda: cp.ulysses_attention(*(torch.randn(1, 6, 16, D),), *(torch.randn(1, 3, 16, D),) * 2),
        "plan-differs": lambda: cp.ring_attention(xp, xp, xp, mask="causal", plan=plan_documents(
            CU if rank else [0, 8, 30, 31, 52, 64], 2, mask="causal", min_chunk=4)),
        "plan-mask": lambda: cp.ring_attention(xp, xp, xp, mask="none", plan=plan),
        "plan-world": lambda: cp.ulysses_attention(xp, xp, xp, mask="causal", plan=plan_documents(CU, 3)),
        "plan-rows": lambda: cp.ring_attention(xp[:-1], xp[:-1], xp[:-1], mask="causal", plan=plan),
        "head_dim": lambda: cp.ulysses_attention(*(torch.randn(1, 2, 16, 12),) * 3),
    }
    res["errors"] = {name: expect_error(fn) for name, fn in errors.items()}
    finish(res, out_dir, rank)


def worker3(rank, init_file, out_dir):
    init(rank, 3, init_file)
    res = {"ulysses": run_dense(cp.ulysses_attention, dense_problem(3, 3, 24),
                                lambda t: cp.shard_for_group(t, layout="zigzag"), mask="causal", layout="zigzag"),
           "ring": packed_case(cp.ring_attention, 3, rank, "causal", "greedy"),
           "ulysses-packed": packed_case(cp.ulysses_attention, 3, rank, "none", "zigzag", hq=3, hkv=3)}
    finish(res, out_dir, rank)


def worker4(rank, init_file, out_dir):
    init(rank, 4, init_file)
    groups = cp.hybrid_groups(ulysses_degree=2, ring_degree=2)
    res = {"hybrid": run_dense(cp.hybrid_attention, dense_problem(4, 1, 32), lambda t: groups.shard(t, layout="zigzag"),
                               groups=groups, mask="causal", layout="zigzag")}
    plan = groups.plan(CU, balance="zigzag", mask="causal", min_chunk=4)
    res["hybrid-packed"] = run_dense(cp.hybrid_attention, packed_problem(2, 2), lambda t: groups.shard_packed(t, plan),
                                     groups=groups, mask="causal", plan=plan)
    res["ring"] = packed_case(cp.ring_attention, 4, rank, "causal", "greedy")
    x = torch.randn(1, 2, 16, D)
    res["errors"] = {"ring-degree": expect_error(lambda: cp.hybrid_groups(ulysses_degree=3)),
                     "hybrid-one-rank": expect_error(lambda: cp.hybrid_attention(
                         x, x, x, groups=groups, layout="striped" if rank == 3 else "contiguous"))}
    finish(res, out_dir, rank)


@pytest.fixture(scope="module")
def results2(tmp_path_factory):
    return spawned(tmp_path_factory, worker2, 2)


@pytest.fixture(scope="module")
def results3(tmp_path_factory):
    return spawned(tmp_path_factory, worker3, 3)


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    return spawned(tmp_path_factory, worker4, 4)


def check(got, want, dtype, what):
    errors = [float((g.double() - w).abs().max()) for g, w in zip(got, want)]
    assert max(errors) < TOL[dtype], f"{what}: max |error| of out, dq, dk, dv(, dsinks) = {errors} ({TOL[dtype]})"


@pytest.mark.parametrize("name", list(ULYSSES2))
def test_ulysses_matches_float64_on_two_ranks(results2, name):
    mask, layout, hq, hkv, seq, dtype, batch, kw = ULYSSES2[name]
    got = [cp.unshard([r[("ulysses", name)][i] for r in results2], layout=layout) for i in range(4)]
    got += [results2[0][("ulysses", name)][4]] if "sinks" in kw else []
    check(got, dense_reference(*dense_problem(hq, hkv, seq, dtype, batch), mask, **kw), dtype, name)


@pytest.mark.parametrize("fn, mask, balance", [("ring", "causal", "zigzag"), ("ring", "none", "greedy"),
                                               ("ulysses", "causal", "greedy")])
def test_packed_documents_match_float64_on_two_ranks(results2, fn, mask, balance):
    plan = plan_documents(CU, 2, balance=balance, mask=mask, min_chunk=4)
    got = [plan.unshard([r[(fn, mask, balance)][i] for r in results2]) for i in range(4)]
    check(got, packed_reference(*packed_problem(2, 1), mask), torch.float32, f"{fn} {mask} {balance}")


def test_bitwise_deterministic(results2):
    for r in results2:
        assert all(torch.equal(a, b) for a, b in zip(r[("ulysses", "window-softcap-sinks")], r["ulysses-again"]))
        assert all(torch.equal(a, b) for a, b in zip(r[("ring", "causal", "zigzag")], r["ring-again"]))


def test_three_ranks(results3):
    got = [cp.unshard([r["ulysses"][i] for r in results3], layout="zigzag") for i in range(4)]
    check(got, dense_reference(*dense_problem(3, 3, 24), "causal"), torch.float32, "ulysses on 3 ranks")
    for key, mask, balance, heads in (("ring", "causal", "greedy", (2, 1)),
                                      ("ulysses-packed", "none", "zigzag", (3, 3))):
        plan = plan_documents(CU, 3, balance=balance, mask=mask, min_chunk=4)
        got = [plan.unshard([r[key][i] for r in results3]) for i in range(4)]
        check(got, packed_reference(*packed_problem(*heads), mask), torch.float32, f"{key} on 3 ranks")


def test_four_ranks_hybrid_and_ring(results4):
    groups = cp.HybridGroups(2, 2, None, None, None, 0, 0)  # unshard needs only the degrees
    got = [groups.unshard([r["hybrid"][i] for r in results4], layout="zigzag") for i in range(4)]
    check(got, dense_reference(*dense_problem(4, 1, 32), "causal"), torch.float32, "hybrid 2x2, MQA replicated")
    plan = plan_documents(CU, 2, balance="zigzag", mask="causal", min_chunk=4, pad_multiple=2)
    got = [plan.unshard([torch.cat([results4[2 * j]["hybrid-packed"][i], results4[2 * j + 1]["hybrid-packed"][i]])
                         for j in range(2)]) for i in range(4)]
    check(got, packed_reference(*packed_problem(2, 2), "causal"), torch.float32, "hybrid 2x2 packed")
    plan = plan_documents(CU, 4, balance="greedy", mask="causal", min_chunk=4)
    got = [plan.unshard([r["ring"][i] for r in results4]) for i in range(4)]
    check(got, packed_reference(*packed_problem(2, 1), "causal"), torch.float32, "packed ring on 4 ranks")


EXPECTED = {
    "one-rank-mask": ("rank 1 of the group refused its input", "mask: got 'tree2'"),
    "one-rank-dims": ("rank 1 of the group refused its input", "q: expected 4 dims"),
    "heads": ("q's 3 heads do not split over 2 ranks",) * 2,
    "kv-heads": ("k/v's 3 heads and 2 ranks: neither divides the other",) * 2,
    "plan-differs": ("plan differs across the ranks",) * 2,
    "plan-mask": ("plan: built for mask 'causal'",) * 2,
    "plan-world": ("plan: built for 3 ranks, but the group has 2",) * 2,
    "plan-rows": ("the plan's shards have",) * 2,
    "head_dim": ("no fagen kernel for the local problem",) * 2,
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_bad_input_raises_on_every_rank(results2, name):
    for r, want in enumerate(EXPECTED[name]):
        message = results2[r]["errors"][name]
        assert message is not None and want in message and "\n" not in message, (name, r, message)
    if name.startswith("one-rank"):  # the refused rank gives its own message
        assert EXPECTED[name][1] in results2[1]["errors"][name]


def test_hybrid_errors(results4):
    for r in results4:
        assert "ulysses_degree 3 x ring_degree None must be the group's 4 ranks" in r["errors"]["ring-degree"]
        assert "layout: got 'striped'" in r["errors"]["hybrid-one-rank"]


# -- the plans, on the host ---------------------------------------------------------------------------------------
def brute_pairs(plan):
    """Visible pairs [rank][source] counted token by token from the plan's rows."""
    doc_of = [d for d, (a, b) in enumerate(zip(plan.cu, plan.cu[1:])) for _ in range(b - a)]
    rows = [set(plan.rows(r)) for r in range(plan.world)]
    owner = {p: r for r in range(plan.world) for p in rows[r]}
    out = [[0] * plan.world for _ in range(plan.world)]
    for i in range(plan.cu[-1]):
        for j in range(plan.cu[doc_of[i]], plan.cu[doc_of[i] + 1]):
            if plan.mask == "none" or j <= i:
                out[owner[i]][owner[j]] += 1
    return out


@pytest.mark.parametrize("balance", cp.BALANCES)
@pytest.mark.parametrize("mask", ["causal", "none"])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_plan_covers_every_row_once_and_counts_pairs(balance, mask, world):
    cu = [0, 3, 50, 51, 51, 90, 200]
    plan = plan_documents(cu, world, balance=balance, mask=mask, min_chunk=4, pad_multiple=2)
    assert sorted(p for r in range(world) for p in plan.rows(r)) == list(range(200))
    assert plan.shard_len % 2 == 0 and all(len(plan.rows(r)) <= plan.shard_len for r in range(world))
    assert plan.pairs() == brute_pairs(plan)
    x = torch.randn(200, 3)
    assert torch.equal(plan.unshard([plan.shard(x, r) for r in range(world)]), x)


def test_balance_on_a_long_tailed_mix():
    """The balance docs/distributed.md quotes: 8 ranks, 1M tokens of log-uniform lengths in [128, 128k]."""
    import math
    import random

    rng, lengths = random.Random(0), []
    while sum(lengths) < 1 << 20:
        lengths.append(min(int(math.exp(rng.uniform(math.log(128), math.log(131072)))), (1 << 20) - sum(lengths)))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    stats = {b: plan_documents(cu, 8, balance=b).balance_stats() for b in cp.BALANCES}
    assert stats["greedy"]["ratio"] >= 0.85 and stats["greedy"]["ring_ratio"] >= 0.85
    assert stats["zigzag"]["ratio"] >= 0.85
    assert stats["contiguous"]["ratio"] < 0.85  # the plain cut is what the balance fixes


def test_plan_errors():
    with pytest.raises(ContextParallelError, match="cu_seqlens: must start at 0"):
        plan_documents([1, 5], 2)
    with pytest.raises(ContextParallelError, match="balance: got 'random'"):
        plan_documents([0, 5], 2, balance="random")
    with pytest.raises(ContextParallelError, match="packed documents take 'none', 'causal'"):
        plan_documents([0, 5], 2, mask="tree")
    with pytest.raises(ContextParallelError, match="expected a tensor with 5 packed rows"):
        plan_documents([0, 5], 2).shard(torch.randn(4, 2), 0)
    with pytest.raises(ContextParallelError, match="init_process_group"):
        cp.ulysses_attention(*(torch.randn(1, 2, 16, D),) * 3)
