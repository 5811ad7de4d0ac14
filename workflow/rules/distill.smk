# Cold-start distillation (paper §4.1): the teacher refines kernels over `distill.turns` turns
# with KernelGym feedback; one job per query shard. `distill.teacher`:
#   offline  - the bank-backed teacher (`kpipe serve teacher`), started and stopped by each job;
#   api      - an OpenAI-compatible endpoint (`distill.engine`; the key comes from the variable
#              named by `distill.engine.api_key_env`); each job holds one unit of the `api`
#              resource, so the `api` total (common.smk) caps how many shards talk to the API at once;
#   released - no distillation: the authors' released trajectories (`distill.released_path`).
# Answers and evaluations are cached under results/cache/ (not outputs: a failed or killed job
# keeps them), so rerunning a shard re-sends no request that was already answered.

if DISTILL["teacher"] == "released":

    rule coldstart_released:
        """kpipe.agent.distill.coldstart_released_job: the released cold-start trajectories."""
        input:
            DISTILL["released_path"],
        output:
            f"{COLDSTART_DIR}/part-0.parquet",
        params:
            run=COLDSTART,
            code=job_code("coldstart_released", "agent", "llm/extract.py"),
        log:
            f"{LOGS}/coldstart_released/{COLDSTART}.log",
        conda:
            "../envs/kpipe.yaml"
        script:
            "../scripts/coldstart_released.py"

else:

    rule distill:
        """kpipe.agent.distill.distill_job: one query shard distilled into cold-start trajectories."""
        input:
            queries=QUERIES,
        output:
            f"{COLDSTART_DIR}/part-{{shard}}.parquet",
        params:
            distill=DISTILL,
            gym=CRITICAL_GYM,
            num_shards=DISTILL["shards"],
            run=COLDSTART,
            cache=lambda wildcards: answers_cache(f"{RESULTS}/cache/distill/teacher={TEACHER}/shard-{wildcards.shard}.jsonl",
                                                  DISTILL["teacher"] == "offline"),
            code=job_code("distill", "agent", "llm", "gym", "data/schemas.py"),
        wildcard_constraints:
            shard=r"\d+",
        priority: CRITICAL_PATH
        resources:
            api=1 if DISTILL["teacher"] == "api" else 0,
            gpu_slots=evaluating_job_slots(),
            gpu=whole_gpus(evaluating_job_slots()),
        log:
            f"{LOGS}/distill/{COLDSTART}/shard-{{shard}}.log",
        benchmark:
            f"{LOGS}/distill/{COLDSTART}/shard-{{shard}}.benchmark.tsv"
        conda:
            "../envs/kpipe.yaml"
        script:
            "../scripts/distill.py"
