"""Host banks: the routed experts in host memory, readable by the CPU executor and the copy
engine alike.

On a GPU the bank's tensors are copied once into the executor's huge-page memory
(`cpu_executor.huge_page_empty`) and registered with CUDA (`cudaHostRegister`), so PCIe
copies read the same bytes the executor streams: the host holds one copy of the experts.
On a CPU-only machine the loaded bank already is host memory and is used as is.

The executor reads most bank formats directly (f32/bf16/f16, NVFP4, MXFP4, FP8 block, GGUF
Q4_0/Q8_0/Q4_K/Q6_K). GGUF MXFP4 blocks (1 E8M0 byte + 16 code bytes, values j and j + 16 in
the low and high nibbles of byte j, codes doubled and the scale halved) are the MXFP4 layout
in another byte order: `executor_bank` repacks them (a second host copy of those layers, logged).
"""

from __future__ import annotations

import logging
import weakref

import gguf
import torch

from freetoken.formats.qweight import QuantWeight
from freetoken.moe.banks import ExpertBank
from freetoken.moe.cpu_executor import GGUF_TYPES, huge_page_empty

logger = logging.getLogger(__name__)
_MXFP4 = int(gguf.GGMLQuantizationType.MXFP4)
_EXECUTOR_FORMATS = ("f32", "bf16", "f16", "nvfp4", "mxfp4", "fp8_block")


def executor_reads(w: QuantWeight) -> bool:
    """Whether the CPU executor computes this bank format as stored."""
    return w.fmt in _EXECUTOR_FORMATS or (w.fmt == "gguf" and w.ggml_type in GGUF_TYPES)


def gguf_mxfp4_to_mxfp4(w: QuantWeight) -> QuantWeight:
    """GGUF MXFP4 `[..., N, K/32 * 17]` -> the `mxfp4` layout (codes `[..., N, K/2]`, low
    nibble = even k; E8M0 scales `[..., N, K/32]`). The same values (see module docstring)."""
    *lead, n, k = w.shape
    blocks = w.data.reshape(*lead, n, k // 32, 17)
    scales = blocks[..., 0].contiguous()
    qs = blocks[..., 1:]  # [..., 16]: value j in the low nibble, j + 16 in the high one
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [..., 32] in k order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantWeight(packed.reshape(*lead, n, k // 2).contiguous(), "mxfp4", tuple(w.shape),
                       scales=scales, source=w.source)


def _executor_weight(w: QuantWeight) -> QuantWeight | None:
    if executor_reads(w):
        return w
    if w.fmt == "gguf" and w.ggml_type == _MXFP4:
        return gguf_mxfp4_to_mxfp4(w)
    return None


def executor_bank(bank: ExpertBank) -> ExpertBank | None:
    """The bank as the CPU executor takes it (repacked where needed), or None when the
    executor has no kernel for its format (the caller falls back to the torch reference)."""
    w13, w2 = _executor_weight(bank.w13), _executor_weight(bank.w2)
    if w13 is None or w2 is None:
        return None
    return ExpertBank(w13, w2, bank.scales.contiguous())


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """t copied into huge-page host memory, registered with CUDA as pinned until the tensor
    is freed (a registration left behind makes the next one at that address fail: error 712,
    seen when a second model was loaded in the same process)."""
    out = huge_page_empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    if out.numel():
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(out.data_ptr(), out.numel() * out.element_size(), 0)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister of a {out.numel() * out.element_size()} B "
                               f"host bank failed (error {int(rc)})")
        weakref.finalize(out, cudart.cudaHostUnregister, out.data_ptr())
    return out


def host_bank(bank: ExpertBank, pin: bool) -> ExpertBank:
    """The bank in host memory: as is on a CPU-only machine, else copied to pinned huge pages
    (tensors already pinned, as when a second engine is built on a loaded model, stay as they
    are). Only routed experts come here, so the device keeps dense weights, KV and slots."""
    def move(t):
        if t is None:
            return None
        t = t.cpu().contiguous()
        return _pinned_copy(t) if pin and not t.is_pinned() else t

    def qw(w: QuantWeight) -> QuantWeight:
        return QuantWeight(move(w.data), w.fmt, w.shape, scales=move(w.scales),
                           ggml_type=w.ggml_type, source=w.source)

    return ExpertBank(qw(bank.w13), qw(bank.w2), move(bank.scales.float()))


def bank_bytes(bank: ExpertBank) -> int:
    return bank.w13.nbytes() + bank.w2.nbytes() + bank.scales.numel() * 4
