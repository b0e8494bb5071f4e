"""Command-line converters between checkpoint layouts and the random test-checkpoint maker."""
