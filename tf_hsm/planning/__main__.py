"""python -m tf_hsm.planning --classes 10M --hidden 300 --tokens 3200 [...]

With --verify, the bench's cases measured beside the planner's figures
(`tf_hsm.bench.plan_verify`, a command that imports the planner: the planner's modules
never import it).
"""

import sys

argv = sys.argv[1:]
if "--verify" in argv:
  from tf_hsm.bench import plan_verify
  sys.exit(plan_verify.main([a for a in argv if a != "--verify"]))
else:
  from tf_hsm.planning.cli import main
  sys.exit(main(argv))
