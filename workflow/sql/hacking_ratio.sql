-- Hacking ratio (paper Appendix C, Figure 8): the fraction of generated samples (every turn
-- row, whatever its status) that KernelGym flagged as hacked, per run, stage, RL iteration,
-- model and level. Stage 'rl' gives the ratio over training iterations (the rollouts),
-- 'eval' / 'stts' the ratio on KernelBench. Level: the task's, else the query's. Rows behind a cell:
--   select * from turns where stage = ... and run = ... and iteration = ... and model = ...
SELECT t.run, t.stage, t.iteration, t.model, coalesce(k.level, q.level) AS level,
       count(*) AS n_samples,
       count_if(coalesce(t.hacked, false)) AS n_hacked,
       100.0 * count_if(coalesce(t.hacked, false)) / count(*) AS hacking_ratio
FROM trajectories t
LEFT JOIN tasks k USING (task_id)
LEFT JOIN queries q ON q.query_id = t.task_id
WHERE t.stage IN ('rl', 'eval', 'stts')
GROUP BY t.run, t.stage, t.iteration, t.model, coalesce(k.level, q.level)
ORDER BY t.run, t.stage, t.model, level, t.iteration;
