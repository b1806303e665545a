"""python -m tf_hsm.demo [--models ...] [--corpus ...]"""

from tf_hsm.demo.run import main

main()
