import sys

from deltaps.cli import main

raise SystemExit(main(["worker"] + sys.argv[1:]))
