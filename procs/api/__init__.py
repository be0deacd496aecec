"""The api process: OpenAI-compatible HTTP in front of the engine.

`app.create_app(engine, config)` builds the aiohttp application around an `engine_client.EngineClient`;
`await server.start_api(engine, config)` serves it (`procs.api.process` runs it under uvloop).
Modules: schemas (request bodies), validation (-> GenerateRequest), responses (OpenAI shapes),
errors (OpenAI error bodies), metrics (Prometheus), tracking (latencies + request log line).
"""
