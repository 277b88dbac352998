"""The review queue, its JSON API and its page (also in a real browser)."""
