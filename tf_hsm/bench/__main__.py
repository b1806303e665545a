"""`python -m tf_hsm.bench`: runs the benchmark's command line."""

import sys

from tf_hsm.bench import cli

sys.exit(cli.main())
