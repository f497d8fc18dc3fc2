"""The one-machine demo: a DeepSpeed pipeline training on CPU, its bubbles harvested by fill jobs."""
