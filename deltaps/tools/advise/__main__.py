"""`python -m deltaps.tools.advise validate ...` (see the package docstring)."""
from deltaps.tools.advise.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
