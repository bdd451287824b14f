"""The model runner (forward + sampling) the scheduler drives, with its sampler backends and penalties."""
