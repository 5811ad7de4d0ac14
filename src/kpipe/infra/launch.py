"""Start a training command on the GPUs a job was given: one process per GPU, FSDP when many.

The rule's `gpu` resource decides the process count. Snakemake's SLURM executor passes that
resource to ``sbatch --gpus`` (the job's total), so `gpus` here is the job's total too; on a
multi-node allocation each node runs one ``accelerate launch`` with ``gpus / nodes``
processes, ranked by SLURM's node id. Configs live in ``workflow/accelerate/``:

- 0 GPUs or 1: the command runs in plain Python (accelerate's single-process path; bf16 on a GPU);
- several GPUs of one node: ``fsdp_single_node.yaml``;
- several nodes: ``fsdp_multi_node.yaml``, started once per node through ``srun``.

``kpipe launch --gpus N --module M -- ARGS`` (``python -m M ARGS`` in each process; M defaults to
``kpipe.cli``) does all of it, holding a GPU lease (:mod:`kpipe.infra.gpu`) on a shared box; ``--print``
shows the command instead of running it. A training rule's job of several processes becomes
``kpipe launch --gpus N --module kpipe.infra.jobs -- SETTINGS_FILE`` (:func:`kpipe.infra.jobs.run_job`).
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import click

DEFAULT_CONFIG_DIR = Path("workflow") / "accelerate"
CONFIG_DIR_ENV = "KPIPE_ACCELERATE_DIR"
DEFAULT_PORT = 29500
PORT_SPAN = 10000  # jobs sharing a node get distinct rendezvous ports: 29500 + job id mod span
FSDP_SINGLE_NODE, FSDP_MULTI_NODE = "fsdp_single_node.yaml", "fsdp_multi_node.yaml"


@dataclass(frozen=True)
class NodeInfo:
    """Where this process sits in a (possibly multi-node) job."""

    nodes: int = 1
    rank: int = 0
    main_address: str = "127.0.0.1"
    main_port: int = DEFAULT_PORT

    def __post_init__(self) -> None:
        if self.nodes < 1 or not 0 <= self.rank < self.nodes:
            raise ValueError(f"node rank {self.rank} is outside a job of {self.nodes} node(s)")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: ``gpu[03-05,09],cpu1`` -> ``gpu03`` (the node that
    hosts rank 0 and the rendezvous)."""
    match = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read a host from SLURM nodelist {nodelist!r}")
    prefix, first_index = match.groups()
    return prefix + (first_index or "")


def free_port() -> int:
    """A port nothing listens on now: two single-node jobs on one box must not share one."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rendezvous_port(job_id: str | None) -> int:
    """The same port on every node of a SLURM job (each computes it alone), distinct per job."""
    return DEFAULT_PORT + int(job_id) % PORT_SPAN if job_id and job_id.isdigit() else free_port()


def node_info_from_env(env: Mapping[str, str]) -> NodeInfo:
    """This node's place in the job, from SLURM's variables; MASTER_ADDR / MASTER_PORT (as set
    by torchrun-style launchers, e.g. Kubernetes' PyTorchJob) take precedence when present."""
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    rank = int(env.get("SLURM_NODEID") or 0)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    address = env.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else "127.0.0.1")
    port = int(env.get("MASTER_PORT") or rendezvous_port(env.get("SLURM_JOB_ID")))
    return NodeInfo(nodes=nodes, rank=rank, main_address=address, main_port=port)


def config_name(nodes: int) -> str:
    return FSDP_MULTI_NODE if nodes > 1 else FSDP_SINGLE_NODE


def gpus_per_node(gpus: int, nodes: int) -> int:
    """The job's GPUs split evenly over its nodes (FSDP wants the same count everywhere)."""
    if gpus < 0:
        raise ValueError(f"gpus must be >= 0, got {gpus}")
    if gpus % nodes:
        raise ValueError(f"{gpus} GPU(s) cannot be split evenly over {nodes} node(s)")
    return gpus // nodes


def default_config_dir() -> Path:
    return Path(os.environ.get(CONFIG_DIR_ENV) or DEFAULT_CONFIG_DIR)


def accelerate_command(gpus: int, args: Sequence[str], node: NodeInfo = NodeInfo(),
                       config_dir: Path | None = None, module: str = "kpipe.cli") -> list[str]:
    """The command this node runs: ``python -m <module> <args>``, under ``accelerate launch`` with one
    process per GPU of the job when it has several (`gpus` is the job's total over all nodes)."""
    per_node = gpus_per_node(gpus, node.nodes)
    if per_node == 0 and node.nodes > 1:
        raise ValueError("a multi-node job needs GPUs")
    if per_node <= 1 and node.nodes == 1:
        # one process: Accelerator() needs no launcher (its precision is kpipe's `mixed_precision`,
        # bf16 on a GPU), and `accelerate launch` would import torch once more before it (seconds per job)
        return [sys.executable, "-m", module, *args]
    config = (config_dir or default_config_dir()) / config_name(node.nodes)
    if not config.is_file():
        raise FileNotFoundError(f"accelerate config {config} not found (set {CONFIG_DIR_ENV} or run from the repository root)")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", str(gpus), "--num_machines", str(node.nodes)]
    if node.nodes > 1:
        command += ["--machine_rank", str(node.rank), "--main_process_ip", node.main_address]
    if gpus > 1:
        command += ["--main_process_port", str(node.main_port)]
    return [*command, "-m", module, *args]


def srun_per_node(gpus: int, args: Sequence[str], nodes: int, module: str = "kpipe.cli") -> list[str]:
    """From the job's first node: one task per node, each running ``kpipe launch --node-task``
    (which reads its own SLURM_NODEID). ``--overlap`` lets the tasks share the resources of the
    job step Snakemake's jobstep executor already holds."""
    return ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--overlap",
            "--kill-on-bad-exit=1", sys.executable, "-m", "kpipe.cli", "launch", "--gpus", str(gpus),
            "--module", module, "--node-task", "--", *args]


def launch_plan(gpus: int, args: Sequence[str], env: Mapping[str, str], node_task: bool,
                config_dir: Path | None = None, module: str = "kpipe.cli") -> list[str]:
    """What `kpipe launch` runs here: the per-node fan-out on a multi-node job's first node,
    else this node's accelerate (or plain Python) command."""
    node = node_info_from_env(env)
    if node.nodes > 1 and not node_task:
        gpus_per_node(gpus, node.nodes)  # fail before srun starts anything
        return srun_per_node(gpus, args, node.nodes, module)
    return accelerate_command(gpus, args, node, config_dir, module)


def launch_command(gpus: int, args: Sequence[str], slots: tuple[int, int] | None = None,
                   module: str = "kpipe.cli") -> list[str]:
    """``kpipe launch --gpus N --module M -- ARGS`` as this interpreter runs it; `slots` (the job's GPU slots,
    slots per GPU) leases that many slots instead of N whole GPUs (kpipe.infra.gpu.gpu_slot_lease)."""
    share = ["--gpu-slots", str(slots[0]), "--slots-per-gpu", str(slots[1])] if slots is not None else []
    return [sys.executable, "-m", "kpipe.cli", "launch", "--gpus", str(gpus), *share, "--module", module, "--", *args]


@click.command("launch", context_settings={"ignore_unknown_options": True})
@click.option("-n", "--gpus", type=int, required=True, help="GPUs of the job (the rule's `gpu` resource; all nodes together)")
@click.option("--gpu-slots", type=click.IntRange(min=0), default=None,
              help="lease this many GPU slots (the rule's `gpu_slots`) instead of N whole GPUs: a share of one GPU")
@click.option("--slots-per-gpu", type=click.IntRange(min=1), default=1, show_default=True, help="slots of one GPU (config gpu.slots_per_gpu)")
@click.option("--config-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help=f"accelerate configs (default: ${CONFIG_DIR_ENV} or {DEFAULT_CONFIG_DIR})")
@click.option("--module", default="kpipe.cli", show_default=True,
              help="what each process runs: python -m MODULE ARGS (kpipe.infra.jobs: a job's settings file)")
@click.option("--node-task", is_flag=True, help="internal: this is one node's task of a multi-node job")
@click.option("--print", "print_only", is_flag=True, help="print the command instead of running it")
@click.argument("args", nargs=-1, required=True, type=click.UNPROCESSED)
def launch(gpus: int, gpu_slots: int | None, slots_per_gpu: int, config_dir: Path | None, module: str,
           node_task: bool, print_only: bool, args: tuple[str, ...]) -> None:
    """Run `python -m MODULE ARGS...` (default: `kpipe ARGS...`) on N GPUs: one process per GPU (FSDP),
    across nodes under SLURM.

    Example: kpipe launch --gpus 8 --module kpipe.infra.jobs -- logs/sft-default.job.json
    """
    try:
        command = launch_plan(gpus, args, os.environ, node_task, config_dir, module)
    except (ValueError, FileNotFoundError) as error:
        raise click.ClickException(str(error)) from None
    if print_only:
        click.echo(shlex.join(command))
        return
    if command[0] == "srun":
        sys.exit(subprocess.call(command))
    from kpipe.infra.gpu import GPULeaseError, job_lease

    slots = (gpu_slots, slots_per_gpu) if gpu_slots is not None else None
    try:
        with job_lease(gpus // node_info_from_env(os.environ).nodes, slots):
            sys.exit(subprocess.call(command))
    except GPULeaseError as error:
        raise click.ClickException(str(error)) from None
