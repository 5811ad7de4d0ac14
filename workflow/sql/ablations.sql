-- Ablations (paper §4.3, §5.3, Appendix D): one row per run (a config overlay: w/o hacking
-- check, single turn, gamma = 0, GRPO, +MRS, +PR, +PRS, PRS w/o softness...), model and level,
-- at the last evaluated turn: Fast@1 and Fast@1.2 against eager PyTorch (last turn and best of
-- history), the correctness and hacking rates. Same convention as Table 1, and as there both hack
-- definitions from the same rows: kpipe's (fast_*, hacking_ratio: any KernelGym check) and the paper's
-- (hacking_ratio_paper: no Triton kernel ran in train or eval mode; its Fast@p lies in
-- [fast_*, fast_*_paper_hi], open by the n_unjudged samples only kpipe's stricter checks rejected,
-- at their timed speedup or fast when never timed: views.sql). Rows behind a cell:
--   select * from fastp_samples where stage = 'eval' and baseline = 'eager' and turn = last_turn and run = ...
WITH at_last AS (
    SELECT * FROM fastp_samples WHERE stage = 'eval' AND baseline = 'eager' AND turn = last_turn
),
hacked AS (
    SELECT run, model, level, count(*) AS n_generated, count_if(coalesce(hacked, false)) AS n_hacked,
           count_if(hacked_paper) AS n_hacked_paper
    FROM turns WHERE stage = 'eval'
    GROUP BY run, model, level
)
SELECT a.run, a.model, a.level, any_value(a.last_turn) AS turn,
       count(*) FILTER (WHERE history = 'last') AS n_samples,
       count_if(correct AND history = 'last') AS n_correct,
       count_if(fast_1 AND history = 'last') AS n_fast_1,
       count_if(fast_1_2 AND history = 'last') AS n_fast_1_2,
       count_if(fast_1_2 AND history = 'best') AS n_fast_1_2_best,
       count_if(unjudged AND history = 'last') AS n_unjudged,
       100.0 * count_if(correct AND history = 'last') / count(*) FILTER (WHERE history = 'last') AS correct,
       100.0 * count_if(fast_1 AND history = 'last') / count(*) FILTER (WHERE history = 'last') AS fast_1,
       100.0 * count_if(fast_1_2 AND history = 'last') / count(*) FILTER (WHERE history = 'last') AS fast_1_2,
       100.0 * count_if(fast_1_2 AND history = 'best') / count(*) FILTER (WHERE history = 'best') AS fast_1_2_best,
       100.0 * count_if(fast_1_paper_hi AND history = 'last') / count(*) FILTER (WHERE history = 'last')
           AS fast_1_paper_hi,
       100.0 * count_if(fast_1_2_paper_hi AND history = 'last') / count(*) FILTER (WHERE history = 'last')
           AS fast_1_2_paper_hi,
       100.0 * count_if(fast_1_2_paper_hi AND history = 'best') / count(*) FILTER (WHERE history = 'best')
           AS fast_1_2_best_paper_hi,
       any_value(h.n_generated) AS n_generated,
       any_value(h.n_hacked) AS n_hacked,
       any_value(h.n_hacked_paper) AS n_hacked_paper,
       100.0 * any_value(h.n_hacked) / any_value(h.n_generated) AS hacking_ratio,
       100.0 * any_value(h.n_hacked_paper) / any_value(h.n_generated) AS hacking_ratio_paper
FROM at_last a
LEFT JOIN hacked h USING (run, model, level)
GROUP BY a.run, a.model, a.level
ORDER BY a.run, a.model, a.level;
