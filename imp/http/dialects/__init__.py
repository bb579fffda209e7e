"""The generation dialects: each a folder whose `parse.py` reads its wire body into the typed
request and whose `render.py` writes engine Deltas back in its wire format; its `__init__.py`
names the two for the pipeline (`imp.http.pipeline.dialect`). `openai/` holds what the
OpenAI-family dialects share (fields and ranges, wire pieces, logprobs)."""
