"""`python -m baton_operator [kopf run flags]`, the same as `baton operator`."""

import sys

from baton_operator.main import main

sys.exit(main())
