"""A dense KV cache that grows by one key a step ([Note] Decode steps in fagen/templates/triton/decode.py.j2): every
step has a new Sk and new k/v tensors (transformers' DynamicCache), yet launches through the kept step, with exactly
the arguments the general path would pass. The launcher and the kernel are fakes (tests/test_launch.py), so this
runs on the CPU; the cost per step is `fagen bench --suite latency`'s growing rows on a GPU."""

import threading

import pytest
import torch

import fagen
from test_launch import STEP_SPECS, FakeKernel, FakeTritonJIT, _raw_stream_of
from _env import DEVICE


class OneFunctionPerCompile(FakeTritonJIT):
    """Each specialisation compiles to its own function handle, so launching the wrong one shows."""

    def __getitem__(self, grid):
        def compile_and_launch(*args, **consts):
            self.compiles.append((grid, args, consts))
            kernel = FakeKernel(self.launcher)
            kernel.function = 1000 + len(self.compiles)
            return kernel
        return compile_and_launch


def _aligned_flat(n):
    t = torch.randn(n + 4)
    return t[(-t.data_ptr() % 16) // 4:][:n]  # a 16-byte aligned start: every view below starts aligned


@pytest.mark.parametrize("which", ["none", "switches"])
def test_growing_cache_replays_steps_with_this_calls_lengths(monkeypatch, which):
    module = fagen.load(STEP_SPECS[which])  # d16, gqa 2, BLOCK_N 16
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_INTERPRET", False), ("_STEPS", {}),
                        ("_WORKSPACES", threading.local()), ("_raw_stream", _raw_stream_of([77]))):
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    split = OneFunctionPerCompile(module._decode_split)
    monkeypatch.setattr(module, "_decode_split", split)
    hkv, d, lengths = 2, 16, range(290, 340)  # 4 key blocks of 16, both Triton classes of Sk (x16 and not)
    q = torch.randn(1, 2 * hkv, 1, d)
    flat_k, flat_v = _aligned_flat(hkv * lengths[-1] * d), _aligned_flat(hkv * lengths[-1] * d)
    out, lse = torch.empty_like(q), torch.empty(1, 2 * hkv, 1)
    masks = module._check_mask_inputs(q, q, None, None, None)
    scores = module._check_scores(q, (40, 0), 30.0, torch.rand(4), torch.rand(4)) if which == "switches" else ()

    def step(sk):  # a fresh contiguous k and v per step, as torch.cat in a DynamicCache makes them
        k, v = flat_k[:hkv * sk * d].view(1, hkv, sk, d), flat_v[:hkv * sk * d].view(1, hkv, sk, d)
        module._launch(q, k, v, 0.25, *masks, *scores, out=out, lse=lse, num_splits=None)
        return split.launcher.calls[-1] if split.launcher.calls else None

    for sk in lengths:  # compile every specialisation first, so that each general path below launches
        step(sk)
    module._STEPS.clear()
    compiles, general = len(split.compiles), 0
    for sk in lengths:
        kept = dict(module._STEPS)
        got = step(sk)  # a step kept by an earlier Sk, or the general path (which keeps one)
        general += len(module._STEPS) > len(kept)
        assert (type(got[13]) is int) == (len(module._STEPS) == len(kept))  # a step passes addresses as ints
        steps, module._STEPS = module._STEPS, {}
        want = step(sk)  # the general path for this Sk, on the same workspace
        module._STEPS = steps
        assert got[:13] == want[:13], sk  # grid, stream, function (the specialisation), flags, metadata
        bad = [name for name, a, b in zip(split.arg_names, got[13:], want[13:]) if _value(a) != _value(b)
               and name not in ("Slopes", "Sinks")]  # fresh tensors per call
        assert not bad and len(got) == len(want), (sk, bad)
    assert len(split.compiles) == compiles  # a new Sk never re-specialises the kernel
    assert general <= 2 * 4  # the general path once per key block and Triton class of Sk, not once per step


def _value(arg):
    """A launch argument as the kernel sees it: a tensor is its address."""
    return (int, arg.data_ptr()) if isinstance(arg, torch.Tensor) else (type(arg), arg)


def test_latency_suite_has_a_growing_row_and_one_summary_table():
    """`fagen bench --suite latency`'s growing case: every call gets the next length; one table closes the run."""
    from fagen.bench import latency

    case = latency.LatencyCase("fixed-growing", 1, 4, 2, 1, 20, head_dim=16, mask="none", grow=True)
    grow = latency.Growing(case, DEVICE, torch.float32, 3)
    pairs = [next(grow) for _ in range(3)]
    assert [k.shape[2] for k, _ in pairs] == [20, 21, 22] and all(k.is_contiguous() for k, _ in pairs)
    assert pairs[1][0].stride(1) == 21 * 16  # strides follow the length, as after torch.cat
    lines = []
    fixed = latency.LatencyCase("fixed", 1, 4, 2, 1, 20, head_dim=16, mask="none")  # the twin of "fixed-growing"
    records = latency.run(DEVICE, torch.float32, calls=2, rounds=1, log=lines.append, cases=(fixed, case))
    assert {r["impl"] for r in records if r["case"] == "fixed-growing"} == {"fagen.attention", "fagen module.forward",
                                                                              "sdpa"}
    table = lines[lines.index(next(x for x in lines if x.startswith("us per call"))):]
    assert [row.split()[0] for row in table[2:]] == ["fixed", "fixed-growing"]
    assert table[1].split()[-3:] == ["attention/sdpa", "attention/fixed-shape", "sdpa"]
    us = {(r["case"], r["impl"]): r["us_per_call"] for r in records}
    twin = us["fixed-growing", "fagen.attention"] / us["fixed", "sdpa"]  # the growing row against its fixed twin's SDPA
    assert table[3].split()[-1] == f"{twin:.2f}x"
