-- RL validation curves (paper Figures 4, 5 left and 8): each validated RL iteration's checkpoint
-- on the validation tasks (config rl.validation; paper: KernelBench level 2), per run and iteration.
-- Fast@p, pass rate: at the last validated turn (the paper's turn 3), eager baseline, with
-- Table 1's convention: a sample counts iff it is correct, NOT hacked (hacked counts as
-- incorrect) and its speedup >= p; every (task, sample) trajectory is in the denominator (a turn
-- never reached counts as incorrect). pass_rate: correct and not hacked at that turn.
-- hacking_ratio: hacked turns over every generated turn of the validation (as hacking_ratio.sql).
-- Both hack definitions, as in Table 1: kpipe's (fast_*, pass_rate, hacking_ratio) and the paper's
-- (hacking_ratio_paper; its Fast@p and pass rate lie in [x, x_paper_hi], open by the n_unjudged samples
-- only kpipe's stricter checks rejected, at their timed speedup or fast when never timed: views.sql).
-- step: the RL global step at the end of the iteration (train_metrics, stage rl). Percentages.
-- Rows behind a cell:
--   select * from fastp_samples where stage = 'rl_val' and baseline = 'eager' and history = 'last'
--     and turn = last_turn and run = ... and iteration = ...
WITH at_last_turn AS (
    SELECT run, iteration, model, level, turn,
           count(*) AS n_samples,
           count_if(correct) AS n_correct,
           count_if(fast_1) AS n_fast_1,
           count_if(fast_1_2) AS n_fast_1_2,
           count_if(unjudged) AS n_unjudged,
           count_if(fast_1_paper_hi) AS n_fast_1_paper_hi,
           count_if(fast_1_2_paper_hi) AS n_fast_1_2_paper_hi,
           count_if(correct OR unjudged) AS n_correct_paper_hi
    FROM fastp_samples
    WHERE stage = 'rl_val' AND baseline = 'eager' AND history = 'last' AND turn = last_turn
    GROUP BY run, iteration, model, level, turn
),
generated AS (
    SELECT run, iteration, model, level, count(*) AS n_turns, count_if(hacked) AS n_hacked,
           count_if(hacked_paper) AS n_hacked_paper
    FROM sample_turns
    WHERE stage = 'rl_val' AND reached
    GROUP BY run, iteration, model, level
),
steps AS (
    SELECT run, iteration, max(step) AS step
    FROM train_metrics
    WHERE stage = 'rl'
    GROUP BY run, iteration
)
SELECT f.run, f.iteration, s.step, f.model, f.level, f.turn,
       f.n_samples, f.n_correct, f.n_fast_1, f.n_fast_1_2, f.n_unjudged, g.n_turns, g.n_hacked, g.n_hacked_paper,
       100.0 * f.n_fast_1 / f.n_samples AS fast_1,
       100.0 * f.n_fast_1_2 / f.n_samples AS fast_1_2,
       100.0 * f.n_correct / f.n_samples AS pass_rate,
       100.0 * g.n_hacked / g.n_turns AS hacking_ratio,
       100.0 * f.n_fast_1_paper_hi / f.n_samples AS fast_1_paper_hi,
       100.0 * f.n_fast_1_2_paper_hi / f.n_samples AS fast_1_2_paper_hi,
       100.0 * f.n_correct_paper_hi / f.n_samples AS pass_rate_paper_hi,
       100.0 * g.n_hacked_paper / g.n_turns AS hacking_ratio_paper
FROM at_last_turn f
JOIN generated g USING (run, iteration, model, level)
LEFT JOIN steps s USING (run, iteration)
ORDER BY f.run, f.model, f.level, f.iteration;
