"""The overlap engine: two execution contexts and a baton, the micro-batch schedule, delayed weight gradients."""
