"""``swarmd`` command line: the command group and ``main``; the commands live in ``cli_run`` (start, demo, sim,
id, keygen), ``cli_inspect`` (status, peers, state, write, doctor, wire) and ``cli_export`` (export).

Exit codes: 0 success (also after a clean SIGINT/SIGTERM shutdown); 1 a runtime failure (port in use, data dir
locked, no node running); 2 bad input (flags, config, addresses). Errors are one line on stderr, no traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

from swarmd.node import __version__, datadir
from swarmd.node.cli_common import EXIT_RUNTIME, EXIT_USAGE, LOOPS, Fail
from swarmd.node.cli_export import export
from swarmd.node.cli_inspect import WIRE_MODULES, doctor, peers, state, status, wire, write
from swarmd.node.cli_run import demo, keygen, show_id, sim, start

__all__ = ["EXIT_RUNTIME", "EXIT_USAGE", "LOOPS", "WIRE_MODULES", "Fail", "cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="swarmd")
def cli() -> None:
    """swarmd: a peer-to-peer daemon for decentralized training."""


for _command in (start, status, peers, state, write, export, demo, sim, wire, show_id, keygen, doctor):
    cli.add_command(_command)


def main(argv: list[str] | None = None, *, on_loops: Callable[[list], None] | None = None) -> None:
    """The ``swarmd`` command. ``on_loops``, for a script that runs the command in its own process: called with the
    training loops ``start`` made from the config, before the node starts them (a test's peer installs its fault
    plan on them: ``tests/byzantine_peer.py``)."""
    try:
        cli.main(args=argv, prog_name="swarmd", standalone_mode=False, obj={"on_loops": on_loops})
    except click.UsageError as e:
        hint = f" (see `swarmd {e.ctx.info_name} --help`)" if e.ctx and e.ctx.parent else ""
        print(f"swarmd: error: {e.format_message()}{hint}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except click.exceptions.Abort:
        sys.exit(130)
    except Fail as e:
        print(f"swarmd: error: {e}", file=sys.stderr)
        sys.exit(e.code)
    except datadir.DataDirError as e:
        print(f"swarmd: error: {e}", file=sys.stderr)
        sys.exit(EXIT_RUNTIME)
    except click.ClickException as e:
        print(f"swarmd: error: {e.format_message()}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
