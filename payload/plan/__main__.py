"""`python -m payload.plan`: the plan's command line, as infra runs it (infra/jobfit.py)."""

import sys

from payload.plan.estimate import main

sys.exit(main())
