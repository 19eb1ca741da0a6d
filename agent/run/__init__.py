"""Running a recipe: the plan of a run (plan.py), the stand-in's part in it (standin.py), one trial run
and its verdict from evidence (trial_run.py)."""
