"""One config on one device count: the resolved mesh and every per-device size the planner needs.

`Layout.of(cfg, devices)` runs the config validation for that device count first, so a layout
the trainer would refuse is refused here with the same one-line `ConfigError`. Everything
else is arithmetic on the config: no devices, no compile.

Per-device sizes follow the activation rules of sharding/rules.py: the batch is split over
data x fsdp x expert, the sequence over context (and, for the residual stream under sequence
parallelism, over tensor too), heads, MLP width and vocabulary over tensor; a dimension a mesh
axis does not divide stays whole (as `logical_to_mesh` drops that axis).
"""

from __future__ import annotations

import dataclasses
import functools

from jaxinfra.config import Config, ConfigError, pipeline_sizes, validate, validate_layout
from kernels import facts as kernel_facts
from kernels.masks import make_band
from models.config import ModelConfig
from sharding.mesh import MeshError, resolve_mesh_sizes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
F32_BYTES = 4


def split(size: int, ways: int) -> int:
    """`size` over `ways` devices, or whole when `ways` does not divide it (logical_to_mesh's rule)."""
    return size // ways if ways > 1 and size % ways == 0 else size


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: per-layout caches key on it
class Layout:
    cfg: Config
    devices: int
    sizes: dict[str, int]  # resolved mesh axis sizes (ICI x DCN)
    backend: str = "gpu"  # "cpu", "gpu" or "tpu": what XLA lowers some ops to differs (see activations.py)
    # The device kind the attention kernels dispatch on (kernels/facts.py); None: the backend alone.
    target: kernel_facts.Target | None = None

    @classmethod
    def of(cls, cfg: Config, devices: int, backend: str = "gpu", base_checked: bool = False,
           target: kernel_facts.Target | None = None) -> Layout:
        """The layout, or the ConfigError the trainer would raise for this device count.

        base_checked: `cfg` differs from a config `validate` accepted only in its layout (mesh,
        parallelism, remat, accumulation), so only those checks run (`validate_layout`).
        target: the device (kind, compute capability) `model.attention_impl` resolves on."""
        if devices < 1:
            raise ConfigError(f"--devices={devices} is invalid: must be a positive integer")
        (validate_layout if base_checked else validate)(cfg, devices)
        try:
            sizes = resolve_mesh_sizes(cfg.mesh, devices)
        except MeshError as e:  # pragma: no cover - validate() already resolved the same sizes
            raise ConfigError(str(e)) from None
        return cls(cfg, devices, sizes, backend, target)

    # ------------------------------------------------------------ mesh
    @property
    def model(self) -> ModelConfig:
        return self.cfg.model

    @property
    def tp(self) -> int:
        return self.sizes["tensor"]

    @property
    def pp(self) -> int:
        return self.sizes["stage"]

    @property
    def ep(self) -> int:
        return self.sizes["expert"]

    @property
    def cp(self) -> int:
        return self.sizes["context"]

    @property
    def batch_shards(self) -> int:
        return self.sizes["data"] * self.sizes["fsdp"] * self.sizes["expert"]

    @functools.cached_property
    def pipeline(self) -> tuple[int, int]:
        """(microbatches, repeats) of the pipeline; (1, 1) without one."""
        return pipeline_sizes(self.cfg, self.pp) if self.pp > 1 else (1, 1)

    # ------------------------------------------------------------ per-device activation sizes
    @property
    def accum_rows(self) -> int:
        """Rows of one gradient-accumulation step on this device (what the head and loss see)."""
        t = self.cfg.train
        return t.batch_size // t.grad_accum_steps // self.batch_shards

    @property
    def rows(self) -> int:
        """Rows one layer processes at a time on this device: a pipeline microbatch, or accum_rows."""
        return self.accum_rows // self.pipeline[0]

    @property
    def seq(self) -> int:
        """Sequence positions per device (split over context)."""
        return split(self.cfg.train.seq_len, self.cp)

    @property
    def kv_seq(self) -> int:
        """Key positions each local query is scored against in one attention call: all of them,
        except under ring attention, which calls the kernel once per visiting K/V block and whose
        custom VJP recomputes each step's piece (sharding/ring.py): one block's keys at a time."""
        if self.cp > 1 and self.cfg.parallelism.context_impl == "ring":
            return self.seq
        return self.cfg.train.seq_len

    @property
    def tokens(self) -> int:
        """Tokens per layer call per device (rows x seq)."""
        return self.rows * self.seq

    @property
    def residual_split(self) -> int:
        """Extra split of the residual stream: tensor under sequence parallelism."""
        sp = self.cfg.parallelism.sequence_parallel and self.seq % self.tp == 0
        return self.tp if sp else 1

    @property
    def heads(self) -> int:
        return split(self.model.num_heads, self.tp)

    @property
    def kv_heads(self) -> int:
        return split(self.model.kv_heads, self.tp)

    @property
    def mlp(self) -> int:
        return split(self.model.mlp_dim, self.tp)

    @property
    def vocab(self) -> int:
        return split(self.model.vocab_size, self.tp)

    @functools.cached_property
    def attention_impl(self) -> str:
        """What `model.attention_impl` runs as in the train step on this layout's device, asked of
        the kernels (kernels/facts.py: `auto` by their table, Mosaic GPU's fallback). The model's
        call: causal, the batch's segment ids (always passed in training), no softcap, q and k/v
        in the compute dtype; under context parallelism the local queries against all keys (ring
        attention: against one visiting block, with a (q, kv) segment pair; it runs cuDNN, which
        returns no log-sum-exp, as `auto`: sharding/ring.py). Attention sinks: as without them, but never
        cuDNN (they need the log-sum-exp)."""
        m = self.model
        impl, segments = m.attention_impl, "shared"
        if self.cp > 1 and self.cfg.parallelism.context_impl == "ring":
            impl, segments = ("auto" if impl == "cudnn" else impl), "pair"
        d_qk, d_v = ((m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim) if m.is_mla
                     else (m.resolved_head_dim, m.resolved_head_dim))
        call = kernel_facts.Call(m.dtype, d_qk, d_v, make_band(True, None, self.seq, self.kv_seq), segments,
                                 sinks=m.attention_sinks)
        return kernel_facts.resolve(impl, self.target or kernel_facts.Target(self.backend), call)[0]

    @property
    def attention_keeps(self) -> kernel_facts.Keeps:
        """What that implementation holds for its backward (scores or only its lse)."""
        return kernel_facts.KEEPS[self.attention_impl]

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.model.dtype]

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.model.param_dtype]

    # ------------------------------------------------------------ layers on this device
    @functools.cached_property
    def layer_counts(self) -> tuple[int, int, int]:
        """(dense layers outside the pipeline, dense layers in it, MoE layers in it) per device.

        Without a pipeline every layer is "in it" (one device holds all). A dense model's
        layers split over stages; a MoE model pipelines its periods and runs the dense prefix
        before the pipeline on every stage (docs/architecture.md)."""
        m, stages = self.model, self.pp
        flags = m.moe_layer_flags()
        dense, sparse = flags.count(False), flags.count(True)
        if stages == 1:
            return 0, dense, sparse
        if not m.is_moe:
            return 0, dense // stages, 0
        prefix = m.moe_first_dense_layers
        return prefix, (dense - prefix) // stages, sparse // stages

    def with_config(self, cfg: Config) -> Layout:
        return Layout.of(cfg, self.devices, self.backend, target=self.target)
