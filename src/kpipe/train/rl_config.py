"""RL settings: `RLConfig`, the hyper-parameters (the paper's defaults, the paper's ablations as named
overlays), and `IterationSettings`, everything one iteration is run with (`kpipe.train.rl.run_iteration`).

`RLConfig` holds everything one RL iteration depends on. Defaults are the paper's (§4–6,
facts.md); where only the released code says something (hkust-nlp/KernelGYM on verl), the
default follows the code and the comment says so. `ABLATIONS` are the paper's named
variants (Figures 4, 5, 8 and Appendix D) as overlays on any base config, so an ablation
is a `run` of the same DAG that differs in exactly the keys listed.
"""

from __future__ import annotations

import hashlib
import math
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kpipe.train.algos import (
    ADVANTAGES,
    REWARDS,
    SPEEDUP_CAP,
    KEVIN_GAMMA,
    KL_ESTIMATORS,
    MRS_DELTA,
    MRS_TOKEN_VETO,
    PRS_SCOPES,
    PRS_SOFTNESS,
    PRS_TAU,
    TRITONFORGE_MIN_VALID_GROUP_RATIO,
    TRITONFORGE_MIN_VALID_ITEM_RATIO,
    ZERO_VARIANCE_MIN_STD,
)
from kpipe.train.batching import PRECISIONS, accepted_types
from kpipe.train.trainer_memory import OPTIMIZER_OFFLOADS, read_offload_setting

if TYPE_CHECKING:
    import torch

    from kpipe.agent.loop import AgentTask

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
RETURN_AGGREGATES = ("sum", "max")
SINGLETONS = ("zero", "return")
BASELINES = ("eager", "compile")
HISTORIES = ("full", "top_w", "best_window", "kevin")
ENGINES = ("hf", "vllm")
BUFFERS = ("none", "tritonforge", "tritonforge_released")
ASYNC_MODES = ("off", "eval", "off_policy_1")
TRITONFORGE_GROUP_SIZE = 8  # TritonForge §3: "n_samples_per_prompt = 8"; its scripts: --n-samples-per-prompt 8
TRITONFORGE_KL_COEF = 1e-3  # not TritonForge's (its text gives none, its scripts 0): verl's GRPO example value


@dataclass
class RLConfig:
    """One RL run's settings. One iteration = `steps_per_iteration` rollout + update steps."""

    # --- rollouts (paper §4.3, §6.1)
    prompts_per_step: int = 16  # rollout batch: prompts per step
    rollouts_per_prompt: int = 16
    max_turns: int = 3
    max_tokens: int = 8192  # generated tokens per turn
    # ... and `extend_max_tokens` from rollout step `extend_at_step` on (1-based, as the metrics count steps):
    # Kevin §4.4, "we extend the max response length from 16K to 22K tokens at step 30"; null: never
    extend_max_tokens: int | None = None
    extend_at_step: int = 1
    max_context_tokens: int = 32768
    temperature: float = 1.0
    top_p: float = 1.0
    history: str = "full"
    history_window: int = 4
    steps_per_iteration: int = 1
    # a scratch checkpoint (the model and its optimizer state) after each step of an iteration but its last, which a
    # failed job resumes from; off, a failed job reruns its iteration from the first step and the disk never holds
    # one (16 bytes a parameter beside the models, 131 GB for the 8B: one GPU's 64 GiB, config/paper_smoke_1gpu.yaml)
    step_checkpoints: bool = True
    max_prompts: int | None = None  # use only the first N training queries (offline runs)
    engine: str = "hf"  # hf | vllm (rollouts); the trainer is always torch + transformers
    generation_batch_size: int = 16  # HF engine: sequences per generate() call
    vllm_gpu_memory_utilization: float = 0.35  # vLLM shares the GPU with the trainer
    # issue 63: the colocated vLLM engine sleeps (level 2: weights and KV cache off the GPU) while the trainer
    # trains, and wakes for the push; the trainer then plans its memory on the whole GPU. engine vllm only
    vllm_sleep: bool = False
    # asynchronous inference (§6.1; config key `async`, a Python keyword): off | eval (turns are judged
    # while the engine decodes the others; same rows) | off_policy_1 (also the next step's rollouts are
    # generated during this step's update, by the policy before it: one step stale). Off by default:
    # with one GPU, kernels would be timed while the engine decodes on it (the paper's KernelGym has its own)
    async_mode: str = "off"
    # --- evaluation (the `gym` config section picks the backend and protocol; RL overrides this much)
    # ablation "w/o hacking check": KernelGym's Protocol.hacking_check off (launch check, ghost replay, fallback screens)
    hacking_check: bool = True
    # --- reward and returns (Eq. 1, 2, 8)
    reward: str = "paper"  # paper | released_code | kevin | tritonforge
    use_pr: bool = False  # Eq. 8: + C·PR (the "+PR" ablation)
    baseline: str = "eager"  # speedup against eager or torch.compile
    speedup_cap: float = SPEEDUP_CAP
    gamma: float = 1.0
    return_aggregate: str = "sum"  # sum (Eq. 2) | max (Kevin's alternative)
    # --- advantages (Eq. 3, 5)
    advantage: str = "trloo"  # an estimator of kpipe.train.algos.ADVANTAGES (kevin: per task over all turns)
    singleton: str = "zero"  # a group of one valid rollout: 0 (paper) or its return (released code)
    baseline_includes_rejected: bool = False  # released code: filtered rows still count in the baseline
    # --- TritonForge's group buffer: filter and normalise each (prompt, turn) group's returns before the
    # advantage (tritonforge: as described; tritonforge_released: its default filter, rewards in [0, 1])
    buffer: str = "none"  # none | tritonforge | tritonforge_released
    buffer_min_valid_group_ratio: float = TRITONFORGE_MIN_VALID_GROUP_RATIO
    buffer_min_valid_item_ratio: float = TRITONFORGE_MIN_VALID_ITEM_RATIO
    # --- filters (Eq. 6, 9, the released code's masks); each one counted in the metrics
    mrs: bool = False
    mrs_delta: float = MRS_DELTA
    mrs_token_veto: float = MRS_TOKEN_VETO
    prs: bool = False
    prs_tau: float = PRS_TAU
    prs_softness: float = PRS_SOFTNESS
    prs_hard: bool = False  # Appendix D "w/o s": keep iff PR >= tau
    prs_scope: str = "all"  # Eq. 9: every sample | correct: the released code (correct, non-hacked turns only)
    zero_variance_filter: bool = False  # released code only
    zero_variance_min_std: float = ZERO_VARIANCE_MIN_STD
    regression_filter: bool = False  # released code only
    # --- update (released code: PPO clip 0.2/0.28, dual clip 3, no KL, no entropy bonus)
    lr: float = 1e-6
    weight_decay: float = 0.01  # AdamW as verl's actor (not stated in the paper)
    betas: tuple[float, float] = (0.9, 0.999)
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = 3.0
    loss_agg: str = "seq-mean-token-sum"
    # KL regulariser against the reference policy (the run's SFT model), aggregated as the loss: off in the
    # paper and its code; TritonForge's "standard KL" (its scripts: low_var_kl against the SFT checkpoint)
    kl_coef: float = 0.0
    kl_estimator: str = "low_var_kl"  # k1 | low_var_kl (k3)
    grad_clip: float = 1.0
    mini_batches: int = 1  # optimizer steps per rollout step (PPO mini-batches)
    ppo_epochs: int = 1
    micro_batch_tokens: int = 32768  # padded tokens per forward pass
    mixed_precision: str = "auto"
    gradient_checkpointing: bool = False
    # --- the 8B on one GPU (issue 63, docs/training.md): log-probs and entropy through the LM head in chunks of
    # this many tokens, no [tokens, vocab] logits (0: the model's own logits; FSDP2 always uses those)
    logprob_chunk_tokens: int = 0
    optimizer_offload: str = "off"  # where AdamW's state lives: off | auto | fp32 | bf16 (kpipe.train.trainer_memory)
    seed: int = 0

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        for item in fields(self):
            value, expected = getattr(self, item.name), accepted_types(item.type)
            if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
                raise ValueError(f"RLConfig: {item.name} must be {item.type}, got {value!r}")
        checks = [
            # the registries as they are now: an entry registered after this module's import counts too
            (self.reward in REWARDS, f"reward must be one of {tuple(REWARDS)}"),
            (self.advantage in ADVANTAGES, f"advantage must be one of {tuple(ADVANTAGES)}"),
            (self.return_aggregate in RETURN_AGGREGATES, f"return_aggregate must be one of {RETURN_AGGREGATES}"),
            (self.singleton in SINGLETONS, f"singleton must be one of {SINGLETONS}"),
            (self.baseline in BASELINES, f"baseline must be one of {BASELINES}"),
            (self.history in HISTORIES, f"history must be one of {HISTORIES}"),
            (self.engine in ENGINES, f"engine must be one of {ENGINES}"),
            (self.async_mode in ASYNC_MODES, f"async must be one of {ASYNC_MODES}"),
            (not (self.vllm_sleep and self.engine == "vllm" and self.async_mode == "off_policy_1"),
             "vllm_sleep puts the engine to sleep during the update, when async off_policy_1 generates with it"),
            (self.buffer in BUFFERS, f"buffer must be one of {BUFFERS}"),
            (self.buffer == "none" or self.advantage not in ADVANTAGES or ADVANTAGES[self.advantage].prompt_turn_groups,
             "a buffer normalises (prompt, turn) groups: use it with "
             + ", ".join(name for name, estimator in ADVANTAGES.items() if estimator.prompt_turn_groups)),
            (0 < self.buffer_min_valid_group_ratio <= 1 and 0.5 <= self.buffer_min_valid_item_ratio <= 1,
             "buffer_min_valid_group_ratio must be in (0, 1], buffer_min_valid_item_ratio in [0.5, 1] "
             "(padding repeats each item at most once)"),
            (self.loss_agg in AGG_MODES, f"loss_agg must be one of {AGG_MODES}"),
            (self.mixed_precision in PRECISIONS, f"mixed_precision must be one of {PRECISIONS}"),
            (self.optimizer_offload in OPTIMIZER_OFFLOADS, f"optimizer_offload must be one of {OPTIMIZER_OFFLOADS}"),
            (self.logprob_chunk_tokens >= 0, "logprob_chunk_tokens must be >= 0 (0: the model's own logits)"),
            (not (self.reward in ("kevin", "tritonforge") and self.use_pr),
             f"the {self.reward} reward has no PR term (use_pr)"),
            (0.0 <= self.gamma <= 1.0, "gamma must be in [0, 1]"),
            (min(self.prompts_per_step, self.rollouts_per_prompt, self.max_turns, self.max_tokens,
                 self.steps_per_iteration, self.mini_batches, self.ppo_epochs, self.generation_batch_size) >= 1,
             "counts (prompts, rollouts, turns, tokens, steps, mini_batches, ppo_epochs, batch sizes) must be >= 1"),
            (self.lr > 0 and self.temperature > 0, "lr and temperature must be positive"),
            (0 < self.mrs_delta < 1 and 0 < self.mrs_token_veto < 1, "mrs_delta and mrs_token_veto must be in (0, 1)"),
            (self.prs_scope in PRS_SCOPES, f"prs_scope must be one of {PRS_SCOPES}"),
            (self.kl_estimator in KL_ESTIMATORS and self.kl_coef >= 0,
             f"kl_estimator must be one of {KL_ESTIMATORS} and kl_coef >= 0"),
            (self.prs_softness > 0, "prs_softness must be > 0 (prs_hard gives the hard threshold)"),
            (self.dual_clip is None or self.dual_clip > 1, "dual_clip must be > 1 or null"),
            ((self.extend_max_tokens is None or self.extend_max_tokens >= 1) and self.extend_at_step >= 1,
             "extend_max_tokens must be >= 1 or null and extend_at_step >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"RLConfig: {message}")

    @classmethod
    def from_dict(cls, values: dict[str, Any], ablation: str | None = None) -> RLConfig:
        """A config from `values` (the `rl:` config section) with an optional named ablation on top.

        The ablation comes from the argument or an ``ablation`` key in `values`; unknown keys are an error.
        The config's ``async`` is the field `async_mode` (YAML reads an unquoted ``off`` as false, also
        ``optimizer_offload``'s).
        """
        values = read_offload_setting(dict(values))
        if "async" in values:
            mode = values.pop("async")
            values["async_mode"] = "off" if mode is False else mode
        ablation = values.pop("ablation", None) or ablation
        known = {item.name for item in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"RLConfig: unknown key(s) {sorted(unknown)}")
        return with_ablation(cls(**values), ablation) if ablation else cls(**values)

    def max_tokens_at(self, global_step: int) -> int:
        """The per-turn token cap of the rollouts of 0-based step `global_step` (`extend_max_tokens` from
        `extend_at_step` on)."""
        if self.extend_max_tokens is not None and global_step + 1 >= self.extend_at_step:
            return self.extend_max_tokens
        return self.max_tokens

    def fingerprint(self) -> str:
        """Identity of the settings that change what an iteration computes (resume must match it)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True, default=str).encode()).hexdigest()[:16]


# The paper's ablations (Figure 4: hacking check, turns, gamma, GRPO; Figure 5: MRS, PR, PRS;
# Appendix D: PRS without softness). Cumulative ones (+PR includes +MRS, as in Figure 5) say so.
# Not the paper's: TritonForge's recipe (its reward, its group buffer, GRPO on top; the buffer's values
# have mean 0 per group, so GRPO's centring leaves them as slime's GRPO does with its normalisation off),
# as described and with its released filter.
ABLATIONS: dict[str, dict[str, Any]] = {
    "no_hacking_check": {"hacking_check": False},
    "single_turn": {"max_turns": 1},
    "gamma0": {"gamma": 0.0},
    "grpo": {"advantage": "grpo"},
    "mrs": {"mrs": True},
    "pr": {"mrs": True, "use_pr": True},
    "prs": {"mrs": True, "use_pr": True, "prs": True},
    "prs_hard": {"mrs": True, "use_pr": True, "prs": True, "prs_hard": True},
    # +PRS as the released code reads Eq. 9: only correct, non-hacked turns are sampled (docs/rl.md, PRS's scope)
    "prs_correct": {"mrs": True, "use_pr": True, "prs": True, "prs_scope": "correct"},
    # TritonForge (papers/tritonforge.md): groups of n = 8 (text and scripts); its "standard KL" (text, no
    # coefficient given: TRITONFORGE_KL_COEF is kpipe's) against the SFT model; released: the KL coefficient 0
    "tritonforge": {"reward": "tritonforge", "buffer": "tritonforge", "advantage": "grpo",
                    "rollouts_per_prompt": TRITONFORGE_GROUP_SIZE, "kl_coef": TRITONFORGE_KL_COEF},
    "tritonforge_released": {"reward": "tritonforge", "buffer": "tritonforge_released", "advantage": "grpo",
                             "rollouts_per_prompt": TRITONFORGE_GROUP_SIZE},
    # Kevin-32B (papers/kevin.md): 0.3·C + uncapped speedup, 0 for kernels using torch ops (§6.2), the discounted
    # sum of later turns' scores with gamma = 0.4 (§4.3), rewards normalised per task over every sample (§4),
    # earlier turns shown as summaries with their chains of thought dropped (§4.1). Its batch shape (8 tasks x
    # 16 trajectories x 4 turns) is config/ablations/kevin.yaml's, not the recipe's
    "kevin": {"reward": "kevin", "speedup_cap": math.inf, "gamma": KEVIN_GAMMA,
              "advantage": "kevin", "history": "kevin"},
}


def with_ablation(cfg: RLConfig, name: str) -> RLConfig:
    """`cfg` with the ablation `name` applied on top."""
    if name not in ABLATIONS:
        raise ValueError(f"RLConfig: unknown ablation {name!r}; choose one of {sorted(ABLATIONS)}")
    return replace(cfg, **ABLATIONS[name])



@dataclass(frozen=True)
class IterationSettings:
    """One RL iteration: its hyper-parameters, which iteration of which run on which prompts, the model
    and optimizer state it starts from, and where its outputs and partial work go."""

    cfg: RLConfig
    tasks: tuple[AgentTask, ...]
    init_model: Path  # the previous iteration's model (iteration 0: the SFT model)
    model_out: Path
    trajectories: Path  # the rollouts (`trajectories` rows, stage rl)
    metrics: Path  # the steps' `train_metrics` rows
    scratch: Path  # partial work: a rerun with the same restart key resumes from it
    run: str = "default"
    iteration: int = 0
    init_state: Path | None = None  # the previous iteration's optimizer state; None: a fresh optimizer
    state_out: Path | None = None  # where this iteration's optimizer state goes; None: nowhere
    model_out_dtype: torch.dtype | None = None  # model_out's weights (None: the trainer's; bf16: evaluation only)
    gym: Mapping[str, Any] = field(default_factory=dict)  # the `gym` config section (backend, workers, protocol)
    reference_model: Path | None = None  # the KL term's reference policy (the run's SFT model; rl.kl_coef > 0)
    progress: bool = True

    def global_step(self, step: int) -> int:
        """`step` of this iteration counted over the run: the seeds and metrics' step."""
        return self.iteration * self.cfg.steps_per_iteration + step
