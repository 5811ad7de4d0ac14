-- STTS curves (paper §6.3, Figure 6): Fast@p against eager PyTorch vs the number of turns T,
-- per history strategy (full = vanilla extrapolation; top_w = context management, the
-- paper; best_window = the released code's contiguous window). history 'last': the kernel of
-- turn T (Figure 6 left); 'best': best of turns 1..T (Figure 6 right). Same convention as
-- Table 1 (correct, not hacked, speedup >= p), with both hack definitions as there: kpipe's (fast_*)
-- and the paper's, in [fast_*, fast_*_paper_hi] (n_unjudged: samples only kpipe's stricter checks
-- rejected, at their timed speedup or fast when never timed: views.sql, sample_turns). Rows behind a point:
--   select * from stts_samples where baseline = 'eager' and <keys of the row>
SELECT run, base_model AS model, strategy, level, turn AS T, history,
       count(*) AS n_samples,
       count_if(fast_1) AS n_fast_1,
       count_if(fast_1_2) AS n_fast_1_2,
       count_if(fast_1_5) AS n_fast_1_5,
       count_if(fast_2) AS n_fast_2,
       count_if(unjudged) AS n_unjudged,
       100.0 * count_if(fast_1) / count(*) AS fast_1,
       100.0 * count_if(fast_1_2) / count(*) AS fast_1_2,
       100.0 * count_if(fast_1_5) / count(*) AS fast_1_5,
       100.0 * count_if(fast_2) / count(*) AS fast_2,
       100.0 * count_if(fast_1_paper_hi) / count(*) AS fast_1_paper_hi,
       100.0 * count_if(fast_1_2_paper_hi) / count(*) AS fast_1_2_paper_hi,
       100.0 * count_if(fast_1_5_paper_hi) / count(*) AS fast_1_5_paper_hi,
       100.0 * count_if(fast_2_paper_hi) / count(*) AS fast_2_paper_hi
FROM stts_samples
WHERE baseline = 'eager'
GROUP BY run, base_model, strategy, level, turn, history
ORDER BY run, model, strategy, level, history DESC, T;
