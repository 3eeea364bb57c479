"""`python -m flint` = the `flint` command."""
import os
import signal
import sys


def _exit_130(signum, frame):
    os._exit(130)


# Ctrl-C while the interpreter imports the CLI (torch, numpy): exit 130 at once, no traceback (a KeyboardInterrupt
# inside their native initialisation aborts the process); the commands get Python's own handling back before they run
signal.signal(signal.SIGINT, _exit_130)
from .cli import main  # noqa: E402

signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(main())
