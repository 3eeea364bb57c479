"""`python -m flint` = the `flint` command."""
import sys

from .cli import main

sys.exit(main())
