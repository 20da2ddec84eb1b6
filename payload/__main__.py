from payload.cli import main

raise SystemExit(main(None))
