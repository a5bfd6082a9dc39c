"""The harness: what makes the lesson run for real (config, data, checkpoints, logging, scoring, ...)."""
