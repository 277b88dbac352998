"""Conversation keys, transcript assembly and the conversation stage."""
