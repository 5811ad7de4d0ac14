-- Kevin's test-time budget (Kevin-32B §5.3–5.4, its Table 2 and Figure 6): a fixed budget of
-- generated kernels per task, split into parallel trajectories × serial turns (Kevin: 128 = 128×1
-- = 32×4 = 16×8; config eval_budget). A trajectory is correct if any of its turns is (hacked =
-- incorrect); its speedup is its fastest correct kernel's over eager PyTorch (0 if none). Per task,
-- best@k is the best of k of its n trajectories, exactly in expectation over every k-subset
-- (kpipe.data.metrics.expected_best_of_k), then averaged over tasks. Percentages; speedups as ratios.
-- k = trajectories spends the whole budget (Kevin's Table 2, `full_budget`: the rows shown here);
-- smaller k give the scaling curves at fixed turns (§5.3), kernels = k × turns. The splits of one
-- model share their sampling seeds (sample i starts alike in every split): they differ by the
-- split, not by the draw. Rows behind a cell:
--   select * from fastp_samples where stage = 'budget' and baseline = 'eager' and history = 'last'
--     and model = '<model>@<trajectories>x<turns>' and level = ...
WITH trajectory AS (
    SELECT run, split_part(model, '@', 1) AS model, level, task_id, sample,
           CAST(regexp_extract(model, '@([0-9]+)x([0-9]+)$', 2) AS INTEGER) AS turns,
           bool_or(correct) AS correct,
           coalesce(max(speedup) FILTER (WHERE correct), 0) AS speedup
    FROM fastp_samples
    WHERE stage = 'budget' AND baseline = 'eager' AND history = 'last'
    GROUP BY run, model, level, task_id, sample
),
ranked AS (
    SELECT *,
           count(*) OVER task AS n,
           row_number() OVER (task ORDER BY correct) AS rank_correct,
           row_number() OVER (task ORDER BY speedup) AS rank_speedup
    FROM trajectory
    WINDOW task AS (PARTITION BY run, model, level, turns, task_id)
),
-- best@k = sum over the ascending order statistics v_(i), i >= k, of C(i-1, k-1) / C(n, k) * v_(i)
weighted AS (
    SELECT r.*, k,
           CASE WHEN rank_correct >= k THEN exp(lgamma(rank_correct) - lgamma(k) - lgamma(rank_correct - k + 1)
                - lgamma(n + 1) + lgamma(k + 1) + lgamma(n - k + 1)) ELSE 0 END AS w_correct,
           CASE WHEN rank_speedup >= k THEN exp(lgamma(rank_speedup) - lgamma(k) - lgamma(rank_speedup - k + 1)
                - lgamma(n + 1) + lgamma(k + 1) + lgamma(n - k + 1)) ELSE 0 END AS w_speedup
    FROM ranked r, LATERAL (SELECT unnest(range(1, r.n + 1)) AS k)
),
per_task AS (
    SELECT run, model, level, turns, task_id, k, any_value(n) AS n,
           sum(w_correct * correct::INTEGER) AS best_correct,
           sum(w_speedup * speedup) AS best_speedup,
           avg(correct::INTEGER) AS avg_correct,
           avg(speedup) AS avg_speedup
    FROM weighted
    GROUP BY run, model, level, turns, task_id, k
)
SELECT run, model, level, min(n) * turns AS budget, min(n) AS trajectories, turns, k, k * turns AS kernels,
       k = min(n) AS full_budget, count(*) AS n_tasks,
       100.0 * avg(best_correct) AS best_at_k_correct,
       avg(best_speedup) AS best_at_k_speedup,
       100.0 * avg(avg_correct) AS avg_correct,
       avg(avg_speedup) AS avg_speedup
FROM per_task
WHERE k <= n
GROUP BY run, model, level, turns, k
HAVING k <= min(n)
ORDER BY run, model, level, turns, k;
