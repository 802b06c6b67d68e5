"""The daemon: wiring, tier manager, local service, CLI."""
