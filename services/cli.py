"""The `morphling` command: one entry point, a subcommand per process or tool."""

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {
        "bench-engine": "offline generation throughput: our engine vs transformers.generate",
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        parser = argparse.ArgumentParser(prog="morphling")
        sub = parser.add_subparsers(dest="command", required=True)
        for name, help_text in commands.items():
            sub.add_parser(name, help=help_text, add_help=False)
        parser.parse_args(argv[:1])
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command, rest = argv[0], argv[1:]
    if command == "bench-engine":
        from services.executor.engine.bench import main as bench_engine

        bench_engine(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
