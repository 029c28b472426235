"""The OpenAI-compatible HTTP API, one module per job.

`requests` / `responses` (the wire models), `validation` (what every body
is checked for before parsing: encodable text, known-but-unimplemented fields, integer bounds),
`chat_messages` (chat messages, tool calls and results included), `errors` (APIError, the OpenAI
error body and the app's handlers), `context` (the request id),
`middleware` (request ids, API key, body size limit, the last-resort 500), `formatting`
(logprobs, usage, SSE framing), `streams` (merging and collecting engine output streams), `core`
(OpenAIServing: the state and checks every endpoint shares), one module per endpoint family
(`completions`, `chat`, `tokenization`, `system`), `tools` (tool calling on chat: the plan of a request's
tools, calls out of each choice's text), and `app` (the FastAPI app that wires them to
routes), `metrics` (/metrics). It depends on the engines only through the client it is given, and
on `cluster.settings` (ServeArgs); Ray Serve lives in `cluster.serve`.
"""
