"""`python -m fagen.cli ...`: the fagen command."""

from fagen.cli import main

main()
