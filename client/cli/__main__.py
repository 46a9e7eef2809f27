from tritium.client.cli.main import main

raise SystemExit(main())
