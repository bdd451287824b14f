"""`baton operator [kopf run flags]`: `kopf run` with baton's handlers preloaded."""

from __future__ import annotations

import sys

import click
from kopf import cli as kopf_cli

HANDLERS = "baton_operator.handlers"


def kopf_args(argv: list[str]) -> list[str]:
    """The `kopf run` arguments for the user's flags: ours first, theirs after (they win)."""
    return ["-m", HANDLERS, *argv]


def main(argv: list[str] | None = None) -> int:
    """Run the operator until it is signalled; returns the process exit code."""
    args = kopf_args(sys.argv[1:] if argv is None else list(argv))
    try:
        result = kopf_cli.run.main(args=args, prog_name="baton operator", standalone_mode=False,
                                   auto_envvar_prefix="KOPF_RUN", obj=kopf_cli.CLIControls())
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Abort:
        return 130
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
