"""`andrea serve`: a trained model behind OpenAI's HTTP API (command.py: the command; app.py: the
routes; worker.py: the thread that owns the decoder; schemas.py: the wire format; prompt.py: the
chat template and the answer's text)."""
