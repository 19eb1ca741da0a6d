"""Running a recipe: the plan of a run (plan.py) and the stand-in's part in it (standin.py)."""
