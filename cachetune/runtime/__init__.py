"""The bottom of the engine: KV caches that carry positions, the layer driver, attention, per-layer
loading and sampling. Nothing here knows about chunks, stores, methods or requests."""
