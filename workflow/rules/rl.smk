# Multi-turn RL (paper §4–5): one job per iteration. Iteration k trains from iteration k-1's
# model (iteration 0: the SFT model) and optimizer state, runs `rl.steps_per_iteration`
# rollout + update steps, and writes its model, its rollouts (trajectories, stage=rl) and its
# metrics (train_metrics, stage=rl). Ablations are runs: `rl.runs` maps a run name to an
# overlay of `rl` keys (`ablation: <name>` picks one of kpipe.train.rl_config.ABLATIONS);
# config/ablations/*.yaml add the paper's. Partial work lives in results/work (not an
# output): a killed iteration rerun by Snakemake resumes it when its restart key (settings, tasks,
# input models and state, code, library versions) is unchanged, and nothing else reruns; a
# finished iteration leaves no partial work, so a forced rerun trains it again. A run's last iteration
# writes what `rl.final_checkpoint` says: `trainer` (its model as trained and its optimizer state, as
# every other iteration) or `evaluation` (what only evaluation reads: the model in bf16, no optimizer
# state; one GPU's 64 GiB disk, config/paper_smoke_1gpu.yaml). Which is a param of each iteration, so
# raising rl.iterations reruns the former last one as a trainer checkpoint.
# `rl.gpus` decides the process count: `kpipe launch` runs one process per GPU (FSDP2,
# data-parallel rollouts); one process (a CPU, one GPU) runs in the job's own (kpipe.infra.jobs.run_job).
import json

from kpipe.infra.provenance import RL_CODE

# the nano policy on one GPU shares it (its rollouts are timed by the run's service); else whole GPUs
RL_SLOTS = gpu_slots(RL["gpus"], SHARED_GYM and TINY_POLICY and RL["gpus"] == 1)


rule rl_iter:
    """kpipe.train.rl.rl_job: one RL iteration (kpipe.train.rl.run_iteration), in one process per GPU."""
    input:
        queries=QUERIES,
        model=rl_init_model,
        reference=f"{RESULTS}/models/sft-{RUN}",  # the KL term's reference policy (rl.kl_coef > 0)
    output:
        model=directory(f"{RESULTS}/models/{RL_ROOT}/{{run}}/iter={{iter}}"),
        trajectories=f"{RESULTS}/trajectories/stage=rl/{RL_ROOT}/run={{run}}/iter={{iter}}/part-0.parquet",
        metrics=f"{RESULTS}/train_metrics/stage=rl/{RL_ROOT}/run={{run}}/iter={{iter}}/part-0.parquet",
    params:
        settings=lambda wildcards: json.dumps(rl_settings(wildcards.run), sort_keys=True),
        gym=json.dumps(CRITICAL_GYM, sort_keys=True),
        init_state=lambda wildcards: (rl_state_dir(wildcards.run, int(wildcards.iter) - 1)
                                      if int(wildcards.iter) else ""),
        export=lambda wildcards: rl_export(wildcards.iter),
        state=lambda wildcards: "" if rl_export(wildcards.iter) == "evaluation" else rl_state_dir(wildcards.run,
                                                                                                  wildcards.iter),
        scratch=lambda wildcards: f"{RESULTS}/work/{RL_ROOT}/{wildcards.run}/iter={wildcards.iter}/scratch",
        drop_init_state=not RL["keep_optimizer_states"],
        code=job_code("rl_iter", *RL_CODE),
    priority: CRITICAL_PATH
    resources:
        gpu_slots=RL_SLOTS,
        gpu=whole_gpus(RL_SLOTS),
    wildcard_constraints:
        run="[A-Za-z0-9_.-]+",
        iter="[0-9]+",
    benchmark:
        f"{LOGS}/benchmarks/{RL_ROOT}/{{run}}-iter{{iter}}.tsv"
    log:
        f"{LOGS}/{RL_ROOT}/{{run}}/iter={{iter}}.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/rl_iter.py"


# RL validation (paper Figures 4, 5, 8): the checkpoint of every validated iteration of every run
# (`rl.validation.every`; always the last iteration) on the validation tasks (`rl.validation.level`,
# the eval tasks of that level), through the eval stage's loop and evaluator, one GPU like eval.
# Rows: trajectories with stage=rl_val, the run and iteration; table workflow/sql/rl_validation.sql.


rule rl_validate:
    """kpipe.evaluate.kernelbench.validation_job: an RL iteration's checkpoint on the validation tasks."""
    input:
        tasks=TASKS,
        model=lambda wildcards: rl_model_dir(wildcards.run, wildcards.iter),
    output:
        f"{RESULTS}/trajectories/stage=rl_val/{RL_ROOT}/run={{run}}/iter={{iter}}/part-0.parquet",
    params:
        settings=job_settings(RL_VALIDATION, drop=("every",)),
        rl=lambda wildcards: rl_settings(wildcards.run),
        gym=GYM,
        run=lambda wildcards: wildcards.run,
        iteration=lambda wildcards: int(wildcards.iter),
        cache=lambda wildcards: f"{RESULTS}/cache/rl_val/{RL_ROOT}/{wildcards.run}/iter={wildcards.iter}.jsonl",
        code=job_code("rl_validate", "evaluate/kernelbench.py", "agent", "llm", "gym"),
    resources:
        gpu_slots=evaluating_job_slots(TINY_POLICY),
        gpu=whole_gpus(evaluating_job_slots(TINY_POLICY)),
    wildcard_constraints:
        run="[A-Za-z0-9_.-]+",
        iter="[0-9]+",
    benchmark:
        f"{LOGS}/benchmarks/rl_val-{RUN}/{{run}}-iter{{iter}}.tsv"
    log:
        f"{LOGS}/rl_val-{RUN}/{{run}}/iter={{iter}}.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/rl_validate.py"
