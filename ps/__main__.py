from ps.cli import main

raise SystemExit(main())
