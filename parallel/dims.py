"""Process-group setup: one place picks the backend, the device and the compute precision."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from model.config import ModelConfig


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(init_timeout_s: float | None = None) -> DistInfo:
    """Join the torchrun job if there is one: NCCL on CUDA devices, gloo on CPU. `init_timeout_s`: the
    process group's timeout until set_collective_timeout (None: torch's default)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world_size == 1:
        return DistInfo(0, 1, 0, device, None)
    if not dist.is_initialized():
        timeout = default_pg_timeout if init_timeout_s is None else timedelta(seconds=init_timeout_s)
        dist.init_process_group(backend=backend, timeout=timeout, store=_attempt_store(world_size, timeout),
                                rank=int(os.environ["RANK"]), world_size=world_size)
    return DistInfo(dist.get_rank(), world_size, local_rank, device, backend)


def _attempt_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """torchrun's agents share their rendezvous TCPStore with the workers (TORCHELASTIC_USE_AGENT_STORE) and
    keep it across restarts (--max-restarts), while the workers write into it without a prefix: a restarted
    group could read the dead group's keys (gloo's peer addresses) and fail to connect, by race (2 restarts of
    4 on this machine's 2-rank test). A prefix per attempt (TORCHELASTIC_RESTART_COUNT) gives each its own
    keys. None where the workers' store is their own (env:// as before)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


PRECISIONS = ("auto", "bf16", "fp32")


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """train.precision -> the dtype the forward computes in. bf16: autocast, and FSDP2 gathers bf16
    parameters (reducing gradients in fp32); the optimizer's master weights stay fp32 in every precision.
    auto: bf16 on CUDA, fp32 elsewhere."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


def set_collective_timeout(seconds: float) -> None:
    """Every process group of this rank (the default one, the mesh's, the checkpoint writer's) times out a
    collective after `seconds`: a rank that never arrives ends the job with a timeout error instead of
    hanging it. The trainer sets it after the first step, which may take longer (compilation, lazy init).
    torch has no public setter; torchtitan calls this one the same way."""
    if not dist.is_initialized():
        return
    timeout = timedelta(seconds=seconds)
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Leave together: a rank tearing down gloo while a peer still has traffic in flight has aborted at
    exit ("terminate called without an active exception") under load."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


@dataclass(frozen=True)
class Degrees:
    """How many ranks each parallelism spans: the one description of a layout. The trainer reads it from
    `parallel.*` (`Degrees.of`), `build_layout` builds the mesh from it, and the memory planner plans and
    names it. `dp` counts replicas; fsdp ranks shard one replica and see different data too, so the
    ranks splitting a batch are `data_ranks = dp * fsdp`; ep is carved out of dp; vp is the virtual
    pipeline stages (chunks) per pipeline rank; cp ranks hold contiguous slices of the same sequences."""
    dp: int = 1
    fsdp: int = 1
    pp: int = 1
    vp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1

    @classmethod
    def of(cls, parallel, world_size: int) -> Degrees:
        """From a `parallel` config (fields dp, fsdp, cp, pp, vp, tp, ep); dp=None takes what fsdp, cp, pp and
        tp leave of `world_size`."""
        others = parallel.fsdp * parallel.cp * parallel.pp * parallel.tp
        dp = parallel.dp if parallel.dp is not None else max(1, world_size // others)
        return cls(dp, parallel.fsdp, parallel.pp, parallel.vp, parallel.tp, parallel.ep, parallel.cp)

    @property
    def world(self) -> int:
        return self.dp * self.fsdp * self.cp * self.pp * self.tp

    @property
    def data_ranks(self) -> int:
        return self.dp * self.fsdp

    @property
    def sequence_ranks(self) -> int:
        """Ranks holding slices of one sequence: cp's slices, each cut again by tp's sequence parallelism."""
        return self.cp * self.tp

    def name(self) -> str:
        """'dp2_fsdp2_pp2' (the degrees above 1, in mesh order), 'single' for one rank."""
        parts = [f"{k}{getattr(self, k)}" for k in MESH_ORDER if getattr(self, k) > 1]
        return "_".join(parts) or "single"

    def problems(self, model: ModelConfig, seq_len: int, micro_batch: int | None = None,
                 global_batch: int | None = None) -> list[str]:
        """Why this layout cannot train `model` on sequences of `seq_len` tokens, one line each (empty: it
        can). The one statement of the layout's rules: the trainer's config check, the memory planner and its
        layout search all ask it. The batch rules apply when micro_batch and global_batch are given."""
        bad = [f"parallel.{key}={getattr(self, key)} must be positive" for key in MESH_ORDER if getattr(self, key) < 1]
        if bad:
            return bad
        for key, value in (("model.n_heads", model.n_heads), ("model.dense_inter", model.dense_inter),
                           ("train.seq_len", seq_len)):
            if value % self.tp:
                bad.append(f"{key}={value} must be divisible by parallel.tp={self.tp} (heads, channels and the "
                           "sequence are split tp ways)")
        if self.cp > 1:
            bad += self._context_problems(model, seq_len)
        if model.moe.n_routed_experts % self.ep:
            bad.append(f"model.moe.n_routed_experts={model.moe.n_routed_experts} must be divisible by "
                       f"parallel.ep={self.ep}")
        if self.pp * self.vp > model.n_blocks:
            bad.append(f"parallel.pp * parallel.vp = {self.pp * self.vp} chunks is more than model.n_blocks="
                       f"{model.n_blocks} transformer blocks")
        if self.dp % self.ep:
            bad.append(f"parallel.ep={self.ep} must divide the data-parallel size dp={self.dp}: expert-parallel "
                       "groups are carved out of the data-parallel ranks")
        if micro_batch is not None and global_batch is not None:
            bad += self._batch_problems(micro_batch, global_batch)
        return bad

    def _context_problems(self, model: ModelConfig, seq_len: int) -> list[str]:
        if seq_len % self.sequence_ranks:
            return [f"train.seq_len={seq_len} must be divisible by parallel.cp * parallel.tp = {self.cp} * {self.tp} "
                    "(every rank holds an equal slice of each sequence)"]
        piece, history = seq_len // self.cp, model.kda.conv_kernel - 1
        if piece % 2:
            return [f"train.seq_len / parallel.cp = {piece} tokens per slice must be even: MLA balances its causal "
                    "work over 2 * cp half-slices"]
        if piece < history:
            return [f"train.seq_len / parallel.cp = {piece} tokens per slice is fewer than the {history} a KDA short "
                    "convolution reads from the slice before (model.kda.conv_kernel - 1)"]
        return []

    def _batch_problems(self, micro_batch: int, global_batch: int) -> list[str]:
        if global_batch % (micro_batch * self.data_ranks):
            return [f"train.global_batch={global_batch} must be a multiple of train.micro_batch * dp * fsdp = "
                    f"{micro_batch} * {self.dp} * {self.fsdp}"]
        microbatches = global_batch // (micro_batch * self.data_ranks)
        if self.pp > 1 and self.vp > 1 and microbatches % self.pp:
            return [f"interleaved pipelining needs the microbatches per step (train.global_batch / (train.micro_batch "
                    f"* dp * fsdp) = {microbatches}) to be a multiple of parallel.pp={self.pp}"]
        return []


MESH_ORDER = ("dp", "fsdp", "cp", "pp", "vp", "tp", "ep")


@dataclass(kw_only=True)
class Layout:
    """Where this rank sits in the (dp, fsdp, cp, pp, tp) mesh of `degrees`, and the groups it talks to.

    `data_ranks` is the ranks that see different data (replicas times fsdp shards;
    `data_group` links them, `data_rank` picks this rank's share of a batch). FSDP2 shards parameters,
    gradients and optimizer state over the `fsdp` ranks of one replica (`fsdp_mesh`: 1-D, or 2-D
    (replica, shard) for HSDP), and over the cp ranks too. Expert parallelism splits each dp group into
    ep-sized groups that share one copy of the routed experts (`ep_group`); `expert_dp_group` links the
    ranks holding the same expert shard. Context parallelism gives the `cp` ranks of `cp_group` slice
    `cp_rank` of the same sequences; a parameter's gradient is averaged over `dp_cp_group`, the data
    ranks times the cp ranks (the same ranks as `data_group` without cp)."""
    degrees: Degrees = Degrees()
    data_rank: int = 0
    pp_rank: int = 0
    tp_rank: int = 0
    ep_rank: int = 0
    data_group: object | None = None
    pp_group: object | None = None
    tp_group: object | None = None
    ep_group: object | None = None
    expert_dp_group: object | None = None
    mesh: object | None = None  # DeviceMesh (dp_rep, ep, fsdp, cp, pp, tp); checkpoints place shards on it
    fsdp_mesh: object | None = None  # what fully_shard gets: ("fsdp",) or ("dp_rep", "fsdp") for HSDP
    cp_rank: int = 0
    cp_group: object | None = None
    dp_cp_group: object | None = None

    @property
    def data_ranks(self) -> int:
        return self.degrees.data_ranks

    @property
    def fsdp(self) -> int:
        return self.degrees.fsdp

    @property
    def pp(self) -> int:
        return self.degrees.pp

    @property
    def tp(self) -> int:
        return self.degrees.tp

    @property
    def ep(self) -> int:
        return self.degrees.ep

    @property
    def cp(self) -> int:
        return self.degrees.cp

    @property
    def dp_cp(self) -> int:
        return self.degrees.data_ranks * self.degrees.cp


_LAYOUTS: dict[tuple, Layout] = {}


def build_layout(info: DistInfo, degrees: Degrees) -> Layout:
    """The layout of `degrees`, built once per process group: a process that trains several runs (scripts.compare,
    the tests' launches) reuses its groups: each gloo group runs an I/O thread of its own, and ranks holding
    ~80 of them spent most of their CPU time in epoll_wait (strace, 8 ranks on 2 cores)."""
    if info.world_size == 1:
        return Layout()
    key = (dist.group.WORLD, info.device.type, degrees)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = _new_layout(info, degrees)
    return _LAYOUTS[key]


def _new_layout(info: DistInfo, degrees: Degrees) -> Layout:
    """A (dp, fsdp, cp, pp, tp) device mesh over all ranks, tp innermost so tensor-parallel peers are
    neighbours, then cp, and fsdp inside dp so a replica's shards are too. dp is split as (dp / ep, ep)
    for the experts. FSDP shards over fsdp x cp (torchtitan's dp_shard_cp): cp ranks hold the same
    parameters and average their gradients, as data ranks do, experts' included."""
    from torch.distributed.device_mesh import init_device_mesh

    dp, fsdp, cp, pp, tp, ep = degrees.dp, degrees.fsdp, degrees.cp, degrees.pp, degrees.tp, degrees.ep
    mesh = init_device_mesh(info.device.type, (dp // ep, ep, fsdp, cp, pp, tp),
                            mesh_dim_names=("dp_rep", "ep", "fsdp", "cp", "pp", "tp"))
    data_mesh = mesh["dp_rep", "ep", "fsdp"]._flatten("dp")
    dp_cp_group = mesh["dp_rep", "ep", "fsdp", "cp"]._flatten("dp_cp").get_group() if cp > 1 else data_mesh.get_group()
    # FSDP shards over fsdp x cp (one name for both, so a tp checkpoint can pair it with tp).
    shard_dim = mesh["fsdp", "cp"]._flatten("fsdp_cp") if cp > 1 else mesh["fsdp"]
    shard_name = shard_dim.mesh_dim_names[0]
    fsdp_mesh, expert_dp_group = None, mesh.get_group("dp_rep")
    if ep > 1:
        # The ranks holding the same experts (replicated, not fsdp-sharded): dp_rep x fsdp x cp of one ep index.
        expert_dp_group = (mesh["dp_rep", "fsdp", "cp"]._flatten("expert_dp").get_group() if fsdp * cp > 1
                           else mesh.get_group("dp_rep"))
    if fsdp > 1 and ep > 1:
        # fsdp x ep: the shards' replicas are all dp ranks, ep ones included.
        mesh["dp_rep", "ep"]._flatten("replica")  # names the replicas on the root mesh
        fsdp_mesh = mesh["replica", shard_name]
    elif fsdp > 1:
        fsdp_mesh = mesh["dp_rep", shard_name] if dp > 1 else shard_dim
    return Layout(degrees=degrees, data_rank=data_mesh.get_local_rank(), pp_rank=mesh.get_local_rank("pp"),
                  tp_rank=mesh.get_local_rank("tp"), ep_rank=mesh.get_local_rank("ep"), data_group=data_mesh.get_group(),
                  pp_group=mesh.get_group("pp"), tp_group=mesh.get_group("tp"), ep_group=mesh.get_group("ep"),
                  expert_dp_group=expert_dp_group, mesh=mesh, fsdp_mesh=fsdp_mesh, cp_rank=mesh.get_local_rank("cp"),
                  cp_group=mesh.get_group("cp"), dp_cp_group=dp_cp_group)
