"""Downstream consumers of the log: the shard writer, the learner's batch reader, taps and replay."""
