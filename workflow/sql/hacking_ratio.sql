-- Hacking ratio (paper Appendix C, Figure 8): the fraction of generated samples (every turn
-- row, whatever its status) flagged as hacked, per run, stage, RL iteration, model and level, by both
-- definitions from the same rows: kpipe's (hacking_ratio: any KernelGym check) and the paper's
-- (hacking_ratio_paper: "no Triton kernel executed in training or evaluation mode", the check
-- no_triton_launch). checks: how often each check fired (a turn can fire several; hack_check in
-- views.sql names them). Stage 'rl' gives the ratio over training iterations (the rollouts), 'rl_val' over
-- training iterations on the validation tasks (Appendix C's "during training ... on the level-2 subset";
-- Figure 8), 'eval' / 'stts' the ratio on KernelBench. Level: the task's, else the query's. Rows behind a cell:
--   select * from turns where stage = ... and run = ... and iteration = ... and model = ...
WITH rows AS (
    SELECT t.run, t.stage, t.iteration, t.model, coalesce(t.level, q.level) AS level,
           coalesce(t.hacked, false) AS hacked, t.hacked_paper, t.hack_checks
    FROM turns t
    LEFT JOIN queries q ON q.query_id = t.task_id
    WHERE t.stage IN ('rl', 'rl_val', 'eval', 'stts')
),
fired AS (
    SELECT run, stage, iteration, model, level, check_name, count(*) AS n
    FROM (SELECT *, unnest(string_split(hack_checks, ',')) AS check_name FROM rows WHERE hacked)
    GROUP BY ALL
),
checks AS (
    SELECT run, stage, iteration, model, level, string_agg(check_name || '=' || n, ', ' ORDER BY n DESC, check_name) AS checks
    FROM fired
    GROUP BY ALL
)
SELECT r.run, r.stage, r.iteration, r.model, r.level,
       count(*) AS n_samples,
       count_if(r.hacked) AS n_hacked,
       count_if(r.hacked_paper) AS n_hacked_paper,
       100.0 * count_if(r.hacked) / count(*) AS hacking_ratio,
       100.0 * count_if(r.hacked_paper) / count(*) AS hacking_ratio_paper,
       any_value(c.checks) AS checks
FROM rows r
LEFT JOIN checks c ON c.run = r.run AND c.stage = r.stage AND c.iteration IS NOT DISTINCT FROM r.iteration
                  AND c.model = r.model AND c.level IS NOT DISTINCT FROM r.level
GROUP BY r.run, r.stage, r.iteration, r.model, r.level
ORDER BY r.run, r.stage, r.model, r.level, r.iteration;
