"""Sampling, the evaluator stage, verdict storage, code checks under time limits."""
