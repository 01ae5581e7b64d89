"""The OpenAI-compatible HTTP server (`cachetune serve`): app.py routes, worker.py the engine's thread,
protocol.py the bodies, http.py errors and plumbing, metrics.py Prometheus, text.py streamed text."""
