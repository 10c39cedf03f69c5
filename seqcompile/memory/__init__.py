"""Stage 5, plan memory: what the forward keeps for the backward and what it recomputes."""
