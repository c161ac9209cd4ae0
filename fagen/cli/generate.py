"""`fagen generate`: render one spec, or the default catalog, into source files."""

from __future__ import annotations

from pathlib import Path

import click

from fagen.cli.common import spec_from_options, spec_options

@click.command()
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
    from fagen.codegen.render import generate as render
    from fagen.runtime.cache import write_if_different
    from fagen.spec.manifest import DEFAULT_CATALOG, ManifestError, load_manifest
    from fagen.spec.tables import SOURCE_SUFFIX

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
