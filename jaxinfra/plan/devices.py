"""The device table: memory, peak FLOP/s, memory bandwidth, the fast-link domain and the compute
efficiency the step-time model assumes, per device kind.

Peak FLOP/s come from jaxinfra/metrics/peak.py (the table MFU uses); memory and bandwidth from
the vendors' datasheets. `efficiency` is the fraction of the dense peak a well-shaped
training step's matmuls reach, stated rather than measured: 0.45 for GPUs (our 1.1B step on
an H200 reached MFU 0.41, benchmarks/RESULTS.md; large published runs report 0.38-0.45),
0.55 for TPUs (MaxText's reported MFUs on v5p), 0.8 for CPU (the `small` step's matmul work
runs at ~0.8 of the same-process 2048^2 matmul probe, benchmarks/RESULTS.md). `--efficiency`
overrides it. The memory bandwidth prices the optimizer update, which is memory-bound, and the
On this machine's CPU, jaxinfra/plan/probes.py measures each kind of the step's work at its own
shapes (`rates`), the memory-bound kinds (elementwise, softmax, loss) included; without probes
those are inside the stated efficiency.

On CPU the "device" is a share of the host: fake devices (--xla_force_host_platform_device_count)
split the host's cores, memory bandwidth and RAM, so the matmul and bandwidth probes (which use
the whole host) and the RAM are divided by the number of devices in the process.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

from jaxinfra.config import ConfigError
from jaxinfra.metrics.peak import PEAK_FLOPS_PER_DEVICE, measure_matmul_flops
from kernels.facts import Target

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    kind: str  # the --device-kind name
    name: str
    memory_bytes: float
    peak_flops: dict[str, float]  # dense FLOP/s by compute dtype ("bfloat16", "float32")
    memory_bandwidth: float  # bytes/s
    domain: int  # devices joined by the fast link (NVLink node, ICI slice)
    fast_link: str  # jaxinfra/plan/links.py names
    slow_link: str
    efficiency: float
    shared_host: int = 1  # CPU: devices sharing the host's cores and RAM
    compute_capability: str | None = None  # CUDA's, for GPUs (kernels/facts.py: Mosaic GPU needs 9.0)
    # Per-device rates by kind measured at the step's shapes (jaxinfra/plan/probes.py; units there);
    # a kind absent here is priced from the datasheet (rate()).
    rates: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def platform(self) -> str:
        return "cpu" if self.kind == "cpu" else "tpu" if self.kind.startswith("tpu") else "gpu"

    @property
    def kernel_target(self) -> Target:
        """The device as the attention kernels' dispatch sees it (`name` is jax's device_kind
        prefix the kernels/block_sizes.py tables key on)."""
        if self.platform == "cpu":
            return Target("cpu")
        return Target(self.platform, self.name, self.compute_capability)

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s of one device for `dtype`, as MFU counts it (jaxinfra/metrics/peak.py)."""
        return self.peak_flops[dtype]

    def throughput(self, dtype: str) -> float:
        """FLOP/s one device's share of the hardware delivers to a training step."""
        return self.peak(dtype) * self.efficiency / self.shared_host

    def rate(self, kind: str, dtype: str) -> float:
        """One device's rate for a kind of work (jaxinfra/plan/probes.py KINDS): the probe's when one
        ran for this dtype, else the datasheet path: dots at the dense peak x efficiency, and the
        memory-bound kinds free (inf), because the stated efficiency is an end-to-end figure (a
        real step's MFU) that already holds their time."""
        measured = self.rates.get(f"{kind}:{dtype}")
        if measured:
            return measured
        if kind in ("matmul", "head", "batched"):
            return self.throughput(dtype)
        return math.inf


def _gpu(kind: str, key: str, memory_gib: float, bandwidth: float, fast: str, slow: str, cc: str) -> DeviceSpec:
    return DeviceSpec(kind, key, memory_gib * GiB, PEAK_FLOPS_PER_DEVICE[key], bandwidth, 8, fast, slow, 0.45,
                      compute_capability=cc)


def _tpu(kind: str, key: str, memory_gib: float, bandwidth: float, slice_chips: int) -> DeviceSpec:
    return DeviceSpec(kind, key, memory_gib * GiB, PEAK_FLOPS_PER_DEVICE[key], bandwidth, slice_chips,
                      f"ici-{kind[4:]}", "dcn", 0.55)


# Memory as the device reports it (nvidia-smi MiB; TPU docs GiB). On GPUs JAX preallocates 75% of
# it unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise; the plan counts the whole device.
DEVICES: dict[str, DeviceSpec] = {
    "h100": _gpu("h100", "NVIDIA H100 SXM", 79.6, 3.35e12, "nvlink4", "ib-ndr", "9.0"),
    "h200": _gpu("h200", "NVIDIA H200", 140.4, 4.8e12, "nvlink4", "ib-ndr", "9.0"),
    "a100": _gpu("a100", "NVIDIA A100", 79.2, 2.04e12, "nvlink3", "ib-hdr", "8.0"),
    "tpu-v5p": _tpu("tpu-v5p", "TPU v5p", 95, 2.765e12, 6144),
    "tpu-v5e": _tpu("tpu-v5e", "TPU v5e", 16, 0.819e12, 256),
    "tpu-v6e": _tpu("tpu-v6e", "TPU v6e", 32, 1.64e12, 256),
}
DEVICE_KINDS: tuple[str, ...] = (*DEVICES, "cpu")


def host_memory_bytes() -> float:
    """This machine's RAM (MemTotal), the memory fake CPU devices share."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@functools.lru_cache(maxsize=4)  # once per process, as the matmul probe
def measure_memory_bandwidth(mib: int = 32, repeats: int = 5) -> float:
    """Bytes/s of an AdamW-like fused elementwise update (4 arrays read, 3 written, `mib` MiB each),
    jitted on the default device; the best of `repeats` runs after a warm-up (as the matmul probe)."""
    import time

    import jax
    import jax.numpy as jnp

    n = mib * 2**18
    p, g, m, v = (jnp.full((n,), 0.5 + i, jnp.float32) for i in range(4))

    @jax.jit
    def update(p, g, m, v):
        m, v = 0.9 * m + 0.1 * g, 0.95 * v + 0.05 * g * g
        return p - 1e-3 * (m / (jnp.sqrt(v) + 1e-8) + 0.1 * p), m, v

    jax.block_until_ready(update(p, g, m, v))
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        jax.block_until_ready(update(p, g, m, v))
        best = min(best, time.perf_counter() - start)
    return 7 * 4 * n / best


def cpu_spec(devices_on_host: int, matmul_flops: float | None = None, bandwidth: float | None = None) -> DeviceSpec:
    """This host as `devices_on_host` fake CPU devices; the peak is the matmul probe and the memory
    bandwidth an elementwise probe (measured now unless given), shared by the devices like the RAM."""
    flops = matmul_flops if matmul_flops is not None else measure_matmul_flops()
    bandwidth = bandwidth if bandwidth is not None else measure_memory_bandwidth()
    return DeviceSpec("cpu", "CPU (matmul probe)", host_memory_bytes(), {"float32": flops, "bfloat16": flops},
                      bandwidth / devices_on_host, devices_on_host, "host", "host", 0.8, shared_host=devices_on_host)


def device_spec(kind: str, devices_on_host: int = 1, memory_gib: float | None = None,
                efficiency: float | None = None, matmul_flops: float | None = None,
                bandwidth: float | None = None) -> DeviceSpec:
    """The spec of a --device-kind, with --hbm-gib / --efficiency overrides; bad values are a ConfigError.
    CPU: `matmul_flops` and `bandwidth` are the host's probes (measured when not given)."""
    if kind not in DEVICE_KINDS:
        raise ConfigError(f"--device-kind={kind!r} is unknown: choose one of {list(DEVICE_KINDS)}")
    spec = cpu_spec(devices_on_host, matmul_flops, bandwidth) if kind == "cpu" else DEVICES[kind]
    if kind == "cpu":  # the RAM is shared, like the cores
        spec = dataclasses.replace(spec, memory_bytes=spec.memory_bytes / devices_on_host)
    if memory_gib is not None:
        if not memory_gib > 0:
            raise ConfigError(f"--hbm-gib={memory_gib} is invalid: must be a positive number of GiB per device")
        spec = dataclasses.replace(spec, memory_bytes=memory_gib * GiB)
    if efficiency is not None:
        if not 0 < efficiency <= 1:
            raise ConfigError(f"--efficiency={efficiency} is invalid: must be in (0, 1]")
        spec = dataclasses.replace(spec, efficiency=efficiency)
    return spec


def with_rates(spec: DeviceSpec, rates: dict[str, float], efficiency: float | None = None) -> DeviceSpec:
    """`spec` with probe rates ("kind:dtype" -> per-device rate); a stated --efficiency keeps the
    dots at peak x efficiency (the probes then price the memory-bound kinds only)."""
    if efficiency is not None:
        rates = {k: v for k, v in rates.items() if k.split(":")[0] not in ("matmul", "head", "batched")}
    return dataclasses.replace(spec, rates={**spec.rates, **rates})


def kind_of(device) -> str:
    """The --device-kind of a jax device (its platform and device_kind), or 'cpu' when unknown."""
    if device.platform == "cpu":
        return "cpu"
    text = device.device_kind.lower()
    for kind, name in (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("tpu-v5p", "v5p"),
                       ("tpu-v5e", "v5 lite"), ("tpu-v5e", "v5e"), ("tpu-v6e", "v6"), ("tpu-v5p", "tpu v5")):
        if name in text:
            return kind
    return "cpu"
