"""The local protocol's server side: one connection (an asyncio Protocol) per client process
on the Unix socket, decoding typed requests and answering with typed replies."""
