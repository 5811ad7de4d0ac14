# Multi-turn RL (paper §4–5): one job per iteration. Iteration k trains from iteration k-1's
# model (iteration 0: the SFT model) and optimizer state, runs `rl.steps_per_iteration`
# rollout + update steps, and writes its model, its rollouts (trajectories, stage=rl) and its
# metrics (train_metrics, stage=rl). Ablations are runs: `rl.runs` maps a run name to an
# overlay of `rl` keys (`ablation: <name>` picks one of kpipe.train.rl_config.ABLATIONS);
# config/ablations/*.yaml add the paper's. Partial work lives in results/work (not an
# output): a killed iteration rerun by Snakemake resumes it, and nothing else reruns.


rule rl_iter:
    input:
        queries=f"{RESULTS}/queries/queries.parquet",
        model=rl_init_model,
    output:
        model=directory(f"{RESULTS}/models/rl-{{run}}/iter={{iter}}"),
        trajectories=f"{RESULTS}/trajectories/stage=rl/run={{run}}/iter={{iter}}/part-0.parquet",
        metrics=f"{RESULTS}/train_metrics/stage=rl/run={{run}}/iter={{iter}}/part-0.parquet",
    params:
        rl=lambda wildcards: rl_settings(wildcards.run),
        gym=config["gym"],
        run=lambda wildcards: wildcards.run,
        iteration=lambda wildcards: int(wildcards.iter),
        init_state=lambda wildcards: rl_state_dir(wildcards.run, int(wildcards.iter) - 1) if int(wildcards.iter) else None,
        state=lambda wildcards: rl_state_dir(wildcards.run, wildcards.iter),
        scratch=lambda wildcards: f"{RESULTS}/work/rl-{wildcards.run}/iter={wildcards.iter}/scratch",
        keep_optimizer_states=RL["keep_optimizer_states"],
        code=code_version("train", "agent", "llm", "gym"),
    resources:
        gpu=gpus_per_job(RL["gpus"]),
    wildcard_constraints:
        run="[A-Za-z0-9_.-]+",
        iter="[0-9]+",
    benchmark:
        f"{LOGS}/benchmarks/rl-{{run}}-iter{{iter}}.tsv"
    log:
        f"{LOGS}/rl/{{run}}/iter={{iter}}.log",
    conda:
        "../envs/kpipe.yaml"
    script:
        "../scripts/rl_iter.py"
