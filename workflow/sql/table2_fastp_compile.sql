-- Table 2 (paper §6.4): Fast@p against the torch.compile baseline, per KernelBench level.
-- Fast@p = n_fast_p / n_samples: a sample counts iff it is correct, NOT hacked (hacked counts
-- as incorrect) and its speedup >= p (KernelBench's own fastp uses > p). n_samples: every
-- (task, sample) trajectory; a turn never reached counts as incorrect.
-- history = 'last': the kernel written at `turn`; 'best': the best correct kernel of turns
-- 1..turn (the paper's † rows). Percentages. Rows behind a cell:
--   select * from fastp_samples where stage = 'eval' and baseline = 'compile' and <keys of the row>
SELECT run, iteration, model, level, baseline, turn, history,
       count(*) AS n_samples,
       count_if(correct) AS n_correct,
       count_if(fast_1) AS n_fast_1,
       count_if(fast_1_2) AS n_fast_1_2,
       count_if(fast_1_5) AS n_fast_1_5,
       count_if(fast_2) AS n_fast_2,
       100.0 * count_if(fast_1) / count(*) AS fast_1,
       100.0 * count_if(fast_1_2) / count(*) AS fast_1_2,
       100.0 * count_if(fast_1_5) / count(*) AS fast_1_5,
       100.0 * count_if(fast_2) / count(*) AS fast_2
FROM fastp_samples
WHERE stage = 'eval' AND baseline = 'compile'
GROUP BY run, iteration, model, level, baseline, turn, history
ORDER BY run, iteration, model, level, history DESC, turn;
