"""python -m tf_hsm.plan --classes 10M --hidden 300 --tokens 3200 [...]"""

import sys

from tf_hsm.planner import main

sys.exit(main())
