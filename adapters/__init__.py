"""Engine plug-ins: vLLM, SGLang and LMCache load these through their own mechanisms.

Each adapter module imports its engine lazily (inside the classes the engine loads), so the
rest of kvstore never needs an engine installed. What they share lives in `adapters.common`:
how an engine's key becomes an object id, and a store handle that never raises on the data
path (a daemon that is down or slow is a miss, counted).
"""
