"""The writer: commits, acknowledgements, queue limits, the file."""
