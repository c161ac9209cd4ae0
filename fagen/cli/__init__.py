"""The fagen command line. One module per command; `fagen --help` imports none of them, and no torch.

    fagen generate   render sources              fagen/cli/generate.py
    fagen compile    one spec, ahead of time     fagen/cli/build.py
    fagen build      a manifest, in parallel     fagen/cli/build.py
    fagen verify     the property suite          fagen/cli/verify.py
    fagen bench      fagen against the peers     fagen/cli/bench.py
    fagen tune       search launch configs       fagen/cli/tune.py
"""

from __future__ import annotations

import importlib

import click

from fagen import __version__

# command name -> (module, attribute, one-line summary shown by `fagen --help` without importing the module)
COMMANDS = {
    "generate": ("fagen.cli.generate", "generate", "Render kernel source: one spec, or the default catalog."),
    "compile": ("fagen.cli.build", "compile_", "Compile one spec ahead of time for each arch (no GPU needed)."),
    "build": ("fagen.cli.build", "build_", "Compile every variant of a manifest, in parallel, cached."),
    "verify": ("fagen.cli.verify", "verify_command", "Property-based verification against a float64 reference."),
    "bench": ("fagen.cli.bench", "bench", "Time fagen's kernels and the peers on the same inputs."),
    "tune": ("fagen.cli.tune", "tune", "Search launch configs on a GPU; store the winners."),
}


class LazyGroup(click.Group):
    """Imports a command's module only when that command runs (or its --help is asked for)."""

    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx, formatter):
        with formatter.section("Commands"):
            formatter.write_dl([(name, summary) for name, (_, _, summary) in COMMANDS.items()])

    def invoke(self, ctx):
        # A file fagen cannot read or write (a read-only cache, an unwritable -o) is one line and exit 1.
        from fagen.files import CacheError

        try:
            return super().invoke(ctx)
        except CacheError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            if e.filename is None:
                raise
            raise click.ClickException(f"{e.filename}: {e.strerror or e}") from None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.version_option(__version__, prog_name="fagen")
def main():
    """fagen: generate specialized attention kernels from a small validated spec."""


__all__ = ["main", "COMMANDS"]
