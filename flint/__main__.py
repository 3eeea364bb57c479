"""`python -m flint` = the `flint` command."""
import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C before the command started: no traceback
    sys.exit(130)

sys.exit(main())
