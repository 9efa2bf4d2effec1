"""What the dispatcher (``_families.choose``) needs to know about a GPU: its compute
capability, SM count and opt-in shared memory (:class:`DeviceInfo`), read once per device, and
the profiles of GPUs to explain dispatch for without one (:data:`PROFILES`)."""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """The properties of a GPU that dispatch depends on."""
    cc: int            # compute capability as an int: 90 for 9.0
    num_sms: int
    smem_optin: int    # bytes of shared memory one block may opt in to
    name: str = ""

    @property
    def arch(self) -> str:
        """The NVRTC target: ``sm_90a`` on Hopper (wgmma, setmaxnreg), else ``sm_<cc>``."""
        return "sm_90a" if self.cc == 90 else f"sm_{self.cc}"


#: Devices to explain dispatch for without a GPU (``python -m cuflash info --explain --gpu``).
PROFILES = {
    "h200": DeviceInfo(90, 132, 232448, "NVIDIA H200"),
    "h100": DeviceInfo(90, 132, 232448, "NVIDIA H100 SXM"),
    "a100": DeviceInfo(80, 108, 166912, "NVIDIA A100"),
    "l40s": DeviceInfo(89, 142, 101376, "NVIDIA L40S"),
    "v100": DeviceInfo(70, 80, 98304, "NVIDIA V100"),
}


@functools.lru_cache(maxsize=None)
def device_info(device_id: int) -> DeviceInfo:
    """The DeviceInfo of CUDA device ``device_id`` (read once per process)."""
    import cupy
    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(device_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return DeviceInfo(cc=10 * props["major"] + props["minor"],
                      num_sms=props["multiProcessorCount"],
                      smem_optin=int(rt.deviceGetAttribute(
                          rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id)),
                      name=name)
