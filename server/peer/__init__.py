"""The peer protocol between daemons: frames, TCP and UCX transports, authentication, the
peer service (what a peer asks of this node) and the client side of it."""
