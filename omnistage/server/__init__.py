"""The OpenAI-compatible HTTP server (`omnistage serve`)."""
