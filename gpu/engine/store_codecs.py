"""The engine side of `gpu.engine.connector`: state tensors <-> store object bytes.

A paged KV object holds one chunk of `chunk_tokens` tokens in layout
`paged(order=layer_first, layers, block=page_tokens, kv_heads, head_dim)`: segment (layer, block)
is K then V of `block` tokens, each [block, kv_heads, head_dim]. The engines export and import
KV as [layers, 2 (K, V), tokens, kv_heads, head_dim]; the codec reorders between the two and
converts dtypes with `gpu.formats` (bf16/fp16/fp32 casts, fp8 saturating casts, mxfp8 with its
own per-segment scales). A recurrent object is the fp32 state after a chunk boundary,
[delta layers, heads, v_dim, k_dim] (`gpu.delta_rule`'s S convention), in layout
`recurrent(layers, heads, k_dim, v_dim)`; the connector stores it only together with the
chunk it ends, as one store group (`boundary_only`).

Codecs work on CPU bytes: export moves the encoded object to the CPU; load decodes on the CPU
and the engine's import moves it to its device.
"""

from __future__ import annotations

import torch

from kvstore.client.gpu import host_tensor
from kvstore.gpu.formats import decode_segments, encode_segments
from kvstore.dtypes import DType
from kvstore.errors import InvalidArgument
from kvstore.identity import StateDescriptor
from kvstore.layout import Layout


def paged_layout(num_layers: int, page_tokens: int, kv_heads: int, head_dim: int) -> Layout:
    return Layout.make("paged", order="layer_first", layers=num_layers, block=page_tokens,
                       kv_heads=kv_heads, head_dim=head_dim)


class PagedKVCodec:
    """KV chunks of an engine with `export_kv(id, start, end)` / `import_kv(id, kv, start)`."""

    boundary_only = False

    def __init__(self, engine, descriptor: StateDescriptor, out_dtype: torch.dtype):
        layout = descriptor.layout
        if layout.name != "paged" or layout.param("order") != "layer_first":
            raise InvalidArgument(f"PagedKVCodec needs a layer_first paged layout, got {layout}")
        self.engine = engine
        self.descriptor = descriptor
        self.out_dtype = out_dtype
        p = dict(layout.params)
        self._layers, self._block = int(p["layers"]), int(p["block"])
        self._blocks = layout.num_blocks(descriptor.chunk_tokens)
        self._token_shape = (int(p["kv_heads"]), int(p["head_dim"]))
        self._segment_bytes = layout.segment_bytes(descriptor.dtype)

    def encode(self, kv: torch.Tensor) -> torch.Tensor:
        """[layers, 2, chunk_tokens, kv_heads, head_dim] -> uint8 [object_bytes] (CPU)."""
        segments = kv.reshape(self._layers, 2, self._blocks, self._block, *self._token_shape)
        segments = segments.transpose(1, 2).reshape(self._layers * self._blocks, -1)
        return encode_segments(segments, self.descriptor.dtype).reshape(-1).cpu()

    def decode_segments(self, raw: torch.Tensor) -> torch.Tensor:
        """uint8 [n * segment_bytes] -> [n, 2, block, kv_heads, head_dim] in out_dtype."""
        values = decode_segments(raw.view(-1, self._segment_bytes), self.descriptor.dtype, self.out_dtype)
        return values.view(-1, 2, self._block, *self._token_shape)

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """uint8 [object_bytes] -> [layers, 2, chunk_tokens, kv_heads, head_dim]."""
        segments = self.decode_segments(raw).view(self._layers, self._blocks, 2, self._block,
                                                  *self._token_shape)
        return segments.transpose(1, 2).reshape(self._layers, 2, -1, *self._token_shape)

    def export(self, request_id, start_token: int, end_token: int) -> torch.Tensor:
        return self.encode(self.engine.export_kv(request_id, start_token, end_token))

    def load(self, request_id, start_token: int, end_token: int, data) -> None:
        self.engine.import_kv(request_id, self.decode(host_tensor(data)), start_token)


class RecurrentCodec:
    """fp32 recurrent snapshots of an engine with `export_recurrent(id, boundary)` (None when
    it has no snapshot there) / `import_recurrent(id, state, boundary)`."""

    boundary_only = True

    def __init__(self, engine, descriptor: StateDescriptor):
        layout = descriptor.layout
        if layout.name != "recurrent" or descriptor.dtype is not DType.FP32:
            raise InvalidArgument(f"RecurrentCodec stores fp32 recurrent(...) objects, got "
                                  f"{descriptor.dtype.value} {layout}")
        self.engine = engine
        self.descriptor = descriptor
        p = dict(layout.params)
        self._shape = (int(p["layers"]), int(p["heads"]), int(p["v_dim"]), int(p["k_dim"]))

    def export(self, request_id, start_token: int, end_token: int) -> torch.Tensor | None:
        state = self.engine.export_recurrent(request_id, end_token)
        if state is None:
            return None
        return state.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).reshape(-1)

    def load(self, request_id, start_token: int, end_token: int, data) -> None:
        state = host_tensor(data).view(torch.float32).view(self._shape)
        self.engine.import_recurrent(request_id, state, end_token)
