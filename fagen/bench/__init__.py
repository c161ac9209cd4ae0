"""Benchmarks: workloads, the peers, checking, timing, the isolating runner, reports and the tuner."""

# The implementations a bench run can time, in table order (fagen-nondet: fagen.attention(deterministic=False);
# cudnn-fp8: cuDNN's fp8 SDPA through nvidia-cudnn-frontend, on the fp8 forward rows only; copy: a device copy of a
# decode row's bytes, the reference of the rows whose target is a share of it, [Note] Copy reference in impls.py).
# Here, not in cases.py, so that the CLI can offer them without importing torch.
IMPLS = ("fagen", "fagen-nondet", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "cudnn-fp8", "flex", "copy")
