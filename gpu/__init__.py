"""Kernels that move and convert inference state on the device, each with a torch reference.

Every concept has two modules: `gpu/<name>.py` holds the types and the torch reference (the
specification, runs anywhere), `gpu/<name>_triton.py` holds the Triton kernel behind the same
function signatures. Importing `gpu` or any reference module never imports triton; only the
`*_triton` modules do, and only when first used. Without a GPU the Triton kernels run under
`TRITON_INTERPRET=1` (slowly: tests keep shapes tiny).

- formats: FP8 (e4m3, e5m2; per-tensor and per-block scales) and MXFP8 quantize/dequantize,
  packing to and from the store's segment bytes.
- paged: gather/scatter between an engine's paged KV (or MLA latent) cache and chunk layout.
- sparse: Quest-style page summaries, page scoring, top-k selection with warm start.
- delta_rule: gated delta-rule update of an FP32 recurrent state (Gated DeltaNet, KDA).
"""
