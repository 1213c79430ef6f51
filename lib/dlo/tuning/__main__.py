from dlo.tuning.cli import main

raise SystemExit(main())
