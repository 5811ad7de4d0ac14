-- Table 1 (paper §6.2): Fast@p against eager PyTorch, per KernelBench level.
-- Fast@p = n_fast_p / n_samples: a sample counts iff it is correct, NOT hacked (hacked counts
-- as incorrect) and its speedup >= p (KernelBench's own fastp uses > p). n_samples: every
-- (task, sample) trajectory; a turn never reached counts as incorrect.
-- history = 'last': the kernel written at `turn`; 'best': the best correct kernel of turns
-- 1..turn (the paper's † rows). Percentages.
-- Two hack definitions from the same rows: kpipe's (fast_*: any KernelGym check rejects) and the paper's
-- (hacked = no Triton kernel ran in train or eval mode: n_hacked_paper). A sample only kpipe's stricter
-- checks rejected (n_unjudged: another hack check, or an extra correctness check) counts in the upper bound
-- at its timed speedup, or as fast when never timed (views.sql, sample_turns), so the paper-definition
-- Fast@p is in [fast_*, fast_*_paper_hi]: equal to kpipe's when n_unjudged = 0.
-- The STTS rows (Table 1's "DR. KERNEL-14B-STTS", its † the best of history): each model's context
-- management run (stage 'stts', strategy top_w, model "<model>@top_w(w=<w>)") at its last turn T
-- (stts.max_turns; the paper does not state T). Rows behind a cell:
--   select * from fastp_samples where <table1_rows> and baseline = 'eager' and <keys of the row>
--   (table1_rows: stage = 'eval' or (stage = 'stts' and strategy top_w), kpipe.report.tables.TABLE1_ROWS)
SELECT run, iteration, model, level, baseline, turn, history,
       count(*) AS n_samples,
       count_if(correct) AS n_correct,
       count_if(fast_1) AS n_fast_1,
       count_if(fast_1_2) AS n_fast_1_2,
       count_if(fast_1_5) AS n_fast_1_5,
       count_if(fast_2) AS n_fast_2,
       count_if(hacked) AS n_hacked,
       count_if(hacked_paper) AS n_hacked_paper,
       count_if(unjudged) AS n_unjudged,
       100.0 * count_if(fast_1) / count(*) AS fast_1,
       100.0 * count_if(fast_1_2) / count(*) AS fast_1_2,
       100.0 * count_if(fast_1_5) / count(*) AS fast_1_5,
       100.0 * count_if(fast_2) / count(*) AS fast_2,
       100.0 * count_if(fast_1_paper_hi) / count(*) AS fast_1_paper_hi,
       100.0 * count_if(fast_1_2_paper_hi) / count(*) AS fast_1_2_paper_hi,
       100.0 * count_if(fast_1_5_paper_hi) / count(*) AS fast_1_5_paper_hi,
       100.0 * count_if(fast_2_paper_hi) / count(*) AS fast_2_paper_hi
FROM fastp_samples
WHERE (stage = 'eval' OR (stage = 'stts' AND split_part(model, '@', 2) LIKE 'top_w%')) AND baseline = 'eager'
GROUP BY run, iteration, model, level, baseline, turn, history
ORDER BY run, iteration, model, level, history DESC, turn;
