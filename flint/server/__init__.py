"""The server wing: `flint serve`, an OpenAI-compatible HTTP server on the batch-1 engine.

The entry point is flint.server.serve (the command: cmd_serve, its flags, uvicorn and the draining
shutdown); the other modules are its parts, one concern each (serve.py's docstring lists them).
Heavy imports (fastapi, pydantic, uvicorn, torch) happen inside functions, and this file imports
nothing, so building flint's parser does not pay for them.
"""
