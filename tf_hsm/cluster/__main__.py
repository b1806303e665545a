"""python -m tf_hsm.cluster --ps 4 --workers 2 --classes 2M --hidden 300 --tokens 3200"""

import sys

from tf_hsm.cluster.loopback import main

sys.exit(main())
