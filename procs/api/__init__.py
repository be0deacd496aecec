"""The api process: OpenAI-compatible HTTP in front of the engine.

`app.create_app(engine, config)` builds the aiohttp application around an `engine_client.EngineClient`;
`server.run_api(engine, config)` (blocking, uvloop) or `await server.start_api(engine, config)` serve it.
Modules: schemas (request bodies), validation (-> GenerateRequest), responses (OpenAI shapes),
errors (OpenAI error bodies), metrics (Prometheus), tracking (latencies + request log line).
"""
