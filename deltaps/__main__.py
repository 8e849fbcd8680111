from deltaps.cli import main

raise SystemExit(main())
