"""GenAI semantic-convention dialects read into one shape."""
