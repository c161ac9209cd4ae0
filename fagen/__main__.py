"""`python -m fagen ...`: the fagen command."""

from fagen.cli import main

main()
