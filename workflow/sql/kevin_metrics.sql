-- Kevin's trajectory metrics (Kevin-32B; Dr. Kernel's related work): a trajectory is correct if
-- any of its turns is (hacked = incorrect); its performance is its fastest correct kernel's
-- speedup (0 if none). Per task, best@k is the best of its k trajectories and avg@k their mean,
-- with k = every sample of the task (the paper's 8; `k` is the fewest a task had, so the values
-- are exact when k = k_max); then averaged over tasks. Percentages, speedups as ratios; fast@1.2
-- = correct with speedup >= 1.2. Both hack definitions, as in Table 1: kpipe's (any KernelGym check) and
-- the paper's, whose correctness and fast@1.2 lie in [x, x_paper_hi]: a trajectory with a turn only
-- kpipe's stricter checks rejected counts as correct in the upper bound, and fast at its timed speedup
-- (or when never timed). Rows
-- behind a cell:
--   select * from fastp_samples where stage = 'eval' and history = 'last' and <keys of the row>
WITH trajectory AS (
    SELECT run, model, level, baseline, task_id, sample,
           bool_or(correct) AS correct,
           coalesce(max(speedup) FILTER (WHERE correct), 0) AS speedup,
           bool_or(unjudged) AS unjudged,
           bool_or(fast_1_2_paper_hi) AS fast_1_2_paper_hi
    FROM fastp_samples
    WHERE stage = 'eval' AND history = 'last'
    GROUP BY run, model, level, baseline, task_id, sample
),
per_task AS (
    SELECT run, model, level, baseline, task_id,
           count(*) AS k,
           max(correct::INTEGER) AS best_correct,
           avg(correct::INTEGER) AS avg_correct,
           max((correct AND speedup >= 1.2)::INTEGER) AS best_fast_1_2,
           avg((correct AND speedup >= 1.2)::INTEGER) AS avg_fast_1_2,
           max((correct OR unjudged)::INTEGER) AS best_correct_paper_hi,
           avg((correct OR unjudged)::INTEGER) AS avg_correct_paper_hi,
           max(((correct AND speedup >= 1.2) OR fast_1_2_paper_hi)::INTEGER) AS best_fast_1_2_paper_hi,
           avg(((correct AND speedup >= 1.2) OR fast_1_2_paper_hi)::INTEGER) AS avg_fast_1_2_paper_hi,
           max(speedup) AS best_speedup,
           avg(speedup) AS avg_speedup
    FROM trajectory
    GROUP BY run, model, level, baseline, task_id
)
SELECT run, model, level, baseline,
       count(*) AS n_tasks, min(k) AS k, max(k) AS k_max,
       100.0 * avg(best_correct) AS best_at_k_correct,
       100.0 * avg(avg_correct) AS avg_at_k_correct,
       100.0 * avg(best_fast_1_2) AS best_at_k_fast_1_2,
       100.0 * avg(avg_fast_1_2) AS avg_at_k_fast_1_2,
       100.0 * avg(best_correct_paper_hi) AS best_at_k_correct_paper_hi,
       100.0 * avg(avg_correct_paper_hi) AS avg_at_k_correct_paper_hi,
       100.0 * avg(best_fast_1_2_paper_hi) AS best_at_k_fast_1_2_paper_hi,
       100.0 * avg(avg_fast_1_2_paper_hi) AS avg_at_k_fast_1_2_paper_hi,
       avg(best_speedup) AS best_at_k_speedup,
       avg(avg_speedup) AS avg_at_k_speedup
FROM per_task
GROUP BY run, model, level, baseline
ORDER BY run, model, level, baseline;
