"""Running a recipe: one trial run and its verdict from evidence (trial_run.py)."""
