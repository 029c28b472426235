"""The OpenAI-compatible HTTP API, one module per job.

`settings` (ServeArgs), `requests` / `responses` (the wire models), `errors` (APIError and the
OpenAI error body), `formatting` (logprobs, usage, SSE framing), `streams` (merging and
collecting engine output streams), `core` (OpenAIServing: the state and checks every endpoint
shares), one module per endpoint family (`completions`, `chat`, `tokenization`, `system`), and
`app` (the FastAPI app that wires them to routes). Ray Serve lives in `cluster.serve_app`.
"""
