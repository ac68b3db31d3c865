"""shardwise's one I/O engine: tensors to and from files, off the main thread, past the page cache.

NVMe offload swaps optimizer states and parameters through it (``nvme/``), checkpoint shards are written
and hashed through it (``checkpoint/``), and ZeRO-Inference's disk tier reads through :func:`shared_engine`
(``files/safetensors_io.read_into``). The public face::

    from shardwise.aio import AioConfig, AlignedBuffer, IOEngine, open_file

    with IOEngine(AioConfig(intra_op_parallelism=4)) as io:
        buf = AlignedBuffer(nbytes)            # page-aligned host memory (mmap), a uint8 tensor
        f = open_file(path)                    # O_DIRECT where the filesystem takes it
        io.write(f, buf.tensor).wait()         # raises AioError naming the file on failure
        io.read(f, buf.tensor).wait()
        f.close()

``write_tensor`` / ``read_tensor`` do the same for any contiguous host tensor (through an aligned
bounce buffer when the tensor is not aligned).
"""

from shardwise.aio.buffer import ALIGN, AlignedBuffer, align_up
from shardwise.aio.engine import AioConfig, IOEngine, IOHandle, shared_engine
from shardwise.aio.files import AioError, AioFile, open_file, takes_direct_io
from shardwise.aio.whole import read_tensor, write_tensor

__all__ = ["ALIGN", "AioConfig", "AioError", "AioFile", "AlignedBuffer", "IOEngine", "IOHandle", "align_up",
           "open_file", "read_tensor", "shared_engine", "takes_direct_io", "write_tensor"]
