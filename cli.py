"""Entry point for running fagen from a checkout: `python cli.py --help`."""

from fagen.cli import main

if __name__ == "__main__":
    main()
