from asyncengine.cli.main import main

raise SystemExit(main())
