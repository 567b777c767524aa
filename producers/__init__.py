"""Rollout workers: task sources, the policy, the sandbox, and the events they publish."""
