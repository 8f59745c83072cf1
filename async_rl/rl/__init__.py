"""The RL loop: trainer, rollout controller, evaluation, checkpoints, placements."""
