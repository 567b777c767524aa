"""The Faust stream processors: clean, assemble, score and group rollout events."""
