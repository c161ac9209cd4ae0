"""What the commands share: the spec flags, the shape flags, one console, device choice, and bench cases."""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from pathlib import Path

import click

from fagen.spec.axes import Kind, Mask
from fagen.spec.kernel import KernelSpec, SpecError, read_fields

# One line of help per KernelSpec field; the flags themselves (name, type, choices) come from the field and its
# validated enum, so a new spec field fails here, at import, until it has its help line.
_SPEC_HELP = {
    "head_dim": "Head dim: a multiple of 8 from 16 to 256.",
    "mask": "Attention mask.",
    "gqa": "Query heads per KV head (1 = MHA).",
    "dtype": "Element type of q, k, v and out.",
    "direction": "fwd, or bwd for training.",
    "backend": "Emitted language.",
    "kind": "prefill, or decode for short queries.",
    "block_m": "Query rows per program (power of two, 16..256).",
    "block_n": "Keys per inner step (power of two, 16..256).",
    "num_warps": "Warps per program.",
    "num_stages": "Software pipelining depth.",
    "window": "Sliding window (left, right) as runtime arguments.",
    "softcap": "Logit softcap cap * tanh(s / cap).",
    "alibi": "ALiBi slopes, float32 [Hq].",
    "sinks": "Attention sinks, float32 [Hq] (with their gradient).",
    "layout": "dense, varlen (packed sequences) or paged (a paged KV cache).",
    "head_dim_v": "V's and out's head dim (default: --head-dim), e.g. 128 with --head-dim 192 (MLA).",
    "kv_dtype": "An fp8 KV cache read by a decode kernel (default: the cache has --dtype).",
    "shared_kv": "V is the first --head-dim-v columns of the K cache, read once (MLA's absorbed decode).",
    "score_mod": 'A score mod as expression text, e.g. "score + bias[h, q_idx - kv_idx + 4095]" (docs/mods.md).',
    "mask_mod": 'A mask mod as expression text, e.g. "q_idx >= kv_idx" (True: visible).',
    "mod_tensors": "A tensor the mods index, NAME=DTYPE:RANK, e.g. bias=fp32:2 (repeatable).",
    "mod_scalars": "A runtime scalar the mods read, NAME=int|float, e.g. cap=float (repeatable).",
}
# The mods' repeatable declarations: flag (singular) and the parser of one NAME=... text (fagen/mods/text.py).
_DECLS = {"mod_tensors": ("--mod-tensor", "parse_tensor_decl"), "mod_scalars": ("--mod-scalar", "parse_scalar_decl")}


def _decls(field: str):
    def parse(ctx, param, values):
        from fagen.mods import text

        try:
            return tuple(tuple(getattr(text, _DECLS[field][1])(v)) for v in values)
        except SpecError as e:
            raise click.BadParameter(f"got {e.value!r}; {e.allowed}") from None
    return parse
_SPEC_FLAGS = tuple(f.name for f in dataclasses.fields(KernelSpec))


def _spec_option(field: dataclasses.Field):
    """The click option of one KernelSpec field: --x/--no-x for a switch, a choice of its enum, mod text, a
    repeatable mod declaration, else an int."""
    hint = typing.get_type_hints(KernelSpec)[field.name]
    flag, text = "--" + field.name.replace("_", "-"), _SPEC_HELP[field.name]
    if field.name in _DECLS:
        return click.option(_DECLS[field.name][0], field.name, multiple=True, callback=_decls(field.name), help=text)
    if hint == str | None:
        return click.option(flag, type=str, help=text)
    if hint is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", default=None, help=text)
    enums = [t for t in typing.get_args(hint) if isinstance(t, type) and issubclass(t, enum.Enum)]  # X | None
    if isinstance(hint, type) and issubclass(hint, enum.Enum) or enums:
        return click.option(flag, type=click.Choice((enums[0] if enums else hint).choices()), help=text)
    return click.option(flag, type=int, help=text)


def spec_options(fn):
    """The flags that mirror KernelSpec's fields, plus --spec FILE. Shared by every command that takes one spec."""
    options = [
        click.option("--spec", "spec_file", type=click.Path(dir_okay=False, path_type=Path),
                     help="Read the spec from a .toml or .json file (flags given too override its fields)."),
        *(_spec_option(f) for f in dataclasses.fields(KernelSpec)),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(options), fn)


def spec_from_options(spec_file: Path | None, **flags) -> KernelSpec | None:
    """The spec the flags describe, or None when none was given. Errors name the flag or file."""
    given = {k: v for k, v in flags.items() if k in _SPEC_FLAGS and v is not None and v != ()}
    if spec_file is None and not given:
        return None
    fields = {}
    if spec_file is not None:
        try:
            fields = read_fields(spec_file)
        except SpecError as e:
            raise click.ClickException(f"{spec_file}: {e}") from None
    fields.update(given)
    if "head_dim" not in fields:
        raise click.UsageError("--head-dim is required (or give --spec FILE)")
    try:
        return KernelSpec.from_dict(fields)
    except SpecError as e:
        if e.field in given:
            raise click.BadParameter(f"got {e.value!r}; {e.allowed}",
                                     param_hint=f"--{e.field.replace('_', '-')}") from None
        raise click.ClickException(f"{spec_file}: {e}" if spec_file else str(e)) from None



def console(stderr: bool = False):
    """A rich console; piped or captured output gets a wide one, so variant names and rows are never squeezed."""
    from rich.console import Console

    out = Console(stderr=stderr, highlight=False)
    return out if out.is_terminal else Console(stderr=stderr, width=200, highlight=False)


def pick_device(device: str) -> str:
    """--device auto|cuda|cpu, resolved once (fagen.runtime.device); cpu runs kernels through the interpreter."""
    from fagen.runtime.device import DeviceError, prepare_device

    try:
        return prepare_device(device)
    except DeviceError as e:
        raise click.ClickException(str(e)) from None


def shape_options(fn):
    """--batch/--heads/--seq-q/--seq-k: the problem a single spec is measured on."""
    options = [
        click.option("--batch", type=click.IntRange(min=1), help="Batch size (default: batch x seq = 16k)."),
        click.option("--heads", type=click.IntRange(min=1),
                     help="Query heads, a multiple of --gqa (default: 2048 / head_dim)."),
        click.option("--seq-q", type=click.IntRange(min=1), help="Queries per sequence (default 4096; tree: nodes)."),
        click.option("--seq-k", type=click.IntRange(min=1), help="Keys per sequence (default: --seq-q)."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(options), fn)


def cases_from_options(suite, case_names, quick, spec_file, batch, heads, seq_q, seq_k, seed, flags):
    from fagen.bench.serving import serving_suite
    from fagen.bench.workloads import SUITES, case_from_spec

    spec = spec_from_options(spec_file, **flags)
    if suite and spec is not None:
        raise click.UsageError("give either --suite or spec flags (--head-dim ...), not both")
    if suite:
        if any(x is not None for x in (batch, heads, seq_q, seq_k)):
            raise click.UsageError("--batch/--heads/--seq-q/--seq-k shape one spec's case; a --suite has its own")
        cases = {**SUITES, "serving": serving_suite}[suite](quick=quick)
        if case_names:
            names = [c.name for c in cases]
            unknown = [n for n in case_names if n not in names]
            if unknown:
                raise click.BadParameter(f"unknown case(s) {', '.join(unknown)}; the {suite} suite has: "
                                         + ", ".join(names), param_hint="--case")
            cases = [c for c in cases if c.name in case_names]
        return cases
    if spec is None:
        return None
    if case_names:
        raise click.UsageError("--case selects rows of a --suite")
    overrides = [(k, v) for k, v in flags.items() if k in _SPEC_FLAGS and k not in
                 ("head_dim", "mask", "gqa", "dtype", "direction") and v is not None]
    if quick:  # small defaults for what was not given
        tree, decode = spec.mask is Mask.TREE, spec.kind is Kind.DECODE
        seq_q = seq_q or (1 if decode else 24 if tree else 64)
        seq_k = seq_k or (seq_q + 40 if tree else 96 if decode else seq_q)
        batch, heads = batch or 1, heads or 2 * spec.gqa
    try:
        return [case_from_spec(spec, batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k, overrides=overrides,
                               seed=seed)]
    except (ValueError, SpecError) as e:
        raise click.UsageError(str(e)) from None
