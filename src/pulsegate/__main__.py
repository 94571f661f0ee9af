from pulsegate.cli import main

raise SystemExit(main())
