from ddrl.cli import main

raise SystemExit(main())
