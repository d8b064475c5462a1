"""Training: the engine (one rank's step), the loop, LR schedule, precision, logging."""
