"""The whole daemon: start, stop, kill -9, the demo, online evals end to end."""
