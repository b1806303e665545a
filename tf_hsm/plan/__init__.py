"""`python -m tf_hsm.plan`: the planner's command line (tf_hsm/planner.py); `tf_hsm.plan`
is the function."""
