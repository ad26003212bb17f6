"""Training drafters for a target from the target's own outputs (`diffspec train-drafter`)."""
