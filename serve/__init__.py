"""`pagedq serve`: an OpenAI-compatible HTTP front over the queue (chat completions, completions, models, files,
batches), and the Batch API's store that `pagedq batch` shares with it.

The HTTP app needs the `serve` extra (FastAPI, uvicorn): `serve.app:create_app` is its ASGI factory. Everything
else here (config, translation, the batch store) needs only what `producer` needs, so `pagedq batch` runs
without FastAPI.
"""
