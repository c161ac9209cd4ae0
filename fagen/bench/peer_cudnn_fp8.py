"""cuDNN's fp8 attention forward, through nvidia-cudnn-frontend's graph API, as the peer of the fp8 forward rows.

torch's SDPA takes no fp8 tensors, so the rows `fwd-fp8-d128-*` had no peer. cuDNN ships an fp8 SDPA forward
(`graph.sdpa_fp8`); the frontend's wheel (`pip install nvidia-cudnn-frontend`, about 12 MB) drives it with the cuDNN
library torch already loaded. Without the wheel the peer is "unavailable", never an error.

[Note] What the cuDNN fp8 peer computes
- Per-tensor descales only (1x1x1x1 float32 tensors). The bench's fp8 rows carry per-KV-head scales (k_scale,
  v_scale [Hkv], what fagen's forward takes as k_descale / v_descale), so the peer re-quantizes K and V once, outside
  the timing, to one scale each: K' = e4m3(K * s_h / max s), descale max s. That is what a user of a per-tensor API
  would hold, and that second rounding is not small: it moves the rows' peaky scores (q ~ 3 N(0, 1)) by ~0.1, and
  was the whole of the H100 check's failure (2511 causal / 1431 full outputs of a head past the fp8 tolerance, up to
  0.43 off, against the per-head inputs; on the K', V' it computes on cuDNN passes, max error 0.23: O's own e4m3
  rounding). So the peer's check takes its reference from the inputs it computes on (Prepared.inputs: K', V' and
  their descales), which is what checking cuDNN can mean here; fagen's rows are checked on the per-head inputs
  (docs/hopper.md, "fp8 forward, tenth session").
- P is quantized to e4m3 inside cuDNN's kernel at scale_s = P_SCALE (descale_s = 1 / P_SCALE). Newer cuDNN (9.14 and
  later: cudnn-frontend's test/python/sdpa/fp8_ref.py) moves a row's running max only when a block's max exceeds it
  by more than 4 (natural log), so P reaches e^4 = 54.6 before the kernel's own factor 2^-4: e4m3 holds it at
  scale_s <= 448 * 16 / 54.6 = 131 (256 would saturate the largest P; the H100's cuDNN 9.19 reads the same at 64
  and 256, so its kernel stops short of that).
  At scale_s = 1 P flushes below 2^-9 (the ninth session's first try; its failing check, 2524 outputs, was the
  re-quantization as well: 2511 at 256). 64 (cudnn-frontend's test uses 32) keeps P down to 2^-11 of the max and is
  safe under either cuDNN.
- O in bf16 where cuDNN builds it (as fagen's fp8 forward writes it: the same bytes out), else e4m3 (scale_o = 1:
  |O| <= max |V| fits e4m3's range; the note says which). On Hopper it is e4m3: cuDNN builds fp8 SDPA with a 16-bit
  O only on Blackwell (cuDNN >= 9.13).
- The same attention scale as the case (1 / sqrt(d) unless the case sets one), causal top-left (Sq == Sk here).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fagen.bench.cases import CaseContext, Prepared, Unavailable, Unsupported, first_line
from fagen.bench.workloads import BenchCase
from fagen.spec.axes import Direction, DType, Mask

NAME = "cudnn-fp8"
P_SCALE = 64.0  # P in e4m3 at this scale inside cuDNN's kernel ([Note] What the cuDNN fp8 peer computes)
O_TYPES = ("bf16", "e4m3")  # O's dtype: the first cuDNN builds a plan for


def applies(case: BenchCase) -> bool:
    """Whether the peer runs on a row at all (others do not even list it): the fp8 forward rows."""
    return case.dtype is DType.FP8_E4M3 and case.direction is Direction.FWD


def _per_tensor(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (e4m3 [B, H, S, D]) with per-head scales -> (e4m3 x', float32 [1, 1, 1, 1] descale) with x' * d ~ x * s_h."""
    top = scale.float().max()
    ratio = (scale.float() / top).view(1, -1, 1, 1)
    return (x.float() * ratio).to(x.dtype), top.reshape(1, 1, 1, 1).contiguous()


def _graph(cudnn, handle, case: BenchCase, s0, scale: float, o_type: str):
    """The built fp8 SDPA graph and its tensors ((q, k, v, o, amax_s, amax_o), {scale name: tensor})."""
    B, H, S, D = s0.q.shape
    f32, e4m3 = cudnn.data_type.FLOAT, cudnn.data_type.FP8_E4M3
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    dims, strides = [B, H, S, D], [H * S * D, S * D, D, 1]  # O: torch.empty's
    tq, tk, tv = (graph.tensor(name=n, dim=dims, stride=list(t.stride()), data_type=e4m3)
                  for n, t in zip("qkv", (s0.q, s0.k, s0.v)))
    one = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
    sc = {n: graph.tensor(name=n, **one) for n in ("dq", "dk", "dv", "ds", "ss", "so")}
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=tq, k=tk, v=tv, descale_q=sc["dq"], descale_k=sc["dk"], descale_v=sc["dv"], descale_s=sc["ds"],
        scale_s=sc["ss"], scale_o=sc["so"], is_inference=True, attn_scale=scale,
        use_causal_mask=case.mask is Mask.CAUSAL, name="sdpa_fp8")
    o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(
        cudnn.data_type.BFLOAT16 if o_type == "bf16" else e4m3)
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, (tq, tk, tv, o, amax_s, amax_o), sc


def prepare_cudnn_fp8(case: BenchCase, cc: CaseContext) -> Prepared:
    if not applies(case):
        raise Unsupported("cudnn-fp8 runs the fp8 forward rows only")
    if case.mask not in (Mask.NONE, Mask.CAUSAL) or case.seq_q != case.seq_k or case.gqa != 1:
        raise Unsupported("cudnn-fp8 is timed on dense MHA rows with mask none or causal only")
    if any(case_value is not None for case_value in (case.window, case.softcap)) or case.alibi or case.sinks:
        raise Unsupported("cuDNN's fp8 SDPA takes no score switches")
    try:
        import cudnn
    except ImportError:
        raise Unavailable("nvidia-cudnn-frontend is not installed (pip install nvidia-cudnn-frontend)") from None
    s0 = cc.sets[0]
    scale = s0.kwargs.get("scale") or 1.0 / math.sqrt(s0.q.shape[-1])
    errors = []
    try:
        torch.nn.functional.scaled_dot_product_attention(*(s0.q[:1, :1, :16].to(torch.bfloat16),) * 3)  # cuDNN loaded
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(s0.q.device).cuda_stream)
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"cuDNN: {first_line(e)}") from None
    for o_type in O_TYPES:
        try:
            graph, (tq, tk, tv, o, amax_s, amax_o), sc = _graph(cudnn, handle, case, s0, scale, o_type)
            break
        except Exception as e:  # noqa: BLE001 - a cuDNN without the fp8 engine for this shape is a refusal
            errors.append(f"O {o_type}: {first_line(e)}")
    else:
        raise Unavailable(f"cuDNN refused the fp8 graph: {'; '.join(errors)}")
    dev = s0.q.device
    workspace = torch.empty(graph.get_workspace_size(), device=dev, dtype=torch.uint8)
    ones = torch.ones(1, 1, 1, 1, device=dev, dtype=torch.float32)
    p_scale = torch.full((1, 1, 1, 1), P_SCALE, device=dev, dtype=torch.float32)
    p_descale = torch.full((1, 1, 1, 1), 1.0 / P_SCALE, device=dev, dtype=torch.float32)
    amaxes = torch.empty(2, 1, 1, 1, device=dev, dtype=torch.float32)
    mine = {}  # id(input set) -> (the set as this peer holds it, its variant pack, out)

    def held(s):
        """The input set as the peer computes on it: K and V re-quantized once per set, outside the timing, with the
        per-tensor descales as every head's scale ([Note] What the cuDNN fp8 peer computes)."""
        if id(s) not in mine:
            k, dk = _per_tensor(s.k, s.scores["k_scale"])
            v, dv = _per_tensor(s.v, s.scores["v_scale"])
            heads = s.scores["k_scale"].shape[0]
            held_set = dataclasses.replace(s, k=k, v=v, scores={**s.scores, "k_scale": dk.view(1).expand(heads),
                                                                "v_scale": dv.view(1).expand(heads)})
            out = torch.empty(s.q.shape, device=dev, dtype=torch.bfloat16 if o_type == "bf16" else s.q.dtype)
            pack = {tq: s.q, tk: k, tv: v, sc["dq"]: ones, sc["dk"]: dk, sc["dv"]: dv, sc["ds"]: p_descale,
                    sc["ss"]: p_scale, sc["so"]: ones, o: out, amax_s: amaxes[0:1], amax_o: amaxes[1:2]}
            mine[id(s)] = (held_set, pack, out)
        return mine[id(s)]

    def fn(s):
        _, pack, out = held(s)
        graph.execute(pack, workspace, handle=handle)
        return out

    refused = f" (cuDNN refused {errors[0][:80]})" if errors else ""  # Hopper: bf16 O is Blackwell's (cuDNN 9.13)
    note = (f"cuDNN fp8 SDPA (nvidia-cudnn-frontend), per-tensor descales (checked on its re-quantized K, V), "
            f"P at {P_SCALE:g}, O in {o_type}{refused}")
    return Prepared(fn, note=note, inputs=lambda s: held(s)[0])
