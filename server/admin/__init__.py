"""The REST admin API (aiohttp): routes, listings, OpenAPI, Prometheus metrics, and the
client the commands use to call it."""
