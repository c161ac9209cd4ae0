"""The fagen command line: generate, and the stages built on it."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from fagen import __version__
from fagen.enums import Backend, Direction, DType, Kind, Mask
from fagen.spec import KernelSpec, SpecError, read_fields

_SPEC_FLAGS = ("head_dim", "mask", "gqa", "dtype", "direction", "backend", "kind",
               "block_m", "block_n", "num_warps", "num_stages")


def spec_options(fn):
    """The flags that mirror KernelSpec, plus --spec FILE. Shared by every command that takes one spec."""
    options = [
        click.option("--spec", "spec_file", type=click.Path(dir_okay=False, path_type=Path),
                     help="Read the spec from a .toml or .json file (flags given too override its fields)."),
        click.option("--head-dim", type=int, help="Head dim: a multiple of 8 from 16 to 256."),
        click.option("--mask", type=click.Choice(Mask.choices()), help="Attention mask."),
        click.option("--gqa", type=int, help="Query heads per KV head (1 = MHA)."),
        click.option("--dtype", type=click.Choice(DType.choices()), help="Element type of q, k, v and out."),
        click.option("--direction", type=click.Choice(Direction.choices()), help="fwd, or bwd for training."),
        click.option("--backend", type=click.Choice(Backend.choices()), help="Emitted language."),
        click.option("--kind", type=click.Choice(Kind.choices()), help="prefill, or decode for short queries."),
        click.option("--block-m", type=int, help="Query rows per program (power of two, 16..256)."),
        click.option("--block-n", type=int, help="Keys per inner step (power of two, 16..256)."),
        click.option("--num-warps", type=int, help="Warps per program."),
        click.option("--num-stages", type=int, help="Software pipelining depth."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(options), fn)


def spec_from_options(spec_file: Path | None, **flags) -> KernelSpec | None:
    """The spec the flags describe, or None when none was given. Errors name the flag or file."""
    given = {k: v for k, v in flags.items() if k in _SPEC_FLAGS and v is not None}
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fagen")
def main():
    """fagen: generate specialized attention kernels from a small validated spec."""


@main.command()
@spec_options
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("generated"),
              show_default=True, help="Directory for the rendered sources.")
def generate(spec_file, out_dir, **flags):
    """Render kernel source. With no spec, renders the default catalog.

    \b
    Examples:
      fagen generate --head-dim 64 --mask causal --gqa 4 --dtype bf16 -o out/
      fagen generate --spec my_kernel.toml
      fagen generate            # the default catalog into generated/
    """
    from fagen.manifest import DEFAULT_CATALOG, ManifestError, load_manifest
    from fagen.render import generate as render
    from fagen.tables import SOURCE_SUFFIX
    from fagen.cache import write_if_different

    spec = spec_from_options(spec_file, **flags)
    if spec is None:
        try:
            specs = load_manifest(DEFAULT_CATALOG).specs
        except ManifestError as e:
            raise click.ClickException(str(e)) from None
    else:
        specs = (spec,)
    # Render everything before writing anything: a failure leaves no half-written output.
    rendered = [(out_dir / f"{s.name}{SOURCE_SUFFIX[s.backend]}", render(s)) for s in specs]
    changed = sum(write_if_different(path, text) for path, text in rendered)
    if len(rendered) == 1:
        click.echo(f"wrote {rendered[0][0]}" if changed else f"{rendered[0][0]} is up to date")
    else:
        click.echo(f"rendered {len(rendered)} variants into {out_dir}/ ({changed} changed)")
