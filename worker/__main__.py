import sys

from ps.cli import main

raise SystemExit(main(["worker"] + sys.argv[1:]))
