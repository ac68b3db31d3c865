"""``shardwise.inference``: ZeRO-Inference: generate with models larger than memory, layers streamed.

- ``stream``: load an HF folder on meta, stream its decoder layers from disk or CPU through the
  stage-3 mechanism (``SafetensorsReader``, ``memory_report``; what a streamed model carries:
  ``stream_state_of``).
- ``tensor_parallel``: TP-sliced inference, each rank reading its own slices of the folder.
- ``compat``: :func:`init_inference`, shardwise's keywords and DeepSpeed's call forms (the public one,
  also ``shardwise.init_inference``).
- ``quantize``: group-wise int8 / int4 weight-only copies of a folder (the command line is ``shardwise.cli``).
- ``quantized_linear``: int4 Linear layers kept packed (torch's CPU int4 matmul kernel).
"""

from __future__ import annotations

from shardwise.inference.compat import init_inference
from shardwise.inference.stream import SafetensorsReader, StreamState, memory_report, stream_state_of

__all__ = ["init_inference", "SafetensorsReader", "StreamState", "memory_report", "stream_state_of"]
