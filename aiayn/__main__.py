"""`python -m aiayn` runs the command-line tool (also under `torchrun`)."""

from aiayn.cli.entry import main

if __name__ == "__main__":
    raise SystemExit(main())
