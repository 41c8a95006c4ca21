from dump_gen.cli import main

raise SystemExit(main())
