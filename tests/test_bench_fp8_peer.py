"""The cudnn-fp8 bench peer (fagen/bench/peer_cudnn_fp8.py): where it runs, what it computes, how it refuses."""

import sys

import pytest
import torch

from fagen.bench import IMPLS, peer_cudnn_fp8, workloads
from fagen.bench.cases import CaseContext, Unavailable, Unsupported
from fagen.bench.impls import case_impls
from fagen.bench.report import relative_target


def _rows():
    return {c.name: c for c in workloads.standard_suite(quick=True)}


def test_the_peer_lists_only_on_the_fp8_forward_rows():
    rows = _rows()
    fp8 = [name for name, c in rows.items() if "cudnn-fp8" in case_impls(c, IMPLS)]
    assert fp8 == ["fwd-fp8-d128-causal-s16k", "fwd-fp8-d128-full-s16k"]
    assert case_impls(rows["fwd-fp8-d128-full-s16k"], IMPLS) == ("fagen", "cudnn-fp8")  # no SDPA peer takes fp8
    assert "cudnn-fp8" not in case_impls(rows["fwd-d128-full-s16k"], IMPLS)


def test_the_fp8_rows_target_cudnn_fp8():
    by = {("fwd-fp8-d128-full-s16k", "cudnn-fp8"): {"tflops": 800.0, "metric": "tflops", "status": "ok"},
          ("fwd-d128-full-s16k", "fagen"): {"tflops": 600.0, "metric": "tflops", "status": "ok"}}
    text = relative_target("fwd-fp8-d128-full-s16k", 880.0, by)
    assert text == "1.47x fwd-d128-full-s16k (>= 1.5 MISSED); 1.10x cudnn-fp8 (>= 1 met)"


def test_per_tensor_requantization_keeps_the_values():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 3, 37, 16, generator=gen) * 40).to(torch.float8_e4m3fn)
    s = 0.5 + torch.rand(3, generator=gen)
    y, d = peer_cudnn_fp8._per_tensor(x, s)
    assert y.dtype == x.dtype and d.shape == (1, 1, 1, 1) and float(d) == pytest.approx(float(s.max()))
    want = x.double() * s.double().view(1, -1, 1, 1)
    got = y.double() * d.double()
    assert torch.allclose(got, want, rtol=2 ** -3, atol=2 ** -9 * float(s.max()))  # one more e4m3 rounding
    assert (got - want).abs().max() > 0  # the head with the largest scale is exact, the others rounded again
    top = int(s.argmax())
    assert torch.equal(got[:, top], want[:, top])


def test_without_the_frontend_the_peer_is_unavailable(monkeypatch):
    case = _rows()["fwd-fp8-d128-causal-s16k"]
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn raises ImportError
    cc = CaseContext.__new__(CaseContext)
    with pytest.raises(Unavailable, match="pip install nvidia-cudnn-frontend"):
        peer_cudnn_fp8.prepare_cudnn_fp8(case, cc)
    with pytest.raises(Unsupported, match="fp8 forward rows only"):
        peer_cudnn_fp8.prepare_cudnn_fp8(_rows()["fwd-d128-full-s16k"], cc)


class _FakeCudnn:
    """nvidia-cudnn-frontend's surface as prepare_cudnn_fp8 uses it; execute() computes what an exact fp8 SDPA
    would on the variant pack (float64 attention of q, k * descale_k, v * descale_v) into O's tensor. `refuse`:
    O dtypes whose graph fails to build, as a cuDNN without that engine does."""

    class data_type:
        FLOAT, FP8_E4M3, BFLOAT16 = "f32", "e4m3", "bf16"

    class heur_mode:
        A, FALLBACK = 0, 1

    def __init__(self, refuse=()):
        self.refuse, self.built = refuse, []

    def create_handle(self):
        return None

    def set_stream(self, **kw):
        pass

    def pygraph(self, **kw):
        fake = self

        class Tensor:
            def __init__(self, name="out"):
                self.name, self.dtype = name, None

            def set_output(self, _):
                return self

            def set_dim(self, _):
                return self

            def set_stride(self, _):
                return self

            def set_data_type(self, t):
                self.dtype = t
                return self

        class Graph:
            def tensor(self, name, **kw):
                return Tensor(name)

            def sdpa_fp8(self, **kw):
                self.kw, self.o = kw, Tensor()
                return self.o, None, Tensor("amax_s"), Tensor("amax_o")

            def validate(self):
                if self.o.dtype in fake.refuse:
                    raise RuntimeError(f"no engine for O in {self.o.dtype}")
                fake.built.append((self.o.dtype, self.kw["use_causal_mask"]))

            def build_operation_graph(self):
                pass

            create_execution_plans = check_support = build_plans = lambda self, *a: None

            def get_workspace_size(self):
                return 8

            def execute(self, pack, workspace, handle=None):
                from fagen.verify import reference
                kw = self.kw
                q, k, v = pack[kw["q"]], pack[kw["k"]], pack[kw["v"]]
                out, _ = reference.attention(q.double(), k.double() * pack[kw["descale_k"]].double().view(()),
                                             v.double() * pack[kw["descale_v"]].double().view(()),
                                             mask="causal" if kw["use_causal_mask"] else "none")
                pack[self.o].copy_(out)
        return Graph()


def _fp8_context(mask="causal"):
    case = workloads.make_case("fwd-fp8-t", head_dim=64, mask=mask, batch=1, heads_q=3, heads_kv=3, seq_q=200,
                               seq_k=200, dtype="fp8_e4m3", peers=False)
    return case, CaseContext(case, torch.device("cpu"), 1)


@pytest.fixture
def fake_cudnn(monkeypatch):
    fake = _FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    return fake


def test_p_scale_holds_what_cudnns_rescale_threshold_lets_p_reach():
    """cuDNN's fp8 forward moves a row's max only past a rise of 4 (cudnn-frontend's fp8_ref.py), so P reaches e^4
    before its 2^-4: scaled by P_SCALE that must stay within e4m3's 448 ([Note] What the cuDNN fp8 peer computes)."""
    import math
    top = math.exp(4.0) * peer_cudnn_fp8.P_SCALE * 2.0 ** -4
    assert top <= 448 and torch.tensor(top).to(torch.float8_e4m3fn).float() < 448 * 1.0001
    assert 2.0 ** -9 / (peer_cudnn_fp8.P_SCALE * 2.0 ** -4) <= 2.0 ** -10  # and P down to 2^-10 of the max is kept


def test_the_peers_check_takes_the_inputs_it_computes_on(fake_cudnn):
    """An exact per-tensor fp8 SDPA passes the bench's check on its own re-quantized K', V' (Prepared.inputs) and
    fails it on the per-head inputs at these tiny shapes: the re-quantization alone moves outputs past the fp8
    tolerance, which is why the check takes the peer's inputs."""
    from fagen.bench.check import check
    for mask in ("causal", "none"):
        case, cc = _fp8_context(mask)
        prepared = peer_cudnn_fp8.prepare_cudnn_fp8(case, cc)
        assert "O in bf16" in prepared.note and fake_cudnn.built[-1] == ("bf16", mask == "causal")
        held = prepared.inputs(cc.sets[0])
        assert held.k.dtype == torch.float8_e4m3fn and not torch.equal(held.k, cc.sets[0].k)
        assert torch.equal(held.scores["k_scale"], cc.sets[0].scores["k_scale"].max().expand(3))
        status, msg, _ = check("cudnn-fp8", prepared, cc)
        assert status == "ok", msg
        assert prepared.fn(cc.sets[0]).dtype == torch.bfloat16
        prepared.inputs = None
        assert check("cudnn-fp8", prepared, cc)[0] == "fail"
        assert cc.references() is cc.references()  # set 0's references stay cached, untouched by the peer's


def test_o_falls_back_to_e4m3_where_cudnn_refuses_bf16(fake_cudnn):
    fake_cudnn.refuse = ("bf16", )
    case, cc = _fp8_context()
    prepared = peer_cudnn_fp8.prepare_cudnn_fp8(case, cc)
    assert "O in e4m3" in prepared.note and "no engine for O in bf16" in prepared.note
    assert prepared.fn(cc.sets[0]).dtype == torch.float8_e4m3fn
    fake_cudnn.refuse = ("bf16", "e4m3")
    with pytest.raises(Unavailable, match="O bf16: .*O e4m3: "):
        peer_cudnn_fp8.prepare_cudnn_fp8(case, cc)
