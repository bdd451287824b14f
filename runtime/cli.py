"""`baton` console script: one subcommand per process kind (docs/architecture.md "CLI contract")."""

from __future__ import annotations

import argparse
import sys


def _model_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="baton model", description="prepare or fetch models")
    sub = parser.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="convert a builtin model into an HF folder (once)")
    prep.add_argument("name", help="builtin model name, e.g. smollm2-135m")
    pull = sub.add_parser("pull", help="download hf://org/name into --dest (needs network)")
    pull.add_argument("uri")
    pull.add_argument("--dest", required=True)
    args = parser.parse_args(argv)
    from runtime import model_store

    if args.action == "prepare":
        name = args.name.removeprefix(model_store.BUILTIN_PREFIX)
        try:
            path = model_store.prepare(name)
        except (ValueError, RuntimeError) as e:
            parser.error(str(e))
        print(path)
        return 0
    return model_store.pull(args.uri, args.dest)


def _lazy(module: str) -> object:
    import importlib

    return importlib.import_module(module).main


COMMANDS = {
    "serve": "runtime.server.main",
    "router": "runtime.router.main",
    "up": "runtime.launch",
    "operator": "baton_operator.main",
    "plan": "baton_operator.planner",  # the P:D planner, offline (docs/rollouts.md)
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: baton {serve,router,up,operator,plan,model} ...\n"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage + "\n" + __doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "model":
        return _model_main(rest)
    if cmd not in COMMANDS:
        print(usage + f"baton: unknown command {cmd!r}", file=sys.stderr)
        return 2
    run = _lazy(COMMANDS[cmd])
    return int(run(rest) or 0)  # type: ignore[operator]


if __name__ == "__main__":
    sys.exit(main())
