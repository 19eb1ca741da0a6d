"""Defaults shared by the migrator (agent/) and the engine: each number lives here once.

engine/ cannot import agent/, so the agent's defaults live on this side of the boundary too.
"""

TIMEOUT_S = 1800            # seconds for one run of infer.sh (migrate, repair, baseline, classify)
DEMO_TIMEOUT_S = 900        # `migrator demo`: a tiny model, so a run that takes longer is stuck
MAX_NEW_TOKENS = 32         # tokens generated per run
INPUT_MAX_LEN = 1024        # prompt budget in tokens, less when the model has fewer positions
MAX_ROUNDS = 5              # repair rounds per migration
MAX_ROUNDS_LIMIT = 20       # the most --max-rounds accepts
WORLD_SIZE = 1              # cards per run
