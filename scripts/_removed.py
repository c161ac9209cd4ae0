"""Records of past rounds whose levers were removed: a script that would now time the product under a removed
lever's name stops with one line instead (house, sixteenth session; docs/mods.md, "House (sixteenth session)")."""

from __future__ import annotations

import sys
from collections.abc import Iterable


def refuse_removed(script: str, keys: Iterable[str], doc: str) -> None:
    """Exit with one line when any of `keys` (GluonBackend.variant keys the script's levers set) is no longer one
    of GluonBackend.variant's: the render ignores an unknown key, so the lever's rows would be the product's."""
    from fagen.backends.gluon import GluonBackend

    gone = sorted(set(keys) - set(GluonBackend.variant))
    if gone:
        sys.exit(f"{script}: a record of past rounds (results: {doc}); its levers' variant keys {', '.join(gone)} "
                 "were removed from GluonBackend.variant, so it would time the product under their names: not run")
