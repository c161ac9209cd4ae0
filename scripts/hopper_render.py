"""Render fagen/templates/gluon/attention.py.j2 (the Hopper forward) with its variant switches, for measurements.

    python scripts/hopper_render.py --head-dim 128 --mask causal --gqa 4 --dtype bf16 -o out.py
    python scripts/hopper_render.py --o-via-q 1 --q-stages 1 --stages 3 --kv-join 2 -o out.py   # 3 K/V slots at d128

The kernel itself is fagen's backend 'gluon' (`fagen generate --backend gluon ...`); its spec fixes the variant
switches at their measured defaults (fagen.backends.GLUON.variant). This script renders the same template
through fagen's environment with the switches set (ping-pong, late releases, Q buffers, register budgets), to
measure them. `render(**config)` returns the source; `load(**config)` renders, writes it to a cache folder and
imports it (Gluon, like Triton, reads the source of its kernels from a file).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # fagen from this checkout


class ConfigError(ValueError):
    """A config field is out of range; the message names the field, the value and what is allowed."""

    def __init__(self, field, value, allowed):
        super().__init__(f"{field}={value!r} is not supported; allowed: {allowed}")


@dataclasses.dataclass(frozen=True)
class HopperConfig:
    head_dim: int = 128
    mask: str = "none"
    gqa: int = 1
    dtype: str = "bf16"
    block_m: int = 64
    block_n: int = 128
    stages: int = 0  # 0: the measured default, 2 at head_dim 128 (shared memory allows no more), 3 at 64
    q_stages: int = 2
    pingpong: int = 0
    v_late: int = 0
    k_late: int = 0
    consumer_regs: int = 240
    loader_regs: int = 24
    o_via_q: int = 0  # 1: O staged through the tile's Q buffer, no O buffer ([Note] O via Q)
    kv_join: int = 0  # 1: one `empty` barrier per slot for K_n and V_n; 2: one per step for K_n and V_{n-1}

    def __post_init__(self):
        if self.stages == 0:
            object.__setattr__(self, "stages", 3 if self.head_dim == 64 else 2)
        checks = [
            ("head_dim", self.head_dim in (64, 128), "64 or 128"),
            ("mask", self.mask in ("none", "causal"), "'none' or 'causal'"),
            ("gqa", isinstance(self.gqa, int) and 1 <= self.gqa <= 64, "an int in [1, 64]"),
            ("dtype", self.dtype in ("bf16", "fp16"), "'bf16' or 'fp16'"),
            ("block_m", self.block_m == 64, "64 (one wgmma M tile per consumer warpgroup)"),
            ("block_n", self.block_n in (64, 128), "64 or 128 (a TMA box side is a power of two)"),
            ("stages", self.stages in (2, 3, 4), "2, 3 or 4"),
            ("q_stages", self.q_stages in (1, 2), "1 or 2"),
            ("pingpong", self.pingpong in (0, 1), "0 or 1"),
            ("v_late", self.v_late in (0, 1), "0 or 1"),
            ("k_late", self.k_late in (0, 1), "0 or 1"),
            ("consumer_regs", self.consumer_regs in range(24, 257, 8), "a multiple of 8 in [24, 256]"),
            ("loader_regs", self.loader_regs in range(24, 257, 8), "a multiple of 8 in [24, 256]"),
            ("o_via_q", self.o_via_q in (0, 1), "0 or 1"),
            ("kv_join", self.kv_join in (0, 1, 2), "0, 1 or 2"),
            ("k_late", not (self.k_late and self.kv_join), "0 with kv_join (the joined barrier places the K release)"),
            ("v_late", not (self.v_late and self.kv_join == 2), "0 with kv_join 2 (the step's one arrive frees V)"),
        ]
        for field, ok, allowed in checks:
            if not ok:
                raise ConfigError(field, getattr(self, field), allowed)
        if self.smem_bytes() > 227 * 1024:
            raise ConfigError("stages", self.stages, f"fewer (or o_via_q 1, q_stages 1): {self.smem_bytes()} bytes "
                              "of shared memory > 227 KB")
        if 2 * self.consumer_regs * 128 + 128 * self.loader_regs > 65536:
            raise ConfigError("consumer_regs", self.consumer_regs, "2*128*consumer + 128*loader <= 65536 registers")

    def smem_bytes(self) -> int:
        """Q (q_stages per warpgroup), O (one per warpgroup, none with o_via_q) and the K/V ring, 2 bytes an
        element, plus 1 KB for barriers and triton's scratch (fagen.backends.gluon.smem_bytes)."""
        from fagen.backends import gluon
        return gluon.smem_bytes(self.head_dim, 2 * self.block_m, self.block_n, self.stages, self.q_stages,
                                self.o_via_q)

    @property
    def name(self) -> str:
        flags = "".join(tag for on, tag in ((self.pingpong, "_pp"), (self.v_late, "_vl"), (self.k_late, "_kl"),
                                            (self.o_via_q, "_oq"), (self.kv_join, f"_j{self.kv_join}")) if on)
        return (f"attn_fwd_hopper_{self.mask}_d{self.head_dim}_m{2 * self.block_m}n{self.block_n}s{self.stages}"
                f"q{self.q_stages}{flags}_g{self.gqa}_{self.dtype}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def spec_of(cfg: HopperConfig):
    """The fagen spec of a config (the variant switches aside); a SpecError names what fagen refuses.

    A ring that fits only without the O buffer (o_via_q) is not a valid spec (the spec's shared memory counts the
    default variant): the spec then keeps the default depth and the template takes the ring depth from kv_stages.
    """
    from fagen.backends import gluon
    from fagen.spec import targets
    from fagen.spec.kernel import KernelSpec

    stages = cfg.stages
    if gluon.smem_bytes(cfg.head_dim, 2 * cfg.block_m, cfg.block_n, stages) > targets.ARCH_SMEM_LIMIT["sm_90"]:
        stages = 2 if cfg.head_dim >= 128 else 3  # backends.GLUON's default ring
    return KernelSpec(head_dim=cfg.head_dim, mask=cfg.mask, gqa=cfg.gqa, dtype=cfg.dtype, backend="gluon",
                      block_m=2 * cfg.block_m, block_n=cfg.block_n, num_stages=stages)


def render(**config) -> str:
    from fagen.codegen import render as fagen_render

    cfg = HopperConfig(**config)
    spec = spec_of(cfg)
    context = fagen_render._context(spec)
    context["gluon"] = {f: getattr(cfg, f) for f in ("q_stages", "pingpong", "v_late", "k_late", "consumer_regs",
                                                     "loader_regs", "o_via_q", "kv_join")}
    context["gluon"]["kv_stages"] = cfg.stages
    return fagen_render.environment().get_template("gluon/attention.py.j2").render(**context)


def load(**config):
    """Render, write under $FAGEN_HOPPER_CACHE (default: a temp folder) and import the module."""
    src = render(**config)
    digest = hashlib.sha256(src.encode()).hexdigest()[:16]
    folder = Path(os.environ.get("FAGEN_HOPPER_CACHE", Path(tempfile.gettempdir()) / "fagen_hopper"))
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{HopperConfig(**config).name}_{digest}"
    path = folder / f"{name}.py"
    if not path.exists() or path.read_text() != src:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(src)
        tmp.replace(path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(HopperConfig):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=field.default)
    parser.add_argument("-o", "--output", help="write here instead of stdout")
    args = vars(parser.parse_args(argv))
    output = args.pop("output")
    try:
        src = render(**args)
    except ConfigError as err:
        parser.error(str(err))
    if output:
        Path(output).write_text(src)
    else:
        sys.stdout.write(src)


if __name__ == "__main__":
    main()
