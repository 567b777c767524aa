"""The learner: turns scored trajectories into policy updates (GRPO, PPO-clip, SFT, DPO) and checkpoints."""
