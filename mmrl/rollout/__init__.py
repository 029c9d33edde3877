"""Rollout workers: policy copies that sample whole groups for the learner, each sample\ntagged with the version of the weights that produced it (docs/architecture.md)."""
